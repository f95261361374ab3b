"""A memory-mapped state file: simple, page-cache based.

Reads and writes are memory copies into and out of a shared mapping; the
kernel moves the pages. After each copy the range is dropped from this
process's page tables (``MADV_DONTNEED`` on a shared file mapping keeps the
data in the page cache) so the process's RSS does not grow with the state;
the page cache does, which is why ``direct`` exists.

Only two methods change the file through the mapping: :meth:`MmapFile._store`
(a copy into it) and :meth:`MmapFile._msync` (``msync``). Tests that simulate
power loss (:mod:`tierstore.testing.powercut`) wrap those two to see what
reached the page cache and what was made durable, as they see ``os.pwritev``
and ``os.fdatasync`` for the other backends.

Example
-------
>>> import tempfile, pathlib
>>> from tierstore.hostmem import HostBuffer
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> f = MmapFile(d / "s.bin", 4096, create=True)
>>> b = HostBuffer(4096); f.write_from(b.view, 0); f.read_into(b.view, 0); f.close(); b.close()
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import ClassVar

import torch

from ..errors import CorruptStateError
from .base import ShardFile, io_error, open_fd


class MmapFile(ShardFile):
    """The state file mapped ``MAP_SHARED``; copies go through ``torch`` (GIL released)."""

    name: ClassVar[str] = "mmap"

    def __init__(self, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False) -> None:
        if readonly:
            raise ValueError("the mmap backend maps files read-write; open read-only files with 'buffered'")
        super().__init__(path, nbytes, create=create)
        self._fd = open_fd(self.path, self.nbytes, create=create, flags=0)
        self._map: mmap.mmap | None = None
        if self.nbytes == 0:  # nothing to map (a model with nothing to train)
            self._bytes = None
            return
        try:
            self._map = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED)
        except (OSError, ValueError) as exc:
            os.close(self._fd)
            raise CorruptStateError(f"cannot map state file {self.path}: {exc}") from exc
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self.nbytes else None

    def _file_range(self, offset: int, length: int) -> torch.Tensor:
        return self._bytes[offset : offset + length]

    def _drop(self, offset: int, length: int) -> None:
        if self._map is None or length == 0:
            return
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def read_into(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        if os.fstat(self._fd).st_size < offset + len(buffer):
            # Touching a mapped page past EOF would kill the process with SIGBUS.
            raise CorruptStateError(
                f"state file {self.path} is truncated below offset {offset + len(buffer)}; "
                "restore the state directory from a checkpoint"
            )
        if not len(buffer):
            return
        target = torch.frombuffer(buffer, dtype=torch.uint8)
        target.copy_(self._file_range(offset, len(buffer)))
        self._drop(offset, len(buffer))

    def write_from(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        if not len(buffer):
            return
        self._store(offset, torch.frombuffer(buffer, dtype=torch.uint8))
        self._drop(offset, len(buffer))

    def _store(self, offset: int, source: torch.Tensor) -> None:
        """Copy ``source`` into the mapping at ``offset`` (dirty pages, not yet durable)."""
        self._file_range(offset, source.numel()).copy_(source)

    def sync(self) -> None:
        if self._map is None:
            return
        try:
            self._msync(0, self.nbytes)
        except OSError as exc:
            raise io_error(exc, self.path, "syncing", 0, self.nbytes) from exc

    def _msync(self, offset: int, length: int) -> None:
        """``msync(MS_SYNC)`` of ``[offset, offset + length)``: those pages are durable after it."""
        self._map.flush(offset, length)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._bytes = None
        if self._map is not None:
            self._map.close()
        os.close(self._fd)
