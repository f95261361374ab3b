"""A disk run alone in its own process: its peak RSS and the page cache its state file fills.

``bench step`` runs this module as a child (``python -m
tierstore.cli.bench.footprint CONFIG_JSON``) so the peak is the run's own,
not the benchmark's other contenders'. The child builds the parameters,
takes its baseline RSS (torch imported and its optimizer machinery loaded
by a throw-away ``torch.optim.AdamW`` step, parameters and gradients built),
restarts the peak counter, builds a :class:`~tierstore.TieredAdamW` under the
budget, runs the steps, and prints one JSON line: baseline and peak RSS,
the state file's bytes in the page cache (``mincore``) and the growth of the
system's page cache (``/proc/meminfo`` ``Cached``, noisy on a shared machine).

Example
-------
>>> import tempfile
>>> out = measure({"params": 50_000, "ram_budget": 200_000, "dir": tempfile.mkdtemp(),
...                "steps": 2, "backend": "buffered", "shard_numel": 4096})
>>> out["peak_over_baseline_bytes"] >= 0, len(out["step_seconds"])
(True, 2)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from . import rss, workload


def _warm_torch_optim() -> int | None:
    """Pay torch's one-time optimizer cost before the baseline; return its RSS growth.

    The first ``torch.optim`` optimizer imports ``torch._dynamo`` (about 70 MiB
    of modules on torch 2.x), whichever optimizer it is: part of the
    baseline of any training process, not of tierstore's state.
    """
    import torch

    before = rss.rss_now()
    w = torch.zeros(16, requires_grad=True)
    w.grad = torch.ones(16)
    torch.optim.AdamW([w], lr=1e-3, fused=True).step()
    after = rss.rss_now()
    return None if before is None or after is None else after - before


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """Run ``config["steps"]`` steps of a disk-tier TieredAdamW; return the memory figures.

    ``config`` keys: ``params``, ``ram_budget`` (bytes), ``dir`` (an empty or
    missing directory for the state), ``steps``, and optional ``backend``,
    ``shard_numel``, ``prefetch_depth``, ``io_workers``, ``request_bytes``,
    ``keep_master``, ``durable`` (default ``True``, as TieredAdamW with a state_dir).
    """
    from ...optimizer import TieredAdamW

    params = workload.build(int(config["params"]))
    warm = _warm_torch_optim()
    baseline = rss.rss_now()
    reset = rss.reset_peak()
    cached_before = rss.meminfo("Cached")
    times = []
    opt = TieredAdamW(
        params,
        lr=1e-3,
        state_dir=config["dir"],
        ram_budget=int(config["ram_budget"]),
        backend=config.get("backend", "auto"),
        shard_numel=config.get("shard_numel"),
        prefetch_depth=config.get("prefetch_depth", 2),
        io_workers=config.get("io_workers", 4),
        request_bytes=config.get("request_bytes", 8 << 20),
        keep_master=config.get("keep_master"),
        durable=bool(config.get("durable", True)),  # TieredAdamW's own default with a state_dir
        moment_dtype=config.get("moment_dtype", "float32"),
    )
    try:
        construct_peak = rss.peak_rss()
        for _ in range(int(config["steps"])):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        peak = rss.peak_rss()
        file_cached = rss.state_cached_bytes(config["dir"])
        cached_after = rss.meminfo("Cached")
        result = {
            "backend": opt.backend,
            "baseline_rss_bytes": baseline,
            "peak_rss_bytes": peak,
            "peak_after_construction_bytes": construct_peak,
            "peak_over_baseline_bytes": None if peak is None or baseline is None else peak - baseline,
            "peak_reset": reset,
            "torch_optim_warmup_bytes": warm,
            "ram_budget": int(config["ram_budget"]),
            "optimizer_ram_bytes": opt.ram_bytes,
            "state_bytes": opt.plan.state_nbytes,
            "disk_bytes": opt.disk_bytes,
            "state_file_cached_bytes": file_cached,
            "meminfo_cached_delta_bytes": None
            if cached_before is None or cached_after is None
            else cached_after - cached_before,
            "step_seconds": times,
            "describe": opt.describe(),
        }
    finally:
        opt.close()
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tierstore.cli.bench.footprint CONFIG_JSON", file=sys.stderr)
        return 2
    print(json.dumps(measure(json.loads(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
