"""Is the tuned step faster? A short streamed step with the tuner's knobs file and with none, interleaved.

Two :class:`~tierstore.TieredAdamW` over copies of the same synthetic
parameters (:mod:`tierstore.cli.bench.workload`), each with a state spread
over the same directories (a folder of its own on each drive) and a
``ram_budget`` that streams most of the state: one built with
``knobs=<the candidate file>``, one with the defaults (its placement from
the optimizer's own quick probe). After a warm-up step each, every round
steps both once, in alternating order, so both see the same drive weather;
the verdict is the median over rounds of (tuned step / default step), and
the tuned knobs are kept only when it is below 1.

Example
-------
>>> import json, tempfile, pathlib
>>> from tierstore._config.knobs_file import knobs_document, encode_knobs_file
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "k.json").write_bytes(encode_knobs_file(knobs_document({"io_workers": 2})))
>>> result = compare_steps([folder], folder / "k.json", params=100_000, rounds=1, shard_numel=1024)
>>> len(result.ratios), result.tuned_s[0] > 0
(1, True)
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["StepComparison", "compare_steps", "DEFAULT_RAM_BUDGET"]

DEFAULT_RAM_BUDGET = "1/8"  # most of the state streams: the knobs decide the step's speed


@dataclass
class StepComparison:
    """Step seconds with the tuned knobs and with the defaults, round by round, and their ratios."""

    tuned_s: list[float] = field(default_factory=list)
    default_s: list[float] = field(default_factory=list)
    params: int = 0
    ram_budget: str = DEFAULT_RAM_BUDGET

    @property
    def ratios(self) -> list[float]:
        """Tuned step / default step, per round."""
        return [t / d for t, d in zip(self.tuned_s, self.default_s) if d > 0]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def faster(self) -> bool:
        """The tuned step was faster: the median ratio is below 1."""
        return self.median_ratio < 1.0

    def to_dict(self) -> dict:
        return {"params": self.params, "ram_budget": self.ram_budget, "tuned_s": self.tuned_s,
                "default_s": self.default_s, "ratios": self.ratios, "median_ratio": self.median_ratio,
                "tuned_is_faster": self.faster}


def compare_steps(directories: Sequence[Path | str], knobs: Path | str, *, params: int, rounds: int,
                  ram_budget: str = DEFAULT_RAM_BUDGET, shard_numel: int | None = None) -> StepComparison:
    """Time streamed steps with ``knobs`` and with the defaults, interleaved (see the module docs)."""
    from ...optimizer import TieredAdamW
    from ..bench.workload import build

    base = build(params)
    folders = [Path(d) / f".tierstore-tune-{os.getpid()}" for d in directories]
    result = StepComparison(params=params, ram_budget=ram_budget)
    opts = {}
    try:
        for name, knobs_file in (("tuned", knobs), ("default", None)):
            copies = [p.detach().clone().requires_grad_() for p in base]
            for copy, p in zip(copies, base):
                copy.grad = p.grad
            dirs = [str(f / name) for f in folders]
            opts[name] = TieredAdamW(copies, lr=1e-3, state_dir=dirs if len(dirs) > 1 else dirs[0],
                                     ram_budget=ram_budget, durable=False, shard_numel=shard_numel,
                                     knobs=None if knobs_file is None else str(knobs_file))
        for opt in opts.values():  # warm-up: the arena fills, the update's threads start
            opt.step()
        for rnd in range(rounds):
            order = ("tuned", "default") if rnd % 2 == 0 else ("default", "tuned")
            for name in order:
                t0 = time.perf_counter()
                opts[name].step()
                (result.tuned_s if name == "tuned" else result.default_s).append(time.perf_counter() - t0)
    finally:
        for opt in opts.values():
            opt.close()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    return result
