"""The chunk files of an uncompressed zarr v3 float32 array, read and written in place.

A checkpoint array (:mod:`tierstore.checkpoint`) stores its chunks with the
``bytes`` codec (little endian), optionally followed by ``crc32c`` (four
bytes of CRC32C appended): a chunk file is the chunk's raw bytes. Going
through zarr for them costs RAM outside ``ram_budget``: zarr encodes a copy
of every chunk it writes and reads every chunk into a new buffer on its
worker threads, and glibc keeps one freed chunk per thread in that thread's
malloc arena (up to ``min(32, cores + 4)`` chunks of 16 MiB). So tierstore
writes a chunk file from, and reads it into, the caller's buffer (the
optimizer's arena) with ``pwrite``/``preadv``; zarr still writes and reads the
metadata, and plain zarr reads the files (they are exactly what zarr writes).

A chunk file is opened only as a regular file and never through a symbolic
link at its own name (:func:`~tierstore.backends.base.open_regular`: a link,
FIFO or device planted there is refused at once, never written through or
waited on).

Edge chunks are stored whole, padded with the fill value 0 as zarr pads them
(here a sparse hole). A reader that wants only part of a chunk streams it
through a 1 MiB scratch buffer, verifying its checksums on the way. Files
written or read are dropped from the page cache once synced or read: a
checkpoint is larger than RAM, and streaming it must not evict the rest.

Example
-------
>>> import tempfile, numpy as np
>>> from pathlib import Path
>>> files = ChunkFiles(Path(tempfile.mkdtemp()), chunk_numel=2048, crc32c=True, key=lambda i: f"c/{i}")
>>> data = np.arange(1024, dtype=np.float32)  # an edge chunk: half of the chunk
>>> files.write(0, memoryview(data).cast("B"))
>>> (files.directory / "c" / "0").stat().st_size  # 2048 elements and the CRC32C
8196
>>> back = np.empty(1024, dtype=np.float32)
>>> files.read(0, memoryview(back).cast("B"), valid_nbytes=data.nbytes)
>>> bool((back == data).all())
True
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.base import open_regular
from .integrity import CHECKSUM_BLOCK, BlockDigests

ITEMSIZE = 4  # float32
CRC_NBYTES = 4
SCRATCH_NBYTES = CHECKSUM_BLOCK  # 1 MiB: one checksum block per piece of a partly wanted chunk
_ZEROS = bytes(64 << 10)  # the padding of an edge chunk, fed to the CRC in 64 KiB pieces


class ChunkCorrupt(ValueError):
    """A chunk file with the wrong size or a CRC32C that does not match (the caller names the chunk)."""


class ChunkFiles:
    """Where the chunk files of one 1-D float32 array are, and how they are encoded.

    Parameters
    ----------
    directory
        The array's directory (the one holding its ``zarr.json``).
    chunk_numel
        Elements per chunk (edge chunks are stored this long too).
    crc32c
        The ``crc32c`` codec follows ``bytes``: every file ends with the
        CRC32C of the chunk (little endian).
    key
        The chunk key encoding: chunk index -> path relative to ``directory``.
    """

    def __init__(self, directory: Path, *, chunk_numel: int, crc32c: bool, key: Callable[[int], str]) -> None:
        self.directory = Path(directory)
        self.chunk_nbytes = chunk_numel * ITEMSIZE
        self.crc32c = bool(crc32c)
        self._key = key
        self._made: set[Path] = set()

    @classmethod
    def of(cls, directory: Path, array: Any) -> ChunkFiles | None:
        """The chunk files of a zarr array, or ``None`` when its encoding is not plain bytes (+ crc32c)."""
        from zarr.codecs import BytesCodec, Crc32cCodec
        from zarr.core.metadata import ArrayV3Metadata

        meta = array.metadata
        if not isinstance(meta, ArrayV3Metadata) or len(array.shape) != 1 or array.dtype != np.dtype("<f4"):
            return None
        codecs = tuple(meta.codecs)
        if not codecs or not isinstance(codecs[0], BytesCodec) or getattr(codecs[0].endian, "value", None) != "little":
            return None
        rest = codecs[1:]
        if rest and not (len(rest) == 1 and isinstance(rest[0], Crc32cCodec)):
            return None
        return cls(directory, chunk_numel=array.chunks[0], crc32c=len(codecs) == 2, key=lambda i: meta.encode_chunk_key((i,)))

    @property
    def file_nbytes(self) -> int:
        return self.chunk_nbytes + (CRC_NBYTES if self.crc32c else 0)

    def path(self, index: int) -> Path:
        """The file of chunk ``index``."""
        return self.directory / self._key(index)

    # -- writing ----------------------------------------------------------------
    def write(self, index: int, data: memoryview) -> None:
        """Store ``data`` (at most one chunk of bytes) as chunk ``index``, zero-padded to a whole chunk.

        Raises
        ------
        OSError
            As the filesystem raises it (``ENOSPC`` when the drive is full);
            :class:`~tierstore.errors.CorruptStateError` (an ``OSError``) when
            something other than a regular file stands at the chunk's name.
        """
        data = data.cast("B") if data.format != "B" else data
        if len(data) > self.chunk_nbytes:
            raise ValueError(f"{len(data)} bytes do not fit a chunk of {self.chunk_nbytes} bytes")
        path = self.path(index)
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="chunk file")
        try:
            _pwrite_all(fd, data, 0)
            if len(data) < self.chunk_nbytes:
                os.ftruncate(fd, self.chunk_nbytes)  # the padding: a hole that reads as zeros
            if self.crc32c:
                crc = _crc_extend(_crc(data), self.chunk_nbytes - len(data))
                _pwrite_all(fd, memoryview(crc.to_bytes(CRC_NBYTES, "little")), self.chunk_nbytes)
        finally:
            os.close(fd)

    # -- reading ----------------------------------------------------------------
    def read(
        self,
        index: int,
        out: memoryview,
        *,
        valid_nbytes: int,
        offset: int = 0,
        digests: BlockDigests | None = None,
        scratch: memoryview | None = None,
    ) -> None:
        """Read bytes ``[offset, offset + len(out))`` of chunk ``index`` into ``out``, verifying its CRC32C.

        ``valid_nbytes``: the chunk's bytes inside the array (less than a
        chunk for the edge chunk); ``digests`` (over those bytes) is filled
        on the way. When ``out`` is not the whole valid part, the chunk
        streams through ``scratch`` (at least :data:`SCRATCH_NBYTES`).

        Raises
        ------
        ChunkCorrupt
            If the file has the wrong size or fails its CRC32C.
        OSError
            If it cannot be read (``FileNotFoundError`` when it is missing;
            :class:`~tierstore.errors.CorruptStateError` when it is a link,
            a FIFO, a device or a directory).
        """
        out = out.cast("B") if out.format != "B" else out
        if not 0 <= offset <= offset + len(out) <= valid_nbytes <= self.chunk_nbytes:
            raise ValueError(f"bytes {offset}..{offset + len(out)} are not inside the chunk's {valid_nbytes} valid bytes")
        whole = offset == 0 and len(out) == valid_nbytes
        if not whole and (scratch is None or len(scratch) < SCRATCH_NBYTES):
            raise ValueError(f"reading part of a chunk needs a scratch buffer of {SCRATCH_NBYTES} bytes")
        fd = open_regular(self.path(index), os.O_RDONLY, what="chunk file")
        try:
            size = os.fstat(fd).st_size
            if size != self.file_nbytes:
                raise ChunkCorrupt(f"the file holds {size} bytes, a chunk is {self.file_nbytes}")
            crc = 0
            if whole:
                _pread_all(fd, out, 0)
                if digests is not None:
                    digests.update(0, out)
                if self.crc32c:
                    crc = _crc(out)
                done = valid_nbytes
            else:
                done = 0
                while done < valid_nbytes:
                    n = min(SCRATCH_NBYTES, valid_nbytes - done)
                    piece = scratch[:n]
                    _pread_all(fd, piece, done)
                    if digests is not None:
                        digests.update(done, piece)
                    if self.crc32c:
                        crc = _crc(piece, crc)
                    a, b = max(done, offset), min(done + n, offset + len(out))
                    if a < b:
                        out[a - offset : b - offset] = piece[a - done : b - done]
                    done += n
            if self.crc32c:
                crc = self._crc_of_padding(fd, done, crc, scratch)
                stored = bytearray(CRC_NBYTES)
                _pread_all(fd, memoryview(stored), self.chunk_nbytes)
                if int.from_bytes(stored, "little") != crc:
                    raise ChunkCorrupt(
                        f"its CRC32C does not match: stored {bytes(stored).hex()}, computed "
                        f"{crc.to_bytes(CRC_NBYTES, 'little').hex()}"
                    )
            _drop_cache(fd)
        finally:
            os.close(fd)

    def _crc_of_padding(self, fd: int, start: int, crc: int, scratch: memoryview | None) -> int:
        """Extend ``crc`` over the chunk's bytes ``[start, chunk_nbytes)`` as stored (an edge chunk's padding)."""
        buffer = scratch if scratch is not None else memoryview(bytearray(len(_ZEROS)))
        while start < self.chunk_nbytes:
            n = min(len(buffer), self.chunk_nbytes - start)
            _pread_all(fd, buffer[:n], start)
            crc = _crc(buffer[:n], crc)
            start += n
        return crc


def sync_and_drop(path: Path) -> None:
    """``fsync`` a written file, then drop its (now clean) pages from the page cache."""
    fd = open_regular(Path(path), os.O_RDONLY, what="chunk file")
    try:
        os.fsync(fd)
        _drop_cache(fd)
    finally:
        os.close(fd)


def _drop_cache(fd: int) -> None:
    with contextlib.suppress(AttributeError, OSError):  # advice only: a filesystem may not take it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:  # pragma: no cover - the Linux kernel raises instead
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        done += n


def _pread_all(fd: int, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise ChunkCorrupt(f"the file ends at byte {offset + done}, {len(out) - done} bytes early")
        done += n


def _crc(data: memoryview, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing ``crc`` (google_crc32c, which zarr's codec uses: no copy)."""
    import google_crc32c

    if not len(data):
        return crc
    return google_crc32c.extend(crc, np.frombuffer(data, dtype=np.uint8))


def _crc_extend(crc: int, zeros: int) -> int:
    """Extend ``crc`` over ``zeros`` zero bytes."""
    import google_crc32c

    while zeros > 0:
        n = min(zeros, len(_ZEROS))
        crc = google_crc32c.extend(crc, _ZEROS[:n])
        zeros -= n
    return crc
