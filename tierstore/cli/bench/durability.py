"""What durability costs a training loop: iteration time with commits in the background.

A training loop on the CPU: a compute stand-in that holds every core the way
a model's forward and backward do (a chain of matrix products, calibrated to
take ``--compute-share`` times as long as writing the optimizer state to the
drive once), then ``optimizer.step()`` over fp32 parameters (:mod:`.workload`)
whose state lives all in RAM. Contenders, in the same run, interleaved (each
round runs every contender for ``--block`` iterations, in a rotating order;
the first iteration of each block is not counted, so every counted one runs
in the steady rhythm of commits):

- ``durable-auto``: ``TieredAdamW`` with a ``state_dir``, the default
  durable mode (``commit_every="auto"``);
- ``durable-every-step``: the same with ``commit_every=1``: it reports how far
  ``committed_step`` lags ``step_count``;
- ``not-durable``: ``state_dir`` with ``durable=False``;
- ``no-state-dir``: ``TieredAdamW`` without a ``state_dir``;
- ``torch-fused``: ``torch.optim.AdamW(fused=True)``.

Reported: median iteration time and its ratio to ``not-durable`` (the target:
``durable-auto`` <= 1.05), commits per step, the lag, and the bytes written
to the drive per step: once per commit with background commits, against the
state's size (what writing every resident shard every step cost).

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(); add_arguments(parser)
>>> parser.parse_args(["--params", "5e7"]).block
3
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...sizes import format_size
from . import workload
from .report import format_table, machine_info, median, write_json

CONTENDERS = ("durable-auto", "durable-every-step", "not-durable", "no-state-dir", "torch-fused")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench/durability.py``."""
    parser.add_argument("--params", default="5e7", help="fp32 parameters (default 5e7: 400 MB of state)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--block", type=int, default=3, help="iterations per contender per round (default 3)")
    parser.add_argument(
        "--compute-share", type=float, default=1.2,
        help="the stand-in forward+backward takes this many times the state's write time (default 1.2)",
    )  # fmt: skip
    parser.add_argument("--dir", default=None, help="where state directories go (default: the temp directory)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")


class ComputeStandIn:
    """Holds the cores like a model's forward and backward: ``reps`` products of ``n x n`` matrices."""

    def __init__(self, n: int = 1024) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen) / n**0.5
        self.b = torch.randn(n, n, generator=gen) / n**0.5
        self.reps = 1

    def run(self) -> None:
        x = self.a
        for _ in range(self.reps):
            x = torch.tanh(x @ self.b)

    def calibrate(self, seconds: float) -> float:
        """Pick ``reps`` so that :meth:`run` takes about ``seconds``; returns the measured time (median of 3)."""
        self.reps = 8
        self.run()  # warm up: thread pools, allocations
        for _ in range(2):  # refine: the per-product time settles once the pool is warm
            per_rep = statistics.median(self._time() for _ in range(3)) / self.reps
            self.reps = max(1, round(seconds / per_rep))
        return statistics.median(self._time() for _ in range(3))

    def _time(self) -> float:
        t0 = time.perf_counter()
        self.run()
        return time.perf_counter() - t0


def _optimizer(name: str, params: list[torch.Tensor], root: Path) -> Any:
    from ...optimizer import TieredAdamW

    if name == "torch-fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "no-state-dir":
        return TieredAdamW(params, lr=1e-4)
    kwargs = {
        "durable-auto": {},
        "durable-every-step": {"commit_every": 1},
        "not-durable": {"durable": False},
    }[name]
    return TieredAdamW(params, lr=1e-4, state_dir=str(root / name), **kwargs)


def write_seconds(params: list[torch.Tensor], root: Path) -> float:
    """Seconds to write the all-resident state to the drive once (a step, then a commit, waited for)."""
    from ...optimizer import TieredAdamW

    times = []
    with TieredAdamW(params, lr=1e-4, state_dir=str(root / "calibrate"), commit_every=10**9) as opt:
        for _ in range(3):
            opt.step()
            t0 = time.perf_counter()
            opt.commit()
            times.append(time.perf_counter() - t0)
    shutil.rmtree(root / "calibrate", ignore_errors=True)
    return statistics.median(times)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    numel = int(float(args.params))
    root = Path(tempfile.mkdtemp(prefix="tierstore-durability-", dir=args.dir))
    try:
        params = workload.build(numel)
        state = numel * 8
        write_s = write_seconds(params, root)
        compute = ComputeStandIn()
        compute_s = compute.calibrate(args.compute_share * write_s)
        opts = {name: _optimizer(name, params, root) for name in CONTENDERS}
        times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
        per_round: list[dict[str, float]] = []  # each round's median per contender, for paired ratios
        lags: dict[str, list[int]] = {n: [] for n in CONTENDERS}
        drive: dict[str, list[int]] = {n: [] for n in CONTENDERS}
        committed: dict[str, int] = dict.fromkeys(CONTENDERS, 0)
        steps: dict[str, int] = dict.fromkeys(CONTENDERS, 0)
        for r in range(args.rounds + 1):  # the first round warms up
            order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
            this_round: dict[str, list[float]] = {n: [] for n in CONTENDERS}
            for name in order:
                opt = opts[name]
                for k in range(args.block):
                    t0 = time.perf_counter()
                    compute.run()
                    opt.step()
                    elapsed = time.perf_counter() - t0
                    if r == 0 or k == 0:
                        continue
                    times[name].append(elapsed)
                    this_round[name].append(elapsed)
                    stats = getattr(opt, "last_step_stats", None)
                    if stats is not None:
                        steps[name] += 1
                        committed[name] += int(stats.committed)
                        drive[name].append(stats.drive_bytes)
                        if opt.committed_step is not None:
                            lags[name].append(opt.step_count - opt.committed_step)
            if r > 0:
                per_round.append({n: median(v) for n, v in this_round.items()})
        for opt in opts.values():
            if hasattr(opt, "close"):
                opt.close()
        del opts
        gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = median(times["not-durable"])
    rows = []
    for name in CONTENDERS:
        t = median(times[name])
        paired = median([rnd[name] / rnd["not-durable"] for rnd in per_round])
        row = {"contender": name, "iteration_s": t, "vs_not_durable": t / base, "vs_not_durable_paired": paired}
        if steps[name]:
            row["commits_per_step"] = committed[name] / steps[name]
            row["drive_bytes_per_step"] = statistics.mean(drive[name]) if drive[name] else 0
        if lags[name]:
            row["lag_mean"] = statistics.mean(lags[name])
            row["lag_max"] = max(lags[name])
        rows.append(row)
    return {
        "tool": "bench durability",
        "machine": machine_info(args.dir),
        "config": {
            "params": numel,
            "state_bytes": state,
            "rounds": args.rounds,
            "block": args.block,
            "compute_share": args.compute_share,
        },
        "calibration": {"state_write_s": write_s, "compute_s": compute_s, "compute_reps": compute.reps},
        "contenders": rows,
        "iterations": times,
        "summary": {
            "durable_auto_vs_not_durable": median(times["durable-auto"]) / base,
            "durable_auto_vs_not_durable_paired": rows[0]["vs_not_durable_paired"],
            "durable_every_step_vs_not_durable": median(times["durable-every-step"]) / base,
            "every_step_lag_max": max(lags["durable-every-step"], default=None),
            "auto_drive_bytes_per_step": rows[0].get("drive_bytes_per_step"),
            "state_bytes": state,
        },
    }


def render(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    head = (
        f"{result['config']['params']:,} fp32 params, state {format_size(result['config']['state_bytes'])} all in RAM; "
        f"writing it once took {cal['state_write_s']:.3f} s, the compute stand-in {cal['compute_s']:.3f} s"
    )
    rows = [
        {
            **r,
            "drive": format_size(int(r["drive_bytes_per_step"])) if "drive_bytes_per_step" in r else None,
        }
        for r in result["contenders"]
    ]
    table = format_table(
        rows,
        [
            ("contender", "contender", "{}"),
            ("iteration_s", "iteration s", "{:.3f}"),
            ("vs_not_durable", "vs not-durable", "{:.3f}x"),
            ("vs_not_durable_paired", "paired", "{:.3f}x"),
            ("commits_per_step", "commits/step", "{:.2f}"),
            ("drive", "drive bytes/step", "{}"),
            ("lag_mean", "lag mean", "{:.2f}"),
            ("lag_max", "lag max", "{}"),
        ],
    )
    return f"{head}\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    result = run_benchmark(args)
    print(render(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
