"""Several drives measured alone and all at once: the machinery of ``tierstore bench io DIR DIR...`` and ``tune``.

A :class:`DriveSet` keeps one written test file per directory and times
sequential transfers through tierstore's own :class:`~tierstore._storage.transfer.IOQueue`
with each drive's backend (``auto``: ``direct`` where the filesystem takes
``O_DIRECT``, else ``mmap``, as the optimizer picks), two request windows
queued as the pipeline queues them:

- :meth:`DriveSet.alone`: one drive, nothing else running;
- :meth:`DriveSet.together`: every drive at once, each with its own queue
  and threads (as a state over several drives has them), each moving its
  share of the bytes; the time is the slowest drive's.

:func:`sweep` runs the whole grid (request size x workers) ``rounds`` times,
interleaved: in each round and at each setting every drive runs alone
(read and write, in a rotating order), then all run at once with shares in
proportion to what each drive did alone in that round at that setting
(:func:`proportional_shares`; a drive's weight is its step bandwidth, the
bytes it reads and writes back per second: ``1 / (1/read + 1/write)``, the
measure the state's placement uses). :mod:`.drives_report` turns the trials
into the table, the JSON summary and the plot.

Example
-------
>>> import tempfile
>>> dirs = [tempfile.mkdtemp(), tempfile.mkdtemp()]
>>> with DriveSet(dirs, size=4 << 20, backend="buffered").open() as drives:
...     alone = drives.alone(0, "write", request_bytes=1 << 20, workers=2)
...     both = drives.together("read", [2 << 20, 2 << 20], request_bytes=1 << 20, workers=2)
...     step = drives.read_write_back([3 << 20, 1 << 20], request_bytes=1 << 20, workers=2, overlap=True)
>>> alone > 0 and both > 0 and step > 0
True
>>> proportional_shares(10 << 20, [3.0, 1.0], align=1 << 20, cap=8 << 20)
[8388608, 2097152]
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._platform.hostmem import HostBuffer
from ..._storage.transfer import IOQueue
from ...backends import open_backend, resolve_backend, supports_direct_io
from ...errors import ClosedError, ConfigError
from . import rawio

__all__ = ["Drive", "DriveSet", "DriveTrial", "TrialLog", "proportional_shares", "step_bandwidth", "sweep",
           "sweep_steps", "ALL", "drive_kind"]

MiB = 1 << 20
ALL = "all"  # the kind of a trial of every drive at once
FILL_REQUEST = 8 * MiB  # how the test files are first written (every block allocated and written)


def drive_kind(index: int) -> str:
    """The kind of a trial of drive ``index`` alone: ``"d0"``, ``"d1"``, ...

    >>> drive_kind(1)
    'd1'
    """
    return f"d{index}"


def step_bandwidth(read: float, write: float) -> float:
    """Bytes per second a drive reads and writes back: ``1 / (1/read + 1/write)`` (``nan`` if either is not > 0).

    >>> step_bandwidth(2.0, 2.0)
    1.0
    """
    if not (read > 0 and write > 0):
        return float("nan")
    return 1.0 / (1.0 / read + 1.0 / write)


def proportional_shares(total: int, weights: Sequence[float], *, align: int, cap: int) -> list[int]:
    """``total`` bytes split in proportion to ``weights``, in multiples of ``align``, none above ``cap``.

    What a drive cannot take (its ``cap``) goes to the others, again in
    proportion. A weight that is not a number > 0 gets nothing (unless all
    are such: then equal shares).

    Raises
    ------
    ConfigError
        If ``cap`` times the number of drives is less than ``total``.

    Example
    -------
    >>> proportional_shares(8 << 20, [1.0, 1.0], align=1 << 20, cap=8 << 20)
    [4194304, 4194304]
    """
    n = len(weights)
    if n == 0 or cap * n < total or (cap // align) * n < total // align:
        raise ConfigError(f"{total} bytes do not fit {n} drive(s) of at most {cap} bytes each")
    w = [x if x == x and x > 0 else 0.0 for x in weights]
    if not any(w):
        w = [1.0] * n
    units, cap_units = total // align, cap // align
    shares = [0] * n
    left = units
    while left > 0:
        open_ = [i for i in range(n) if w[i] > 0 and shares[i] < cap_units] or [i for i in range(n) if shares[i] < cap_units]
        if not open_:  # unreachable after the check above; never loop forever
            break
        weight = sum(w[i] for i in open_) or 1.0
        exact = {i: left * w[i] / weight for i in open_}
        give = {i: min(int(exact[i]), cap_units - shares[i]) for i in open_}
        rest = left - sum(give.values())
        # The units rounding leaves: one each to the largest remainders that have room.
        for i in sorted(open_, key=lambda i: exact[i] - int(exact[i]), reverse=True):
            if rest and shares[i] + give[i] < cap_units:
                give[i] += 1
                rest -= 1
        for i, units_i in give.items():
            shares[i] += units_i
        left -= sum(give.values())
    out = [s * align for s in shares]
    out[max(range(n), key=lambda i: (cap - out[i], w[i]))] += total - sum(out)  # bytes below one align unit
    return out


@dataclass
class DriveTrial:
    """One timed transfer: a drive alone (``kind`` ``d0``, ``d1``, ...) or all at once (``all``, with each one's share)."""

    kind: str
    op: str
    request_bytes: int
    workers: int
    nbytes: int
    seconds: float
    round: int
    started_s: float  # since the log began
    shares: list[int] | None = None

    @property
    def GBps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class TrialLog:
    """The ``record`` callback of :func:`sweep_steps`: keeps every trial, in order."""

    def __init__(self) -> None:
        self.trials: list[DriveTrial] = []
        self._t0 = time.perf_counter()

    def __call__(self, kind: str, op: str, seconds: float, *, request_bytes: int, workers: int, nbytes: int,
                 round: int, shares: list[int] | None = None) -> None:
        self.trials.append(DriveTrial(kind, op, request_bytes, workers, nbytes, seconds, round,
                                      time.perf_counter() - self._t0, shares))


@dataclass(frozen=True)
class Drive:
    """One measured directory: its index, path, backend (``auto`` resolved) and whether ``O_DIRECT`` works there."""

    index: int
    directory: Path
    backend: str
    direct: bool


class DriveSet:
    """A written test file of ``size`` bytes on each drive; timed transfers alone and all at once.

    Parameters
    ----------
    directories
        One directory per drive (each gets a hidden folder of its own, removed by :meth:`close`).
    size
        Bytes of each test file (a multiple of 1 MiB).
    backend
        ``"auto"`` or a backend name, for every drive.

    Raises
    ------
    ConfigError
        For an unknown backend.
    """

    def __init__(self, directories: Sequence[Path | str], *, size: int, backend: str = "auto") -> None:
        self.size = size
        self.drives = tuple(
            Drive(i, Path(d), resolve_backend(backend, d), supports_direct_io(d)) for i, d in enumerate(directories)
        )
        self.folders = [d.directory / f".tierstore-bench-io-{os.getpid()}" for d in self.drives]
        self.files = [folder / "drive.bin" for folder in self.folders]
        self._open = False

    # -- lifetime ---------------------------------------------------------------
    def open(self) -> DriveSet:
        """Create, allocate and write every test file (reads of unwritten blocks would not touch the drive)."""
        try:
            pattern = HostBuffer(FILL_REQUEST * 2, pin=False)
            try:
                pattern.tensor.fill_(0x5A)
                for drive, folder, path in zip(self.drives, self.folders, self.files):
                    folder.mkdir()
                    fd = rawio.open_file(path, direct=drive.direct, create=True)
                    try:
                        os.posix_fallocate(fd, 0, self.size)
                        rawio.fill(fd, self.size, buffer=pattern, request_bytes=FILL_REQUEST, depth=2)
                    finally:
                        os.close(fd)
            finally:
                pattern.close()
        except BaseException:
            self.close()
            raise
        self._open = True
        return self

    def close(self) -> None:
        """Remove the test files and folders; safe to call twice."""
        self._open = False
        for folder, path in zip(self.folders, self.files):
            path.unlink(missing_ok=True)
            if folder.exists():
                folder.rmdir()

    def __enter__(self) -> DriveSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> list[dict[str, Any]]:
        """Each drive as a report names it: index, directory, backend, whether ``O_DIRECT`` works, its filesystem."""
        from .report import machine_info

        return [{"index": d.index, "dir": str(d.directory), "backend": d.backend, "direct_io_supported": d.direct,
                 "filesystem": machine_info(d.directory).get("filesystem")} for d in self.drives]  # fmt: skip

    # -- timed transfers ----------------------------------------------------------
    def _require_open(self) -> None:
        if not self._open:
            raise ClosedError("the drive set is not open; call open() first")

    def alone(self, index: int, op: str, *, request_bytes: int, workers: int, nbytes: int | None = None,
              buffer: HostBuffer | None = None) -> float:
        """Seconds for drive ``index`` alone to move ``nbytes`` (default: the whole file)."""
        self._require_open()
        return _timed(self, index, op, nbytes or self.size, request_bytes, workers, buffer)

    def together(self, op: str, shares: Sequence[int], *, request_bytes: int, workers: int,
                 buffers: Sequence[HostBuffer | None] | None = None) -> float:
        """Seconds for every drive at once, drive ``i`` moving ``shares[i]`` bytes with its own queue.

        Every drive starts at one barrier; the time ends when the last one is done.
        """
        self._require_open()
        if len(shares) != len(self.drives) or any(s < 0 or s > self.size for s in shares):
            raise ConfigError(f"shares {list(shares)} must be one per drive, each within 0..{self.size} bytes")
        buffers = list(buffers) if buffers is not None else [None] * len(self.drives)
        active = [i for i, s in enumerate(shares) if s > 0]
        barrier = threading.Barrier(len(active) + 1)
        ends: dict[int, float] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                _timed(self, i, op, shares[i], request_bytes, workers, buffers[i], barrier=barrier)
                ends[i] = time.perf_counter()
            except BaseException as exc:  # re-raised once every drive stopped
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(i,), name=f"tierstore-drive-{i}") for i in active]
        for t in threads:
            t.start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a drive failed to start: raised below
            barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return max(ends.values()) - t0 if ends else 0.0

    def read_write_back(self, shares: Sequence[int], *, request_bytes: int, workers: int, sync: bool = True,
                        overlap: bool = False) -> float:
        """Seconds for every drive at once to read its share and write it back (a streamed step's I/O, no update).

        Each drive reads ``shares[i]`` bytes and writes as many back, with its
        own queue: one after the other, or (``overlap=True``) both at once,
        each with a queue of its own, as the store's separate read and write
        workers do. ``sync=False``: no sync after the writes, as a step that is
        not durable. The time ends when the last drive is done.
        """
        self._require_open()
        if len(shares) != len(self.drives) or any(s < 0 or s > self.size for s in shares):
            raise ConfigError(f"shares {list(shares)} must be one per drive, each within 0..{self.size} bytes")
        errors: list[BaseException] = []
        jobs = [(i, ops) for i in range(len(self.drives)) if shares[i]
                for ops in ((("read",), ("write",)) if overlap else (("read", "write"),))]
        barrier = threading.Barrier(len(jobs) + 1)
        ends: list[float] = []

        def run(i: int, ops: tuple[str, ...]) -> None:
            buffer = self.buffer(request_bytes, workers)
            try:
                barrier.wait()
                for op in ops:
                    _timed(self, i, op, shares[i], request_bytes, workers, buffer, sync=sync)
                ends.append(time.perf_counter())
            except BaseException as exc:  # re-raised once every drive stopped
                errors.append(exc)
                barrier.abort()
            finally:
                buffer.close()

        threads = [threading.Thread(target=run, args=job, name=f"tierstore-drive-{job[0]}") for job in jobs]
        for t in threads:
            t.start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a drive failed to start: raised below
            barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return max(ends) - t0 if ends else 0.0

    def buffer(self, request_bytes: int, workers: int) -> HostBuffer:
        """A pre-touched buffer for two request windows (capped at the file), as one transfer uses."""
        return HostBuffer(min(2 * request_bytes * workers, 2 * self.size), pin=False)


def _timed(drives: DriveSet, index: int, op: str, nbytes: int, request_bytes: int, workers: int,
           buffer: HostBuffer | None, *, barrier: threading.Barrier | None = None, sync: bool = True) -> float:
    """Move ``nbytes`` of drive ``index``'s file from offset 0 through an IOQueue, two windows queued.

    A write ends with the file's sync (``sync=False``: without, as a step of a state that is not durable).
    """
    drive, path = drives.drives[index], drives.files[index]
    own = buffer is None
    buf = drives.buffer(request_bytes, workers) if own else buffer
    window = request_bytes * workers
    if op == "read":
        rawio.drop_cache(path)  # page-cache backends start cold: the figure is the drive's
    file = open_backend(drive.backend, path, drives.size, create=False)
    try:
        with IOQueue(workers=workers, request_bytes=request_bytes) as io:
            submit = io.read if op == "read" else io.write
            pending: deque = deque()
            if barrier is not None:
                barrier.wait()
            t0 = time.perf_counter()
            for k, offset in enumerate(range(0, nbytes, window)):
                if len(pending) == 2:
                    pending.popleft().wait()
                base = (k % 2) * window
                pending.append(submit(file, buf.view[base: base + min(window, nbytes - offset)], offset))
            while pending:
                pending.popleft().wait()
            if op == "write" and sync:
                file.sync()
            return time.perf_counter() - t0
    finally:
        file.close()
        if own:
            buf.close()


Step = tuple[str, Callable[[], None]]


def sweep_steps(drives: DriveSet, *, requests: Sequence[int], workers: Sequence[int], rounds: int,
                record: Callable[..., None]) -> list[list[Step]]:
    """Every round's labelled steps: at each setting each drive alone, then all at once in proportion (with two or more).

    ``record(kind, op, seconds, request_bytes=, workers=, nbytes=, round=)`` is
    called by each step with its time; the proportions of an all-at-once step
    come from the alone times recorded just before it, in its round.
    """
    grid = [(r, w) for r in requests for w in workers]
    plan: list[list[Step]] = []
    n = len(drives.drives)
    for rnd in range(rounds):
        steps: list[Step] = []
        for i, (request, count) in enumerate(grid):
            seen: dict[tuple[int, str], float] = {}  # (drive, op) -> GB/s alone, this round and setting
            holder: dict[int, HostBuffer] = {}

            def buffer(d: int, request: int = request, count: int = count, holder: dict = holder) -> HostBuffer:
                if d not in holder:
                    holder[d] = drives.buffer(request, count)
                return holder[d]

            order = [(i + rnd + k) % n for k in range(n)]
            for op in rawio.OPS:
                for d in order:
                    def one(d: int = d, op: str = op, request: int = request, count: int = count,
                            seen: dict = seen, rnd: int = rnd) -> None:
                        seconds = drives.alone(d, op, request_bytes=request, workers=count, buffer=buffer(d))
                        seen[(d, op)] = drives.size / seconds if seconds > 0 else float("nan")
                        record(drive_kind(d), op, seconds, request_bytes=request, workers=count,
                               nbytes=drives.size, round=rnd)

                    steps.append((f"d{d} {op} {request >> 10} KiB x{count}", one))
            for op in rawio.OPS if n > 1 else ():  # one drive: "all at once" is that drive alone
                def all_at_once(op: str = op, request: int = request, count: int = count, seen: dict = seen,
                                rnd: int = rnd) -> None:
                    weights = [step_bandwidth(seen.get((d, "read"), 0.0), seen.get((d, "write"), 0.0))
                               for d in range(n)]
                    shares = proportional_shares(drives.size, weights, align=MiB, cap=drives.size)
                    seconds = drives.together(op, shares, request_bytes=request, workers=count,
                                              buffers=[buffer(d) for d in range(n)])
                    record(ALL, op, seconds, request_bytes=request, workers=count, nbytes=drives.size, round=rnd,
                           shares=shares)

                steps.append((f"all {op} {request >> 10} KiB x{count}", all_at_once))

            def release(holder: dict = holder) -> None:
                for b in holder.values():
                    b.close()
                holder.clear()

            steps.append(("", release))
        plan.append(steps)
    return plan


def sweep(drives: DriveSet, *, requests: Sequence[int], workers: Sequence[int], rounds: int,
          record: Callable[..., None], progress: Callable[[str], None] | None = None) -> None:
    """Run :func:`sweep_steps` in order (``progress(label)`` after each labelled step)."""
    for steps in sweep_steps(drives, requests=requests, workers=workers, rounds=rounds, record=record):
        for label, step in steps:
            step()
            if label and progress is not None:
                progress(label)
