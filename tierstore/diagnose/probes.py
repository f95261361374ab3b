"""Memory probes: what :func:`~tierstore.diagnose.diagnose` measures with, current and peak over a block.

On a GPU the numbers come from ``torch.cuda`` memory stats
(``memory_allocated``, ``max_memory_allocated`` after
``reset_peak_memory_stats``); on the CPU from the process RSS, whose peak is
the Linux kernel's high-water mark (reset through ``/proc/self/clear_refs``)
together with a sampling thread. Both expose ``kind`` (what is measured, in
words), ``current()`` and ``watch()``.

Example
-------
>>> probe = RssProbe()
>>> with probe.watch() as peak:
...     block = b"x" * (8 << 20)  # 8 MiB, touched
>>> probe.kind.startswith("process RSS"), peak[0] > 8 << 20
(True, True)
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `import tierstore` stays fast (the CLI's --help)
    import torch

__all__ = ["CudaProbe", "RssProbe", "probe_for", "SAMPLE_INTERVAL_S"]

SAMPLE_INTERVAL_S = 0.001  # RSS sampling period; the Linux kernel's high-water mark covers what sampling misses


class CudaProbe:
    """Allocated memory on one CUDA device, from the caching allocator's stats."""

    kind = "torch.cuda memory stats (allocated bytes)"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    @contextlib.contextmanager
    def watch(self) -> Iterator[list[int]]:
        """Yield a one-element list that holds the peak of the block when it ends."""
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        box = [0]
        try:
            yield box
        finally:
            torch.cuda.synchronize(self.device)
            box[0] = int(torch.cuda.max_memory_allocated(self.device))


class RssProbe:
    """Resident set size of this process: current, and the peak over a block."""

    kind = "process RSS"

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._status = Path("/proc/self/status")
        self._clear_refs = Path("/proc/self/clear_refs")
        self.high_water = self._can_reset_high_water()
        if self.high_water:
            self.kind = "process RSS (peak: kernel high-water mark + sampling)"
        else:
            self.kind = "process RSS (peak: sampling every 1 ms)"

    def current(self) -> int:
        return int(self._process.memory_info().rss)

    def _hwm(self) -> int | None:
        try:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", self._status.read_text())
        except OSError:
            return None
        return int(match.group(1)) * 1024 if match else None

    def _can_reset_high_water(self) -> bool:
        try:
            self._clear_refs.write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        except OSError:
            return False
        return self._hwm() is not None

    @contextlib.contextmanager
    def watch(self) -> Iterator[list[int]]:
        """Yield a one-element list that holds the peak RSS of the block when it ends."""
        box = [self.current()]
        if self.high_water:
            self._clear_refs.write_text("5")
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_INTERVAL_S):
                box[0] = max(box[0], self.current())

        sampler = threading.Thread(target=sample, name="tierstore-diagnose-rss", daemon=True)
        sampler.start()
        try:
            yield box
        finally:
            stop.set()
            sampler.join()
            box[0] = max(box[0], self.current(), (self._hwm() or 0) if self.high_water else 0)


def probe_for(device: torch.device) -> CudaProbe | RssProbe:
    """The probe that measures memory where ``device``'s tensors live."""
    if device.type == "cuda":
        return CudaProbe(device)
    return RssProbe()
