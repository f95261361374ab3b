"""Files read and written without trusting what is at their path: no link followed, no FIFO read, writes atomic.

A checkpoint, a state directory or an output path may hold anything (a
link planted at the path, a FIFO, a device), so what is read is a regular
file opened with ``O_NOFOLLOW`` and bounded in size (:func:`read_regular`),
what is written replaces only a regular file, atomically
(:func:`write_output_file`), and an error says what was found in words
(:func:`file_kind`).

Example
-------
>>> import os, stat, tempfile
>>> file_kind(os.lstat(tempfile.mkdtemp()).st_mode), file_kind(stat.S_IFIFO)
('a directory', 'a FIFO')
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._state.statedir import fsync_dir
from ..backends.base import file_kind
from ..errors import CheckpointExistsError, DiskFullError, StateDirError

__all__ = ["file_kind", "read_regular", "fsync_file", "write_output_file"]


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path``: a regular file (never through a link, never a FIFO) of at most ``limit`` bytes.

    Raises
    ------
    OSError
        If it cannot be opened, is a link (``ELOOP``), is not a regular file
        or is larger than ``limit`` (``EFBIG``).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{path} holds {st.st_size} bytes, more than {limit}")
        chunks, left = [], limit + 1
        while left > 0 and (piece := os.read(fd, min(left, 1 << 20))):
            chunks.append(piece)
            left -= len(piece)
        if left <= 0:
            raise OSError(errno.EFBIG, f"{path} grew past {limit} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_output_file(path: str | os.PathLike, write: Callable[[Any], object], *, overwrite: bool) -> Path:
    """Write a file at ``path`` atomically: ``write(file)`` fills a new temporary beside it, which then replaces it.

    The temporary is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``,
    a random name in the target's directory), so a file or link planted
    under its name is never written through; it is synced and renamed over
    the target, so ``path`` holds the old file or the complete new one.
    ``overwrite`` replaces only a regular file: a directory, link, FIFO,
    socket or device at ``path`` is refused, never followed or truncated.

    Parameters
    ----------
    path
        The file to create (its directory must exist).
    write
        Called with the temporary opened for binary writing (e.g.
        ``lambda f: torch.save(obj, f)``).
    overwrite
        Replace an existing regular file at ``path``.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    CheckpointExistsError
        If ``path`` exists and ``overwrite`` is false, or it is not a regular file.
    StateDirError
        If the directory of ``path`` does not exist or cannot be written.
    DiskFullError
        If the drive fills up (the temporary is removed, ``path`` is untouched).

    Example
    -------
    >>> import tempfile
    >>> out = write_output_file(tempfile.mkdtemp() + "/x.bin", lambda f: f.write(b"hi"), overwrite=False)
    >>> out.read_bytes()
    b'hi'
    """
    path = Path(path).expanduser()

    def check() -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not overwrite:
            raise CheckpointExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it, or choose another path")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointExistsError(
                f"{str(path)!r} is {file_kind(st.st_mode)}, so it is not replaced (overwrite replaces only a regular "
                "file); remove it yourself or choose another path"
            )

    check()
    parent = path.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = parent / f".{path.name}.{secrets.token_hex(8)}.partial"
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as to any file the user writes
            break
        except FileExistsError:
            continue  # that name is taken (by a planted file or link too): draw another
        except OSError as exc:
            raise StateDirError(
                f"cannot create a file in {str(parent)!r} ({exc.strerror}); pass an output path in an existing, "
                "writable directory"
            ) from exc
    else:  # 100 random 64-bit names all taken: someone is planting them, or the names are not random
        raise StateDirError(
            f"cannot find a free temporary name in {str(parent)!r}: 100 random names "
            f"'.{path.name}.<random>.partial' were all taken (something else creates them); remove those files, "
            "or choose an output path in a directory only you can write"
        )
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        check()  # again: the target may have changed while the file was written
        os.replace(tmp, path)  # replaces a link itself, never its target
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"disk full while writing {str(path)!r}; free space on that drive or write elsewhere") from exc
        raise
    fsync_dir(parent)
    return path
