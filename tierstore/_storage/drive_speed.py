"""How fast a drive serves a streamed step: read a byte back and write it again, synced, timed.

A state over several drives places its shards by each drive's bandwidth
(:func:`tierstore._storage.placement.place`). What a streamed step asks of a
drive for each byte of state is one read (what the previous step wrote) and
one write back, made durable by the commit's sync. :func:`measure_drive`
times exactly that, with the backend the state will use, through an
:class:`~tierstore._storage.transfer.IOQueue` like the store's:

1. a probe file of ``nbytes`` (named with the O_DIRECT probe's prefix, so a
   leftover from a killed probe is never taken for a foreign file) is
   written once and synced: the *fill*, which allocates the file's blocks
   as a new state's first step does. It is timed but not counted;
2. then ``passes`` times: every block is read back and written again, reads
   and writes in flight together as the store's read and write workers
   run, and the file synced. The page cache is dropped before each pass, so
   a backend that uses it reads from the drive, not from RAM.

The figure, :attr:`DriveSpeed.bandwidth`, is ``nbytes`` over the median
pass: bytes a second the drive reads and writes back, durably. The median
of a few passes, interleaved over the drives (:func:`measure_drives`), is
what a burst of other work on the machine changes least.

Memory: the bytes move through one small buffer, :data:`PROBE_BUFFER_BYTES`
(4 MiB: four requests of 1 MiB in flight), reused for every request, every
pass and every drive, so the probe stays inside the 16 MiB the RAM budget's
contract allows beyond ``ram_budget`` however much it moves. Each request's
4 KiB blocks are stamped with their offset and pass before they are
written, so a drive that deduplicates or compresses sees no repeats.

Limits, and why ``tierstore tune`` (its knobs file) takes precedence when given:

- a cache in front of the drive that holds more than ``nbytes`` serves the
  reads (a virtual disk whose host caches its image, a RAID controller's
  cache), and a write cache that absorbs ``nbytes`` before the sync hides
  the drive's sustained write speed (an SSD's SLC cache). A step that moves
  more than that cache holds then runs slower on that drive than the
  figure says. Syncing each pass makes a write count only once the drive
  (or the host's cache behind a virtual disk) has taken it; the passes make
  reads follow a rewrite of the whole file, as a step's do; neither can
  empty a cache the probe does not control;
- it measures a drive alone, for a few hundred milliseconds; drives that
  share a bus or a controller, or a machine whose other work comes and goes,
  can move differently during a long run. ``tierstore tune`` measures each
  drive at length, alone and with the others;
- a drive is known by its ``st_dev``: :func:`probe_drives` measures each
  filesystem once and splits its figure equally between its directories.
  Two filesystems on one physical drive (two partitions) are measured as
  two drives.

The result is a resource, never identity: it decides where a new state's
shards go, and the placement (not the figure) is what the manifest records.
A caller that knows better passes its own figures.

Example
-------
>>> import tempfile
>>> speed = measure_drive(tempfile.mkdtemp(), backend="buffered", nbytes=1 << 20, passes=2)
>>> speed.nbytes, len(speed.pass_seconds), speed.bandwidth > 0
(1048576, 2, True)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._layout.layout import round_up
from .._platform.hostmem import HostBuffer
from ..backends import PROBE_PREFIX, open_backend, resolve_backend
from ..backends.base import O_CLOEXEC, ShardFile
from ..errors import ConfigError
from .integrity import CHECKSUM_BLOCK
from .transfer import IOQueue, Transfer

__all__ = [
    "DriveSpeed",
    "PROBE_BUFFER_BYTES",
    "PROBE_NBYTES",
    "PROBE_PASSES",
    "measure_drive",
    "measure_drives",
    "probe_drive",
    "probe_drives",
    "probe_nbytes",
]

#: The most a placement probe moves per drive and pass by default: 64 MiB (about 60 ms read
#: and written back on a 2 GB/s NVMe drive, a second on a 100 MB/s disk).
PROBE_NBYTES = 64 << 20
#: The probe's RAM, whatever it moves: four 1 MiB requests in flight, reused.
PROBE_BUFFER_BYTES = 4 << 20
#: Timed passes per drive (the figure is their median).
PROBE_PASSES = 3
_MIN_PROBE = 1 << 20  # 1 MiB: one checksum block, one request
_BLOCK = 4096  # the unit stamped with its offset (a page: what a deduplicating drive compares)


@dataclass(frozen=True)
class DriveSpeed:
    """One drive's measured read-and-write-back speed (:func:`measure_drive`).

    Attributes
    ----------
    path
        The directory probed.
    backend
        The backend the probe used (``"auto"`` resolved).
    nbytes
        The probe file's size: bytes read and written back in each pass.
    fill_seconds
        The first write of the file and its sync (allocating its blocks); not counted.
    pass_seconds
        Each timed pass: every byte read back and written again, then the sync.
    """

    path: str
    backend: str
    nbytes: int
    fill_seconds: float
    pass_seconds: tuple[float, ...]

    @property
    def seconds(self) -> float:
        """The median pass: what the figure stands on."""
        return statistics.median(self.pass_seconds)

    @property
    def bandwidth(self) -> float:
        """Bytes per second read and written back, durably: what placement weighs drives by."""
        return self.nbytes / max(self.seconds, 1e-9)


def probe_nbytes(state_nbytes: int, drives: int) -> int:
    """How much a placement probe moves per drive and pass for a state of ``state_nbytes`` over ``drives``.

    No more than each drive's share of the state (a small state's placement
    barely matters, and its probe must cost little), at least 1 MiB, at most
    :data:`PROBE_NBYTES`, in whole 1 MiB blocks.

    Example
    -------
    >>> probe_nbytes(10 << 30, 2) >> 20, probe_nbytes(100, 2) >> 20
    (64, 1)
    """
    share = state_nbytes // max(1, drives)
    return min(PROBE_NBYTES, max(_MIN_PROBE, round_up(share, CHECKSUM_BLOCK)))


class _Ring:
    """The probe's one buffer: ``slots`` requests of ``chunk`` bytes, each waited for before it is reused."""

    def __init__(self, chunk: int, slots: int) -> None:
        import torch

        self.chunk, self.slots = chunk, slots
        self.buffer = HostBuffer(chunk * slots, pin=False)
        # Bytes that do not compress: a drive that compresses must not look faster.
        self.buffer.tensor.random_(0, 256, generator=torch.Generator().manual_seed(chunk * slots))
        self._ramp = torch.arange(chunk // _BLOCK, dtype=torch.int64)
        self.writes: list[Transfer | None] = [None] * slots

    def view(self, slot: int, nbytes: int) -> memoryview:
        return self.buffer.view[slot * self.chunk : slot * self.chunk + nbytes]

    def stamp(self, slot: int, nbytes: int, offset: int, rank: int) -> None:
        """Write each 4 KiB block's own number (its offset's, and ``rank``: the pass) into its first 8 bytes."""
        import torch

        start = slot * self.chunk
        blocks = self.buffer.tensor[start : start + nbytes].view(torch.int64).view(-1, _BLOCK // 8)[:, 0]
        blocks.copy_(self._ramp[: nbytes // _BLOCK]).add_(offset // _BLOCK + (rank << 40))

    def drain(self) -> None:
        for k, w in enumerate(self.writes):
            if w is not None:
                self.writes[k] = None
                w.wait()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing after an error: the first one is raised already
            self.drain()
        self.buffer.close()


def _pass(io: IOQueue, ring: _Ring, file: ShardFile, nbytes: int, *, rank: int, read: bool) -> float:
    """Seconds to (read back and) write ``nbytes`` of ``file`` through ``ring``, then sync it.

    A window of ``ring.slots`` requests at a time: each slot's read waits for
    its previous write only, so one window's reads overlap the last one's
    writes, as a step's prefetch overlaps its write-back.
    """
    offsets = list(range(0, nbytes, ring.chunk))
    t0 = time.perf_counter()
    for first in range(0, len(offsets), ring.slots):
        window = offsets[first : first + ring.slots]
        reads: list[Transfer | None] = []
        for slot, offset in enumerate(window):
            size = min(ring.chunk, nbytes - offset)
            pending = ring.writes[slot]
            if pending is not None:
                ring.writes[slot] = None
                pending.wait()
            reads.append(io.read(file, ring.view(slot, size), offset) if read else None)
        for slot, offset in enumerate(window):
            size = min(ring.chunk, nbytes - offset)
            pending = reads[slot]
            if pending is not None:
                pending.wait()
            ring.stamp(slot, size, offset, rank)
            ring.writes[slot] = io.write(file, ring.view(slot, size), offset)
    ring.drain()
    file.sync()
    return time.perf_counter() - t0


def _check_counts(nbytes: object, passes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % _BLOCK:
        raise ConfigError(f"nbytes={nbytes!r} must be a positive multiple of 4096, e.g. 64 << 20")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"passes={passes!r} must be an int >= 1, e.g. {PROBE_PASSES}")


def measure_drives(
    directories: Sequence[str | os.PathLike],
    *,
    backend: str = "auto",
    nbytes: int = PROBE_NBYTES,
    passes: int = PROBE_PASSES,
    request_bytes: int = 1 << 20,
    workers: int = 4,
    dir_fds: Sequence[int | None] | None = None,
) -> list[DriveSpeed]:
    """Measure each directory's drive (module docs): its fill, then ``passes`` passes, interleaved over the drives.

    One buffer of at most :data:`PROBE_BUFFER_BYTES` serves every drive:
    ``workers`` requests of ``request_bytes`` in flight, fewer (or smaller
    requests) where that would not fit. ``dir_fds``: each directory's open
    descriptor (its probe file is made relative to it). Every probe file is
    removed whatever happens.

    Raises
    ------
    ConfigError
        If ``nbytes`` is not a positive multiple of 4096, ``passes`` is not
        an int >= 1, or ``backend`` is unknown.
    DiskFullError, BackendError, StateDirError
        If a drive cannot hold or move the probe's bytes.
    """
    _check_counts(nbytes, passes)
    paths = [Path(d) for d in directories]
    given = list(dir_fds) if dir_fds is not None else [None] * len(paths)
    chunk = min(round_up(max(1, request_bytes), _BLOCK), PROBE_BUFFER_BYTES)
    ring = None
    opened: list[int] = []  # descriptors this call opened (closed at the end)
    probes: list[tuple[int, str, ShardFile | None]] = []  # (dir fd, probe name, file) per directory
    try:
        fds = []
        for path, fd in zip(paths, given):
            if fd is None:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
                opened.append(fd)
            fds.append(fd)
        resolved = [resolve_backend(backend, path, dir_fd=fd) for path, fd in zip(paths, fds)]
        ring = _Ring(chunk, max(1, min(workers, PROBE_BUFFER_BYTES // chunk)))
        for path, fd, kind in zip(paths, fds, resolved):
            name = f"{PROBE_PREFIX}speed-{os.getpid()}-{secrets.token_hex(4)}"
            probes.append((fd, name, None))  # listed first: removed even if opening fails half way
            probes[-1] = (fd, name, open_backend(kind, path / name, nbytes, create=True, dir_fd=fd))
        with IOQueue(workers=ring.slots, request_bytes=chunk) as io:
            fills = []
            for fd, name, file in probes:
                fills.append(_pass(io, ring, file, nbytes, rank=0, read=False))
                _drop_cache(name, fd)
            times: list[list[float]] = [[] for _ in probes]
            for rank in range(1, passes + 1):
                for k in range(len(probes)):
                    index = (k + rank) % len(probes)  # a rotating order: no drive always goes first
                    fd, name, file = probes[index]
                    times[index].append(_pass(io, ring, file, nbytes, rank=rank, read=True))
                    _drop_cache(name, fd)
    finally:
        if ring is not None:
            ring.close()
        for fd, name, file in probes:
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
        for fd in opened:
            os.close(fd)
    return [DriveSpeed(str(path), kind, nbytes, fill, tuple(t)) for path, kind, fill, t in zip(paths, resolved, fills, times)]


def measure_drive(
    directory: str | os.PathLike,
    *,
    backend: str = "auto",
    nbytes: int = PROBE_NBYTES,
    passes: int = PROBE_PASSES,
    request_bytes: int = 1 << 20,
    workers: int = 4,
    dir_fd: int | None = None,
) -> DriveSpeed:
    """One directory's :func:`measure_drives`.

    Raises
    ------
    ConfigError, DiskFullError, BackendError, StateDirError
        As :func:`measure_drives`.
    """
    return measure_drives([directory], backend=backend, nbytes=nbytes, passes=passes, request_bytes=request_bytes,
                          workers=workers, dir_fds=[dir_fd])[0]  # fmt: skip


def probe_drives(
    directories: Sequence[str | os.PathLike],
    *,
    backend: str = "auto",
    nbytes: int = PROBE_NBYTES,
    passes: int = PROBE_PASSES,
    dir_fds: Sequence[int | None] | None = None,
) -> list[float]:
    """Each directory's bandwidth for placement: its drive's figure, shared by the directories on that drive.

    A drive is a ``st_dev`` (a filesystem). It is measured once, through
    the first of its directories, and each of its ``n`` directories gets
    ``1/n`` of its figure: they share one drive's bandwidth, so two
    directories on one drive get equal shares of a state, and beside another
    drive together as much as one directory there would.

    Example
    -------
    >>> import os, tempfile
    >>> base = tempfile.mkdtemp(); a, b = os.path.join(base, "a"), os.path.join(base, "b")
    >>> os.mkdir(a); os.mkdir(b)
    >>> one, two = probe_drives([a, b], backend="buffered", nbytes=1 << 20, passes=1)
    >>> one == two > 0
    True

    Raises
    ------
    ConfigError, DiskFullError, BackendError, StateDirError
        As :func:`measure_drives`.
    """
    fds = list(dir_fds) if dir_fds is not None else [None] * len(directories)
    devices = [os.fstat(fd).st_dev if fd is not None else os.stat(d).st_dev for d, fd in zip(directories, fds)]
    first = {dev: devices.index(dev) for dev in dict.fromkeys(devices)}  # each drive's first directory
    speeds = measure_drives([directories[k] for k in first.values()], backend=backend, nbytes=nbytes, passes=passes,
                            dir_fds=[fds[k] for k in first.values()])  # fmt: skip
    figure = {dev: speed.bandwidth for dev, speed in zip(first, speeds)}
    return [figure[dev] / devices.count(dev) for dev in devices]


def probe_drive(directory: str | os.PathLike, backend: str = "auto", nbytes: int = PROBE_NBYTES) -> float:
    """Bytes per second ``directory``'s drive reads and writes back (:func:`measure_drive`'s bandwidth).

    Example
    -------
    >>> import tempfile
    >>> probe_drive(tempfile.mkdtemp(), "buffered", 1 << 20) > 0
    True
    """
    return measure_drive(directory, backend=backend, nbytes=nbytes).bandwidth


def _drop_cache(name: str, dir_fd: int) -> None:
    """Drop the probe's clean pages from the page cache, so the next reads come from the drive.

    ``direct`` never filled it; on tmpfs the pages are the file and stay
    (reading them is what that drive costs).
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(name, os.O_RDONLY | O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
