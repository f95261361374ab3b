"""Moving shard extents between arena slots and a state file, several requests in flight.

A shard's extent is split into requests of ``request_bytes``; a small pool of
worker threads issues them (``os.preadv``/``os.pwritev`` and torch copies
release the GIL, so the requests really overlap). A :class:`Transfer` stands
for one extent in flight; ``wait()`` returns when all of its requests are done
and raises the first error any of them hit.

An optional ``on_chunk`` callback runs in the worker right after a request's
bytes are read (or right before they are written): the store uses it to
compute and check checksums on the worker threads, off the update's path.

Example
-------
>>> import tempfile, pathlib
>>> from tierstore.backends import open_backend
>>> from tierstore._platform.hostmem import HostBuffer
>>> f = open_backend("buffered", pathlib.Path(tempfile.mkdtemp()) / "s.bin", 1 << 20, create=True)
>>> buf = HostBuffer(1 << 20)
>>> with IOQueue(workers=2, request_bytes=256 << 10) as io:
...     io.write(f, buf.view, 0).wait()
...     io.read(f, buf.view, 0).wait()
...     io.stats.bytes_read
1048576
>>> f.close(); buf.close()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .._platform.faults import crash_point
from ..backends.base import ShardFile
from ..errors import ClosedError, ConfigError

ChunkHook = Callable[[int, memoryview], None]


@dataclass
class IOStats:
    """Counters of one :class:`IOQueue` (bytes and summed busy seconds of requests)."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    requests: int = 0

    def reset(self) -> None:
        self.bytes_read = self.bytes_written = self.requests = 0
        self.read_seconds = self.write_seconds = 0.0


class Transfer:
    """One extent in flight: a handful of request futures."""

    __slots__ = ("_futures", "nbytes")

    def __init__(self, futures: list[Future], nbytes: int) -> None:
        self._futures = futures
        self.nbytes = nbytes

    def done(self) -> bool:
        """True when every request has finished (successfully or not)."""
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every request finished; raise the first error, after all ended.

        Waiting for all of them first matters: a failed request must not leave
        siblings still writing into a slot that the caller is about to reuse.
        """
        error: BaseException | None = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as exc:  # re-raised below, after the others finished
                if error is None:
                    error = exc
        if error is not None:
            raise error


class IOQueue:
    """A bounded pool of I/O workers.

    Parameters
    ----------
    workers
        Threads issuing requests, for reads and for writes each: up to
        ``2 * workers`` requests are in flight.
    request_bytes
        Size of one request (a multiple of 4096); extents are cut into these.

    Raises
    ------
    ConfigError
        If ``workers`` < 1 or ``request_bytes`` is not a positive multiple of 4096.
    """

    def __init__(self, *, workers: int = 8, request_bytes: int = 1 << 20) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"io_workers={workers!r} must be an int >= 1, e.g. 4")
        if (
            isinstance(request_bytes, bool)
            or not isinstance(request_bytes, int)
            or request_bytes <= 0
            or request_bytes % 4096
        ):
            raise ConfigError(
                f"request_bytes={request_bytes!r} must be a positive multiple of 4096, e.g. 8 << 20"
            )
        self.workers = workers
        self.request_bytes = request_bytes
        self.stats = IOStats()
        self._lock = threading.Lock()
        # Reads and writes get their own workers, so a read the update waits for
        # never queues behind a shard's write-behind (as DeepSpeed's swapper
        # keeps separate read and write handles).
        self._pools: dict[str, ThreadPoolExecutor] | None = {
            kind: ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tierstore-{kind}")
            for kind in ("read", "write")
        }

    def _submit(self, kind: str, fn: Callable[..., None], *args: object) -> Future:
        if self._pools is None:
            raise ClosedError("the I/O queue is closed; create a new optimizer")
        return self._pools[kind].submit(fn, *args)

    def read(self, file: ShardFile, buffer: memoryview, offset: int, *, on_chunk: ChunkHook | None = None) -> Transfer:
        """Start reading ``len(buffer)`` bytes at ``offset`` of ``file`` into ``buffer``."""
        return self._split("read", self._read_one, file, buffer, offset, on_chunk)

    def write(self, file: ShardFile, buffer: memoryview, offset: int, *, on_chunk: ChunkHook | None = None) -> Transfer:
        """Start writing ``buffer`` to ``file`` at ``offset``."""
        return self._split("write", self._write_one, file, buffer, offset, on_chunk)

    def call(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on a write worker (a drive's sync, beside the other drives' syncs)."""
        return self._submit("write", fn, *args)

    def _split(self, kind: str, one: Callable[..., None], file: ShardFile, buffer: memoryview, offset: int, hook: ChunkHook | None) -> Transfer:
        step = self.request_bytes if file.parallel else max(len(buffer), 1)
        futures = [
            self._submit(kind, one, file, buffer[start : start + step], offset + start, start, hook)
            for start in range(0, len(buffer), step)
        ]
        return Transfer(futures, len(buffer))

    def _read_one(self, file: ShardFile, view: memoryview, offset: int, rel: int, hook: ChunkHook | None) -> None:
        t0 = time.perf_counter()
        file.read_into(view, offset)
        dt = time.perf_counter() - t0
        if hook is not None:
            hook(rel, view)
        with self._lock:
            self.stats.bytes_read += len(view)
            self.stats.read_seconds += dt
            self.stats.requests += 1

    def _write_one(self, file: ShardFile, view: memoryview, offset: int, rel: int, hook: ChunkHook | None) -> None:
        if hook is not None:
            hook(rel, view)
        t0 = time.perf_counter()
        file.write_from(view, offset)
        crash_point("mid-write")
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.bytes_written += len(view)
            self.stats.write_seconds += dt
            self.stats.requests += 1

    def close(self) -> None:
        """Finish queued requests and stop the workers; safe to call twice."""
        pools, self._pools = self._pools, None
        for pool in (pools or {}).values():
            pool.shutdown(wait=True)

    def __enter__(self) -> IOQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
