#!/usr/bin/env python
"""The generic adapter on a third-party elementwise class: bitwise, and its streamed step against the I/O floor.

Issue 24's adapter target, for ``tierstore.tiered(cls, ...)`` over a class of
``pytorch-optimizer`` (``Lion`` by default):

- **bitwise**: the class run directly on the whole tensors (state in RAM) and
  through the adapter with its state streamed from ``--dir``
  (``ram_budget="1/8"``), ``--bitwise-steps`` steps from the same parameters
  and gradients: every parameter and every state tensor must be equal, bit
  for bit;
- **streamed step**: the adapter's step with ``ram_budget="1/8"`` over the raw
  direct-I/O floor for its own bytes (:class:`tierstore.cli.bench.floor.RawFloor`:
  read and write as many bytes as the state's file holds, the faster of its
  two modes), taking turns within every round (adapter, floor, floor,
  adapter, ...). Target ``<= 1.3x``. Beside them, the class itself on whole
  tensors with its state in RAM (no I/O): the arithmetic any step of it costs.
  Where that is slower than the drive, no streamed step reaches the I/O floor;
  the JSON also gives the adapter over the slower of the two floors.

Results: the figures, the verdicts, and ``--json``.

Example
-------
    python bench/generic_adapter.py --params 5e7 --rounds 5 --dir /mnt/nvme/scratch \\
        --json bench/results/generic-adapter-5e7.json
    python bench/generic_adapter.py --params 2e6 --rounds 3   # a quick look
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _params(numel: int, seed: int) -> list[torch.Tensor]:
    """The bench's usual model shape (tierstore.cli.bench.workload), each with a fixed gradient."""
    from tierstore.cli.bench import workload

    return workload.build(numel, seed=seed)


def optimizer_class(name: str) -> type:
    """A class of ``pytorch-optimizer`` by name (``Lion``, ``AdaBelief``, ...)."""
    import pytorch_optimizer

    cls = getattr(pytorch_optimizer, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise SystemExit(f"pytorch_optimizer has no optimizer class {name!r}")
    return cls


def bitwise(cls: type, hyper: dict[str, Any], numel: int, steps: int, folder: Path) -> dict[str, Any]:
    """The class on whole tensors vs the adapter streamed from disk: what differs after ``steps`` steps."""
    from tierstore import tiered

    want = _params(numel, 0)
    reference = cls(want, **hyper)
    for _ in range(steps):
        reference.step()
    got = _params(numel, 0)
    state = folder / "bitwise"
    with tiered(cls, got, **hyper, state_dir=str(state), ram_budget="1/8", durable=False) as opt:
        disk = opt.disk_bytes
        for _ in range(steps):
            opt.step()
        mine = opt.state_dict()["state"]
    shutil.rmtree(state, ignore_errors=True)
    theirs = reference.state_dict()["state"]
    problems = [f"param {i} differs" for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
    for key, entry in theirs.items():
        for name, value in entry.items():
            other = mine.get(key, {}).get(name)
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if other is None or not same:
                problems.append(f"param {key} {name!r} differs")
    del reference, want, got, mine, theirs
    return {"steps": steps, "state_disk_bytes": disk, "problems": problems, "bitwise": not problems}


def streamed(cls: type, hyper: dict[str, Any], numel: int, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The adapter's streamed step over the raw direct-I/O floor of its own bytes, interleaved."""
    from tierstore import tiered
    from tierstore.cli.bench.floor import MODES, RawFloor

    state = folder / "streamed"
    opt = tiered(cls, _params(numel, 0), **hyper, state_dir=str(state), ram_budget="1/8", durable=False,
                 shard_numel=args.shard_numel)  # fmt: skip
    # The class itself on the whole tensors, state in RAM: the arithmetic any step of it costs (no I/O).
    direct = cls(_params(numel, 1), **hyper) if args.class_floor else None
    floors = []
    try:
        nbytes = opt.disk_bytes
        if not nbytes:
            return {"skipped": "the whole state fits in ram_budget='1/8' at this size: raise --params"}
        for mode in MODES:
            floors.append(RawFloor(folder / f"floor-{mode}.bin", nbytes, request_bytes=1 << 20, depth=8, mode=mode,
                                   direct=not args.buffered).open())  # fmt: skip
        names = ["adapter", "floor"] + (["class"] if direct is not None else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.warmup + args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if name == "floor":  # the faster of the floor's modes this round
                    seconds = min(f.step()["seconds"] for f in floors)
                else:
                    t0 = time.perf_counter()
                    (opt if name == "adapter" else direct).step()
                    seconds = time.perf_counter() - t0
                if r >= args.warmup:
                    times[name].append(seconds)
        stats = opt.last_step_stats
        out = {"state_disk_bytes": nbytes, "state_bytes": opt.layout.state_nbytes, "ram_bytes": opt.ram_bytes,
               "adapter_s": times["adapter"], "floor_s": times["floor"],
               "ratios": [a / f for a, f in zip(times["adapter"], times["floor"])],
               "update_s": None if stats is None else stats.update, "read_wait_s": None if stats is None else stats.read_wait,
               "write_wait_s": None if stats is None else stats.write_wait}  # fmt: skip
        if direct is not None:
            out["class_ram_s"] = times["class"]
            # Against the slower of the two floors: the drive's bytes and the class's own arithmetic.
            out["ratios_vs_slower_floor"] = [a / max(f, c) for a, f, c in zip(times["adapter"], times["floor"], times["class"])]
        return out
    finally:
        opt.close()
        for f in floors:
            f.close()
        shutil.rmtree(state, ignore_errors=True)


def main(argv: list[str]) -> int:
    from tierstore.cli.bench import verdict
    from tierstore.cli.bench.report import hardware_line, machine_info, write_json
    from tierstore.cli.bench.workload import parse_elements

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="5e7", help="parameters (default 5e7)")
    parser.add_argument("--optimizer", default="Lion", help="a pytorch-optimizer class (default Lion)")
    parser.add_argument("--lr", type=float, default=1e-4, help="its learning rate (default 1e-4)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; a verdict needs 3 (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted (default 1)")
    parser.add_argument("--bitwise-steps", type=int, default=2, help="steps of the bitwise comparison (default 2; 0: skip)")
    parser.add_argument("--shard-numel", type=int, default=None, help="elements per shard (default: tierstore's)")
    parser.add_argument("--dir", default=None, help="scratch folder on the drive to measure (default: a temp dir)")
    parser.add_argument("--buffered", action="store_true", help="the floor without O_DIRECT (tmpfs)")
    parser.add_argument("--no-class-floor", dest="class_floor", action="store_false",
                        help="do not time the class itself on whole tensors in RAM beside them")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    numel = parse_elements(args.params)
    cls = optimizer_class(args.optimizer)
    hyper = {"lr": args.lr}
    folder = Path(tempfile.mkdtemp(prefix="tierstore-generic-", dir=args.dir))
    machine = machine_info(folder)
    print(hardware_line(machine))
    verdicts = []
    document: dict[str, Any] = {"params": numel, "optimizer": f"{cls.__module__}.{cls.__qualname__}", "hyper": hyper,
                                "rounds": args.rounds, "machine": machine, "hardware": hardware_line(machine)}  # fmt: skip
    try:
        if args.bitwise_steps:
            document["bitwise"] = found = bitwise(cls, hyper, numel, args.bitwise_steps, folder)
            print(f"bitwise over {args.bitwise_steps} steps, state streamed ({found['state_disk_bytes']:,} B on disk): "
                  + ("equal" if found["bitwise"] else f"DIFFERS: {found['problems'][:5]}"))
            verdicts.append(verdict.judge(
                verdict.Target("generic_bitwise", f"tiered({cls.__name__}) streamed == {cls.__name__} on whole tensors "
                               "(1: every parameter and state tensor equal)", ">=", 1.0, source="issue 24", min_repeats=1),
                [1.0 if found["bitwise"] else 0.0]))  # fmt: skip
        document["streamed"] = got = streamed(cls, hyper, numel, folder, args)
        if "ratios" in got:
            print(f"streamed step: adapter {statistics.median(got['adapter_s']):.3f} s, raw I/O floor "
                  f"{statistics.median(got['floor_s']):.3f} s for {got['state_disk_bytes']:,} B each way; "
                  f"median ratio {statistics.median(got['ratios']):.3f}")
            if "class_ram_s" in got:
                print(f"the class itself on whole tensors in RAM: {statistics.median(got['class_ram_s']):.3f} s; the "
                      f"adapter over the slower floor: median {statistics.median(got['ratios_vs_slower_floor']):.3f}")
            verdicts.append(verdict.judge(
                verdict.Target("generic_disk", f"tiered({cls.__name__})'s streamed step / raw I/O floor of its bytes "
                               "(budget 1/8)", "<=", 1.3, source="issue 24", more="raise --rounds"), got["ratios"]))
        else:
            print(f"streamed step skipped: {got['skipped']}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(verdict.format_verdicts(verdicts))
    document.update(verdicts=verdicts, overall=verdict.overall(verdicts), torch=torch.__version__,
                    threads=torch.get_num_threads())  # fmt: skip
    if args.json:
        write_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
