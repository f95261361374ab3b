"""Raw I/O baselines: what the drive does without tierstore in the way.

The backends are judged against these, measured in the same run:

- :func:`sequential` is a plain ``O_DIRECT`` copy, one thread, one request
  in flight, like ``dd oflag=direct bs=1M``; :func:`run_dd` runs the real
  ``dd`` when it is installed.
- :func:`parallel` is the fastest raw direct I/O found on the development machine (bench/README.md):
  ``O_DIRECT`` into pre-touched page-aligned buffers with several requests in
  flight, one thread per request slot issuing ``os.preadv``/``os.pwritev``
  (which release the GIL). io_uring (the ``liburing`` package from PyPI) was
  measured against it and was no faster, so it is not used.
- :func:`memory_bandwidth` is a large ``torch`` copy, the ceiling for any
  update that touches every byte.

Example
-------
>>> import tempfile, pathlib
>>> from tierstore._platform.hostmem import HostBuffer
>>> path = pathlib.Path(tempfile.mkdtemp()) / "raw.bin"
>>> fd = open_file(path, direct=False, create=True)
>>> buf = HostBuffer(2 << 20)  # 2 MiB
>>> seconds = parallel(fd, "write", 4 << 20, buffer=buf, request_bytes=1 << 20, depth=2)
>>> seconds > 0, os.fstat(fd).st_size
(True, 4194304)
>>> os.close(fd); buf.close()
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..._platform.hostmem import HostBuffer
from ...backends.direct import O_DIRECT
from ...errors import BackendError

MiB = 1 << 20
OPS = ("read", "write")


def open_file(path: Path | str, *, direct: bool, create: bool = False) -> int:
    """Open ``path`` read-write, with ``O_DIRECT`` when ``direct``.

    Raises
    ------
    BackendError
        If the file cannot be opened, e.g. ``O_DIRECT`` on tmpfs.
    """
    flags = os.O_RDWR | (O_DIRECT if direct else 0) | (os.O_CREAT if create else 0)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        hint = " (the filesystem may not support O_DIRECT; use a local disk)" if direct else ""
        raise BackendError(f"cannot open {path}: {exc.strerror}{hint}") from exc


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} must be 'read' or 'write'")


def transfer_all(fd: int, op: str, view: memoryview, offset: int) -> None:
    """One whole request; short transfers are finished, errors name the offset."""
    done = 0
    while done < len(view):
        try:
            if op == "read":
                n = os.preadv(fd, [view[done:]], offset + done)
            else:
                n = os.pwritev(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise BackendError(f"raw {op} of {len(view) - done} bytes at offset {offset + done} failed: {exc.strerror}") from exc
        if n <= 0:
            raise BackendError(f"raw {op} at offset {offset + done} returned {n}: the file is shorter than expected")
        done += n


def sequential(fd: int, op: str, nbytes: int, *, buffer: HostBuffer, request_bytes: int = 1 * MiB) -> float:
    """Seconds to move ``nbytes`` from offset 0, one request at a time (``dd``-like).

    Example
    -------
    >>> import tempfile
    >>> fd = open_file(tempfile.mkdtemp() + "/s.bin", direct=False, create=True)
    >>> buf = HostBuffer(1 << 20)
    >>> sequential(fd, "write", 2 << 20, buffer=buf) > 0
    True
    >>> os.close(fd); buf.close()
    """
    _check_op(op)
    view = buffer.view[:request_bytes]
    t0 = time.perf_counter()
    for offset in range(0, nbytes, request_bytes):
        transfer_all(fd, op, view[: min(request_bytes, nbytes - offset)], offset)
    return time.perf_counter() - t0


def parallel(
    fd: int,
    op: str,
    nbytes: int,
    *,
    buffer: HostBuffer,
    request_bytes: int,
    depth: int,
    offset: int = 0,
    spread: bool = False,
) -> float:
    """Seconds to move ``nbytes`` from ``offset`` with ``depth`` requests always in flight.

    Each of ``depth`` threads owns the slice ``[k * request_bytes, (k + 1) *
    request_bytes)`` of ``buffer`` and takes the next request from a shared
    counter, so the queue never drains until the end. ``buffer`` must hold
    ``depth * request_bytes`` bytes (or ``nbytes``, when smaller). With
    ``spread=True`` request ``i`` lands at its own place ``[start, start +
    length)`` of a ``buffer`` as large as ``nbytes`` instead (every page of
    the buffer is used once: how reads into never-touched memory are timed).

    Example
    -------
    >>> import tempfile
    >>> fd = open_file(tempfile.mkdtemp() + "/p.bin", direct=False, create=True)
    >>> buf = HostBuffer(4 << 20)
    >>> parallel(fd, "write", 8 << 20, buffer=buf, request_bytes=1 << 20, depth=4) > 0
    True
    >>> os.close(fd); buf.close()
    """
    _check_op(op)
    requests = [(start, min(request_bytes, nbytes - start)) for start in range(0, nbytes, request_bytes)]
    depth = max(1, min(depth, len(requests)))
    need = nbytes if spread else min(depth * request_bytes, nbytes)
    if buffer.nbytes < need:
        raise ValueError(f"buffer of {buffer.nbytes} bytes is smaller than the {need} bytes this transfer needs")
    lock = threading.Lock()
    cursor = iter(requests)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        base = k * request_bytes
        while not errors:
            with lock:
                item = next(cursor, None)
            if item is None:
                return
            start, length = item
            at = start if spread else base
            try:
                transfer_all(fd, op, buffer.view[at : at + length], offset + start)
            except BaseException as exc:  # reported below, after every thread stopped
                errors.append(exc)
                return

    return timed_threads(worker, depth, errors, name="tierstore-raw")


def timed_threads(worker: Callable[[int], None], count: int, errors: list[BaseException], *, name: str) -> float:
    """Run ``worker(k)`` on ``count`` threads; return the wall seconds, then raise the first error."""
    threads = [threading.Thread(target=worker, args=(k,), name=f"{name}-{k}") for k in range(count)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


def fill(fd: int, nbytes: int, *, buffer: HostBuffer, request_bytes: int = 8 * MiB, depth: int = 4) -> None:
    """Write ``nbytes`` of ``buffer``'s pattern so every block is allocated and written.

    Reads of fallocated-but-unwritten extents return zeros without touching
    the drive, so a read benchmark needs a file that was really written.
    """
    parallel(fd, "write", nbytes, buffer=buffer, request_bytes=request_bytes, depth=depth)
    os.fsync(fd)


def drop_cache(path: Path | str) -> None:
    """Write back and evict ``path``'s pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.MULTILINE)


def dd_available() -> bool:
    """True when a ``dd`` binary is on ``PATH``."""
    return shutil.which("dd") is not None


def run_dd(path: Path | str, op: str, nbytes: int, *, block_bytes: int = 1 * MiB, timeout: float = 600.0) -> float | None:
    """Seconds the real ``dd`` takes for ``nbytes`` with ``O_DIRECT``; ``None`` without ``dd``.

    Reads ``path`` into ``/dev/null`` (``iflag=direct``); writes zeros over
    the existing blocks (``oflag=direct conv=notrunc``), so the file keeps
    its size and allocation. The time is ``dd``'s own, parsed from its
    summary line.
    """
    _check_op(op)
    if not dd_available():
        return None
    count = max(1, nbytes // block_bytes)
    if op == "read":
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={block_bytes}", f"count={count}", "iflag=direct"]
    else:
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={block_bytes}", f"count={count}", "oflag=direct", "conv=notrunc"]
    env = dict(os.environ, LC_ALL="C")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    match = _DD_LINE.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise BackendError(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return float(match.group(2))


def memory_bandwidth(nbytes: int = 512 * MiB, *, repeats: int = 5) -> float:
    """Host memory copy bandwidth in GB/s (bytes copied per second, best of ``repeats``).

    Example
    -------
    >>> memory_bandwidth(8 << 20, repeats=2) > 0
    True
    """
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best / 1e9
