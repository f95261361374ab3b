"""Memory a run really uses: resident set size, its peak, its kinds, and the page cache a file holds.

``bench step`` and the RAM-budget tests (:mod:`tierstore.testing.memory`)
check that host RAM stays inside ``ram_budget``: the peak RSS of a run, above
the baseline taken once torch is imported and the model is built, where that
RSS lives (``/proc/self/smaps_rollup`` and, per kind of mapping,
``/proc/self/smaps``), and the page cache the state file fills (none with
``direct``). Linux only (``/proc``); elsewhere the functions return ``None``.

Example
-------
>>> rss_now() is None or rss_now() > 0
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file given in kB, as bytes (``None`` if absent)."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _status_kib(key: str) -> int | None:
    return _proc_kib("/proc/self/status", key)


def rss_now() -> int | None:
    """This process's resident set size in bytes (``VmRSS``)."""
    return _status_kib("VmRSS")


def peak_rss() -> int | None:
    """This process's peak resident set size in bytes (``VmHWM``) since start or :func:`reset_peak`."""
    return _status_kib("VmHWM")


def reset_peak() -> bool:
    """Make the peak RSS start again from the current RSS; ``False`` where the kernel cannot.

    Writes ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+).
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def smaps_rollup() -> dict[str, int] | None:
    """This process's ``/proc/self/smaps_rollup`` sizes in bytes (``Rss``, ``Anonymous``, ``Private_Dirty``, ...).

    Example
    -------
    >>> r = smaps_rollup()
    >>> r is None or r["Rss"] > 0
    True
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        return None
    return out


def rss_by_kind() -> dict[str, int] | None:
    """Resident bytes by kind of mapping, from ``/proc/self/smaps``.

    Kinds: ``heap`` (the ``brk`` heap: glibc's main malloc arena), ``anon``
    (anonymous mappings: tierstore's host buffers, large ``malloc`` blocks,
    Python's object arenas, other threads' malloc arenas, thread stacks),
    ``stack`` (the main thread's), ``file`` (mapped files: libraries' code,
    ``mmap`` backend state files), ``other`` (``[vdso]`` and the like).

    Example
    -------
    >>> kinds = rss_by_kind()
    >>> kinds is None or set(kinds) == {"heap", "anon", "stack", "file", "other"}
    True
    """
    kinds = dict.fromkeys(("heap", "anon", "stack", "file", "other"), 0)
    kind = "other"
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(maxsplit=5)
                if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                    name = head[5].strip() if len(head) > 5 else ""
                    if name == "[heap]":
                        kind = "heap"
                    elif name.startswith("[stack"):
                        kind = "stack"
                    elif not name or name.startswith("[anon"):
                        kind = "anon"
                    elif name.startswith("["):
                        kind = "other"
                    else:
                        kind = "file"
                elif head[0] == "Rss:":
                    kinds[kind] += int(head[1]) * 1024
    except OSError:
        return None
    return kinds


def meminfo(key: str = "Cached") -> int | None:
    """A system-wide ``/proc/meminfo`` figure in bytes (default: the page cache)."""
    return _proc_kib("/proc/meminfo", key)


_libc = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


def cached_bytes(path: Path | str) -> int | None:
    """Bytes of ``path`` now in the page cache (``mincore`` over a read-only mapping).

    ``None`` where ``mincore`` is unavailable.

    Example
    -------
    >>> import tempfile
    >>> fh = tempfile.NamedTemporaryFile(); fh.write(b"x" * 8192); fh.flush()
    8192
    >>> cached_bytes(fh.name) in (None, 8192)
    True
    """
    libc = _load_libc()
    if libc is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // PAGE)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            raw = vec.raw[:pages]
            resident = pages - raw.count(0)  # Linux sets only bit 0 of each entry
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE)


def state_cached_bytes(state_dir: Path | str) -> int | None:
    """Bytes of a state directory's shard files (``shards*.bin``) now in the page cache."""
    total = 0
    for path in sorted(Path(state_dir).glob("shards*.bin")):
        got = cached_bytes(path)
        if got is None:
            return None
        total += got
    return total
