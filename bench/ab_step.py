"""A/B of TieredAdamW configurations on one drive, interleaved step by step in one process.

Each configuration gets its own optimizer over copies of the same parameters;
rounds alternate the optimizers, so every round's times saw the same drive
weather, and the paired ratio (config k / config 0, per round, median) is
robust to the drift of a virtual disk. Three diagnostic switches go beyond the
public knobs: ``"checksums": false`` stubs out the xxh3 hashing (to measure
what integrity costs; never a production setting), ``"block"`` sets the
checksum block size, and ``"hugepages": false`` builds that configuration's
buffers with 4 KiB pages (``TIERSTORE_HUGEPAGES=0`` while it allocates).

Needs (checked before anything is allocated): 8 bytes per parameter, plus per
configuration 4 bytes per parameter and its ``ram_budget`` of RAM, and its
state files on disk (about 14 GB for 10 configurations at 2e8 parameters).

Usage::

    python bench/ab_step.py --params 2e8 --dir /mnt/nvme/scratch --rounds 6 \\
        --configs '[{}, {"checksums": false}]' --json ab-checksums-2e8.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import tierstore._storage.integrity as integrity
from tierstore import TieredAdamW
from tierstore.cli.bench.report import machine_info
from tierstore.cli.bench.resources import ab_needs, check
from tierstore.cli.bench.workload import build
from tierstore.errors import ConfigError

REAL_UPDATE = integrity.BlockDigests.update
DEFAULT_BLOCK = integrity.CHECKSUM_BLOCK


def _apply(diag: dict) -> None:
    integrity.CHECKSUM_BLOCK = diag["block"]
    integrity.BlockDigests.update = REAL_UPDATE if diag["checksums"] else (lambda self, rel, view: None)
    os.environ["TIERSTORE_HUGEPAGES"] = "1" if diag["hugepages"] else "0"  # read by every new host buffer


def _row(run: dict, base: list[float]) -> dict:
    return {
        "config": run["config"],
        "median_s": statistics.median(run["s"]),
        "min_s": min(run["s"]),
        "paired_vs_first": statistics.median(a / b for a, b in zip(run["s"], base)),
        "split_median_s": {k: statistics.median(x[k] for x in run["split"]) for k in run["split"][0]},
        "steps_s": run["s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True)
    parser.add_argument("--dir", required=True, help="a directory on the drive under test")
    parser.add_argument("--budget", type=float, default=1 / 8, help="ram_budget as a share of the state")
    parser.add_argument("--configs", required=True, help="JSON list of TieredAdamW keyword dicts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here (nothing is written without it)")
    args = parser.parse_args()
    numel = int(args.params)
    configs = json.loads(args.configs)
    budget = int(numel * 8 * args.budget)
    needs = ab_needs(params=numel, ram_budget=budget, configs=len(configs),
                     durable_configs=sum(bool(c.get("durable", False)) for c in configs))
    try:
        check(needs, args.dir, fix="lower --params, or compare fewer configurations per run")
    except ConfigError as exc:
        raise SystemExit(f"ab_step.py: {exc}") from None
    params = build(numel)
    runs = []
    try:
        for cfg in configs:
            cfg = dict(cfg)
            diag = {"block": cfg.pop("block", DEFAULT_BLOCK), "checksums": cfg.pop("checksums", True),
                    "hugepages": cfg.pop("hugepages", True)}
            _apply(diag)
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for p, q in zip(params, copies):
                q.grad = p.grad
            cfg.setdefault("durable", False)
            run = {"config": {**cfg, **diag}, "opt": None, "dir": tempfile.mkdtemp(dir=args.dir), "diag": diag,
                   "s": [], "split": []}
            runs.append(run)  # registered before the optimizer exists, so its directory is removed on any error
            run["opt"] = TieredAdamW(copies, state_dir=run["dir"], ram_budget=budget, backend="direct", **cfg)
            run["opt"].step()  # warm-up
            print(json.dumps(run["config"]), run["opt"].describe())
        for _ in range(args.rounds):
            for run in runs:
                _apply(run["diag"])
                t0 = time.perf_counter()
                run["opt"].step()
                run["s"].append(time.perf_counter() - t0)
                st = run["opt"].last_step_stats
                run["split"].append({"read_wait": st.read_wait, "update": st.update, "write_wait": st.write_wait})
        results = [_row(run, runs[0]["s"]) for run in runs]
    finally:
        for run in runs:
            if run["opt"] is not None:
                run["opt"].close()
            shutil.rmtree(run["dir"], ignore_errors=True)
    for row in results:
        print(f"{json.dumps(row['config'])}: median {row['median_s']:.3f} s, paired vs first "
              f"{row['paired_vs_first']:.3f}, split {row['split_median_s']}")
    if args.json:
        document = {"command": " ".join(sys.argv), "params": numel, "machine": machine_info(args.dir),
                    "results": results}
        args.json.write_text(json.dumps(document, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
