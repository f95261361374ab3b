"""What :func:`~tierstore.diagnose.diagnose` found: phases, figures tagged by how they were obtained, the verdict.

Every byte figure carries one of three kinds, so a reader can tell a
measurement from arithmetic:

- **measured**: read from the memory probe while the iteration ran (process
  RSS or CUDA allocator stats): the phases, the peak, the process baseline,
  the forward pass's growth;
- **counted**: exact byte sizes of tensors (parameters, gradients, the
  optimizer's state, the storages autograd saved for backward);
- **estimated**: arithmetic on the above under a stated assumption (the
  peak's drop with :class:`~tierstore.TieredAdamW`, the GPU memory it frees,
  what halving the batch saves, a suggested ``ram_budget``, anything that
  uses a constant).

Example
-------
>>> Figure("peak drop with TieredAdamW", 3 << 20, ESTIMATED, "optimizer state - TieredAdamW's host RAM").tag
'3.00 MiB (estimated)'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..sizes import format_size

__all__ = ["MEASURED", "COUNTED", "ESTIMATED", "KINDS", "Figure", "Phase", "MemoryReport", "tagged"]

MEASURED = "measured"  # read from the memory probe while the iteration ran
COUNTED = "counted"  # exact byte sizes of tensors
ESTIMATED = "estimated"  # arithmetic on the above under a stated assumption
KINDS = (MEASURED, COUNTED, ESTIMATED)
#: What the `dominant` part is called in words; "parameters" is weights and gradients, which no remedy here moves.
PART_NAMES = {"optimizer_state": "optimizer state", "activations": "activations", "parameters": "weights and gradients"}


def tagged(nbytes: int, kind: str) -> str:
    """A byte figure with its kind, as the report's sentences write it: ``"16.02 MiB (counted)"``."""
    return f"{format_size(nbytes)} ({kind})"


@dataclass(frozen=True)
class Figure:
    """One byte figure of the report: its name, value, kind (:data:`KINDS`) and how it was obtained or assumed."""

    name: str
    nbytes: int
    kind: str
    how: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:  # the report's own invariant: every figure says how it was obtained
            raise ValueError(f"figure {self.name!r}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def tag(self) -> str:
        return tagged(self.nbytes, self.kind)


@dataclass(frozen=True)
class Phase:
    """Memory at the end of a phase (``current``) and the most it reached during it (``peak``); both measured."""

    name: str
    current: int
    peak: int | None


@dataclass(frozen=True)
class MemoryReport:
    """What :func:`~tierstore.diagnose.diagnose` measured, counted and estimated, and its verdict.

    Byte counts: ``param_bytes``, ``grad_bytes`` and ``optimizer_state_bytes``
    are counted (exact tensor sizes); ``forward_delta_bytes`` is the forward
    pass's measured growth (from the steady iteration when there is one: the
    first forward also pays one-time costs); ``saved_for_backward_bytes`` is
    counted (saved-tensor hooks); ``activation_bytes`` is the larger of the
    two, and ``activations_from`` says which (``"forward growth"`` or
    ``"saved for backward"``). ``peak_bytes`` and ``baseline_bytes`` (memory
    at the call's start) are measured. ``dominant`` is the largest part, one
    of ``"optimizer_state"``, ``"activations"``, ``"parameters"``.
    ``figures`` holds every byte figure with its kind (:class:`Figure`),
    the verdict's estimates included.
    """

    device: str
    measured_with: str
    optimizer: str
    phases: tuple[Phase, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    forward_delta_bytes: int
    saved_for_backward_bytes: int
    peak_bytes: int
    peak_phase: str
    dominant: str
    advice: str
    suggested_ram_budget: int | None
    baseline_bytes: int = 0
    activations_from: str = "saved for backward"
    figures: tuple[Figure, ...] = ()

    def figure(self, name: str) -> Figure:
        """The figure called ``name`` (``KeyError`` if the report has none)."""
        for fig in self.figures:
            if fig.name == name:
                return fig
        raise KeyError(name)

    def largest_part(self) -> str:
        """The largest part in words, its share of the peak and the process baseline (every number tagged)."""
        part = {"optimizer_state": self.optimizer_state_bytes, "activations": self.activation_bytes,
                "parameters": self.param_bytes + self.grad_bytes}[self.dominant]  # fmt: skip
        share = part / self.peak_bytes if self.peak_bytes else 0.0
        share_text = f"{100 * share:.0f}%" if share >= 0.01 or share == 0 else "under 1%"
        what = "largest part" if self.dominant == "parameters" else "largest movable part"
        return (
            f"{what}: {PART_NAMES[self.dominant]} ({share_text} of the peak; the process baseline is "
            f"{tagged(self.baseline_bytes, MEASURED)} at '{self.phases[0].name}')"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable values (bytes as ints); phases and figures say their kind."""
        data = asdict(self)
        data["phases"] = [{**asdict(p), "kind": MEASURED} for p in self.phases]
        data["figures"] = [asdict(f) for f in self.figures]
        data["largest_part"] = self.largest_part()
        return data

    def __str__(self) -> str:
        base = self.phases[0].current
        lines = [
            f"tierstore diagnose: {self.device}",
            f"measured with {self.measured_with}, phase by phase:",
            f"  {'phase':<24}{'current':>12}{'peak':>12}{'peak - loaded':>16}",
        ]
        for p in self.phases:
            peak = "" if p.peak is None else format_size(p.peak)
            over = "" if p.peak is None else _signed(p.peak - base)
            lines.append(f"  {p.name:<24}{format_size(p.current):>12}{peak:>12}{over:>16}")
        lines += ["", f"  {'figure':<28}{'bytes':>12}  {'kind':<10} how"]
        for f in self.figures:
            lines.append(f"  {f.name:<28}{format_size(f.nbytes):>12}  {f.kind:<10} {f.how}")
        lines += ["", f"peak {tagged(self.peak_bytes, MEASURED)} during {self.peak_phase}; {self.largest_part()}",
                  self.advice]  # fmt: skip
        return "\n".join(lines)


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_size(abs(n))
