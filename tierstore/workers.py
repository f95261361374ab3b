"""A process-wide pool of single-threaded torch workers, for work cut into cache-sized chunks.

The moment codecs and the per-shard update of compressed formats cut a shard
into chunks of a few hundred thousand elements and run several torch ops on
each chunk while it is in the CPU cache. Torch would parallelise each op
over its own OpenMP threads; run from several Python threads at once, every
op would start a team of its own and the cores would be oversubscribed
(OpenMP threads spin while they wait). So each worker of this pool runs
torch with one intra-op thread, and the parallelism comes from the workers
taking chunks (torch ops release the GIL).

Why a pool per thread count, kept for the process: starting threads per
shard costs more than the work on a small shard.

Example
-------
>>> out = []
>>> run([lambda: out.append(1), lambda: out.append(2)], threads=2)
>>> sorted(out)
[1, 2]
>>> run_each([10, 20, 30], lambda worker, item: out.append(item), threads=2)
>>> sorted(out)
[1, 2, 10, 20, 30]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from .errors import ConfigError

T = TypeVar("T")

_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def check_threads(threads: object, *, name: str = "threads") -> int:
    """``threads`` as a positive int.

    Raises
    ------
    ConfigError
        For anything but a positive int.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"{name}={threads!r} must be a positive int (worker threads), e.g. {os.cpu_count() or 1}")
    return threads


def _single_threaded() -> None:
    """Worker initializer: torch ops in this thread use one intra-op thread.

    ``torch.set_num_threads`` sets this thread's OpenMP team size and also the
    process default that threads started later copy; the creating thread puts
    that default back (:func:`_pool`), so only the workers run single-threaded.
    """
    torch.get_num_threads()  # torch's per-thread lazy setup first, so it cannot undo ours
    torch.set_num_threads(1)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            before = torch.get_num_threads()
            pool = ThreadPoolExecutor(threads, thread_name_prefix="tierstore-worker", initializer=_single_threaded)
            # Start every worker now (they run the initializer), then restore the
            # process default that the initializer changed.
            barrier = threading.Barrier(threads)
            for future in [pool.submit(barrier.wait) for _ in range(threads)]:
                future.result()
            torch.set_num_threads(before)
            _POOLS[threads] = pool
        return pool


def run(tasks: Sequence[Callable[[], object]], *, threads: int) -> None:
    """Run ``tasks`` on ``threads`` single-threaded workers (inline when there is one task or thread).

    Waits for every task, then raises the first error any of them raised.
    """
    check_threads(threads)
    if threads == 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    futures = [_pool(threads).submit(task) for task in tasks]
    error = None
    for future in futures:
        try:
            future.result()
        except BaseException as exc:  # every task finishes before the first error propagates
            error = error or exc
    if error is not None:
        raise error


def run_each(items: Iterable[T], work: Callable[[int, T], object], *, threads: int) -> None:
    """Call ``work(worker, item)`` for every item, on up to ``threads`` workers.

    ``worker`` (0 .. threads-1) names the worker, so ``work`` can use per-worker
    scratch; items are taken in order by whichever worker is free.
    """
    check_threads(threads)
    items = list(items)
    n = min(threads, len(items))
    if n <= 1:
        for item in items:
            work(0, item)
        return
    queue = iter(items)  # next() on a list iterator is atomic under the GIL
    lock = threading.Lock()

    def loop(worker: int) -> None:
        while True:
            with lock:
                item = next(queue, _DONE)
            if item is _DONE:
                return
            work(worker, item)

    run([lambda w=w: loop(w) for w in range(n)], threads=threads)


_DONE = object()
