"""The contract every I/O backend fulfils: a preallocated file of shard extents.

A backend reads and writes whole byte ranges at given offsets of one file,
from and into page-aligned host buffers. It never decides *what* to read:
the store and the prefetch pipeline do that. Backends are measured against
each other by ``tierstore bench io`` and all pass the same conformance kit
(``tierstore.testing.backend``).

Example
-------
>>> import tempfile, pathlib
>>> from tierstore.backends import open_backend
>>> from tierstore.hostmem import HostBuffer
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> f = open_backend("mmap", d / "state.bin", 8192, create=True)
>>> buf = HostBuffer(4096); _ = buf.tensor.fill_(7)
>>> f.write_from(buf.view, 4096); f.sync()
>>> out = HostBuffer(4096); f.read_into(out.view, 4096); int(out.tensor[0])
7
>>> f.close(); buf.close(); out.close()
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from ..errors import BackendError, CorruptStateError, DiskFullError


class ShardFile(ABC):
    """A file of ``nbytes`` bytes addressed by offset.

    Parameters
    ----------
    path
        The file. With ``create=True`` it is created (or extended, sparse) to
        ``nbytes``; :meth:`allocate` then reserves the blocks of the ranges
        that will be written. Otherwise it must exist with at least
        ``nbytes`` bytes.
    nbytes
        The file's size in bytes (a multiple of 4096).
    create
        Create and preallocate the file.
    readonly
        Open an existing file for reading only (``tierstore verify`` and the
        other offline readers). Its size is not checked up front: a read past
        its end raises :class:`~tierstore.errors.CorruptStateError`, so a
        verifier can name each damaged shard.

    Raises
    ------
    DiskFullError
        If the blocks cannot be allocated.
    CorruptStateError
        If an existing file is shorter than ``nbytes`` or missing.
    BackendError
        If the filesystem does not support this backend.
    """

    name: ClassVar[str] = "abstract"
    #: True when several requests in flight on this file overlap usefully.
    parallel: ClassVar[bool] = True

    def __init__(self, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False) -> None:
        self.path = Path(path)
        self.nbytes = int(nbytes)
        self.readonly = readonly
        self.closed = False

    @abstractmethod
    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` with the file's bytes at ``[offset, offset + len(buffer))``."""

    @abstractmethod
    def write_from(self, buffer: memoryview, offset: int) -> None:
        """Write ``buffer`` to the file at ``offset``."""

    @abstractmethod
    def sync(self) -> None:
        """Return once every completed write is durable on the drive."""

    @abstractmethod
    def close(self) -> None:
        """Release the file; safe to call twice."""

    def allocate(self, offset: int, length: int) -> None:
        """Reserve the blocks of ``[offset, offset + length)`` so writes there cannot hit ENOSPC.

        Raises
        ------
        DiskFullError
            If the drive has no room for them.
        """
        preallocate(self._fd, self.path, offset, length)

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared helpers for backends built on a file descriptor ---------
    def _check_range(self, buffer: memoryview, offset: int) -> None:
        if offset < 0 or offset + len(buffer) > self.nbytes:
            raise BackendError(
                f"request [{offset}, {offset + len(buffer)}) lies outside {self.path} "
                f"({self.nbytes} bytes); this is a tierstore bug, please report it"
            )


def open_fd(path: Path, nbytes: int, *, create: bool, flags: int, readonly: bool = False) -> int:
    """Open ``path`` with ``flags``; create and preallocate it when asked.

    Translates the OS errors users can act on into tierstore errors.
    """
    if readonly and create:
        raise ValueError("a read-only state file cannot be created")
    try:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
        elif readonly:
            fd = os.open(path, os.O_RDONLY | flags)
        else:
            fd = os.open(path, os.O_RDWR | flags)
    except FileNotFoundError:
        raise CorruptStateError(
            f"state file {path} is missing; the state directory is incomplete: restore it "
            "from a checkpoint or start over with an empty state_dir"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EINVAL and flags & getattr(os, "O_DIRECT", 0):
            raise BackendError(
                f"the filesystem holding {path} does not support O_DIRECT (e.g. tmpfs on older kernels); "
                "use backend='mmap' or put state_dir on a local disk"
            ) from exc
        raise BackendError(f"cannot open state file {path}: {exc.strerror}") from exc
    try:
        if create:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        elif not readonly:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise CorruptStateError(
                    f"state file {path} is truncated: {size} bytes, expected {nbytes}; "
                    "restore the state directory from a checkpoint"
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def preallocate(fd: int, path: Path, offset: int, length: int) -> None:
    """Allocate blocks of ``[offset, offset + length)`` now so later writes cannot run out of space."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"no space left to allocate {length} bytes for {path}; free space on that "
                "drive or choose a state_dir on a larger one"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise BackendError(f"cannot allocate {length} bytes for {path}: {exc.strerror}") from exc
        # Filesystems without fallocate keep the file sparse; writes allocate as they go.


def io_error(exc: OSError, path: Path, what: str, offset: int, length: int) -> Exception:
    """Translate an OSError from a read/write into the tierstore error for it."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return DiskFullError(
            f"disk full while {what} {length} bytes at offset {offset} of {path}; free space on "
            "that drive; the last committed state is untouched"
        )
    return BackendError(f"{what} {length} bytes at offset {offset} of {path} failed: {exc.strerror}")
