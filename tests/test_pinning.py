"""Pinned host memory stays within its limit, is counted, and falls back to pageable with one warning.

No GPU is needed: :class:`~tierstore._platform.hostmem.PinBudget` takes the register and
unregister functions as arguments, so these tests drive success, a CUDA error
(as ``cudaHostRegister`` returns under ``RLIMIT_MEMLOCK`` or a full pinned
pool), a missing runtime and the limit with fakes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tierstore._platform import hostmem
from tierstore._platform.hostmem import HostBuffer, PinBudget

MiB = 1 << 20
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


class FakeCuda:
    """Records register/unregister calls; fails with ``error`` after ``ok`` successes."""

    def __init__(self, *, ok: int = 1 << 30, error: int = CUDA_ERROR_MEMORY_ALLOCATION, raises: bool = False) -> None:
        self.ok, self.error, self.raises = ok, error, raises
        self.registered: dict[int, int] = {}
        self.register_calls = 0
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> int:
        self.register_calls += 1
        if self.raises:
            raise RuntimeError("Torch not compiled with CUDA enabled")
        if len(self.registered) >= self.ok:
            return self.error
        self.registered[address] = size
        return 0

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        self.registered.pop(address)
        return 0

    def budget(self, limit: int | None) -> PinBudget:
        return PinBudget(limit, register=self.register, unregister=self.unregister)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "tierstore._platform.hostmem"]


def test_pinned_bytes_are_counted_and_released_on_close():
    cuda = FakeCuda()
    pins = cuda.budget(64 * MiB)
    bufs = [HostBuffer(n, pin=True, pins=pins) for n in (4 * MiB, 1 * MiB, 10_000)]
    assert all(b.pinned for b in bufs)
    stats = pins.stats()
    # The mapping is pinned whole: 10_000 bytes occupy three pages.
    assert stats.pinned_bytes == 5 * MiB + 3 * 4096 and stats.pinned_buffers == 3
    assert stats.fallback is None and stats.pageable_bytes == 0 and stats.limit == 64 * MiB
    assert sorted(cuda.registered) == sorted(b.address for b in bufs)
    for b in bufs:
        b.close()
        b.close()  # twice is safe and unpins once
    assert pins.stats().pinned_bytes == 0 and pins.stats().pinned_buffers == 0
    assert sorted(cuda.unregistered) == sorted(b.address for b in bufs) and not cuda.registered


def test_pinned_bytes_never_exceed_the_limit(caplog):
    cuda = FakeCuda()
    pins = cuda.budget(8 * MiB)
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        bufs = [HostBuffer(3 * MiB, pin=True, pins=pins) for _ in range(5)]
    assert [b.pinned for b in bufs] == [True, True, False, False, False]
    stats = pins.stats()
    assert stats.pinned_bytes == 6 * MiB <= stats.limit
    assert stats.pageable_bytes == 9 * MiB
    assert cuda.register_calls == 2  # never asked beyond the limit
    (message,) = warnings_of(caplog)  # one warning for three refused buffers
    assert "above the limit of 8.00 MiB" in message and "pin_memory=False" in message
    assert stats.fallback in message
    for b in bufs:
        b.close()
    assert not cuda.registered


def test_a_cuda_error_falls_back_to_pageable_with_one_warning_naming_the_limit_and_the_fix(caplog, monkeypatch):
    monkeypatch.setattr(hostmem, "memlock_limit", lambda: 64 << 10)  # ulimit -l 64
    cuda = FakeCuda(ok=1)
    pins = cuda.budget(None)
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        bufs = [HostBuffer(1 * MiB, pin=True, pins=pins) for _ in range(4)]
    assert [b.pinned for b in bufs] == [True, False, False, False]
    assert cuda.register_calls == 2  # after the failure no buffer tries again
    (message,) = warnings_of(caplog)
    assert "cudaHostRegister of 1.00 MiB failed" in message
    assert f"CUDA error {CUDA_ERROR_MEMORY_ALLOCATION}" in message
    assert "RLIMIT_MEMLOCK (ulimit -l) is 64.00 KiB" in message
    assert "ulimit -l unlimited" in message and "pin_memory=False" in message
    stats = pins.stats()
    assert stats.pinned_bytes == 1 * MiB and stats.pageable_bytes == 3 * MiB and stats.fallback in message
    # Pageable buffers still work.
    bufs[1].tensor.fill_(7)
    assert int(bufs[1].tensor[-1]) == 7
    for b in bufs:
        b.close()
    assert not cuda.registered and pins.stats().pinned_bytes == 0


def test_no_cuda_runtime_falls_back_with_one_warning(caplog):
    cuda = FakeCuda(raises=True)
    pins = cuda.budget(None)
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        bufs = [HostBuffer(MiB, pin=True, pins=pins) for _ in range(3)]
    assert not any(b.pinned for b in bufs) and cuda.register_calls == 1
    (message,) = warnings_of(caplog)
    assert "cudaHostRegister is unavailable" in message and "pin_memory=False" in message
    for b in bufs:
        b.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build's fallback")
def test_the_default_register_on_a_cpu_only_build_warns_once(caplog):
    pins = PinBudget(None)  # the real cudaHostRegister seam
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        bufs = [HostBuffer(MiB, pin=True, pins=pins) for _ in range(3)]
    assert not any(b.pinned for b in bufs)
    assert len(warnings_of(caplog)) == 1
    assert pins.stats().pinned_bytes == 0 and pins.stats().pageable_bytes == 3 * MiB
    for b in bufs:
        b.close()


def test_unpin_failures_are_logged_not_raised(caplog):
    def bad_unregister(address: int) -> int:
        raise RuntimeError("driver gone")

    pins = PinBudget(None, register=lambda address, size: 0, unregister=bad_unregister)
    buf = HostBuffer(MiB, pin=True, pins=pins)
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        buf.close()
    assert "driver gone" in " ".join(warnings_of(caplog))
    assert pins.stats().pinned_bytes == 0


def test_unpinned_and_empty_buffers_never_call_register():
    cuda = FakeCuda()
    pins = cuda.budget(None)
    for buf in (HostBuffer(MiB, pin=False, pins=pins), HostBuffer(0, pin=True, pins=pins)):
        assert not buf.pinned
        buf.close()
    assert cuda.register_calls == 0 and pins.stats().pageable_bytes == 0
