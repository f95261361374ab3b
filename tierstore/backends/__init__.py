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

import logging
import os
import tempfile
from pathlib import Path

from ..errors import ConfigError
from .base import ShardFile
from .direct import O_DIRECT, BufferedFile, DirectFile
from .mmap_file import MmapFile

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[ShardFile]] = {
    "direct": DirectFile,
    "buffered": BufferedFile,
    "mmap": MmapFile,
}
AUTO_PREFERENCE = ("direct", "mmap")


def supports_direct_io(directory: Path | str) -> bool:
    """True when files in ``directory`` can be opened with ``O_DIRECT``."""
    if not O_DIRECT:
        return False
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".tierstore-odirect-")
    except OSError:
        return False
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | O_DIRECT)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        os.unlink(name)


def resolve_backend(name: str, directory: Path | str) -> str:
    """Turn ``"auto"`` into a concrete backend name for ``directory``.

    Raises
    ------
    ConfigError
        If ``name`` is not ``"auto"`` or one of :data:`BACKENDS`.
    """
    if name != "auto":
        if name not in BACKENDS:
            raise ConfigError(f"backend={name!r} is unknown; choose 'auto' or one of {sorted(BACKENDS)}")
        return name
    if supports_direct_io(directory):
        return "direct"
    log.info("O_DIRECT is not supported under %s; backend='auto' uses 'mmap'", directory)
    return "mmap"


def open_backend(name: str, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False) -> ShardFile:
    """Open ``path`` with the backend called ``name`` (not ``"auto"``); see :class:`ShardFile`."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"backend={name!r} is unknown; choose one of {sorted(BACKENDS)}") from None
    if readonly:
        return cls(path, nbytes, create=False, readonly=True)
    return cls(path, nbytes, create=create)


__all__ = ["BACKENDS", "ShardFile", "open_backend", "resolve_backend", "supports_direct_io"]
