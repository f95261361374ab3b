#!/usr/bin/env python
"""Every tiered optimizer against its torch class (state in RAM) and against the raw I/O floor (state on disk).

Issue 24's targets, one algorithm at a time, interleaved within each:

- **RAM** (all state in RAM): the torch class's step time over the front's,
  per interleaved round (torch, tiered, torch, tiered, ...). Target ``>= 0.95x``
  against the torch class with ``fused=True`` where torch has a fused CPU
  kernel (Adam, AdamW, SGD, Adagrad), ``foreach=True`` where it has none;
  ``TieredLion`` ``>= 1.5x`` against ``lion-pytorch``'s ``Lion``.
- **Disk** (``ram_budget="1/8"``, state streamed from ``--dir``): the front's
  step over the raw direct-I/O floor for its own bytes (:class:`RawFloor`:
  read and write the same number of bytes as the state's file, the fastest of
  its two modes, interleaved with the step). Target ``<= 1.15x``. SGD with
  momentum moves one field, a third of Adam's bytes: each algorithm is
  judged against the floor of its own bytes.

A front that this tierstore does not have (or whose peer is not installed) is
reported as skipped, with the reason. Results: a table, verdicts, and
``--json``.

Example
-------
    python bench/algorithms.py --params 5e7 --rounds 5 --dir /mnt/nvme/scratch --json bench/results/algorithms-5e7.json
    python bench/algorithms.py --params 1e6 --rounds 3 --only adamw,sgd   # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Case:
    """One algorithm: its front's name in ``tierstore``, its peer, and the hyperparameters both take."""

    name: str
    front: str
    peer: str  # what the RAM ratio is against, as the table shows it
    make_peer: Callable[[list[torch.Tensor], dict[str, Any]], Any]
    hyper: dict[str, Any] = field(default_factory=dict)
    front_extra: dict[str, Any] = field(default_factory=dict)  # arguments only the front takes (foreach)
    ram_bound: float = 0.95


def _torch(cls_name: str, **flags: Any) -> Callable[[list[torch.Tensor], dict[str, Any]], Any]:
    def make(params: list[torch.Tensor], hyper: dict[str, Any]) -> Any:
        return getattr(torch.optim, cls_name)(params, **hyper, **flags)

    return make


def _lion(params: list[torch.Tensor], hyper: dict[str, Any]) -> Any:
    from lion_pytorch import Lion  # an optional peer: pip install lion-pytorch

    return Lion(params, **hyper)


CASES = (
    Case("adamw", "TieredAdamW", "torch AdamW fused", _torch("AdamW", fused=True), dict(lr=1e-3, weight_decay=1e-2)),
    Case("adam", "TieredAdam", "torch Adam fused", _torch("Adam", fused=True), dict(lr=1e-3)),
    Case("sgd", "TieredSGD", "torch SGD fused", _torch("SGD", fused=True), dict(lr=1e-3, momentum=0.9)),
    Case("adagrad", "TieredAdagrad", "torch Adagrad fused", _torch("Adagrad", fused=True), dict(lr=1e-3)),
    Case("rmsprop", "TieredRMSprop", "torch RMSprop foreach", _torch("RMSprop", foreach=True), dict(lr=1e-3),
         dict(foreach=True)),
    Case("adamax", "TieredAdamax", "torch Adamax foreach", _torch("Adamax", foreach=True), dict(lr=1e-3),
         dict(foreach=True)),
    Case("nadam", "TieredNAdam", "torch NAdam foreach", _torch("NAdam", foreach=True), dict(lr=1e-3), dict(foreach=True)),
    Case("radam", "TieredRAdam", "torch RAdam foreach", _torch("RAdam", foreach=True), dict(lr=1e-3), dict(foreach=True)),
    Case("adadelta", "TieredAdadelta", "torch Adadelta foreach", _torch("Adadelta", foreach=True), dict(lr=1.0),
         dict(foreach=True)),
    Case("lion", "TieredLion", "lion-pytorch Lion", _lion, dict(lr=1e-4, weight_decay=1e-2), ram_bound=1.5),
)


def _params(numel: int, seed: int) -> list[torch.Tensor]:
    """The bench's usual model shape (tierstore.cli.bench.workload), with a fixed gradient each."""
    from tierstore.cli.bench import workload

    params = workload.build(numel, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def _timed(opt: Any) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def _rounds(pair: list[tuple[str, Any]], *, warmup: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """Median step seconds per round for each contender, taking turns within every round (A, B, B, A, ...)."""
    out: dict[str, list[float]] = {name: [] for name, _ in pair}
    for r in range(warmup + rounds):
        order = pair if r % 2 == 0 else pair[::-1]
        times: dict[str, list[float]] = {name: [] for name, _ in pair}
        for _ in range(steps):
            for name, contender in order:
                times[name].append(_timed(contender))
        if r >= warmup:
            for name, ts in times.items():
                out[name].append(statistics.median(ts))
    return out


def _front(case: Case) -> Any:
    import tierstore

    return getattr(tierstore, case.front, None)


def ram_case(case: Case, numel: int, args: argparse.Namespace) -> dict[str, Any]:
    """Torch's (or the peer's) step over the front's, state in RAM."""
    front = _front(case)
    if front is None:
        return {"skipped": f"this tierstore has no {case.front}"}
    try:
        peer = case.make_peer(_params(numel, 0), case.hyper)
    except ImportError as exc:
        return {"skipped": f"{case.peer} is not installed ({exc})"}
    tiered = front(_params(numel, 0), **case.hyper, **case.front_extra, shard_numel=args.shard_numel)
    try:
        times = _rounds([("peer", peer), ("tiered", tiered)], warmup=args.warmup, rounds=args.rounds, steps=args.steps)
    finally:
        tiered.close()
        peer.state.clear()
    ratios = [p / t for p, t in zip(times["peer"], times["tiered"])]
    return {"peer_s": times["peer"], "tiered_s": times["tiered"], "ratios": ratios}


def disk_case(case: Case, numel: int, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The front's streamed step over the raw direct-I/O floor of its own on-disk bytes."""
    from tierstore.cli.bench.floor import MODES, RawFloor

    front = _front(case)
    if front is None:
        return {"skipped": f"this tierstore has no {case.front}"}
    state = folder / f"state-{case.name}"
    tiered = front(_params(numel, 0), **case.hyper, **case.front_extra, state_dir=str(state), ram_budget="1/8",
                   durable=False, shard_numel=args.shard_numel)
    floors = []
    try:
        nbytes = tiered.disk_bytes
        if not nbytes:
            return {"skipped": "the whole state fits in ram_budget='1/8' at this size: raise --params"}
        for mode in MODES:
            floor = RawFloor(folder / f"floor-{case.name}-{mode}.bin", nbytes, request_bytes=1 << 20, depth=8,
                             mode=mode, direct=not args.buffered)
            floor.name = f"floor-{mode}"
            floors.append(floor.open())

        class _Floor:
            def step(self) -> None:  # the fastest floor of this round's modes, as one contender
                self.last = min(f.step()["seconds"] for f in floors)

        fastest = _Floor()
        steps: dict[str, list[float]] = {"tiered": [], "floor": []}
        split: dict[str, list[float]] = {"update_s": [], "read_wait_s": [], "write_wait_s": []}
        for r in range(args.warmup + args.rounds):
            order = [("tiered", tiered), ("floor", fastest)]
            for name, contender in order if r % 2 == 0 else order[::-1]:
                seconds = _timed(contender) if name == "tiered" else (contender.step() or contender.last)
                if r < args.warmup:
                    continue
                steps[name].append(seconds)
                stats = tiered.last_step_stats if name == "tiered" else None
                if stats is not None:  # where the step's time went: the update's CPU time, or waits for the drive
                    split["update_s"].append(stats.update)
                    split["read_wait_s"].append(stats.read_wait)
                    split["write_wait_s"].append(stats.write_wait)
        ratios = [t / f for t, f in zip(steps["tiered"], steps["floor"])]
        return {"state_disk_bytes": nbytes, "tiered_s": steps["tiered"], "floor_s": steps["floor"], "ratios": ratios,
                "update_threads": tiered._knobs.update_threads, **split}
    finally:
        tiered.close()
        for f in floors:
            f.close()
        shutil.rmtree(state, ignore_errors=True)


def main(argv: list[str]) -> int:
    from tierstore.cli.bench import verdict
    from tierstore.cli.bench.workload import parse_elements

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="5e7", help="parameters per optimizer (default 5e7)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; a verdict needs 3 (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per RAM round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted (default 1)")
    parser.add_argument("--shard-numel", type=int, default=None, help="elements per shard (default: tierstore's)")
    parser.add_argument("--only", default="", help="comma-separated algorithms (default: all): "
                        + ",".join(c.name for c in CASES))
    parser.add_argument("--skip", default="", help="phases to skip: ram, disk")
    parser.add_argument("--dir", default=None, help="scratch folder on the drive to measure (default: a temp dir)")
    parser.add_argument("--buffered", action="store_true", help="the floor without O_DIRECT (tmpfs)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    numel = parse_elements(args.params)
    wanted = {n for n in args.only.split(",") if n}
    unknown = wanted - {c.name for c in CASES}
    if unknown:
        parser.error(f"--only names {sorted(unknown)}; known: {[c.name for c in CASES]}")
    skip = {s for s in args.skip.split(",") if s}
    folder = Path(tempfile.mkdtemp(prefix="tierstore-algorithms-", dir=args.dir))
    results: dict[str, Any] = {}
    verdicts = []
    torch.set_num_threads(torch.get_num_threads())
    try:
        for case in CASES:
            if wanted and case.name not in wanted:
                continue
            entry: dict[str, Any] = {"front": case.front, "peer": case.peer}
            if "ram" not in skip:
                entry["ram"] = ram_case(case, numel, args)
                if "ratios" in entry["ram"]:
                    target = verdict.Target(f"{case.name}_ram", f"{case.peer} step / {case.front}'s (state in RAM)",
                                            ">=", case.ram_bound, source="issue 24", more="raise --rounds")
                    verdicts.append(verdict.judge(target, entry["ram"]["ratios"]))
            if "disk" not in skip:
                entry["disk"] = disk_case(case, numel, folder, args)
                if "ratios" in entry["disk"]:
                    target = verdict.Target(f"{case.name}_disk", f"{case.front}'s streamed step / raw I/O floor of "
                                            "its bytes (budget 1/8)", "<=", 1.15, source="issue 24", more="raise --rounds")
                    verdicts.append(verdict.judge(target, entry["disk"]["ratios"]))
            results[case.name] = entry
            for phase in ("ram", "disk"):
                got = entry.get(phase, {})
                if "skipped" in got:
                    print(f"{case.name:9s} {phase:4s} skipped: {got['skipped']}")
                elif "ratios" in got:
                    where = ""
                    if got.get("update_s"):
                        where = (f" (step {statistics.median(got['tiered_s']):.3f} s: update "
                                 f"{statistics.median(got['update_s']):.3f} s, read wait "
                                 f"{statistics.median(got['read_wait_s']):.3f} s; floor "
                                 f"{statistics.median(got['floor_s']):.3f} s)")
                    print(f"{case.name:9s} {phase:4s} median ratio {statistics.median(got['ratios']):.3f}{where}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(verdict.format_verdicts(verdicts))
    document = {"params": numel, "rounds": args.rounds, "steps": args.steps, "threads": torch.get_num_threads(),
                "torch": torch.__version__, "results": results, "verdicts": verdicts,
                "overall": verdict.overall(verdicts)}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
