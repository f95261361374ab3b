"""``tierstore bench io``: what the drive behind a directory can do, per backend and setting.

Sequential read and write bandwidth of a test file under ``--dir`` for each
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

``summary.best_read_GBps``/``best_write_GBps`` are the best medians of the
``O_DIRECT`` kinds (``raw`` and ``direct``), i.e. what a well-fed drive
sustains; ``memory_GBps`` is the copy bandwidth.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(); add_arguments(parser)
>>> parser.parse_args(["--dir", "/tmp", "--quick"]).quick
True
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
from .report import format_table, gbps, machine_info, median, new_figure, save_figure, write_json

log = logging.getLogger(__name__)

MiB = 1 << 20
FULL_REQUESTS = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
FULL_WORKERS = (1, 2, 4, 8)
QUICK_REQUESTS = (1 * MiB, 16 * MiB)
QUICK_WORKERS = (1, 4)
SPECIAL_REQUEST = 16 * MiB  # setting of the allocation and buffer-touch comparisons
SPECIAL_DEPTH = 4
TOUCH_CAP = 1 << 30  # 1 GiB: the touch comparison reads at most this much into one buffer
DD_EVERY = 4  # grid points between repeated dd baselines
DIRECT_KINDS = ("raw", "direct")


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
def _size_list(text: str, name: str) -> tuple[int, ...]:
    values = tuple(parse_size(part.strip(), name=name) for part in text.split(",") if part.strip())
    if not values or any(v <= 0 or v % 4096 for v in values):
        raise ConfigError(f"{name}={text!r} must list positive multiples of 4 KiB, e.g. '1MiB,4MiB,16MiB'")
    return values


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} must list whole numbers, e.g. '1,2,4,8'") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{name}={text!r} must list numbers >= 1, e.g. '1,2,4,8'")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench io``."""
    parser.add_argument("--dir", required=True, help="a directory on the drive to measure (test files are removed)")
    parser.add_argument("--size", default=None, help="bytes per transfer, e.g. 2GiB (default 2GiB, --quick 256MiB)")
    parser.add_argument("--requests", default=None, help="request sizes, e.g. '1MiB,4MiB,16MiB,64MiB'")
    parser.add_argument("--workers", default=None, help="worker counts (requests in flight), e.g. '1,2,4,8'")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"backends to measure (default {','.join(BACKENDS)})"
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole grid; medians are reported")
    parser.add_argument("--no-dd", action="store_true", help="skip the real dd baseline")
    parser.add_argument("--quick", action="store_true", help="a small grid and 256 MiB: a smoke run")
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
        directory = Path(args.dir).expanduser()
        if not directory.is_dir():
            raise ConfigError(f"--dir {str(directory)!r} is not a directory; pass an existing directory on the drive to measure")
        if not os.access(directory, os.W_OK):
            raise ConfigError(f"--dir {str(directory)!r} is not writable; pass a directory you can write to")
        size = parse_size(args.size if args.size is not None else ("256MiB" if args.quick else "2GiB"), name="--size")
        size -= size % MiB
        if size < 4 * MiB:
            raise ConfigError(f"--size {args.size!r} is below 4 MiB; use e.g. --size 256MiB")
        requests = _size_list(args.requests, "--requests") if args.requests else (QUICK_REQUESTS if args.quick else FULL_REQUESTS)
        workers = _int_list(args.workers, "--workers") if args.workers else (QUICK_WORKERS if args.quick else FULL_WORKERS)
        backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
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
            steps += self.baselines()
            rounds.append(steps)
        self.round = 0
        return rounds


def _rotate(items: Sequence[Any], by: int) -> list[Any]:
    items = list(items)
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


# -- summary ----------------------------------------------------------------
def summarize(trials: Sequence[Trial], *, memory_GBps: float, direct: bool) -> dict[str, Any]:
    """Medians per setting, the best setting per kind, and the headline numbers."""
    groups: dict[tuple[str, str, int, int], list[float]] = {}
    for t in trials:
        groups.setdefault((t.kind, t.op, t.request_bytes, t.workers), []).append(t.GBps)
    settings = [
        {"kind": k, "op": op, "request_bytes": r, "workers": w, "GBps": median(v), "runs": len(v)}
        for (k, op, r, w), v in groups.items()
    ]
    best: dict[str, dict[str, dict[str, Any]]] = {}
    for s in settings:
        slot = best.setdefault(s["kind"], {})
        if s["op"] not in slot or s["GBps"] > slot[s["op"]]["GBps"]:
            slot[s["op"]] = {"GBps": s["GBps"], "request_bytes": s["request_bytes"], "workers": s["workers"]}

    def best_of(kinds: Sequence[str], op: str) -> float | None:
        values = [best[k][op]["GBps"] for k in kinds if k in best and op in best[k]]
        return max(values) if values else None

    def only(kind: str, op: str) -> float | None:
        return best.get(kind, {}).get(op, {}).get("GBps")

    drive_kinds = DIRECT_KINDS if direct else tuple(k for k in best if k in BACKENDS)
    summary: dict[str, Any] = {
        "best_read_GBps": best_of(drive_kinds, "read"),
        "best_write_GBps": best_of(drive_kinds, "write"),
        "dd_read_GBps": only("dd", "read"),
        "dd_write_GBps": only("dd", "write"),
        "ddlike_read_GBps": only("dd-like", "read"),
        "ddlike_write_GBps": only("dd-like", "write"),
        "memory_GBps": memory_GBps,
        "direct_io_supported": direct,
        "best": {k: v for k, v in best.items() if k in ("raw", *BACKENDS)},
    }
    if "direct" in best and "raw" in best:
        summary["direct_vs_raw"] = {
            op: best["direct"][op]["GBps"] / best["raw"][op]["GBps"]
            for op in rawio.OPS
            if op in best["direct"] and op in best["raw"]
        }
        # Best-of-grid picks the luckiest cell of a drifting disk; the median over
        # settings of direct/raw at the same request size and workers is steadier.
        cells = {(s["kind"], s["op"], s["request_bytes"], s["workers"]): s["GBps"] for s in settings}
        summary["direct_vs_raw_per_setting"] = {}
        for op in rawio.OPS:
            ratios = [
                cells[("direct", op, r, w)] / g
                for (k, o, r, w), g in cells.items()
                if k == "raw" and o == op and g and ("direct", op, r, w) in cells
            ]
            if ratios:
                summary["direct_vs_raw_per_setting"][op] = median(ratios)
    summary["allocation"] = {
        "fresh_blocks_GBps": only("fresh-blocks", "write"),
        "fallocated_blocks_GBps": only("fallocated-blocks", "write"),
        "overwrite_GBps": only("overwrite-blocks", "write"),
        "tierstore_writes_into": "overwritten blocks: the state file is fallocated at open and every "
        "shard is written once at construction, so steps overwrite allocated, written blocks",
    }
    summary["buffers"] = {
        "untouched_GBps": only("untouched-buffer", "read"),
        "pretouched_GBps": only("pretouched-buffer", "read"),
        "tierstore_reads_into": "pre-touched buffers: HostBuffer faults every arena page in at allocation",
    }
    return {"settings": settings, "summary": summary}


def _grid_rows(settings: Sequence[dict[str, Any]], kinds: Sequence[str]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for s in settings:
        if s["kind"] not in kinds:
            continue
        row = rows.setdefault((s["request_bytes"], s["workers"]), {"request": format_size(s["request_bytes"]), "workers": s["workers"]})
        row[f"{s['kind']}_{s['op']}"] = s["GBps"]
    return [rows[k] for k in sorted(rows)]


def render(result: dict[str, Any], kinds: Sequence[str]) -> str:
    """The terminal report: the grid table, then the baselines and headline numbers."""
    columns = [("request", "request", "{}"), ("workers", "workers", "{}")]
    for op in rawio.OPS:
        columns += [(f"{k}_{op}", f"{k} {op[0]}", "{:.2f}") for k in kinds]
    lines = ["GB/s (median over rounds); r = read, w = write", format_table(_grid_rows(result["settings"], kinds), columns), ""]
    s = result["summary"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} GB/s"

    lines.append(f"best drive read {fmt(s['best_read_GBps'])}, write {fmt(s['best_write_GBps'])} (O_DIRECT kinds)")
    lines.append(f"dd (1 MiB, direct)  read {fmt(s['dd_read_GBps'])}, write {fmt(s['dd_write_GBps'])}")
    lines.append(f"dd-like (python)    read {fmt(s['ddlike_read_GBps'])}, write {fmt(s['ddlike_write_GBps'])}")
    for kind, ops in s["best"].items():
        parts = [
            f"{op} {fmt(v['GBps'])} @ {format_size(v['request_bytes'])} x{v['workers']}" for op, v in ops.items()
        ]
        lines.append(f"best {kind:<9} " + ", ".join(parts))
    if "direct_vs_raw" in s:
        lines.append("direct / raw: " + ", ".join(f"{op} {v:.2f}x" for op, v in s["direct_vs_raw"].items()))
    if s.get("direct_vs_raw_per_setting"):
        lines.append(
            "direct / raw at the same setting (median over settings): "
            + ", ".join(f"{op} {v:.2f}x" for op, v in s["direct_vs_raw_per_setting"].items())
            + " (target >= 0.9)"
        )
    a, b = s["allocation"], s["buffers"]
    lines.append(
        f"writes: new blocks {fmt(a['fresh_blocks_GBps'])}, fallocated {fmt(a['fallocated_blocks_GBps'])}, "
        f"overwrite {fmt(a['overwrite_GBps'])} (tierstore overwrites)"
    )
    lines.append(
        f"reads: into untouched buffer {fmt(b['untouched_GBps'])}, pre-touched {fmt(b['pretouched_GBps'])} "
        "(tierstore's arena is pre-touched)"
    )
    lines.append(f"host memory copy {fmt(s['memory_GBps'])}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path | str, *, kinds: Sequence[str], title: str) -> Path:
    """Bandwidth against request size (best worker count) per kind, read and write, plus the baselines."""
    fig, axes = new_figure(3, width=5.2)
    s = result["summary"]
    for ax, op in zip(axes[:2], rawio.OPS):
        for kind in kinds:
            points: dict[int, float] = {}
            for row in result["settings"]:
                if row["kind"] == kind and row["op"] == op and row["GBps"] == row["GBps"]:
                    points[row["request_bytes"]] = max(points.get(row["request_bytes"], 0.0), row["GBps"])
            if points:
                xs = sorted(points)
                ax.plot([x / MiB for x in xs], [points[x] for x in xs], marker="o", label=kind)
        for key, style, label in ((f"dd_{op}_GBps", "--", "dd"), (f"ddlike_{op}_GBps", ":", "dd-like")):
            if s.get(key):
                ax.axhline(s[key], linestyle=style, color="grey", label=f"{label} {s[key]:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (MiB), best worker count")
        ax.set_ylabel("GB/s")
        ax.set_title(f"sequential {op}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    labels, values = [], []
    for label, v in (
        ("new blocks", s["allocation"]["fresh_blocks_GBps"]),
        ("fallocated", s["allocation"]["fallocated_blocks_GBps"]),
        ("overwrite", s["allocation"]["overwrite_GBps"]),
        ("read untouched", s["buffers"]["untouched_GBps"]),
        ("read pre-touched", s["buffers"]["pretouched_GBps"]),
    ):
        if v is not None:
            labels.append(label)
            values.append(v)
    ax = axes[2]
    ax.barh(labels, values, color=["tab:red", "tab:orange", "tab:green", "tab:red", "tab:green"][: len(values)])
    ax.set_xlabel("GB/s (raw O_DIRECT)")
    mem = s.get("memory_GBps")
    ax.set_title("blocks and buffers" + (f" (memory copy {mem:.1f} GB/s)" if mem else ""))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write JSON and PNG when asked."""
    from tqdm import tqdm

    config = IOConfig.from_args(args)
    bench = _Run(config)
    if not bench.direct:
        log.warning("O_DIRECT is not supported under %s: raw, direct and dd baselines are skipped", config.directory)
    memory: list[float] = []
    mem_bytes = 64 * MiB if config.quick else 512 * MiB
    needs = resources.io_needs(
        size=config.size, largest_window=max(config.requests) * max(config.workers), memory_copy_bytes=mem_bytes
    )
    resources.check(needs, config.directory, fix="free some, or pass a smaller --size")
    started = time.time()
    try:
        bench.setup()
        memory.append(rawio.memory_bandwidth(mem_bytes))
        rounds = bench.plan()
        total = sum(1 for steps in rounds for label, _ in steps if label)
        with tqdm(total=total, desc="bench io", unit="trial", disable=None, leave=False) as bar:
            for rnd, steps in enumerate(rounds):
                bench.round = rnd
                for label, step in steps:
                    if label:
                        bar.set_postfix_str(label, refresh=False)
                    step()
                    if label:
                        bar.update(1)
        memory.append(rawio.memory_bandwidth(mem_bytes))
    finally:
        bench.cleanup()
    kinds = (["raw"] if bench.direct else []) + [b for b in config.backends if b != "direct" or bench.direct]
    result = summarize(bench.trials, memory_GBps=max(memory) if memory else float("nan"), direct=bench.direct)
    print(render(result, kinds))
    document = {
        "tool": "tierstore bench io",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": machine_info(config.directory),
        "config": {
            "dir": str(config.directory),
            "size": config.size,
            "requests": list(config.requests),
            "workers": list(config.workers),
            "backends": list(config.backends),
            "rounds": config.rounds,
            "quick": config.quick,
        },
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
    return 0
