"""The host memory a DCP save or load through ``TieredStateful`` uses: few fixed buffers, no copy of the state.

**Save.** DCP's ``FileSystemWriter`` asks for one block at a time, writes it,
and then asks for the next; with ``single_file_per_rank=True`` (its default) it
also keeps a reference to the last tensor written under every key until the
rank's file is complete (a dict built for its safetensors option), and it
clones a tensor whose storage is larger than the tensor. A fresh tensor per
block therefore stayed alive until the end: the whole state. :class:`BlockRing`
hands out exact-size tensors (``torch.frombuffer`` over part of a buffer, so
torch never clones) over one reusable buffer per writer thread: a block's
bytes are reused only once the thread that asked for it asks for the next,
when the writer has written it. A writer that resolves blocks ahead of
writing them (torch's ``_OverlappingCpuLoader``, used on a GPU host with
``thread_count=1``: up to twice ``per_thread_copy_ahead`` bytes in flight)
gets that many bytes of buffers more, with one warning naming the fix
(``per_thread_copy_ahead=0``: tierstore's blocks are in host memory already).

**Load.** DCP's ``FileSystemReader`` copies every piece it reads into the
tensors the state dict holds, and ``TieredStateful.load_state_dict`` streams
them into the shards only afterwards, so the values need a home the size of
the rank's state: :class:`StagingFile`, an unlinked file that the reader's
copies write into (``pwrite``, through tensors that stand for parts of it,
:class:`tierstore.dcp._staging.Staged`) and the fill reads back (``pread``). No page of
it is mapped, so RSS holds only what DCP's reader itself allocates.

Example
-------
>>> ring = BlockRing(1 << 20)
>>> block = ring.take(1000)
>>> block.untyped_storage().size() == block.nbytes  # exact size: DCP's writer does not clone it
True
>>> ring.take(10).data_ptr() == block.data_ptr()  # this thread asked again: its buffer is reused
True
>>> ring.close()
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections import deque

import torch

from .._platform.torch_private import caller_frame, privateuse1_backend_name
from ..errors import DiskFullError
from ..sizes import format_size

log = logging.getLogger(__name__)

BLOCK_NBYTES = 2 << 20  # 2 MiB: the largest block a save hands out (and a load reads back)
_WRITER_LOADERS = ("_SerialCpuLoader", "_OverlappingCpuLoader")  # torch.distributed.checkpoint.filesystem
TORCH_COPY_AHEAD = 10_000_000  # FileSystemWriter's default per_thread_copy_ahead


def gpu_host() -> bool:
    """Whether torch's writer may copy ahead (its own condition: a CUDA or custom device is available)."""
    if torch.cuda.is_available():
        return True
    custom = getattr(torch, privateuse1_backend_name(), None)
    return bool(custom is not None and getattr(custom, "is_available", lambda: False)())


def copy_ahead_of_caller(gpu_host: bool, *, depth: int = 12) -> int:
    """Bytes the storage writer asking for a block may hold resolved but not yet written.

    Finds torch's loader among the callers: ``_SerialCpuLoader`` writes each
    block before asking for the next (0); ``_OverlappingCpuLoader`` resolves
    up to ``inflight_threshhold`` bytes ahead, and as much again while it
    yields what it drained. Another caller is taken as serial, except on a
    GPU host, where torch's default copy-ahead is assumed.
    """
    frame = caller_frame(1)
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        name = type(owner).__name__
        if name in _WRITER_LOADERS:
            return 2 * int(getattr(owner, "inflight_threshhold", TORCH_COPY_AHEAD)) if name == _WRITER_LOADERS[1] else 0
        frame = frame.f_back
    return 2 * TORCH_COPY_AHEAD if gpu_host else 0


class BlockRing:
    """Exact-size fp32 tensors over reusable buffers of ``nbytes`` each, per asking thread.

    Parameters
    ----------
    nbytes
        The largest block (bytes); each buffer is that large.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self._lock = threading.Lock()
        self._handed: dict[int, deque[tuple[mmap.mmap, int]]] = {}  # thread -> (buffer, bytes handed), oldest first
        self._buffers: list[mmap.mmap] = []
        self._warned = False

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of buffers made so far."""
        return len(self._buffers) * self.nbytes

    def take(self, numel: int, *, keep: int = 0) -> torch.Tensor:
        """A tensor of ``numel`` fp32 elements whose storage is exactly its bytes.

        ``keep``: bytes this thread was handed before that must stay valid
        (a writer that resolves ahead); with 0 the previous block's buffer is reused.
        """
        need = numel * 4
        if need > self.nbytes:
            raise ValueError(f"a block of {need} bytes does not fit the ring's {self.nbytes}-byte buffers")
        me = threading.get_ident()
        with self._lock:
            handed = self._handed.setdefault(me, deque())
            held, kept = 0, 0
            for _, n in reversed(handed):  # the newest blocks that must stay valid
                if held >= keep:
                    break
                held += n
                kept += 1
            buffer = None
            if len(handed) > kept:
                buffer, _ = handed.popleft()
            else:
                buffer = mmap.mmap(-1, self.nbytes)
                self._buffers.append(buffer)
                if keep and not self._warned and len(handed) >= 1:
                    self._warned = True
                    log.warning(
                        "the DCP storage writer resolves blocks ahead of writing them (FileSystemWriter's "
                        "per_thread_copy_ahead on a GPU host): up to %s of blocks stay in host RAM beyond "
                        "ram_budget. Pass FileSystemWriter(..., per_thread_copy_ahead=0): tierstore's blocks "
                        "are in host memory already",
                        format_size(keep + self.nbytes),
                    )
            handed.append((buffer, need))
        if need == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(buffer, dtype=torch.float32, count=numel)

    def close(self) -> None:
        """Forget the buffers (each is unmapped once no tensor over it is left)."""
        with self._lock:
            self._handed.clear()
            self._buffers.clear()


class StagingFile:
    """``numel`` fp32 elements in an unlinked, sparse file under ``directory``; read and written by offset.

    DCP's reader writes the pieces it loads into it, and the fill reads them
    back into the shards, both with ``pwrite``/``pread``: nothing is mapped,
    so nothing of it enters RSS (the Linux kernel keeps the pages in its page cache,
    writes them back and drops them as it needs).

    Raises
    ------
    DiskFullError
        If the drive has less free space than the file may need (checked up front).
    """

    def __init__(self, numel: int, directory: str | os.PathLike | None) -> None:
        self.nbytes = numel * 4
        where = str(directory) if directory is not None else tempfile.gettempdir()
        free = shutil.disk_usage(where).free
        if free < self.nbytes:
            raise DiskFullError(
                f"a DCP load stages one copy of this rank's state ({format_size(self.nbytes)}) in {where}, which has "
                f"{format_size(free)} free; free space on that drive"
            )
        fd, path = tempfile.mkstemp(prefix=".dcp-staging-", dir=where)
        try:
            os.unlink(path)  # the space goes with the descriptor; a crash leaves nothing
            os.ftruncate(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def write(self, offset: int, values: torch.Tensor) -> None:
        """Store ``values`` (fp32) at element ``offset``."""
        data = memoryview(values.detach().to(torch.float32).contiguous().numpy()).cast("B")
        self._io(os.pwritev, data, offset * 4)

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous fp32) from element ``offset``; never-written elements read as 0."""
        self._io(os.preadv, memoryview(out.numpy()).cast("B"), offset * 4)

    def _io(self, call, data: memoryview, at: int) -> None:  # noqa: ANN001
        if self._fd is None:
            raise ValueError("the DCP staging file is closed")
        if at < 0 or at + len(data) > self.nbytes:
            raise ValueError(f"bytes {at}..{at + len(data)} are outside the staging file's {self.nbytes}")
        done = 0
        while done < len(data):
            n = call(self._fd, [data[done:]], at + done)
            if n <= 0:  # pragma: no cover - the file is as long as the state
                raise OSError(errno.EIO, f"the DCP staging file moved {n} bytes at {at + done}")
            done += n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
