"""The AdamW update at several thread counts, timed as a streamed step runs it: beside the drives' I/O.

A streamed step updates shards on the main thread while I/O threads read
the next ones and write the last ones back. On few cores the update's OpenMP
threads and the I/O threads compete: more update threads can make the update
itself faster and the step slower (the I/O threads starve while OpenMP
threads spin at the kernel's barrier). So :func:`time_with_io` times what a
step does, for each thread count: every drive reads its test file and
writes it back (as :class:`~tierstore.cli.bench.drives.DriveSet` moves it,
all at once) while the main thread runs as many fused AdamW updates of one
shard as take about as long alone (:func:`balance`), and the time is until
both are done. Thread counts are set per thread, as the optimizer sets them
(:func:`tierstore._platform.workers.own_threads`), and interleaved round by
round.

Example
-------
>>> import tempfile
>>> from tierstore.cli.bench.drives import DriveSet
>>> with DriveSet([tempfile.mkdtemp()], size=4 << 20, backend="buffered").open() as drives:
...     times = time_with_io(drives, [1, 2], request_bytes=1 << 20, workers=2, numel=1 << 16, rounds=2)
>>> sorted(times.seconds), all(len(v) == 2 for v in times.seconds.values())
([1, 2], True)
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..._compute.kernel import adamw
from ..._platform.workers import own_threads
from ..bench.drives import DriveSet

__all__ = ["UpdateTimes", "time_with_io", "thread_counts", "balance", "MAX_UPDATES"]

MAX_UPDATES = 256  # updates per timed run, whatever the drives' speed


def thread_counts(cores: int | None = None) -> list[int]:
    """The counts worth timing on ``cores`` cores: 1, powers of two, all but one, all.

    >>> thread_counts(2), thread_counts(16)
    ([1, 2], [1, 2, 4, 8, 15, 16])
    """
    cores = cores or len(os.sched_getaffinity(0))
    counts = {1, cores, max(1, cores - 1)}
    k = 2
    while k < cores:
        counts.add(k)
        k *= 2
    return sorted(counts)


def balance(io_seconds: float, update_seconds: float) -> int:
    """Updates that take about as long as the I/O alone (at least 1, at most :data:`MAX_UPDATES`).

    >>> balance(0.5, 0.01), balance(0.001, 0.01)
    (50, 1)
    """
    if update_seconds <= 0:
        return 1
    return max(1, min(MAX_UPDATES, round(io_seconds / update_seconds)))


@dataclass
class UpdateTimes:
    """Per thread count, seconds of each timed run (I/O and updates together), and what one run held."""

    seconds: dict[int, list[float]] = field(default_factory=dict)
    update_seconds: dict[int, list[float]] = field(default_factory=dict)  # the updates' part of each run
    updates: int = 1
    io_alone_s: float = 0.0
    update_alone_s: float = 0.0

    def to_dict(self) -> dict:
        return {"seconds": {str(k): v for k, v in self.seconds.items()},
                "update_seconds": {str(k): v for k, v in self.update_seconds.items()},
                "updates_per_run": self.updates, "io_alone_s": self.io_alone_s, "update_alone_s": self.update_alone_s}


class _Shard:
    """One shard's fp32 parameter, gradient and moments, updated by the fused kernel."""

    def __init__(self, numel: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.p = torch.empty(numel).uniform_(-0.1, 0.1, generator=gen)
        self.g = torch.empty(numel).normal_(0.0, 1e-3, generator=gen)
        self.m, self.v = torch.zeros(numel), torch.zeros(numel)
        self.step = torch.tensor(0.0)

    def update(self, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            self.step.add_(1.0)
            adamw([self.p], [self.g], [self.m], [self.v], [], [self.step], lr=1e-3, beta1=0.9, beta2=0.999,
                  weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False)
        return time.perf_counter() - t0


def _io(drives: DriveSet, request_bytes: int, workers: int) -> float:
    """Every drive reads its whole file, then writes it back, all at once: the seconds."""
    shares = [drives.size] * len(drives.drives)
    return sum(drives.together(op, shares, request_bytes=request_bytes, workers=workers) for op in ("read", "write"))


def time_with_io(drives: DriveSet, threads: Sequence[int], *, request_bytes: int, workers: int, numel: int,
                 rounds: int = 3) -> UpdateTimes:
    """For each thread count, the seconds until the drives' read and write back and a balanced run of updates are done."""
    shard = _Shard(numel)
    out = UpdateTimes(seconds={t: [] for t in threads}, update_seconds={t: [] for t in threads})
    for count in threads:  # warm: each count's first call starts its OpenMP team
        with own_threads(count):
            shard.update(1)
    out.io_alone_s = _io(drives, request_bytes, workers)
    with own_threads(max(threads)):
        out.update_alone_s = statistics.median(shard.update(1) for _ in range(3))
    out.updates = balance(out.io_alone_s, out.update_alone_s)
    for rnd in range(rounds):
        order = list(threads) if rnd % 2 == 0 else list(reversed(threads))
        for count in order:
            errors: list[BaseException] = []

            def io(errors: list[BaseException] = errors) -> None:
                try:
                    _io(drives, request_bytes, workers)
                except BaseException as exc:  # re-raised below
                    errors.append(exc)

            mover = threading.Thread(target=io, name="tierstore-tune-io")
            t0 = time.perf_counter()
            mover.start()
            with own_threads(count):
                updates = shard.update(out.updates)
            mover.join()
            elapsed = time.perf_counter() - t0
            if errors:
                raise errors[0]
            out.seconds[count].append(elapsed)
            out.update_seconds[count].append(updates)
    return out
