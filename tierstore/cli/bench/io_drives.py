"""``tierstore bench io DIR DIR...``: each drive alone and all drives at once, over workers and request sizes.

With several directories ``bench io`` measures one backend (``--backends``,
default ``auto``: what the optimizer picks per directory) through
tierstore's I/O queue, each drive alone and every drive at once with its own
queue and threads, at every request size and worker count, in interleaved
rounds (:mod:`.drives`). It prints the sweep as a table (like DeepSpeed's
``ds_io`` sweep), each drive's best setting and the drives' together
(:mod:`.drives_report`); ``--json`` keeps every trial, ``--plot`` draws the
sweep. ``summary.best_read_GBps``/``best_write_GBps`` are the drives
together, so ``tierstore plan --io-json`` reads them as it reads a
one-drive file; ``summary.drives`` holds each drive's own.

Example
-------
>>> import argparse, tempfile
>>> from tierstore.cli.bench import io
>>> parser = argparse.ArgumentParser(); io.add_arguments(parser)
>>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
>>> config = DrivesConfig.from_args(parser.parse_args([a, b, "--quick"]))
>>> len(config.directories), config.backend, config.workers
(2, 'auto', (4,))
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...backends import BACKENDS
from ...errors import ConfigError
from ...sizes import format_size, parse_size
from . import rawio, resources
from .drives import DriveSet, TrialLog, sweep_steps
from .drives_report import plot, render, summarize
from .io_options import check_directories, directories_of, int_list, run_rounds, size_list
from .report import hardware_line, machine_info, write_json

__all__ = ["DrivesConfig", "run"]

MiB = 1 << 20
# The sweep of DeepSpeed's ds_io tuner, in tierstore's terms: request size (its block_size) and
# requests in flight per drive (its queue_depth x intra-op parallelism).
FULL_REQUESTS = (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB)
FULL_WORKERS = (1, 2, 4, 8, 16)
QUICK_REQUESTS = (1 * MiB, 16 * MiB)
QUICK_WORKERS = (4,)
DEFAULT_SIZE, QUICK_SIZE = "1GiB", "256MiB"


@dataclass(frozen=True)
class DrivesConfig:
    """The validated settings of a ``bench io`` run over several directories."""

    directories: tuple[Path, ...]
    size: int
    requests: tuple[int, ...]
    workers: tuple[int, ...]
    backend: str
    rounds: int
    quick: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DrivesConfig:
        """Validate the parsed options.

        Raises
        ------
        ConfigError
            For a missing, unwritable or repeated directory, a size below 4 MiB,
            more than one backend, or bad lists.
        """
        directories = directories_of(args)
        check_directories(directories)
        size = parse_size(args.size if args.size is not None else (QUICK_SIZE if args.quick else DEFAULT_SIZE),
                          name="--size")
        size -= size % MiB
        if size < 4 * MiB:
            raise ConfigError(f"--size {args.size!r} is below 4 MiB; use e.g. --size 256MiB")
        requests = size_list(args.requests, "--requests") if args.requests else (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
        workers = int_list(args.workers, "--workers") if args.workers else (QUICK_WORKERS if args.quick else FULL_WORKERS)
        backends = [b.strip() for b in (args.backends or "auto").split(",") if b.strip()]
        if len(backends) != 1:
            raise ConfigError(f"--backends {args.backends!r}: with several directories bench io measures one backend; "
                              "pass one of auto, " + ", ".join(sorted(BACKENDS)))
        if backends[0] not in ("auto", *BACKENDS):
            raise ConfigError(f"--backends lists unknown {backends}; choose auto or one of {sorted(BACKENDS)}")
        if isinstance(args.rounds, bool) or args.rounds < 1:
            raise ConfigError(f"--rounds {args.rounds!r} must be >= 1")
        return cls(tuple(directories), size, requests, workers, backends[0], args.rounds, bool(args.quick))


def _needs(config: DrivesConfig) -> resources.Needs:
    """RAM: two request windows per drive at the largest setting (all drives run at once); disk: one file each."""
    window = 2 * min(max(config.requests) * max(config.workers), config.size)
    memory = 2 * (64 * MiB if config.quick else 512 * MiB)
    ram = resources.PROCESS_BYTES + max(window * len(config.directories), memory)
    return resources.Needs(f"bench io --size {config.size / 2**30:.3g}GiB over {len(config.directories)} directories",
                           ram=ram, disk=config.size + 64 * MiB)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write JSON and PNG when asked."""
    config = DrivesConfig.from_args(args)
    needs = _needs(config)
    for directory in config.directories:
        resources.check(needs, directory, fix="free some, or pass a smaller --size")
    started = time.time()
    drives = DriveSet(config.directories, size=config.size, backend=config.backend)
    log = TrialLog()
    memory: list[float] = []
    mem_bytes = 64 * MiB if config.quick else 512 * MiB
    drives.open()
    try:
        plan = sweep_steps(drives, requests=config.requests, workers=config.workers, rounds=config.rounds, record=log)
        run_rounds(plan, desc="bench io", before_round=lambda _: memory.append(rawio.memory_bandwidth(mem_bytes)))
    finally:
        drives.close()
    described = drives.describe()
    result = summarize(log.trials, drives=described, memory_GBps=memory)
    machine = machine_info(config.directories[0])
    print(render(result, machine=machine))
    document = {
        "tool": "tierstore bench io",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": machine,
        "hardware": hardware_line({k: v for k, v in machine.items() if k != "filesystem"}),
        "config": {
            "dirs": [str(d) for d in config.directories],
            "size": config.size,
            "requests": list(config.requests),
            "workers": list(config.workers),
            "backend": config.backend,
            "rounds": config.rounds,
            "quick": config.quick,
        },
        "drives": described,
        "verdict": "UNDECIDED",
        "verdicts": [],  # bench io states no target for several drives: bench/multi_drive.py judges striping
        "summary": result["summary"],
        "settings": result["settings"],
        "memory_GBps_samples": memory,
        "trials": [asdict(t) | {"GBps": t.GBps} for t in log.trials],
    }
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        names = ", ".join(str(d) for d in config.directories)
        title = f"tierstore bench io: {names} ({format_size(config.size)} per transfer)"
        print(f"wrote {plot(result, args.plot, title=title)}")
    return 0
