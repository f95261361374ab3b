"""A memory-mapped state file: simple, page-cache based.

Reads and writes are memory copies into and out of a shared mapping; the
kernel moves the pages. Mapped file pages count in the process's RSS while
they are mapped, so the RSS a request in flight adds is kept small:

- each request first asks the Linux kernel to read its range into the page cache
  (``MADV_WILLNEED``). Otherwise the first fault in an uncached range reads
  around it with the device's read-ahead window (8 MiB on the reference
  machine) into large folios and maps far more than the request: 8 workers
  with 1 MiB requests held 8 MiB of file pages at peak (median of 6, up to
  16 MiB), 2 MiB with it. The price, measured interleaved on the reference
  machine's virtual disk: cold reads 0.6x and writes 0.75x as fast (the
  bound on RAM wins; ``direct`` is the fast backend);
- each request is copied in pieces of :data:`COPY_STEP_BYTES`, every piece
  dropped from this process's page tables right after its copy
  (``MADV_DONTNEED`` on a shared file mapping keeps the data in the page
  cache), so large ``request_bytes`` do not map more: 8 workers with 8 MiB
  requests mapped 52 MiB at peak when whole requests were copied, 2 MiB in
  pieces.

The page cache still grows with the state, which is why ``direct`` exists.

Only two methods change the file through the mapping: :meth:`MmapFile._store`
(a copy into it) and :meth:`MmapFile._msync` (``msync``). Tests that simulate
power loss (:mod:`tierstore.testing.powercut`) wrap those two to see what
reached the page cache and what was made durable, as they see ``os.pwritev``
and ``os.fdatasync`` for the other backends.

Example
-------
>>> import tempfile, pathlib
>>> from tierstore._platform.hostmem import HostBuffer
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
from .base import ShardFile, io_error

__all__ = ["MmapFile"]

COPY_STEP_BYTES = 256 << 10  # 256 KiB: the most RSS one request in flight maps at a time


class MmapFile(ShardFile):
    """The state file mapped ``MAP_SHARED``; copies go through ``torch`` (GIL released)."""

    name: ClassVar[str] = "mmap"

    def __init__(
        self, path: Path | str, nbytes: int, *, create: bool, readonly: bool = False, dir_fd: int | None = None
    ) -> None:
        if readonly:
            raise ValueError("the mmap backend maps files read-write; open read-only files with 'buffered'")
        self._map: mmap.mmap | None = None
        self._bytes = None
        super().__init__(path, nbytes, create=create, dir_fd=dir_fd)
        if self.nbytes == 0:  # nothing to map (a model with nothing to train)
            return
        try:
            self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        except (OSError, ValueError) as exc:
            self._close_fd()
            raise CorruptStateError(f"cannot map state file {self.path}: {exc}") from exc
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self.nbytes else None

    def _file_range(self, offset: int, length: int) -> torch.Tensor:
        return self._bytes[offset : offset + length]

    def _prefetch(self, offset: int, length: int) -> None:
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)

    def _drop(self, offset: int, length: int) -> None:
        if self._map is None or length == 0:
            return
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def read_into(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        if os.fstat(self.fd).st_size < offset + len(buffer):
            # Touching a mapped page past EOF would kill the process with SIGBUS.
            raise CorruptStateError(
                f"state file {self.path} is truncated below offset {offset + len(buffer)}; "
                "restore the state directory from a checkpoint"
            )
        if not len(buffer):
            return
        target = torch.frombuffer(buffer, dtype=torch.uint8)
        self._prefetch(offset, len(buffer))
        for start in range(0, len(buffer), COPY_STEP_BYTES):
            end = min(start + COPY_STEP_BYTES, len(buffer))
            target[start:end].copy_(self._file_range(offset + start, end - start))
            self._drop(offset + start, end - start)

    def write_from(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        if not len(buffer):
            return
        source = torch.frombuffer(buffer, dtype=torch.uint8)
        self._prefetch(offset, len(buffer))
        for start in range(0, len(buffer), COPY_STEP_BYTES):
            end = min(start + COPY_STEP_BYTES, len(buffer))
            self._store(offset + start, source[start:end])
            self._drop(offset + start, end - start)

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
        self._bytes = None
        if self._map is not None:
            self._map.close()
        self._close_fd()
