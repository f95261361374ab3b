"""Page-aligned host buffers, pinned for CUDA within a byte limit, with one warning when pinning fails.

The arena slots, resident shards and staging buffers all come from here.
Memory is an anonymous ``mmap`` (4 KiB aligned, as ``O_DIRECT`` needs), faulted
in once at allocation: reads into never-touched pages run at a third of the
speed of reads into touched ones on virtual disks, and faulting up front
makes the resident set size honest from the start.

Pinning. When CUDA is available the buffers are registered with
``cudaHostRegister`` so device copies are asynchronous. Pinned memory cannot
be paged out, and running out of it is the host OOM offload users meet most,
so every registration goes through a :class:`PinBudget`: one per optimizer,
created with the RAM budget as its limit. It counts the pinned bytes (what
``describe()`` reports), refuses to pin beyond its limit, and when pinning
fails (the limit, ``RLIMIT_MEMLOCK``, a ``cudaHostRegister`` error, a build
without a CUDA runtime) the buffer stays pageable, the budget stops trying
for later buffers, and it logs **one** warning naming the limit and the fix.
The register/unregister functions are arguments, so tests drive every path
without a GPU. Without CUDA nothing is pinned (torch's own
``pin_memory=True`` raises on a CPU-only build).

Example
-------
>>> buf = HostBuffer(1 << 20)  # 1 MiB
>>> buf.tensor.dtype, buf.tensor.numel(), buf.address % 4096
(torch.uint8, 1048576, 0)
>>> buf.close()
>>> pins = PinBudget(8 << 20, register=lambda address, size: 0, unregister=lambda address: 0)
>>> a, b = HostBuffer(6 << 20, pin=True, pins=pins), HostBuffer(4 << 20, pin=True, pins=pins)
>>> a.pinned, b.pinned, pins.stats().pinned_bytes == 6 << 20
(True, False, True)
>>> a.close(); b.close(); pins.stats().pinned_bytes
0
"""

from __future__ import annotations

import logging
import mmap
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._config.registry import env
from ..sizes import format_size

PAGE = 4096
HUGE_PAGE = 2 << 20  # x86-64 transparent huge pages; smaller buffers are not advised

log = logging.getLogger(__name__)


def huge_pages_wanted() -> bool:
    """Whether buffers of 2 MiB and more get transparent huge pages (``TIERSTORE_HUGEPAGES``:
    ``1``, the default, or ``0``, which also keeps a kernel set to ``always`` from using them).

    Raises
    ------
    ConfigError
        For any other value.
    """
    return bool(env("TIERSTORE_HUGEPAGES"))


def _advise_huge(mm: mmap.mmap, size: int, wanted: bool) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on ``mm`` where ``wanted`` and possible (``MADV_NOHUGEPAGE``
    where not wanted); whether huge pages were asked for.

    A hint only: with ``transparent_hugepage`` set to ``never``, or where memory is
    too fragmented, the Linux kernel keeps 4 KiB pages and nothing else changes.
    """
    if size < HUGE_PAGE:
        return False
    advice = getattr(mmap, "MADV_HUGEPAGE" if wanted else "MADV_NOHUGEPAGE", None)
    if advice is None:
        return False
    try:
        mm.madvise(advice)
    except OSError:  # a kernel built without THP
        return False
    return wanted


#: ``register(address, size) -> error code`` (0: pinned); may raise when no CUDA runtime exists.
RegisterFn = Callable[[int, int], int]
#: ``unregister(address) -> error code``.
UnregisterFn = Callable[[int], int]


def cuda_pinning_available() -> bool:
    """True when CUDA is usable, so registering host memory makes sense."""
    return torch.cuda.is_available()


def cuda_host_register(address: int, size: int) -> int:
    """``cudaHostRegister(address, size, 0)``; the CUDA error code (0 on success)."""
    return int(torch.cuda.cudart().cudaHostRegister(address, size, 0))


def cuda_host_unregister(address: int) -> int:
    """``cudaHostUnregister(address)``; the CUDA error code (0 on success)."""
    return int(torch.cuda.cudart().cudaHostUnregister(address))


def _cuda_error_text(code: int) -> str:
    try:
        text = torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaError(code))
    except Exception:  # no runtime, or a binding without these names: the number still helps
        return f"CUDA error {code}"
    return f"CUDA error {code}: {text}"


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes (``ulimit -l``), ``None`` when unlimited or unknown."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(frozen=True)
class PinStats:
    """How much host memory a :class:`PinBudget` pinned, and why it stopped, if it did.

    ``pinned_bytes``/``pinned_buffers``: registered now. ``limit``: the most
    it may pin (``None``: no limit). ``pageable_bytes``: bytes that asked to
    be pinned and stayed pageable. ``fallback``: why pinning stopped
    (``None`` while it works); it is also what the one warning said.
    """

    pinned_bytes: int
    pinned_buffers: int
    limit: int | None
    pageable_bytes: int
    fallback: str | None


class PinBudget:
    """Pins host buffers up to ``limit`` bytes; on the first failure, stays pageable and warns once.

    Parameters
    ----------
    limit
        The most bytes pinned at once (the optimizer's ``ram_budget``);
        ``None``: no limit.
    register, unregister
        The functions that pin and unpin (default: ``cudaHostRegister`` and
        ``cudaHostUnregister`` through ``torch.cuda.cudart()``). ``register``
        returns an error code (0: pinned) or raises when there is no runtime.

    Example
    -------
    >>> failing = PinBudget(None, register=lambda address, size: 2, unregister=lambda address: 0)
    >>> failing.pin(4096 * 16, 4096)  # logs one warning naming the error and the fix
    False
    >>> failing.stats().fallback.startswith("cudaHostRegister of 4.00 KiB failed")
    True
    """

    def __init__(
        self,
        limit: int | None,
        *,
        register: RegisterFn = cuda_host_register,
        unregister: UnregisterFn = cuda_host_unregister,
    ) -> None:
        self.limit = None if limit is None else int(limit)
        self.needs_cuda = register is cuda_host_register  # tests inject their own register function
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # address -> bytes
        self._pageable = 0
        self._fallback: str | None = None

    def pin(self, address: int, size: int) -> bool:
        """Pin ``size`` bytes at ``address``; ``False`` (and the buffer stays pageable) when it cannot."""
        with self._lock:
            if self._fallback is not None:
                self._pageable += size
                return False
            pinned = sum(self._pinned.values())
            if self.limit is not None and pinned + size > self.limit:
                return self._give_up(
                    size,
                    f"host buffers stay pageable: pinning {format_size(size)} more would pin {format_size(pinned + size)}, above the "
                    f"limit of {format_size(self.limit)} (ram_budget). This is a tierstore bug (every pinned "
                    "buffer is part of the budget); please report it. Pass pin_memory=False to silence this",
                )
            try:
                code = int(self._register(address, size))
            except Exception as exc:  # a CUDA build without a usable runtime (or driver)
                return self._give_up(
                    size,
                    f"cudaHostRegister is unavailable ({type(exc).__name__}: {exc}): host buffers stay pageable "
                    "and copies to the GPU are synchronous. Install a CUDA runtime that matches torch, or pass "
                    "pin_memory=False to silence this",
                )
            if code != 0:
                return self._give_up(size, self._failure_text(code, size, pinned))
            self._pinned[address] = size
            return True

    def _failure_text(self, code: int, size: int, pinned: int) -> str:
        memlock = memlock_limit()
        limit = "unlimited" if memlock is None else format_size(memlock)
        return (
            f"cudaHostRegister of {format_size(size)} failed ({_cuda_error_text(code)}) with "
            f"{format_size(pinned)} already pinned by this optimizer; the locked-memory limit "
            f"RLIMIT_MEMLOCK (ulimit -l) is {limit}. The rest of the host buffers stay pageable "
            "(GPU copies become synchronous and slower). Fix: raise the locked-memory limit "
            "(`ulimit -l unlimited`; docker `--ulimit memlock=-1`; systemd `LimitMEMLOCK=infinity`), "
            "free pinned memory held elsewhere (other processes, DataLoader pin_memory), lower "
            "ram_budget, or pass pin_memory=False to silence this"
        )

    def _give_up(self, size: int, reason: str) -> bool:
        self._fallback = reason
        self._pageable += size
        log.warning("%s", reason)
        return False

    def unavailable(self, size: int) -> None:
        """Pinning was asked for on a machine without CUDA: count the buffer pageable, warn once."""
        with self._lock:
            if self._fallback is None:
                self._give_up(size, "pin_memory=True, but CUDA is not available: host buffers stay pageable")
            else:
                self._pageable += size

    def unpin(self, address: int) -> None:
        """Unpin the buffer at ``address`` (pinned by :meth:`pin`); a failure is logged, not raised."""
        with self._lock:
            if self._pinned.pop(address, None) is None:
                return
        try:
            code = int(self._unregister(address))
        except Exception as exc:  # closing must not raise; the memory is unmapped next anyway
            log.warning("cudaHostUnregister failed: %s", exc)
            return
        if code != 0:
            log.warning("cudaHostUnregister returned %s", _cuda_error_text(code))

    def stats(self) -> PinStats:
        """The pinned bytes now, the limit, and the fallback reason (see :class:`PinStats`)."""
        with self._lock:
            return PinStats(sum(self._pinned.values()), len(self._pinned), self.limit, self._pageable, self._fallback)


#: The budget of buffers created without one: no limit, shared, so a failure warns once per process.
PROCESS_PINS = PinBudget(None)


class HostBuffer:
    """One page-aligned host allocation exposed as a ``uint8`` tensor and a memoryview.

    Parameters
    ----------
    nbytes
        Size in bytes (rounded up to whole pages in the mapping).
    pin
        Pin it for CUDA copies; ``None``: pin exactly when CUDA is available.
    touch
        Fault every page in now.
    pins
        The :class:`PinBudget` that pins it and counts it (the optimizer's);
        ``None``: :data:`PROCESS_PINS`, shared by every buffer given none
        (no limit; one warning per process when pinning fails).

    ``close()`` unpins and releases it; calling it twice is safe.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None, touch: bool = True, pins: PinBudget | None = None) -> None:
        self.nbytes = int(nbytes)
        size = max(PAGE, -(-self.nbytes // PAGE) * PAGE)
        wanted = huge_pages_wanted()  # a bad TIERSTORE_HUGEPAGES fails before anything is mapped
        self._mmap: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Huge pages before the first touch: fewer page pins and page-table walks for each
        # O_DIRECT request, fewer TLB misses in the update's walk over a shard (bench/ab_step.py
        # '"hugepages": false' measures it: 0-5 % of a streamed step on a 2-vCPU VM).
        self.huge = _advise_huge(self._mmap, size, wanted)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.nbytes) if self.nbytes else torch.empty(0, dtype=torch.uint8)
        self.view = memoryview(self._mmap)[: self.nbytes]
        self.address = self.tensor.data_ptr() if self.nbytes else 0
        if touch and self.nbytes:
            # Fault every page in now (zero-filled), off the step's critical path.
            self.tensor.zero_()
        self.pinned = False
        self._pins: PinBudget | None = None
        if pin is None:
            pin = cuda_pinning_available()
        if pin and self.nbytes:
            budget = pins if pins is not None else PROCESS_PINS
            if budget.needs_cuda and not cuda_pinning_available():
                budget.unavailable(size)
            else:
                self._pins = budget
                self.pinned = budget.pin(self.address, size)

    def as_float32(self) -> torch.Tensor:
        """The buffer viewed as fp32 (``nbytes`` must be a multiple of 4)."""
        return self.tensor.view(torch.float32)

    def close(self) -> None:
        """Unpin and release the memory. Tensors taken from it must not be used after."""
        if self._mmap is None:
            return
        if self.pinned and self._pins is not None:
            self._pins.unpin(self.address)
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
