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

Reported: median iteration time and its ratio to ``not-durable``, commits
per step, the lag, and the bytes written to the drive per step: once per
commit with background commits, against the state's size (what writing every
resident shard every step cost). The target (``README.md``, Performance):
``durable-auto`` / ``not-durable`` <= 1.05, each round's ratio of medians a
repeat; PASS/FAIL on their median, UNDECIDED with fewer than three rounds.
The report starts with the hardware line.

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ...sizes import format_size
from . import workload
from .report import format_table, hardware_line, machine_info, median, write_json
from .verdict import MIN_REPEATS, Target, format_verdicts, judge, overall, spread

CONTENDERS = ("durable-auto", "durable-every-step", "not-durable", "no-state-dir", "torch-fused")
SOURCE = "README.md, Performance (durable / durable=False, all in RAM)"
DURABLE_OVER_NOT = 1.05  # durable-auto's iteration at most this many times not-durable's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench/durability.py``."""
    parser.add_argument("--params", default="5e7", help="fp32 parameters (default 5e7: 400 MB of state)")
    parser.add_argument("--rounds", type=int, default=10,
                        help=f"timed rounds (default 10; a verdict needs at least {MIN_REPEATS})")
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
    ratios = [rnd["durable-auto"] / rnd["not-durable"] for rnd in per_round]
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
    result = {
        "tool": "bench durability",
        "argv": sys.argv,
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
        "per_round_s": {n: [rnd[n] for rnd in per_round] for n in CONTENDERS},
        "summary": {
            "durable_auto_vs_not_durable": median(times["durable-auto"]) / base,
            "durable_auto_vs_not_durable_paired": rows[0]["vs_not_durable_paired"],
            "durable_auto_vs_not_durable_rounds": ratios,
            "durable_every_step_vs_not_durable": median(times["durable-every-step"]) / base,
            "every_step_lag_max": max(lags["durable-every-step"], default=None),
            "auto_drive_bytes_per_step": rows[0].get("drive_bytes_per_step"),
            "state_bytes": state,
        },
    }
    result["verdicts"] = verdicts(result)
    result["verdict"] = overall(result["verdicts"])
    result["hardware"] = hardware_line(result["machine"])
    return result


def rounds_of(result: dict[str, Any]) -> dict[str, list[float]]:
    """Each round's median iteration per contender (recomputed from ``iterations`` for a JSON from
    before ``per_round_s`` was kept: every round counted ``block - 1`` iterations per contender)."""
    if "per_round_s" in result:
        return result["per_round_s"]
    k = max(1, result["config"]["block"] - 1)
    return {name: [median(v[i:i + k]) for i in range(0, len(v), k)] for name, v in result["iterations"].items()}


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """durable-auto / not-durable per round against <= 1.05 (the README's target).

    Example
    -------
    >>> doc = {"per_round_s": {"durable-auto": [1.0, 1.1, 1.02], "not-durable": [1.0, 1.0, 1.0]}}
    >>> [(v["verdict"], round(v["median"], 2)) for v in verdicts(doc)]
    [('PASS', 1.02)]
    """
    rounds = rounds_of(result)
    ratios = [a / b for a, b in zip(rounds["durable-auto"], rounds["not-durable"]) if b > 0]
    return [judge(Target("durable_auto_vs_not_durable", "all in RAM, a training loop with commits in the background: "
                         "iteration with durable=True (commit_every='auto') / durable=False's (round by round)",
                         "<=", DURABLE_OVER_NOT, source=SOURCE), ratios)]


def render(result: dict[str, Any]) -> str:
    """The terminal report: hardware, calibration, the table, the ratio's spread over rounds, the verdicts."""
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
            ("iteration_s", "median iteration s", "{:.3f}"),
            ("commits_per_step", "commits/step", "{:.2f}"),
            ("drive", "drive bytes/step", "{}"),
            ("lag_mean", "lag mean", "{:.2f}"),
            ("lag_max", "lag max", "{}"),
        ],
    )
    rounds = rounds_of(result)
    lines = [hardware_line(result["machine"])] if result.get("machine") else []
    lines += [head, f"{len(rounds['not-durable'])} interleaved rounds of {result['config']['block']} iterations per "
              "contender (the first of each block not counted)", table, "each against not-durable, as the target judges it:"]
    for name in CONTENDERS:
        if name != "not-durable" and rounds.get(name):
            sp = spread([a / b for a, b in zip(rounds[name], rounds["not-durable"]) if b > 0])
            lines.append(f"  {name} / not-durable: {sp['median']:.3f}x (median of {sp['repeats']} per-round ratios, "
                         f"range {sp['min']:.3f}-{sp['max']:.3f})")
    lines += ["", format_verdicts(verdicts(result))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block < 2:
        parser.error(f"--rounds {args.rounds} --block {args.block}: need --rounds >= 1 and --block >= 2 "
                     "(the first iteration of each block is not counted)")
    result = run_benchmark(args)
    print(render(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
