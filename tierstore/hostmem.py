"""Page-aligned host buffers, pinned for CUDA when CUDA is present.

The arena slots, resident shards and staging buffers all come from here.
Memory is an anonymous ``mmap`` (4 KiB aligned, as ``O_DIRECT`` needs), faulted
in once at allocation: reads into never-touched pages run at a third of the
speed of reads into touched ones on virtual disks, and faulting up front
makes the resident set size honest from the start. When CUDA is available
the region is registered with ``cudaHostRegister`` so device copies are
asynchronous. Without CUDA nothing is pinned (torch's own ``pin_memory=True``
raises on a CPU-only build); asking for ``pin=True`` then logs one warning
per process and keeps the buffers pageable.

Example
-------
>>> buf = HostBuffer(1 << 20)  # 1 MiB
>>> buf.tensor.dtype, buf.tensor.numel(), buf.address % 4096
(torch.uint8, 1048576, 0)
>>> buf.close()
"""

from __future__ import annotations

import logging
import mmap

import torch

PAGE = 4096

log = logging.getLogger(__name__)


_warned_no_cuda = False


def cuda_pinning_available() -> bool:
    """True when CUDA is usable, so registering host memory makes sense."""
    return torch.cuda.is_available()


def _warn_no_cuda_once() -> None:
    # One line per process, not one per buffer: an optimizer allocates dozens.
    global _warned_no_cuda
    if not _warned_no_cuda:
        _warned_no_cuda = True
        log.warning("pin_memory=True, but CUDA is not available: host buffers stay pageable")


class HostBuffer:
    """One page-aligned host allocation exposed as a ``uint8`` tensor and a memoryview.

    ``close()`` unpins and releases it; calling it twice is safe.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None, touch: bool = True) -> None:
        self.nbytes = int(nbytes)
        size = max(PAGE, -(-self.nbytes // PAGE) * PAGE)
        self._mmap: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.nbytes) if self.nbytes else torch.empty(0, dtype=torch.uint8)
        self.view = memoryview(self._mmap)[: self.nbytes]
        self.address = self.tensor.data_ptr() if self.nbytes else 0
        if touch and self.nbytes:
            # Fault every page in now (zero-filled), off the step's critical path.
            self.tensor.zero_()
        self.pinned = False
        if pin is None:
            pin = cuda_pinning_available()
        if pin and self.nbytes:
            if cuda_pinning_available():
                self.pinned = _cuda_host_register(self.address, size)
            else:
                _warn_no_cuda_once()

    def as_float32(self) -> torch.Tensor:
        """The buffer viewed as fp32 (``nbytes`` must be a multiple of 4)."""
        return self.tensor.view(torch.float32)

    def close(self) -> None:
        """Unpin and release the memory. Tensors taken from it must not be used after."""
        if self._mmap is None:
            return
        if self.pinned:
            _cuda_host_unregister(self.address)
            self.pinned = False
        self.view.release()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        mm, self._mmap = self._mmap, None
        try:
            mm.close()
        except BufferError:
            # A caller still holds a view (e.g. a tensor made from this buffer); the
            # mapping is freed when the last view goes away.
            log.debug("host buffer still exported; leaving it to the garbage collector")


def _cuda_host_register(address: int, size: int) -> bool:
    try:
        err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    except Exception as exc:  # a CUDA build without a usable runtime: stay unpinned
        log.warning("cudaHostRegister failed (%s); host buffers stay pageable", exc)
        return False
    if int(err) != 0:
        log.warning("cudaHostRegister returned %s; host buffers stay pageable", err)
        return False
    return True


def _cuda_host_unregister(address: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception as exc:
        log.warning("cudaHostUnregister failed: %s", exc)
