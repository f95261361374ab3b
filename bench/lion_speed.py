#!/usr/bin/env python
"""TieredLion's step against lion-pytorch's ``Lion``, all state in RAM (issue 24: >= 1.5x).

Three contenders on the same fp32 parameters and gradients, interleaved
round by round (lion, tiered, tiered-torch-ops, lion, ...), each timing one
``step()``:

- ``lion``: ``lion_pytorch.Lion`` (seven torch ops per parameter, two of them
  allocating a temporary as large as it);
- ``tiered``: ``TieredLion`` with ``ram_budget=None`` (all state in RAM), its
  update the compiled one-pass kernel (``codec_kernel.c``'s ``ts_lion``);
- ``tiered-torch-ops``: the same front with the compiled kernel suspended
  (``native.suspended()``): lion-pytorch's torch ops on tierstore's pieces,
  what runs where the kernel cannot be built or fails its self-check.

The verdict is judged on the per-round ratios lion / tiered (median, >= 3
rounds). ``lion`` and ``tiered`` take the same steps with the same gradients,
so their parameters must end bitwise equal (checked, reported). RAM: about
4 x 4 B x --params for the parameters, gradient and moments, plus lion's two
temporaries (5e7: ~1.5 GiB).

    python bench/lion_speed.py --params 5e7 --rounds 7 --json bench/results/lion-speed-5e7.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tierstore import TieredLion
from tierstore._compute import lion_kernel, native
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.verdict import MIN_REPEATS, Target, format_verdicts, judge, overall

TARGET = Target("lion_over_tiered", "lion-pytorch Lion step / TieredLion step (all state in RAM)", ">=", 1.5,
                source="issue 24 (Targets)", more="raise --rounds")  # fmt: skip
HYPER = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=5e7, help="parameters (default 5e7)")
    ap.add_argument("--tensors", type=int, default=8, help="split over this many parameters (default 8)")
    ap.add_argument("--rounds", type=int, default=7, help=f"timed rounds after --warmup (a verdict needs {MIN_REPEATS})")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="where to write the JSON")
    args = ap.parse_args(argv)
    try:
        from lion_pytorch import Lion
    except ImportError:
        print("lion-pytorch is not installed (pip install lion-pytorch): nothing to compare with", file=sys.stderr)
        return 2
    machine = machine_info()
    print(hardware_line(machine), flush=True)
    n = int(args.params)
    sizes = [n // args.tensors + (1 if i < n % args.tensors else 0) for i in range(args.tensors)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in sizes]
    grads = [torch.randn(s, generator=gen) for s in sizes]
    sets = {name: [torch.nn.Parameter(t.clone()) for t in init] for name in ("lion", "tiered", "tiered-torch-ops")}
    for params in sets.values():
        for p, g in zip(params, grads):
            p.grad = g  # the same gradient tensors: every contender steps on the same values
    del init
    opts = {"lion": Lion(sets["lion"], **HYPER), "tiered": TieredLion(sets["tiered"], **HYPER),
            "tiered-torch-ops": TieredLion(sets["tiered-torch-ops"], **HYPER)}  # fmt: skip
    kernel = "compiled" if lion_kernel.kernel() is not None else f"torch ops ({native.status()})"
    print(f"{n:,} params in {args.tensors} tensors, {torch.get_num_threads()} threads; TieredLion's update: {kernel}")
    times: dict[str, list[float]] = {name: [] for name in opts}
    for r in range(args.warmup + args.rounds):
        for name, opt in opts.items():
            suspend = native.suspended() if name == "tiered-torch-ops" else _nothing()
            with suspend:
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[name].append(dt)
    bitwise = all(torch.equal(a, b) for a, b in zip(sets["lion"], sets["tiered"]))
    bitwise_ops = all(torch.equal(a, b) for a, b in zip(sets["lion"], sets["tiered-torch-ops"]))
    for opt in opts.values():
        if isinstance(opt, TieredLion):
            opt.close()
    ratios = [a / b for a, b in zip(times["lion"], times["tiered"])]
    ratios_ops = [a / b for a, b in zip(times["lion"], times["tiered-torch-ops"])]
    found = [judge(TARGET, ratios)]
    print(f"median step (s) over {args.rounds} rounds: " + ", ".join(
        f"{name} {statistics.median(ts):.3f}" for name, ts in times.items()))  # fmt: skip
    print(f"lion / tiered {statistics.median(ratios):.2f}x, lion / tiered-torch-ops {statistics.median(ratios_ops):.2f}x;"
          f" bitwise: tiered {bitwise}, tiered-torch-ops {bitwise_ops}")  # fmt: skip
    print(format_verdicts(found))
    if args.json:
        write_json(args.json, {
            "tool": "bench/lion_speed.py", "argv": sys.argv, "machine": machine, "hardware": hardware_line(machine),
            "torch_threads": torch.get_num_threads(), "params": n, "tensors": args.tensors, "rounds": args.rounds,
            "warmup": args.warmup, "hyper": HYPER, "tiered_update": kernel, "step_s": times,
            "median_step_s": {name: statistics.median(ts) for name, ts in times.items()},
            "lion_over_tiered": ratios, "lion_over_tiered_torch_ops": ratios_ops,
            "bitwise_equal": {"tiered": bitwise, "tiered-torch-ops": bitwise_ops},
            "verdicts": found, "verdict": overall(found),
        })  # fmt: skip
        print(f"wrote {args.json}")
    return 0 if bitwise and bitwise_ops else 1


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
