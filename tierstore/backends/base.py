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
>>> from tierstore._platform.hostmem import HostBuffer
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
import fcntl
import os
import stat
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from ..errors import BackendError, CorruptStateError, DiskFullError, TierstoreError

__all__ = ["ShardFile", "open_regular", "open_fd", "preallocate", "io_error"]

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    dir_fd
        A descriptor of the directory holding the file: ``path.name`` is then
        opened relative to it (the state directory's own descriptor, so a
        renamed or replaced directory path cannot redirect the open).
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
        If an existing file is shorter than ``nbytes`` or missing, or is not
        a regular file (a symlink, a FIFO, a device, a directory: never
        followed or read).
    BackendError
        If the filesystem does not support this backend.
    """

    name: ClassVar[str] = "abstract"
    #: True when several requests in flight on this file overlap usefully.
    parallel: ClassVar[bool] = True
    #: Flags added to the open (``O_DIRECT`` for the ``direct`` backend).
    open_flags: ClassVar[int] = 0

    def __init__(
        self, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False, dir_fd: int | None = None
    ) -> None:
        self.path = Path(path)
        self.nbytes = int(nbytes)
        self.readonly = readonly
        self.closed = True  # until the file is open: close() has nothing to release
        # The base class owns the descriptor, so everything it does (allocate) works for
        # every backend, whatever a subclass names its own attributes.
        self.fd = open_fd(self.path, self.nbytes, create=create, flags=self.open_flags, readonly=readonly, dir_fd=dir_fd)
        self.closed = False

    @property
    def _fd(self) -> int:
        """The descriptor under its earlier name (the power-cut recorder and old tests use it)."""
        return self.fd

    def _close_fd(self) -> None:
        """Close the descriptor once (for subclasses' :meth:`close`)."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)

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
        preallocate(self.fd, self.path, offset, length)

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


def open_regular(
    path: Path,
    flags: int,
    *,
    dir_fd: int | None = None,
    mode: int = 0o644,
    what: str = "state file",
    error: type[TierstoreError] = CorruptStateError,
) -> int:
    """Open a file of a state directory: never through a symlink, only a regular file.

    With ``dir_fd`` the file's name (``path.name``) is opened relative to that
    directory descriptor; otherwise ``path`` itself, still without following a
    symlink at its last component. The open never blocks (``O_NONBLOCK``, so a
    FIFO planted in a file's place is refused at once instead of hanging), and
    ``fstat`` then says whether it is a regular file. ``FileNotFoundError`` is
    raised as it is (callers say what a missing file means).

    Raises
    ------
    error
        (``CorruptStateError`` unless told) naming ``path``, what is there
        instead of a regular file, and the fix.

    Example
    -------
    >>> import os, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); os.symlink("/etc/passwd", d / "link")
    >>> open_regular(d / "link", os.O_RDONLY)
    Traceback (most recent call last):
    ...
    tierstore.errors.CorruptStateError: state file .../link is a symbolic link; ...
    """
    name: str | Path = path.name if dir_fd is not None else path
    try:
        fd = os.open(name, flags | O_NOFOLLOW | os.O_NONBLOCK | O_CLOEXEC, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        kind = _kind_of(path, dir_fd) if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK) else None
        if kind is None:
            raise
        raise _not_regular(path, kind, what, error) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, file_kind(st.st_mode), what, error)
        # Regular files ignore O_NONBLOCK; clear it anyway so the descriptor is an ordinary one.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words, for errors about files that are not what was expected.

    The one wording every message about a file's kind uses (state files, checkpoints, output paths).

    Example
    -------
    >>> import stat
    >>> file_kind(stat.S_IFIFO), file_kind(stat.S_IFREG)
    ('a FIFO', 'a regular file')
    """
    for test, text in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return text
    return "not a regular file"


def _kind_of(path: Path, dir_fd: int | None) -> str:
    try:
        st = os.stat(path.name if dir_fd is not None else path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "not a regular file"
    return file_kind(st.st_mode)


def _not_regular(path: Path, kind: str, what: str, error: type[TierstoreError]) -> TierstoreError:
    return error(
        f"{what} {path} is {kind}; tierstore reads and writes only regular files inside a state "
        "directory and never follows symbolic links there (a link or pipe planted in a file's "
        "place must not redirect or hang it). Remove it; if it stood in for state, restore the "
        "state directory from a checkpoint"
    )


def open_fd(
    path: Path, nbytes: int, *, create: bool, flags: int, readonly: bool = False, dir_fd: int | None = None
) -> int:
    """Open ``path`` (relative to ``dir_fd`` when given) with ``flags``; create and size it when asked.

    Only a regular file is opened, never through a symlink (:func:`open_regular`).
    Translates the OS errors users can act on into tierstore errors.
    """
    if readonly and create:
        raise ValueError("a read-only state file cannot be created")
    if create:
        access = os.O_RDWR | os.O_CREAT
    elif readonly:
        access = os.O_RDONLY
    else:
        access = os.O_RDWR
    try:
        fd = open_regular(path, access | flags, dir_fd=dir_fd)
    except TierstoreError:
        raise
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
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, TierstoreError):
            raise
        raise io_error(exc, path, "sizing", 0, nbytes) from exc
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
