"""Positional I/O with ``O_DIRECT``: no page cache, so host RAM stays bounded.

Every request goes straight between the drive and the (page-aligned) arena
slot. Reads and writes are ``os.preadv``/``os.pwritev``, which release the GIL,
so a small thread pool keeps several requests in flight.
The same class without ``O_DIRECT`` is the ``buffered`` backend (page cache
used, for filesystems such as tmpfs that refuse ``O_DIRECT``).

Example
-------
>>> import tempfile, pathlib
>>> from tierstore._platform.hostmem import HostBuffer
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> f = BufferedFile(d / "s.bin", 4096, create=True)
>>> b = HostBuffer(4096); f.write_from(b.view, 0); f.read_into(b.view, 0); f.close(); b.close()
"""

from __future__ import annotations

import os
from typing import ClassVar

from ..errors import CorruptStateError
from .base import ShardFile, io_error

__all__ = ["BufferedFile", "DirectFile"]

O_DIRECT = getattr(os, "O_DIRECT", 0)


class BufferedFile(ShardFile):
    """``pread``/``pwrite`` through the page cache."""

    name: ClassVar[str] = "buffered"
    open_flags: ClassVar[int] = 0

    def read_into(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        done = 0
        total = len(buffer)
        while done < total:
            try:
                n = os.preadv(self.fd, [buffer[done:]], offset + done)
            except OSError as exc:
                raise io_error(exc, self.path, "reading", offset + done, total - done) from exc
            if n == 0:
                raise CorruptStateError(
                    f"state file {self.path} is truncated: no bytes at offset {offset + done} "
                    f"(expected {total - done} more); restore the state directory from a checkpoint"
                )
            done += n

    def write_from(self, buffer: memoryview, offset: int) -> None:
        self._check_range(buffer, offset)
        done = 0
        total = len(buffer)
        while done < total:
            try:
                n = os.pwritev(self.fd, [buffer[done:]], offset + done)
            except OSError as exc:
                raise io_error(exc, self.path, "writing", offset + done, total - done) from exc
            done += n

    def sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise io_error(exc, self.path, "syncing", 0, self.nbytes) from exc

    def close(self) -> None:
        self._close_fd()


class DirectFile(BufferedFile):
    """``pread``/``pwrite`` with ``O_DIRECT``; buffers and offsets must be 4 KiB aligned."""

    name: ClassVar[str] = "direct"
    open_flags: ClassVar[int] = O_DIRECT
