"""Files written so that a crash leaves the old or the new content, and directory entries made durable.

Names are resolved relative to a directory's descriptor when one is given;
nothing is written through a link. A write that fails raises the error
:func:`write_error` chooses: a :class:`~tierstore.errors.DiskFullError` for a
full drive, else a :class:`~tierstore.errors.StateDirError` that says why.

Example
-------
>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
>>> atomic_write(p, b"[1]"); atomic_write(p, b"[2]"); p.read_bytes()
b'[2]'
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .._platform.faults import crash_point
from ..backends.base import O_CLOEXEC, O_NOFOLLOW
from ..errors import DiskFullError, StateDirError


def write_error(exc: OSError, path: Path) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"disk full while writing {path}; free space on that drive. The last committed "
            "state is untouched and resumable"
        )
    if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ELOOP):
        return StateDirError(f"cannot write {path}: {exc.strerror}; something else stands at that name: remove it")
    return StateDirError(f"cannot write {path}: {exc.strerror}; check the directory's permissions and its drive")


def write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


def atomic_write(path: Path, payload: bytes, *, dir_fd: int | None = None, crash_points: bool = True) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves the old or the new content.

    ``dir_fd``: the descriptor of the directory holding ``path`` (names are
    resolved relative to it). The temporary ``.NAME.tmp`` is created
    exclusively after removing whatever a crash (or anyone) left under that
    name; nothing is written through a link. ``crash_points=False`` passes
    the manifest's crash points by (a member record is written with this).

    Raises
    ------
    DiskFullError
        If the drive is full; the old file is left as it was.
    StateDirError
        If the file cannot be written (naming why and what to do).

    Example
    -------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
    >>> atomic_write(p, b"{}"); p.read_bytes()
    b'{}'
    """
    path = Path(path)
    tmp = f".{path.name}.tmp"
    own = dir_fd is None
    fd_dir = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC) if own else dir_fd
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd_dir)  # unlink never follows a link: a planted one just goes
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644, dir_fd=fd_dir)
        try:
            write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        if crash_points:
            crash_point("manifest-tmp")
        os.replace(tmp, path.name, src_dir_fd=fd_dir, dst_dir_fd=fd_dir)
        if crash_points:
            crash_point("manifest-renamed")
        os.fsync(fd_dir)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd_dir)
        raise write_error(exc, path) from exc
    finally:
        if own:
            os.close(fd_dir)


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
