"""Threads of tierstore's own: a pool of single-threaded torch workers, and a thread's own intra-op count.

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

Why never ``torch.set_num_threads``: it is process-wide. Measured on torch
2.13 (OpenMP build): called from any thread, it stores the count every
thread takes when it first runs a parallel op, so threads started later (a
DataLoader's, the user's) and a main thread that has not run one yet get it;
only a thread that already ran one keeps its own. tierstore therefore sets
the OpenMP team size of its own threads only (:func:`own_threads`, with
``omp_set_num_threads``, which is per thread) and never touches the user's
setting, not even for a moment. Where the OpenMP runtime cannot be reached
(a torch built without OpenMP), the threads run with torch's setting.

Example
-------
>>> out = []
>>> run([lambda: out.append(1), lambda: out.append(2)], threads=2)
>>> sorted(out)
[1, 2]
>>> run_each([10, 20, 30], lambda worker, item: out.append(item), threads=2)
>>> sorted(out)
[1, 2, 10, 20, 30]
>>> import torch
>>> with own_threads(1):
...     inside = torch.get_num_threads()
>>> inside
1
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

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


_OMP: dict[str, Any] = {}  # "set": omp_set_num_threads of the OpenMP runtime torch uses (None: not found)


def _omp_set_num_threads() -> Any:
    """``omp_set_num_threads`` of the OpenMP runtime torch runs on, or None (looked up once)."""
    if "set" not in _OMP:
        found = None
        try:
            found = ctypes.CDLL(None).omp_set_num_threads  # torch loads its OpenMP runtime globally
        except (OSError, AttributeError):
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
                for path in sorted(p for p in paths if ".so" in p):
                    found = getattr(ctypes.CDLL(path), "omp_set_num_threads", None)
                    if found is not None:
                        break
            except OSError:
                found = None
        if found is not None:
            found.argtypes, found.restype = [ctypes.c_int], None
        else:
            log.debug("tierstore: no OpenMP runtime found; its threads keep torch's intra-op setting")
        _OMP["set"] = found
    return _OMP["set"]


def set_own_threads(threads: int) -> bool:
    """Give the calling thread ``threads`` intra-op threads, leaving every other thread's setting alone.

    Returns whether it took effect (False without a reachable OpenMP runtime).
    """
    # torch copies its process-wide count into a thread on the thread's first parallel op (or
    # get_num_threads); let that happen first, or it would undo ours later.
    if torch.get_num_threads() == threads:
        return True
    omp_set = _omp_set_num_threads()
    if omp_set is None:
        return False
    omp_set(int(threads))
    return torch.get_num_threads() == threads


@contextlib.contextmanager
def own_threads(threads: int | None) -> Iterator[None]:
    """Run the body with at most ``threads`` intra-op threads on this thread only (``None``: as it is).

    Only lowers: more threads than the thread has leave it alone. Never
    changes torch's process-wide setting (see the module docs).
    """
    before = torch.get_num_threads()
    if threads is None or threads >= before:
        yield
        return
    changed = set_own_threads(threads)
    try:
        yield
    finally:
        if changed:
            set_own_threads(before)


def _single_threaded() -> None:
    """Worker initializer: torch ops in this thread use one intra-op thread (this thread's setting only)."""
    set_own_threads(1)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="tierstore-worker", initializer=_single_threaded)
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
