"""Streamed step time per moment format, side by side in one run (issue 10's targets).

One ``TieredAdamW`` per ``moment_dtype`` over copies of the same fp32
parameters (``keep_master=True``: 12 B/param in float32), every one with the
same ``ram_budget`` (by default 1/8 of the float32 state) and its state files
under ``--dir``. Rounds alternate the optimizers in a rotating order, so every
round's times saw the same drive and CPU weather; the paired ratio (format /
float32, per round, median) is what the targets compare:

- ``bfloat16`` <= 0.72x and ``int8`` <= 0.60x the ``float32`` step time,
  each judged PASS/FAIL on the median of the per-round ratios over >= 3
  rounds (UNDECIDED with fewer; the targets are stated for fp32 masters and
  apply when the first format is ``float32``);
- at the same budget, how many more shards (and parameters) stay resident;
- ``int8@torch`` (any ``<format>@torch``): the format's update in torch ops
  (decode, ``torch._fused_adamw_``, encode; the compiled kernel of
  ``tierstore._compute.native`` and ``tierstore._compute.fused_update`` set aside), to see what
  the kernel buys.

The load average is sampled before every round and reported (the dev machine
is shared). Per step the script also records where the machine's CPU time went
(``/proc/stat``: user, system, iowait, idle, steal, as shares of all CPUs) and
the seconds the compiled update kernel ran, summed over the update's workers,
so a step that is CPU-bound (little iowait and idle, kernel time near
workers x update time) is told from one that waits on the drive. The
optimizers run durable (a committed copy on disk, commits in the background),
as ``TieredAdamW`` with a ``state_dir`` does (``--no-durable`` to measure
``durable=False``); ``--budget`` takes bytes (``'512MiB'``) or a share of the
float32 state (``'1/8'``, ``'12.5%'``, ``0.125``). The report starts with the
hardware line and ends with the verdicts. Needs 4
B/param of gradients plus, per format, 4 B/param of parameters and its budget
of RAM, and its state files on disk, twice over when durable (checked before
anything is allocated).

Usage::

    python bench/formats_step.py --params 2e8 --dir /mnt/nvme/scratch --rounds 7 \\
        --json bench/results/formats-step-2e8.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tierstore import TieredAdamW
from tierstore._compute import native
from tierstore._layout.budget import plan_tiers
from tierstore._layout.layout import Layout
from tierstore._layout.spec import decide
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.resources import Needs, check
from tierstore.cli.bench.step_report import FORMAT_TARGETS, SOURCE_FORMATS, ratio_text, scale_note
from tierstore.cli.bench.verdict import MIN_REPEATS, Target, format_verdicts, judge, overall
from tierstore.cli.bench.workload import build
from tierstore.errors import ConfigError
from tierstore.sizes import format_size, parse_budget

FORMATS = ("float32", "bfloat16", "int8")


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _cpu_ticks() -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``, all CPUs), None where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1 : 1 + len(_CPU_FIELDS)]]
    except (OSError, ValueError):
        return None


def _cpu_split(before: list[int] | None, after: list[int] | None) -> dict | None:
    """Shares of the CPU time between two :func:`_cpu_ticks` (user includes nice, system irq)."""
    if before is None or after is None:
        return None
    d = dict(zip(_CPU_FIELDS, (b - a for a, b in zip(before, after))))
    total = sum(d.values())
    if total == 0:  # a step shorter than a clock tick
        return None
    return {"user": (d["user"] + d["nice"]) / total, "system": (d["system"] + d["irq"] + d["softirq"]) / total,
            "iowait": d["iowait"] / total, "idle": d["idle"] / total, "steal": d["steal"] / total}


class _KernelClock:
    """Wall seconds inside the compiled update kernel, summed over the threads that call it (time
    the hypervisor steals from a thread in the kernel counts too)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = native.Kernel.update
        lock = threading.Lock()
        clock = self

        def update(kernel, *args):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            try:
                return clock._real(kernel, *args)
            finally:
                spent = time.perf_counter() - t0
                with lock:
                    clock.seconds += spent

        native.Kernel.update = update

    def close(self) -> None:
        native.Kernel.update = self._real


def _resident_at(numel: int, fmt: str, *, budget: int, shard_numel: int, keep_master: bool,
                 dtype: torch.dtype = torch.float32) -> dict:
    """Resident shards and parameters of ``fmt`` at a fixed shard size (pure arithmetic, meta tensors)."""
    spec = decide(numel=numel, dtypes=[dtype], cuda=False, amsgrad=False, keep_master=keep_master,
                  arena_slots=4, ram_budget=budget, shard_numel=shard_numel, moment_dtype=fmt,
                  workers=len(os.sched_getaffinity(0)))
    meta = [torch.empty(n, device="meta", dtype=dtype, requires_grad=True) for n in _sizes(numel)]
    layout = Layout.build([meta], shard_numel=spec.shard_numel, fields=spec.fields, moment_dtype=fmt)
    plan = plan_tiers(layout, ram_budget=budget, arena_slots=spec.arena_slots,
                      staging_buffers=spec.staging_buffers, workers=spec.workers)
    return {"shard_numel": layout.shard_numel, "shards": len(layout.shards), "resident_shards": len(plan.resident),
            "resident_params": sum(layout.shards[i].capacity for i in plan.resident),
            "slot_bytes": plan.slot_nbytes, "scratch_bytes": plan.scratch_nbytes}


def _cpu_median(steps: list[dict]) -> dict:
    """Per-step medians of :class:`_KernelClock` and :func:`_cpu_split` figures."""
    out = {k: statistics.median(x[k] for x in steps) for k in ("process_cpu_s", "kernel_s")}
    machine = [x["machine"] for x in steps if x["machine"] is not None]
    if machine:
        out["machine"] = {k: statistics.median(m[k] for m in machine) for k in machine[0]}
    return out


def verdicts(results: list[dict], *, keep_master: bool, params: int | None = None) -> list[dict]:
    """The formats' targets (step time / float32's, round by round), where the first run is ``float32``.

    Example
    -------
    >>> rows = [{"moment_dtype": "float32", "steps_s": [1.0, 1.0, 1.0]},
    ...         {"moment_dtype": "int8", "steps_s": [0.55, 0.62, 0.58]}]
    >>> [(v["key"], v["verdict"]) for v in verdicts(rows, keep_master=True)]
    [('vs_float32[int8]', 'PASS')]
    """
    if not results or results[0]["moment_dtype"] != "float32":
        return []  # the targets compare with float32's step in the same rounds
    base = results[0]["steps_s"]
    notes = [scale_note({"params": params}, 2 * 10**8)]
    notes.append(None if keep_master else "the target is stated for fp32 masters (drop --no-master)")
    note = "; ".join(n for n in notes if n) or None
    return [judge(Target(f"vs_float32[{row['moment_dtype']}]", f"streamed step with {row['moment_dtype']} moments / "
                         "float32's (round by round)", "<=", FORMAT_TARGETS[row["moment_dtype"]],
                         source=SOURCE_FORMATS), [a / b for a, b in zip(row["steps_s"], base) if b > 0], note=note)
            for row in results[1:] if row["moment_dtype"] in FORMAT_TARGETS]


def _sizes(numel: int) -> list[int]:
    from tierstore.cli.bench.workload import param_sizes

    return param_sizes(numel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True, help="fp32 parameters, e.g. 2e8")
    parser.add_argument("--dir", required=True, help="a directory on the drive under test")
    parser.add_argument("--budget", default="1/8",
                        help="ram_budget: bytes ('512MiB') or a share of the float32 state ('1/8', '12.5%%', 0.125; "
                             "default 1/8), the same for every format")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="moment_dtype values, the first is the baseline; NAME:N runs NAME with update_threads=N; "
                             "NAME@torch runs NAME's update in torch ops (no compiled kernel)")
    parser.add_argument("--rounds", type=int, default=7,
                        help=f"timed rounds, each stepping every format once (default 7; a verdict needs {MIN_REPEATS})")
    parser.add_argument("--no-master", action="store_true", help="keep_master=False (8 B/param in float32)")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dtype of the parameters and gradients (bfloat16: fp32 masters in the state, as "
                             "mixed-precision training keeps them)")
    parser.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                        help="durable=True (the default, as TieredAdamW with a state_dir runs: commits in the "
                             "background); --no-durable: durable=False, nothing survives a crash")
    parser.add_argument("--shard-numel", type=float, default=None, help="fixed shard size (default: each format's automatic one)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--update-threads", type=int, default=None, help="TieredAdamW's update_threads (default: its own)")
    parser.add_argument("--json", type=Path, help="write the results here (nothing is written without it)")
    args = parser.parse_args(argv)
    numel = int(args.params)
    param_dtype = getattr(torch, args.param_dtype)
    param_size = param_dtype.itemsize
    if param_dtype != torch.float32 and args.no_master:
        raise SystemExit("formats_step.py: --no-master needs fp32 parameters (bf16 parameters keep fp32 masters)")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    keep_master = not args.no_master
    fp32_state = numel * (12 if keep_master else 8)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1 ({MIN_REPEATS} for a verdict)")
    try:  # the API's parser and errors, a share taken of the float32 state
        budget = parse_budget(args.budget, state_bytes=fp32_state, name="--budget")
    except ConfigError as exc:
        parser.error(str(exc))
    machine = machine_info(args.dir)
    print(hardware_line(machine), flush=True)
    shard_numel = None if args.shard_numel is None else int(args.shard_numel)
    disk = sum(int(numel * (4 * keep_master + 2 * {"float32": 4, "bfloat16": 2, "int8": 1.0157}[f.partition(":")[0].partition("@")[0]]))
               for f in formats)
    needs = Needs(f"formats_step.py --params {args.params:g}", ram=numel * param_size + len(formats) * (numel * param_size + budget), disk=disk * (2 if args.durable else 1) + (64 << 20))
    try:
        check(needs, args.dir, fix="lower --params, or compare fewer formats per run")
    except ConfigError as exc:
        raise SystemExit(f"formats_step.py: {exc}") from None
    params = build(numel, dtype=param_dtype)
    runs = []
    loads = []
    kernel_clock = _KernelClock()
    try:
        for entry in formats:
            fmt, _, threads = entry.partition(":")
            fmt, _, impl = fmt.partition("@")
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for p, q in zip(params, copies):
                q.grad = p.grad
            run = {"moment_dtype": entry, "opt": None, "dir": tempfile.mkdtemp(dir=args.dir), "s": [], "split": [], "cpu": [],
                   "codec": native.suspended if impl == "torch" else contextlib.nullcontext}
            runs.append(run)  # registered first, so its directory is removed on any error
            run["opt"] = TieredAdamW(copies, state_dir=run["dir"], ram_budget=budget, backend=args.backend,
                                     keep_master=keep_master, moment_dtype=fmt, durable=args.durable,
                                     shard_numel=shard_numel, update_threads=int(threads) if threads else args.update_threads)
            with run["codec"]():
                run["opt"].step()  # warm-up
                run["describe"] = run["opt"].describe()
            print(f"{entry}: {run['describe']}", flush=True)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = runs[r % len(runs):] + runs[: r % len(runs)]
            for run in order:
                with run["codec"]():
                    ticks, k0, cpu0 = _cpu_ticks(), kernel_clock.seconds, time.process_time()
                    t0 = time.perf_counter()
                    run["opt"].step()
                    run["s"].append(time.perf_counter() - t0)
                    cpu = time.process_time() - cpu0
                    run["cpu"].append({"process_cpu_s": cpu, "kernel_s": kernel_clock.seconds - k0,
                                       "machine": _cpu_split(ticks, _cpu_ticks())})
                st = run["opt"].last_step_stats
                run["split"].append({"read_wait": st.read_wait, "update": st.update, "write_wait": st.write_wait,
                                     "bytes_read": st.bytes_read, "bytes_written": st.bytes_written})
            print(f"round {r}: load {loads[-1]:.2f}; " + ", ".join(f"{run['moment_dtype']} {run['s'][-1]:.3f} s" for run in runs), flush=True)
        base = runs[0]["s"]
        results = []
        for run in runs:
            opt = run["opt"]
            plan = opt.plan
            results.append({
                "moment_dtype": run["moment_dtype"],
                "median_s": statistics.median(run["s"]),
                "min_s": min(run["s"]),
                "paired_vs_first": statistics.median(a / b for a, b in zip(run["s"], base)),
                "steps_s": run["s"],
                "split_median_s": {k: statistics.median(x[k] for x in run["split"]) for k in ("read_wait", "update", "write_wait")},
                "cpu_median": _cpu_median(run["cpu"]), "cpu_per_step": run["cpu"],
                "bytes_read": run["split"][-1]["bytes_read"], "bytes_written": run["split"][-1]["bytes_written"],
                "state_bytes": plan.state_nbytes, "bytes_per_param": opt.layout.bytes_per_element,
                "shard_numel": opt.layout.shard_numel, "shards": len(opt.layout.shards),
                "resident_shards": len(plan.resident),
                "resident_params": sum(opt.layout.shards[i].capacity for i in plan.resident),
                "arena_bytes": plan.arena_nbytes, "scratch_bytes": plan.scratch_nbytes, "ram_bytes": plan.ram_nbytes,
                "describe": run["describe"],
            })
    finally:
        kernel_clock.close()
        for run in runs:
            if run["opt"] is not None:
                run["opt"].close()
            shutil.rmtree(run["dir"], ignore_errors=True)
    same_shard = results[0]["shard_numel"]
    for row in results:
        row["at_baseline_shard_numel"] = _resident_at(numel, row["moment_dtype"].partition(":")[0].partition("@")[0],
                                                      budget=budget,
                                                      shard_numel=same_shard, keep_master=keep_master,
                                                      dtype=param_dtype)
    found = verdicts(results, keep_master=keep_master, params=numel)
    print(f"\n{numel:.3g} {args.param_dtype} params, keep_master={keep_master}, ram_budget {format_size(budget)} "
          f"({budget / fp32_state:.3g} of the float32 state), durable={args.durable}, {args.rounds} interleaved "
          f"rounds, load average {min(loads):.2f}..{max(loads):.2f}")
    for row in results:
        same = row["at_baseline_shard_numel"]
        row["paired_rounds"] = [a / b for a, b in zip(row["steps_s"], base) if b > 0]
        print(f"  {row['moment_dtype']:9s} median {row['median_s']:.3f} s; step / {results[0]['moment_dtype']}'s "
              f"{ratio_text(row['paired_rounds'])}\n            "
              f"{row['bytes_per_param']:.2f} B/param  resident {row['resident_shards']}/{row['shards']} shards of "
              f"{row['shard_numel']:,} ({row['resident_params']:,} params); at shard_numel={same_shard:,}: "
              f"{same['resident_shards']}/{same['shards']}\n            split (medians): "
              + ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in row["split_median_s"].items()))
        cpu = row["cpu_median"]
        cpu_shares = cpu.get("machine")
        shares = ", ".join(f"{k} {v:.0%}" for k, v in cpu_shares.items()) if cpu_shares else "n/a"
        print(f"            process CPU {cpu['process_cpu_s']:.3f} s/step, in the compiled kernel {cpu['kernel_s']:.3f} s "
              f"(wall, summed over workers); machine CPU: {shares}")
    print()
    print(format_verdicts(found))
    if args.json:
        document = {"tool": "bench/formats_step.py", "argv": sys.argv, "params": numel, "param_dtype": args.param_dtype, "keep_master": keep_master,
                    "update_threads": args.update_threads,
                    "ram_budget": budget, "budget_share_of_float32_state": budget / fp32_state, "durable": args.durable,
                    "rounds": args.rounds, "load_average_per_round": loads, "machine": machine,
                    "hardware": hardware_line(machine), "results": results, "verdicts": found,
                    "verdict": overall(found)}
        print(f"wrote {write_json(args.json, document)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
