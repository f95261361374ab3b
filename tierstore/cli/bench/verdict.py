"""Targets and verdicts: what a benchmark promises, and whether this run kept the promise.

A :class:`Target` is a claim the project makes (in ``README.md``'s
Performance table, ``bench/README.md`` or ``docs/``), written once: what is
measured, in plain words, the bound, its unit and where the claim is stated.
:func:`judge` compares a run's repeats against it. The verdict is decided on
the median of the repeats; the spread (min-max and the interquartile range)
is reported beside it, so a reader sees whether one lucky or unlucky repeat
could have flipped it:

- ``PASS`` / ``FAIL``: the median meets / misses the bound;
- ``UNDECIDED``: fewer repeats than the target needs (three for ratios of
  timed contenders: one repeat says nothing about the noise), or none.

Every benchmark measures its contenders interleaved (A, B, A, B, ...), so a
drifting drive or a busy CPU hits both sides of a ratio alike; a ratio's
repeats are therefore the per-round ratios, not a ratio of medians.

Example
-------
>>> t = Target("peer_over_ours", "DeepSpeed-style swapper's step / ours", ">", 1.0,
...            source="README.md (Performance)")
>>> v = judge(t, [1.1, 1.3, 0.9, 1.2])
>>> v["verdict"], round(v["median"], 2), v["spread_crosses_target"]
('PASS', 1.15, True)
>>> print(format_verdict(v))
PASS  DeepSpeed-style swapper's step / ours: median 1.15x (range 0.90-1.30, IQR 1.05-1.22 over 4 repeats; the range crosses the target); target > 1x [README.md (Performance)]
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import ConfigError

OPS = {
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
}
MIN_REPEATS = 3  # a ratio of timed contenders needs at least this many interleaved rounds
VERDICTS = ("PASS", "FAIL", "UNDECIDED")


@dataclass(frozen=True)
class Target:
    """A stated claim: ``value <op> bound`` in ``unit``, and where the project states it.

    ``unit`` is ``"x"`` for ratios, ``"s"`` for seconds, ``"B"`` for bytes
    (printed as sizes), ``"%"`` for signed percentages; ``min_repeats`` is
    how many repeats a verdict needs (1 for a single measurement such as a
    peak RSS); ``more`` says how to get more repeats (the benchmark's flag).
    """

    key: str
    what: str
    op: str
    bound: float
    unit: str = "x"
    source: str = ""
    min_repeats: int = MIN_REPEATS
    more: str = "raise --steps or --rounds"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ConfigError(f"target {self.key!r}: op {self.op!r} is not one of {sorted(OPS)}")

    def text(self) -> str:
        """The target as a reader would say it, e.g. ``'>= 0.95x'``."""
        return f"{self.op} {_value(self.bound, self.unit)}"


def _value(v: float, unit: str, digits: int = 2) -> str:
    if unit == "B":
        from ...sizes import format_size

        return format_size(int(v)) if v >= 0 else "-" + format_size(int(-v))
    if unit == "x":
        return f"{v:.{digits}f}x" if v != int(v) else f"{v:g}x"
    if unit == "%":
        return f"{v:+.2f}%" if v != int(v) else f"{v:+g}%"
    return f"{v:.3g} {unit}"


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and interquartile range of ``samples`` (``nan`` where there are none).

    Example
    -------
    >>> spread([3.0, 1.0, 2.0])
    {'repeats': 3, 'median': 2.0, 'min': 1.0, 'max': 3.0, 'q1': 1.5, 'q3': 2.5}
    """
    values = [float(v) for v in samples if v is not None and not math.isnan(float(v))]
    if not values:
        nan = float("nan")
        return {"repeats": 0, "median": nan, "min": nan, "max": nan, "q1": nan, "q3": nan}
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"repeats": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": q1, "q3": q3}


def judge(target: Target, samples: Sequence[float], *, note: str | None = None) -> dict[str, Any]:
    """The verdict of ``samples`` (one value per repeat) against ``target``.

    Returns a JSON-ready dict: the target, every sample, the spread, the
    verdict (``PASS``/``FAIL``/``UNDECIDED``), ``spread_crosses_target``
    (some repeat alone would have given the other verdict) and ``why``.

    Example
    -------
    >>> t = Target("ram_vs_torch", "torch step / ours", ">=", 0.95)
    >>> judge(t, [1.0])["verdict"], judge(t, [1.0, 0.99, 1.02])["verdict"]
    ('UNDECIDED', 'PASS')
    """
    s = spread(samples)
    meets = OPS[target.op]
    if s["repeats"] == 0:
        verdict, why = "UNDECIDED", "nothing was measured"
    elif s["repeats"] < target.min_repeats:
        verdict = "UNDECIDED"
        why = (f"{s['repeats']} repeat(s); a verdict needs at least {target.min_repeats} interleaved repeats "
               f"({target.more})")
    else:
        verdict = "PASS" if meets(s["median"], target.bound) else "FAIL"
        why = f"median {_value(s['median'], target.unit)} {'meets' if verdict == 'PASS' else 'misses'} {target.text()}"
    crosses = s["repeats"] > 1 and meets(s["min"], target.bound) != meets(s["max"], target.bound)
    out = {
        "key": target.key,
        "target": asdict(target) | {"text": target.text()},
        "verdict": verdict,
        "why": why,
        "samples": [float(v) for v in samples],
        **s,
        "spread_crosses_target": crosses,
    }
    if note:
        out["note"] = note
    return out


def format_verdict(v: dict[str, Any]) -> str:
    """One line: verdict, what, median and spread, target and its source."""
    t = v["target"]
    unit = t["unit"]
    if v["repeats"] == 0:
        measured = "not measured"
    elif v["repeats"] == 1:
        measured = f"{_value(v['median'], unit)} (one measurement)"
    else:
        cross = "; the range crosses the target" if v["spread_crosses_target"] else ""
        measured = (f"median {_value(v['median'], unit, _digits(v['median'], t['bound']))} "
                    f"(range {_range(v['min'], v['max'], unit)}, "
                    f"IQR {_range(v['q1'], v['q3'], unit)} over {v['repeats']} repeats{cross})")
    line = f"{v['verdict']:<5} {t['what']}: {measured}; target {t['text']}"
    if t["source"]:
        line += f" [{t['source']}]"
    if v["verdict"] == "UNDECIDED":
        line += f" - {v['why']}"
    if v.get("note"):
        line += f" ({v['note']})"
    return line


def _digits(value: float, bound: float) -> int:
    """Decimals that tell ``value`` from ``bound`` (a median of 1.004 against <= 1 prints 1.004x, not 1.00x).

    Example
    -------
    >>> _digits(1.004, 1.0), _digits(1.2, 1.0)
    (3, 2)
    """
    digits = 2
    while digits < 4 and value != bound and f"{value:.{digits}f}" == f"{bound:.{digits}f}":
        digits += 1
    return digits


def _range(lo: float, hi: float, unit: str) -> str:
    if unit == "x":
        return f"{lo:.2f}-{hi:.2f}"
    if unit == "%":  # signed: "-2.15% to +0.60%" (a dash between them would read as a minus)
        return f"{lo:+.2f}% to {hi:+.2f}%"
    return f"{_value(lo, unit)}-{_value(hi, unit)}"


def format_verdicts(verdicts: Sequence[dict[str, Any]]) -> str:
    """The verdict block of a terminal report, with a one-line tally first."""
    if not verdicts:
        return "targets: none apply to this run"
    counts = {k: sum(v["verdict"] == k for v in verdicts) for k in VERDICTS}
    head = "targets: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    head += " (decided on the median of interleaved repeats; the spread is shown beside it)"
    return "\n".join([head, *("  " + format_verdict(v) for v in verdicts)])


def overall(verdicts: Sequence[dict[str, Any]]) -> str:
    """``FAIL`` if any target failed, else ``UNDECIDED`` if any is undecided, else ``PASS`` (none: ``UNDECIDED``).

    Example
    -------
    >>> overall([{"verdict": "PASS"}, {"verdict": "UNDECIDED"}])
    'UNDECIDED'
    """
    kinds = {v["verdict"] for v in verdicts}
    if "FAIL" in kinds:
        return "FAIL"
    if "UNDECIDED" in kinds or not kinds:
        return "UNDECIDED"
    return "PASS"
