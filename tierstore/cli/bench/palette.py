"""Colours and legend placement every benchmark plot shares.

Colours are the Okabe-Ito palette (Okabe and Ito, *Color Universal Design*,
2002), told apart under the common forms of colour blindness; a plot that
needs more series than colours also varies markers or line styles. Legends
go below their axes, where they hide no data.

Example
-------
>>> OKABE_ITO["blue"], len(SERIES)
('#0072B2', 7)
"""

from __future__ import annotations

from typing import Any

OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky blue": "#56B4E9",
    "bluish green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish purple": "#CC79A7",
    "grey": "#999999",  # not one of the eight; a neutral for references (floors, baselines)
}
# Series colours in order; yellow, hard to see on white, comes last.
SERIES = tuple(OKABE_ITO[k] for k in ("blue", "vermillion", "bluish green", "orange", "reddish purple", "sky blue",
                                      "yellow"))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
LINESTYLES = ("-", "--", "-.", ":")


BELOW_INCHES = 0.62  # tick labels and an x label take about this much under the axes


def legend_below(ax: Any, *, ncol: int = 2, fontsize: float = 8, handles: Any = None, labels: Any = None) -> Any:
    """Put ``ax``'s legend under the axes (and its x label), where it covers nothing.

    The gap is a fixed distance in inches, not a share of the axes' height:
    under a short panel a share would put the legend over the x label.
    """
    from matplotlib.transforms import offset_copy

    below = offset_copy(ax.transAxes, fig=ax.figure, y=-BELOW_INCHES, units="inches")
    args = () if handles is None else (handles, labels)
    return ax.legend(*args, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below, ncol=ncol,
                     fontsize=fontsize, frameon=False)
