"""How fast a drive moves a streamed shard: write bytes, sync them, read them back, timed.

A state over several drives places its shards by each drive's bandwidth
(:func:`tierstore._storage.placement.place`). The figure that matters is
what a streamed step asks of a drive for each byte: write it, then read it
back (the next step). :func:`measure_drive` does exactly that once, quickly
(tens of MiB, well under a second on an NVMe drive), with the backend the
state will use, through an :class:`~tierstore._storage.transfer.IOQueue` like
the store's: a probe file (named with the O_DIRECT probe's prefix, so a
leftover from a killed probe is never taken for a foreign file) is written,
synced, dropped from the page cache and read back, then removed.

The result is a resource, never identity: it decides where a new state's
shards go, and the placement (not the figure) is what the manifest records.
A probe is noisy (other work on the drive, a drive's write cache); a caller
that knows better passes its own figures (``tierstore bench io`` measures
them at length).

Example
-------
>>> import tempfile
>>> speed = measure_drive(tempfile.mkdtemp(), backend="buffered", nbytes=1 << 20)
>>> speed.nbytes, speed.bandwidth > 0
(1048576, True)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .._layout.layout import round_up
from .._platform.hostmem import HostBuffer
from ..backends import PROBE_PREFIX, open_backend, resolve_backend
from ..backends.base import O_CLOEXEC
from ..errors import ConfigError
from .integrity import CHECKSUM_BLOCK
from .transfer import IOQueue

__all__ = ["DriveSpeed", "PROBE_NBYTES", "measure_drive", "probe_drive", "probe_nbytes"]

#: What a placement probe moves per drive by default: 32 MiB (about 20 ms each way on a
#: 2 GB/s NVMe drive, half a second on a 100 MB/s disk).
PROBE_NBYTES = 32 << 20
_MIN_PROBE = 1 << 20  # 1 MiB: one checksum block, one request


@dataclass(frozen=True)
class DriveSpeed:
    """One drive's measured write-then-read speed.

    Attributes
    ----------
    path
        The directory probed.
    backend
        The backend the probe used (``"auto"`` resolved).
    nbytes
        Bytes written, then read back.
    write_seconds, read_seconds
        The write (its requests and the sync that makes them durable) and the read back.
    """

    path: str
    backend: str
    nbytes: int
    write_seconds: float
    read_seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second to write a byte and read it back: what placement weighs drives by."""
        return self.nbytes / max(self.write_seconds + self.read_seconds, 1e-9)

    @property
    def write_bandwidth(self) -> float:
        """Bytes per second written (sync included)."""
        return self.nbytes / max(self.write_seconds, 1e-9)

    @property
    def read_bandwidth(self) -> float:
        """Bytes per second read back."""
        return self.nbytes / max(self.read_seconds, 1e-9)


def probe_nbytes(state_nbytes: int, drives: int) -> int:
    """How much a placement probe moves per drive for a state of ``state_nbytes`` over ``drives``.

    No more than each drive's share of the state (a small state's placement
    barely matters, and its probe must cost little), at least 1 MiB, at most
    :data:`PROBE_NBYTES`, in whole 1 MiB blocks.

    Example
    -------
    >>> probe_nbytes(10 << 30, 2) >> 20, probe_nbytes(100, 2) >> 20
    (32, 1)
    """
    share = state_nbytes // max(1, drives)
    return min(PROBE_NBYTES, max(_MIN_PROBE, round_up(share, CHECKSUM_BLOCK)))


def measure_drive(
    directory: str | os.PathLike,
    *,
    backend: str = "auto",
    nbytes: int = PROBE_NBYTES,
    request_bytes: int = 1 << 20,
    workers: int = 4,
    dir_fd: int | None = None,
) -> DriveSpeed:
    """Write ``nbytes`` into a probe file in ``directory``, sync, read them back; time both.

    ``dir_fd``: the directory's open descriptor (the probe file is made
    relative to it). The file is removed whatever happens.

    Raises
    ------
    ConfigError
        If ``nbytes`` is not a positive multiple of 4096, or ``backend`` is unknown.
    DiskFullError, BackendError, StateDirError
        If the drive cannot hold or move the probe's bytes.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 4096:
        raise ConfigError(f"nbytes={nbytes!r} must be a positive multiple of 4096, e.g. 32 << 20")
    path = Path(directory)
    own = dir_fd is None
    fd_dir = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC) if own else dir_fd
    name = f"{PROBE_PREFIX}speed-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        resolved = resolve_backend(backend, path, dir_fd=fd_dir)
        buffer = HostBuffer(nbytes, pin=False)
        try:
            # Bytes that do not compress or deduplicate: a drive that does either must not look faster.
            buffer.tensor.copy_(_pattern(nbytes))
            file = open_backend(resolved, path / name, nbytes, create=True, dir_fd=fd_dir)
            try:
                with IOQueue(workers=workers, request_bytes=round_up(request_bytes, 4096)) as io:
                    t0 = time.perf_counter()
                    io.write(file, buffer.view, 0).wait()
                    file.sync()
                    t1 = time.perf_counter()
                    _drop_cache(name, fd_dir)
                    t2 = time.perf_counter()
                    io.read(file, buffer.view, 0).wait()
                    t3 = time.perf_counter()
            finally:
                file.close()
        finally:
            buffer.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd_dir)
        if own:
            os.close(fd_dir)
    return DriveSpeed(str(path), resolved, nbytes, t1 - t0, t3 - t2)


def probe_drive(directory: str | os.PathLike, backend: str = "auto", nbytes: int = PROBE_NBYTES) -> float:
    """Bytes per second to write a byte to ``directory``'s drive and read it back (:func:`measure_drive`).

    Example
    -------
    >>> import tempfile
    >>> probe_drive(tempfile.mkdtemp(), "buffered", 1 << 20) > 0
    True
    """
    return measure_drive(directory, backend=backend, nbytes=nbytes).bandwidth


def _pattern(nbytes: int):  # noqa: ANN202 - a uint8 tensor
    import torch

    gen = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _drop_cache(name: str, dir_fd: int) -> None:
    """Drop the probe's clean pages from the page cache, so the read back comes from the drive.

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
