"""Peak RAM of DCP saves and loads of a TieredAdamW state, sampled in this process.

:func:`measure_dcp_memory` builds a TieredAdamW state, takes one step, and
saves it through ``torch.distributed.checkpoint`` in each way tierstore
offers (:class:`~tierstore.dcp.TieredStateful`, with and without
:class:`~tierstore.dcp.TieredSavePlanner`, one file per rank or per block)
and through a materialised ``optimizer.state_dict()``, then loads it back.
While each operation runs, a thread samples the process's anonymous and
file-backed resident memory every 2 ms; heap freed by earlier operations is
handed back to the Linux kernel first (glibc's ``malloc_trim``), so each
record's growth is that operation's own. ``docs/distributed.md`` quotes its
figures.

Example
-------
>>> import tempfile
>>> small = dict(rows=64, cols=64, params=2, shard_numel=1024, ram_budget="48KiB")  # 6 of 8 shards on disk
>>> records = measure_dcp_memory(tempfile.mkdtemp(), **small)
>>> len(records), records[0]["op"], records[0]["state_mib"]
(6, 'save TieredStateful + TieredSavePlanner, file per block', 0.1)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["measure_dcp_memory"]


def _rss_kib() -> tuple[int, int]:
    """(anonymous, file-backed) resident KiB of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                fields[line.split(":")[0]] = int(line.split()[1])
    return fields.get("RssAnon", 0), fields.get("RssFile", 0) + fields.get("RssShmem", 0)


def _trim() -> None:
    """Give free heap pages back to the Linux kernel (glibc), so RSS growth shows new allocations."""
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: measurements may read low
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def _peak_during(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """Run ``fn``; return (seconds, peak extra anonymous MiB, peak extra file-backed MiB)."""
    import threading

    base = _rss_kib()
    peak = list(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _rss_kib()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    return seconds, (peak[0] - base[0]) / 1024, (peak[1] - base[1]) / 1024


def measure_dcp_memory(
    directory: str,
    *,
    rows: int = 4096,
    cols: int = 2048,
    params: int = 8,
    shard_numel: int = 1 << 20,
    ram_budget: str = "64MiB",
) -> list[dict[str, Any]]:
    """Peak RAM of DCP saves and loads of a TieredAdamW state, one process, vs materialising it.

    Builds ``params`` fp32 ``rows x cols`` parameters (8 bytes of state per
    element), takes one step, then saves through :class:`~tierstore.dcp.TieredStateful`
    (default and :class:`~tierstore.dcp.TieredSavePlanner`, one file per rank
    or one per block) and through ``optimizer.state_dict()``, and loads back.
    Returns one record per operation: seconds, peak extra anonymous and
    file-backed MiB (sampled every 2 ms), state MiB.

    Example
    -------
    >>> measure_dcp_memory("/mnt/nvme/tmp")  # doctest: +SKIP
    """
    import gc
    import shutil

    import torch.distributed.checkpoint as dcp

    from .. import TieredAdamW
    from ..dcp import TieredSavePlanner, TieredStateful

    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(rows, cols, generator=gen)) for _ in range(params)]
    root = Path(directory)
    opt = TieredAdamW(weights, lr=1e-3, state_dir=str(root / "state"), ram_budget=ram_budget, shard_numel=shard_numel)
    for w in weights:
        w.grad = torch.randn(rows, cols, generator=gen)
    opt.step()
    for w in weights:
        w.grad = None
    gc.collect()
    state_mib = opt.plan.state_nbytes / 2**20
    records = []

    def record(name: str, fn: Callable[[], Any]) -> None:
        gc.collect()
        _trim()  # freed heap from earlier operations would hide this one's growth
        seconds, anon, filed = _peak_during(fn)
        records.append(dict(op=name, seconds=round(seconds, 2), extra_anon_mib=round(anon, 1), extra_file_mib=round(filed, 1), state_mib=round(state_mib, 1)))

    def save(path: str, planner: Any, single: bool) -> Callable[[], Any]:
        writer = dcp.FileSystemWriter(str(root / path), single_file_per_rank=single)
        return lambda: dcp.save({"optim": TieredStateful(opt)}, storage_writer=writer, planner=planner, no_dist=True)

    record("save TieredStateful + TieredSavePlanner, file per block", save("a", TieredSavePlanner(), False))
    record("save TieredStateful, default planner, file per block", save("b", None, False))
    record("save TieredStateful + TieredSavePlanner, file per rank", save("c", TieredSavePlanner(), True))
    record(
        "save optimizer.state_dict() (materialised)",
        lambda: dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(root / "d"), no_dist=True),
    )
    record("load TieredStateful (staging file)", lambda: dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=str(root / "a"), no_dist=True))
    record("save TieredStateful + TieredSavePlanner, file per block (again)", save("e", TieredSavePlanner(), False))
    opt.close()
    for name in ("a", "b", "c", "d", "e", "state"):
        shutil.rmtree(root / name, ignore_errors=True)
    return records
