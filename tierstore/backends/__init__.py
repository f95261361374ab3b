"""I/O backends for the disk tier, and how to pick one.

``direct`` (``O_DIRECT`` positional I/O, no page cache), ``buffered`` (the same
through the page cache) and ``mmap`` (a shared mapping). ``auto`` picks
``direct`` where the filesystem supports it and falls back, with a logged
reason, to ``mmap`` where it does not (tmpfs on older kernels, some network
filesystems).

Example
-------
>>> sorted(BACKENDS)
['buffered', 'direct', 'mmap']
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from pathlib import Path

from ..errors import ConfigError
from .base import O_CLOEXEC, O_NOFOLLOW, ShardFile
from .direct import O_DIRECT, BufferedFile, DirectFile
from .mmap_file import MmapFile

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[ShardFile]] = {
    "direct": DirectFile,
    "buffered": BufferedFile,
    "mmap": MmapFile,
}
AUTO_PREFERENCE = ("direct", "mmap")


PROBE_PREFIX = ".tierstore-odirect-"  # the O_DIRECT probe's file, removed at once
PROBE_NBYTES = 4096  # one page: the alignment O_DIRECT asks of buffers, offsets and lengths


def supports_direct_io(directory: Path | str, *, dir_fd: int | None = None) -> bool:
    """True when files in ``directory`` can be written and read back with ``O_DIRECT``.

    The probe creates a file (exclusively, never through a link), writes one
    aligned page into it with ``O_DIRECT``, reads it back and compares: some
    filesystems accept the flag at open and refuse (``EINVAL``) or mishandle
    only the I/O. The file is removed whatever happens. ``dir_fd``: the
    directory's descriptor, used instead of its path.

    Example
    -------
    >>> import tempfile
    >>> isinstance(supports_direct_io(tempfile.mkdtemp()), bool)
    True
    """
    if not O_DIRECT:
        return False
    own = dir_fd is None
    try:
        fd_dir = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC) if own else dir_fd
    except OSError:
        return False
    name = f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=fd_dir)
        except OSError:
            return False
        os.close(fd)
        try:
            return _direct_round_trip(name, fd_dir)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd_dir)
    finally:
        if own:
            os.close(fd_dir)


def _direct_round_trip(name: str, dir_fd: int) -> bool:
    """Write a page with O_DIRECT into ``name`` and read it back; True when it came back intact."""
    out = mmap.mmap(-1, PROBE_NBYTES)  # anonymous mappings are page aligned, as O_DIRECT needs
    back = mmap.mmap(-1, PROBE_NBYTES)
    try:
        out.write(bytes(range(256)) * (PROBE_NBYTES // 256))
        try:
            fd = os.open(name, os.O_RDWR | O_DIRECT | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            if os.pwritev(fd, [out], 0) != PROBE_NBYTES:
                return False
            if os.preadv(fd, [back], 0) != PROBE_NBYTES:
                return False
        except OSError:  # EINVAL: the filesystem took the flag at open but refuses the I/O
            return False
        finally:
            os.close(fd)
        return out[:] == back[:]
    finally:
        out.close()
        back.close()


def resolve_backend(name: str, directory: Path | str, *, dir_fd: int | None = None) -> str:
    """Turn ``"auto"`` into a concrete backend name for ``directory`` (its descriptor ``dir_fd`` when given).

    Raises
    ------
    ConfigError
        If ``name`` is not ``"auto"`` or one of :data:`BACKENDS`.
    """
    if name != "auto":
        if name not in BACKENDS:
            raise ConfigError(f"backend={name!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}")
        return name
    if supports_direct_io(directory, dir_fd=dir_fd):
        return "direct"
    log.info("O_DIRECT is not supported under %s; backend='auto' uses 'mmap'", directory)
    return "mmap"


def open_backend(
    name: str, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False, dir_fd: int | None = None
) -> ShardFile:
    """Open ``path`` with the backend called ``name`` (not ``"auto"``); see :class:`ShardFile`.

    ``dir_fd``: the descriptor of the directory holding it (``path.name`` is
    opened relative to it).
    """
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}") from None
    if readonly:
        return cls(path, nbytes, create=False, readonly=True, dir_fd=dir_fd)
    return cls(path, nbytes, create=create, dir_fd=dir_fd)


__all__ = ["BACKENDS", "ShardFile", "open_backend", "resolve_backend", "supports_direct_io"]
