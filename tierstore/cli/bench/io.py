"""``tierstore bench io``: what the drive behind a directory can do, per backend and setting.

Sequential read and write bandwidth of a test file in ``DIR`` (or ``--dir``) for each
backend (``direct``, ``buffered``, ``mmap``, through tierstore's own
:class:`~tierstore._storage.transfer.IOQueue`) across request sizes and worker counts,
beside raw baselines measured in the same run and interleaved with them,
because the disk drifts over minutes:

- ``raw``: ``O_DIRECT`` into pre-touched aligned buffers, ``workers``
  requests always in flight (:func:`~tierstore.cli.bench.rawio.parallel`);
- ``dd-like``: one thread, 1 MiB ``O_DIRECT`` requests; ``dd``: the real
  ``dd iflag/oflag=direct bs=1M`` when installed;
- writes into newly allocated blocks, into fallocated-but-unwritten blocks
  and over written blocks; reads into never-touched and pre-touched buffers;
- host memory copy bandwidth.

Buffered and mmap reads start with the file evicted from the page cache,
and their writes include the final ``fdatasync``/``msync``, so every figure
is the drive's. The test files are removed afterwards.

The whole grid runs ``--rounds`` times (3 by default), each round in a
rotated order; figures are medians over rounds with the min-max beside
them, ratios are taken round by round, and the target (the direct backend
at >= 0.9x raw ``O_DIRECT``) gets PASS, FAIL or UNDECIDED (fewer than 3
rounds) from :mod:`.io_report`. The report starts with the hardware line.

Several directories (``tierstore bench io DIR DIR...``) are measured alone
and all at once instead, over a sweep of workers and request sizes:
:mod:`.io_drives`.

``summary.best_read_GBps``/``best_write_GBps`` are the best medians of the
``O_DIRECT`` kinds (``raw`` and ``direct``), i.e. what a well-fed drive
sustains; ``memory_GBps`` is the copy bandwidth.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(); add_arguments(parser)
>>> parser.parse_args(["--dir", "/tmp", "--quick"]).quick
True
>>> parser.parse_args(["/tmp", "/dev/shm"]).dirs
['/tmp', '/dev/shm']
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..._platform.hostmem import HostBuffer
from ..._storage.transfer import IOQueue
from ...backends import BACKENDS, open_backend, supports_direct_io
from ...errors import ConfigError
from ...sizes import format_size, parse_size
from . import rawio, resources
from .io_options import check_directories, directories_of, int_list, run_rounds, size_list
from .io_report import plot, render, summarize, verdicts
from .report import gbps, hardware_line, machine_info, write_json
from .verdict import MIN_REPEATS, overall

log = logging.getLogger(__name__)

MiB = 1 << 20
FULL_REQUESTS = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
FULL_WORKERS = (1, 2, 4, 8)
QUICK_REQUESTS = (1 * MiB, 16 * MiB)
QUICK_WORKERS = (4,)  # a smoke run: two settings, so three rounds cost what one round of four did
SPECIAL_REQUEST = 16 * MiB  # setting of the allocation and buffer-touch comparisons
SPECIAL_DEPTH = 4
TOUCH_CAP = 1 << 30  # 1 GiB: the touch comparison reads at most this much into one buffer
DD_EVERY = 4  # grid points between repeated dd baselines
DIRECT_KINDS = ("raw", "direct")
DEFAULT_ROUNDS = 3  # a verdict needs three interleaved repeats (verdict.MIN_REPEATS)


@dataclass
class Trial:
    """One timed transfer of ``nbytes``."""

    kind: str
    op: str
    request_bytes: int
    workers: int
    nbytes: int
    seconds: float
    round: int
    started_s: float  # since the run began

    @property
    def GBps(self) -> float:
        return gbps(self.nbytes, self.seconds)


# -- arguments ------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench io``."""
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="directories on the drives to measure (test files "
                        "are removed); one gives the full report of one drive, several measure each drive alone and "
                        "all at once (tierstore.cli.bench.io_drives)")
    parser.add_argument("--dir", action="append", default=None, help="a directory to measure, as DIR (repeatable)")
    parser.add_argument("--size", default=None, help="bytes per transfer, e.g. 2GiB (default 2GiB, --quick 256MiB)")
    parser.add_argument("--requests", default=None, help="request sizes, e.g. '1MiB,4MiB,16MiB,64MiB'")
    parser.add_argument("--workers", default=None, help="worker counts (requests in flight), e.g. '1,2,4,8'")
    parser.add_argument(
        "--backends", default=None, help=f"backends to measure (default {','.join(BACKENDS)}; with several "
        "directories one backend, default auto)"
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"interleaved rounds of the whole grid (default {DEFAULT_ROUNDS}; a verdict needs "
                        f"{MIN_REPEATS}): medians are reported with the spread over rounds")
    parser.add_argument("--no-dd", action="store_true", help="skip the real dd baseline")
    parser.add_argument("--quick", action="store_true", help="a small grid (1 and 16 MiB requests, 4 workers) and "
                        "256 MiB: a smoke run")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write a PNG plot")


@dataclass(frozen=True)
class IOConfig:
    """The validated settings of one ``bench io`` run."""

    directory: Path
    size: int
    requests: tuple[int, ...]
    workers: tuple[int, ...]
    backends: tuple[str, ...]
    rounds: int
    dd: bool
    quick: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> IOConfig:
        """Validate the parsed options.

        Raises
        ------
        ConfigError
            For a missing directory, a size below 4 MiB, unknown backends or bad lists.
        """
        directories = directories_of(args)
        if len(directories) > 1:
            raise ConfigError(f"IOConfig measures one directory, not {len(directories)}; use io_drives.DrivesConfig")
        directory = directories[0]
        check_directories(directories, flag="DIR" if getattr(args, "dirs", None) else "--dir")
        size = parse_size(args.size if args.size is not None else ("256MiB" if args.quick else "2GiB"), name="--size")
        size -= size % MiB
        if size < 4 * MiB:
            raise ConfigError(f"--size {args.size!r} is below 4 MiB; use e.g. --size 256MiB")
        requests = size_list(args.requests, "--requests") if args.requests else (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
        workers = int_list(args.workers, "--workers") if args.workers else (QUICK_WORKERS if args.quick else FULL_WORKERS)
        backends = tuple(b.strip() for b in (args.backends or ",".join(BACKENDS)).split(",") if b.strip())
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ConfigError(f"--backends lists unknown {unknown}; choose from {sorted(BACKENDS)}")
        if isinstance(args.rounds, bool) or args.rounds < 1:
            raise ConfigError(f"--rounds {args.rounds!r} must be >= 1")
        return cls(directory, size, requests, workers, backends, args.rounds, not args.no_dd, bool(args.quick))


# -- one trial of each kind -------------------------------------------------
def _backend_transfer(kind: str, op: str, path: Path, size: int, *, request_bytes: int, workers: int, buffer: HostBuffer) -> float:
    """Move the file through tierstore's IOQueue with two windows queued, as the pipeline does."""
    window = request_bytes * workers
    file = open_backend(kind, path, size, create=False)
    try:
        with IOQueue(workers=workers, request_bytes=request_bytes) as io:
            submit = io.read if op == "read" else io.write
            pending: deque = deque()
            t0 = time.perf_counter()
            for k, offset in enumerate(range(0, size, window)):
                if len(pending) == 2:
                    pending.popleft().wait()
                base = (k % 2) * window
                pending.append(submit(file, buffer.view[base : base + min(window, size - offset)], offset))
            while pending:
                pending.popleft().wait()
            if op == "write":
                file.sync()
            return time.perf_counter() - t0
    finally:
        file.close()


def _fresh_write(path: Path, size: int, *, fallocate: bool, buffer: HostBuffer) -> float:
    """Write a new file: into blocks allocated by the write itself, or fallocated first."""
    if path.exists():
        path.unlink()
    fd = rawio.open_file(path, direct=True, create=True)
    try:
        if fallocate:
            os.posix_fallocate(fd, 0, size)
        return rawio.parallel(fd, "write", size, buffer=buffer, request_bytes=SPECIAL_REQUEST, depth=SPECIAL_DEPTH)
    finally:
        os.close(fd)
        path.unlink()


def _touch_read(fd: int, nbytes: int, *, touched: bool) -> float:
    """Read into one buffer as large as the data: never-touched pages or pre-touched ones."""
    buffer = HostBuffer(nbytes, pin=False, touch=touched)
    try:
        return rawio.parallel(
            fd, "read", nbytes, buffer=buffer, request_bytes=SPECIAL_REQUEST, depth=SPECIAL_DEPTH, spread=True
        )
    finally:
        buffer.close()


# -- the run ----------------------------------------------------------------
class _Run:
    """Test files, open descriptors and the list of trials of one ``bench io`` run."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self.folder = config.directory / f".tierstore-bench-io-{os.getpid()}"
        self.main = self.folder / "main.bin"
        self.scratch = self.folder / "scratch.bin"
        self.direct = supports_direct_io(config.directory)
        self.trials: list[Trial] = []
        self.t0 = time.perf_counter()
        self.fd = -1
        self.round = 0

    def record(self, kind: str, op: str, seconds: float | None, *, request_bytes: int, workers: int, nbytes: int | None = None) -> None:
        if seconds is None:
            return
        self.trials.append(
            Trial(kind, op, request_bytes, workers, nbytes or self.config.size, seconds, self.round, time.perf_counter() - self.t0)
        )

    def setup(self) -> None:
        size = self.config.size
        self.folder.mkdir()
        self.fd = rawio.open_file(self.main, direct=self.direct, create=True)
        os.posix_fallocate(self.fd, 0, size)
        pattern = HostBuffer(SPECIAL_REQUEST * SPECIAL_DEPTH, pin=False)
        try:
            pattern.tensor.fill_(0x5A)
            rawio.fill(self.fd, size, buffer=pattern, request_bytes=SPECIAL_REQUEST, depth=SPECIAL_DEPTH)
        finally:
            pattern.close()

    def cleanup(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for path in (self.main, self.scratch):
            if path.exists():
                path.unlink()
        if self.folder.exists():
            self.folder.rmdir()

    # Each builder returns (label, callable) pairs; the caller times and records them.
    def baselines(self) -> list[tuple[str, Callable[[], None]]]:
        """dd-like and dd, read and write: repeated through the run to track drift."""
        if not self.direct:
            return []
        size = self.config.size
        steps: list[tuple[str, Callable[[], None]]] = []
        for op in rawio.OPS:

            def ddlike(op: str = op) -> None:
                buf = HostBuffer(MiB, pin=False)
                try:
                    self.record("dd-like", op, rawio.sequential(self.fd, op, size, buffer=buf), request_bytes=MiB, workers=1)
                finally:
                    buf.close()

            steps.append((f"dd-like {op}", ddlike))
            if self.config.dd and rawio.dd_available():

                def dd(op: str = op) -> None:
                    rawio.drop_cache(self.main)
                    self.record("dd", op, rawio.run_dd(self.main, op, size), request_bytes=MiB, workers=1)

                steps.append((f"dd {op}", dd))
        return steps

    def specials(self) -> list[tuple[str, Callable[[], None]]]:
        """Fresh vs fallocated vs overwritten blocks; untouched vs pre-touched buffers."""
        if not self.direct:
            return []
        size = self.config.size
        touch_bytes = min(size, TOUCH_CAP)
        buf_holder: dict[str, HostBuffer] = {}

        def buffer() -> HostBuffer:
            if "b" not in buf_holder:
                buf_holder["b"] = HostBuffer(SPECIAL_REQUEST * SPECIAL_DEPTH, pin=False)
            return buf_holder["b"]

        def fresh() -> None:
            self.record("fresh-blocks", "write", _fresh_write(self.scratch, size, fallocate=False, buffer=buffer()),
                        request_bytes=SPECIAL_REQUEST, workers=SPECIAL_DEPTH)

        def fallocated() -> None:
            self.record("fallocated-blocks", "write", _fresh_write(self.scratch, size, fallocate=True, buffer=buffer()),
                        request_bytes=SPECIAL_REQUEST, workers=SPECIAL_DEPTH)

        def overwrite() -> None:
            seconds = rawio.parallel(self.fd, "write", size, buffer=buffer(), request_bytes=SPECIAL_REQUEST, depth=SPECIAL_DEPTH)
            self.record("overwrite-blocks", "write", seconds, request_bytes=SPECIAL_REQUEST, workers=SPECIAL_DEPTH)

        def untouched() -> None:
            self.record("untouched-buffer", "read", _touch_read(self.fd, touch_bytes, touched=False),
                        request_bytes=SPECIAL_REQUEST, workers=SPECIAL_DEPTH, nbytes=touch_bytes)

        def touched() -> None:
            self.record("pretouched-buffer", "read", _touch_read(self.fd, touch_bytes, touched=True),
                        request_bytes=SPECIAL_REQUEST, workers=SPECIAL_DEPTH, nbytes=touch_bytes)

        def release() -> None:
            if "b" in buf_holder:
                buf_holder.pop("b").close()

        alloc = _rotate([("fresh blocks", fresh), ("fallocated blocks", fallocated), ("overwrite", overwrite)], self.round)
        touch = _rotate([("untouched buffer", untouched), ("pre-touched buffer", touched)], self.round)
        return alloc + touch + [("", release)]

    def grid_point(self, index: int, request_bytes: int, workers: int) -> list[tuple[str, Callable[[], None]]]:
        """Every kind, read then write, at one (request size, workers) setting."""
        size = self.config.size
        kinds = (["raw"] if self.direct else []) + [b for b in self.config.backends if b != "direct" or self.direct]
        kinds = _rotate(kinds, index + self.round)
        window = request_bytes * workers
        holder: dict[str, HostBuffer] = {}

        def buffer() -> HostBuffer:
            if "b" not in holder:
                holder["b"] = HostBuffer(min(2 * window, 2 * size), pin=False)
            return holder["b"]

        steps: list[tuple[str, Callable[[], None]]] = []
        for op in rawio.OPS:
            for kind in kinds:

                def one(kind: str = kind, op: str = op) -> None:
                    rawio.drop_cache(self.main)
                    if kind == "raw":
                        seconds = rawio.parallel(self.fd, op, size, buffer=buffer(), request_bytes=request_bytes, depth=workers)
                    else:
                        seconds = _backend_transfer(
                            kind, op, self.main, size, request_bytes=request_bytes, workers=workers, buffer=buffer()
                        )
                    self.record(kind, op, seconds, request_bytes=request_bytes, workers=workers)

                steps.append((f"{kind} {op} {format_size(request_bytes)} x{workers}", one))

        def release() -> None:
            if "b" in holder:
                holder.pop("b").close()

        return steps + [("", release)]

    def plan(self) -> list[list[tuple[str, Callable[[], None]]]]:
        """All rounds' steps, each round a list; dd baselines repeated every few grid points."""
        grid = [(r, w) for r in self.config.requests for w in self.config.workers]
        rounds = []
        for rnd in range(self.config.rounds):
            self.round = rnd
            steps = self.baselines() + self.specials()
            for i, (r, w) in enumerate(grid):
                if i and i % DD_EVERY == 0:
                    steps += self.baselines()
                steps += self.grid_point(i, r, w)
            if rnd == self.config.rounds - 1:
                steps += self.baselines()  # the next round's opening baselines close this one
            rounds.append(steps)
        self.round = 0
        return rounds


def _rotate(items: Sequence[Any], by: int) -> list[Any]:
    items = list(items)
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write JSON and PNG when asked."""
    from . import io_drives

    if len(directories_of(args)) > 1:
        return io_drives.run(args)
    config = IOConfig.from_args(args)
    bench = _Run(config)
    if not bench.direct:
        log.warning("O_DIRECT is not supported under %s: raw, direct and dd baselines are skipped", config.directory)
    memory: list[float] = []  # one per round, measured before the round's trials
    mem_bytes = 64 * MiB if config.quick else 512 * MiB
    needs = resources.io_needs(
        size=config.size, largest_window=max(config.requests) * max(config.workers), memory_copy_bytes=mem_bytes
    )
    resources.check(needs, config.directory, fix="free some, or pass a smaller --size")
    started = time.time()
    try:
        bench.setup()

        def before_round(rnd: int) -> None:
            bench.round = rnd
            memory.append(rawio.memory_bandwidth(mem_bytes))

        run_rounds(bench.plan(), desc="bench io", before_round=before_round)
    finally:
        bench.cleanup()
    kinds = (["raw"] if bench.direct else []) + [b for b in config.backends if b != "direct" or bench.direct]
    result = summarize(bench.trials, memory_GBps=memory, direct=bench.direct)
    machine = machine_info(config.directory)
    found = verdicts(result)
    if config.rounds < MIN_REPEATS:
        log.warning("--rounds %d: a verdict needs at least %d interleaved rounds (the verdicts say UNDECIDED)",
                    config.rounds, MIN_REPEATS)
    print(render(result, kinds, machine=machine, verdict_list=found))
    document = {
        "tool": "tierstore bench io",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": machine,
        "hardware": hardware_line(machine),
        "config": {
            "dir": str(config.directory),
            "size": config.size,
            "requests": list(config.requests),
            "workers": list(config.workers),
            "backends": list(config.backends),
            "rounds": config.rounds,
            "quick": config.quick,
        },
        "verdict": overall(found),
        "verdicts": found,
        "summary": result["summary"],
        "settings": result["settings"],
        "memory_GBps_samples": memory,
        "trials": [asdict(t) | {"GBps": t.GBps} for t in bench.trials],
    }
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        title = f"tierstore bench io: {config.directory} ({format_size(config.size)} per transfer)"
        print(f"wrote {plot(result, args.plot, kinds=kinds, title=title)}")
    return 0  # a FAIL is a finding, not an error: the verdicts and the JSON's "verdict" say it
