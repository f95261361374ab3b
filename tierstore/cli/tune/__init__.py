"""``tierstore tune DIR [DIR...]``: measure the drives and the CPU, write a knobs file the optimizer reads.

1. **The drives**: every drive alone and all at once, over a sweep of
   request sizes and workers, in interleaved rounds (the machinery of
   ``tierstore bench io DIR DIR...``: :mod:`tierstore.cli.bench.drives`).
2. **The CPU**: the AdamW update of one shard at several thread counts,
   timed while every drive streams (:mod:`.cpu`).
3. **The picks** (:mod:`.picks`): ``io_workers`` and ``request_bytes``,
   ``prefetch_depth``, ``update_threads``, a shard size to suggest for a new
   state, and each drive's bandwidth (for a new state's placement), each
   printed with the measurement behind it.
4. **The check** (:mod:`.verify`): a short streamed step with the picked
   knobs file and with the defaults, interleaved. The picks are written only
   when their step is faster; otherwise the file holds the defaults
   (``"fallback": true``) and the output says so: a tuned step is never
   slower than the defaults.

The knobs file (:mod:`tierstore._config.knobs_file`) holds resources only:
``TieredAdamW(..., knobs="tuned.json")`` reads it, explicit arguments win
over it, and any state runs with any knobs file.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(); add_arguments(parser)
>>> args = parser.parse_args(["/nvme0/scratch", "/nvme1/scratch", "--out", "tuned.json", "--quick"])
>>> args.dirs, args.out, args.quick
(['/nvme0/scratch', '/nvme1/scratch'], 'tuned.json', True)
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run", "TuneConfig"]

MiB = 1 << 20
FULL_REQUESTS = "256KiB,1MiB,4MiB,16MiB"
FULL_WORKERS = "2,4,8,16"
QUICK_REQUESTS = "1MiB,4MiB"
QUICK_WORKERS = "4,8"
SHARD_NUMEL_FOR_UPDATE = 4 << 20  # the update is timed on one default-sized shard


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore tune``."""
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="a directory on each drive the state will use, in the order you will pass them as "
                             "state_dir (test files are written there and removed)")
    parser.add_argument("--out", default="tuned.json", metavar="FILE",
                        help="the knobs file to write (default tuned.json); read it with TieredAdamW(knobs=FILE)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 128 MiB per transfer, 4 settings, 2 rounds, a 2e6-parameter step check")
    parser.add_argument("--size", default=None, help="bytes per transfer per drive (default 512MiB; --quick 128MiB)")
    parser.add_argument("--requests", default=None, help=f"request sizes to try (default {FULL_REQUESTS})")
    parser.add_argument("--workers", default=None, help=f"I/O workers per drive to try (default {FULL_WORKERS})")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the drive sweep (default 3; "
                        "--quick 2)")
    parser.add_argument("--threads", default=None, help="update thread counts to try, e.g. '1,2,4' (default: 1, "
                        "powers of two, all cores but one, all cores)")
    parser.add_argument("--backend", default="auto", help="the backend the state will use (default auto)")
    parser.add_argument("--step-params", default=None, help="parameters of the streamed step that checks the "
                        "picks against the defaults (default 2e7; --quick 2e6)")
    parser.add_argument("--step-rounds", type=int, default=None, help="interleaved rounds of that check "
                        "(default 5; --quick 3)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write every measurement as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write a PNG of the drive sweep")


def _out_problem(out: Path, overwrite: bool) -> str | None:
    """Why ``--out`` cannot be written (checked before anything is measured), or ``None``."""
    from ..paths import parent_problem

    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        return parent_problem(out)
    if stat.S_ISDIR(st.st_mode):
        return f"--out {out} is a directory; pass a file path such as {out / 'tuned.json'}"
    if not stat.S_ISREG(st.st_mode):
        return (f"--out {out} exists and is not a regular file (a link, a FIFO, ...), so --overwrite will not replace "
                "it; remove it yourself or pass another --out")
    if not overwrite:
        return f"--out {out} exists; pass --overwrite to replace it, or choose another --out"
    return None


class TuneConfig:
    """The validated settings of one ``tune`` run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ...errors import ConfigError
        from ...planner.inputs import parse_count
        from ...sizes import parse_size
        from ..bench.io_options import check_directories, int_list, size_list

        self.directories = [Path(d).expanduser() for d in args.dirs]
        check_directories(self.directories)
        from ..._storage.placement import MAX_DRIVES

        if len(self.directories) > MAX_DRIVES:
            raise ConfigError(f"{len(self.directories)} directories; a state spans at most {MAX_DRIVES}")
        self.out = Path(args.out).expanduser()
        problem = _out_problem(self.out, args.overwrite)
        if problem:
            raise ConfigError(problem)
        quick = bool(args.quick)
        size = parse_size(args.size if args.size is not None else ("128MiB" if quick else "512MiB"), name="--size")
        self.size = size - size % MiB
        if self.size < 4 * MiB:
            raise ConfigError(f"--size {args.size!r} is below 4 MiB; use e.g. --size 256MiB")
        self.requests = size_list(args.requests or (QUICK_REQUESTS if quick else FULL_REQUESTS), "--requests")
        self.workers = int_list(args.workers or (QUICK_WORKERS if quick else FULL_WORKERS), "--workers")
        self.rounds = args.rounds if args.rounds is not None else (2 if quick else 3)
        self.step_rounds = args.step_rounds if args.step_rounds is not None else (3 if quick else 5)
        for flag, value in (("--rounds", self.rounds), ("--step-rounds", self.step_rounds)):
            if isinstance(value, bool) or value < 1:
                raise ConfigError(f"{flag}={value!r} must be an int >= 1")
        from .cpu import thread_counts

        self.threads = list(int_list(args.threads, "--threads")) if args.threads else thread_counts()
        self.step_params = parse_count(args.step_params or ("2e6" if quick else "2e7"), name="--step-params")
        from ..._config.registry import KNOBS

        self.backend = KNOBS["backend"].validate(args.backend, "--backend")
        self.quick = quick


def _drive_figures(summary: dict[str, Any], request: int, workers: int, settings: list[dict[str, Any]]) -> list:
    """Each drive's read, write and read+write bandwidth (bytes/s) alone at the picked setting."""
    from ..._config.knobs_file import DriveFigure, device_of

    figures = []
    for d in summary["drives"]:
        ops = {s["op"]: s["GBps"] for s in settings if s["kind"] == f"d{d['index']}"
               and s["request_bytes"] == request and s["workers"] == workers}
        read, write = ops.get("read"), ops.get("write")
        step = 1.0 / (1.0 / read + 1.0 / write)
        figures.append(DriveFigure(d["dir"], device_of(d["dir"]), step * 1e9, read * 1e9, write * 1e9, d["backend"]))
    return figures


def run(args: argparse.Namespace) -> int:
    """Measure, pick, check against the defaults, write the knobs file; print each pick and why."""
    from ..._config.knobs import Knobs
    from ..._config.knobs_file import encode_knobs_file, knobs_document
    from ..._state.atomic_write import atomic_write
    from ..._version import __version__
    from ..bench import drives_report, rawio, resources
    from ..bench.drives import DriveSet, TrialLog, sweep_steps
    from ..bench.io_options import run_rounds
    from ..bench.report import hardware_line, machine_info, write_json
    from . import picks
    from .cpu import time_with_io
    from .verify import compare_steps

    config = TuneConfig(args)
    window = 2 * min(max(config.requests) * max(config.workers), config.size)
    needs = resources.Needs(f"tune --size {config.size / 2**30:.3g}GiB over {len(config.directories)} directories",
                            ram=resources.PROCESS_BYTES + window * len(config.directories)
                            + 16 * config.step_params + 16 * SHARD_NUMEL_FOR_UPDATE,
                            disk=config.size + 8 * config.step_params + 64 * MiB)
    for directory in config.directories:
        resources.check(needs, directory, fix="free some, or pass a smaller --size and --step-params")
    started = time.time()
    drives = DriveSet(config.directories, size=config.size, backend=config.backend)
    log = TrialLog()
    kind = "all" if len(config.directories) > 1 else "d0"
    drives.open()
    try:
        plan = sweep_steps(drives, requests=config.requests, workers=config.workers, rounds=config.rounds, record=log)
        run_rounds(plan, desc="tune: drives")
        result = drives_report.summarize(log.trials, drives=drives.describe(),
                                         memory_GBps=[rawio.memory_bandwidth(64 * MiB)])  # fmt: skip
        io = picks.pick_io(result["settings"], kind=kind)
        request, workers = io.value["request_bytes"], io.value["io_workers"]
        update = time_with_io(drives, config.threads, request_bytes=request, workers=workers,
                              numel=SHARD_NUMEL_FOR_UPDATE, rounds=config.rounds)
    finally:
        drives.close()
    figures = _drive_figures(result["summary"], request, workers, result["settings"])
    threads = picks.pick_threads(update.seconds, numel=SHARD_NUMEL_FOR_UPDATE, updates=update.updates)
    shard = picks.suggest_shard_numel(io_workers=workers, request_bytes=request)
    prefetch = picks.pick_prefetch([f.bandwidth for f in figures], io_workers=workers, request_bytes=request,
                                   shard_numel=shard.value)
    chosen = {"io_workers": workers, "request_bytes": request, "prefetch_depth": prefetch.value,
              "update_threads": threads.value}
    measurements: dict[str, Any] = {p.name: {"why": p.why, **p.measured} for p in (io, prefetch, threads, shard)}
    measurements["update_threads"]["alone"] = {"io_s": update.io_alone_s, "update_s": update.update_alone_s}
    machine = machine_info(config.directories[0])
    common = dict(hardware=hardware_line({k: v for k, v in machine.items() if k != "filesystem"}),
                  written_by=f"tierstore tune {__version__}", created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  command=" ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="tierstore-tune-") as scratch:
        candidate = Path(scratch) / "candidate.json"
        candidate.write_bytes(encode_knobs_file(knobs_document(chosen, drives=figures, shard_numel=shard.value,
                                                               measurements=measurements, **common)))
        check = compare_steps(config.directories, candidate, params=config.step_params, rounds=config.step_rounds)
    measurements["step"] = check.to_dict()
    defaults = Knobs()
    if check.faster:
        document = knobs_document(chosen, drives=figures, shard_numel=shard.value, measurements=measurements, **common)
    else:
        measurements["drives_measured"] = [vars(f) for f in figures]
        document = knobs_document({"io_workers": int(defaults.io_workers), "request_bytes": int(defaults.request_bytes),
                                   "prefetch_depth": int(defaults.prefetch_depth), "update_threads": None},
                                  fallback=True, measurements=measurements, **common)
    atomic_write(config.out, encode_knobs_file(document))
    print(drives_report.render(result, machine=machine))
    print()
    print("picks (each with the measurement behind it):")
    for p in (io, prefetch, threads, shard):
        print(f"  {p.why}")
    for f in figures:
        print(f"  drive {f.path}: {f.bandwidth / 1e9:.2f} GB/s read+write at the picked setting (read "
              f"{f.read_bandwidth / 1e9:.2f}, write {f.write_bandwidth / 1e9:.2f}): its share of a new state's shards")
    ratios = check.ratios
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    print(f"streamed step ({config.step_params:,} parameters, ram_budget {check.ram_budget}, {config.step_rounds} "
          f"rounds interleaved): picks {_median(check.tuned_s):.3f} s, defaults {_median(check.default_s):.3f} s; "
          f"picks / defaults median {check.median_ratio:.3f}x{spread}")
    if check.faster:
        print(f"wrote {config.out}: the picks (their step is faster than the defaults'); use it with "
              f"TieredAdamW(..., knobs={str(config.out)!r})")
    else:
        print(f"wrote {config.out}: THE DEFAULTS, not the picks: the picks' step was not faster than the defaults' "
              f"on this machine (fallback), so a tuned step is never slower; the measurements are in the file")
    if args.json:
        full = {"tool": "tierstore tune", "argv": sys.argv, "machine": machine, "duration_s": time.time() - started,
                "config": {"dirs": [str(d) for d in config.directories], "size": config.size,
                           "requests": list(config.requests), "workers": list(config.workers),
                           "rounds": config.rounds, "threads": config.threads, "step_params": config.step_params,
                           "step_rounds": config.step_rounds, "backend": config.backend},
                "knobs_file": document, "summary": result["summary"], "settings": result["settings"],
                "update_threads": update.to_dict(),
                "trials": [vars(t) for t in log.trials]}
        print(f"wrote {write_json(args.json, full)}")
    if args.plot:
        names = ", ".join(str(d) for d in config.directories)
        print(f"wrote {drives_report.plot(result, args.plot, title=f'tierstore tune: {names}')}")
    return 0


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")
