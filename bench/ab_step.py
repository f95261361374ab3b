"""A/B of TieredAdamW configurations on one drive, interleaved step by step in one process.

Each configuration gets its own optimizer over copies of the same parameters;
rounds alternate the optimizers, so every round's times saw the same drive
weather, and the paired ratio (config k / config 0, per round, median) is
robust to the drift of a virtual disk. Two diagnostic switches go beyond the
public knobs: ``"checksums": false`` stubs out the xxh3 hashing (to measure
what integrity costs; never a production setting) and ``"block"`` sets the
checksum block size.

Usage::

    python bench/ab_step.py --params 2e8 --dir /work/benchdir --rounds 6 \\
        --configs '[{}, {"checksums": false}]' --json bench/results/ab-checksums-2e8.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tierstore.integrity as integrity
from tierstore import TieredAdamW
from tierstore.benchmarks.workload import build

REAL_UPDATE = integrity.BlockDigests.update
DEFAULT_BLOCK = integrity.CHECKSUM_BLOCK


def _apply(diag: dict) -> None:
    integrity.CHECKSUM_BLOCK = diag["block"]
    integrity.BlockDigests.update = REAL_UPDATE if diag["checksums"] else (lambda self, rel, view: None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True)
    parser.add_argument("--dir", required=True, help="a directory on the drive under test")
    parser.add_argument("--budget", type=float, default=1 / 8, help="ram_budget as a share of the state")
    parser.add_argument("--configs", required=True, help="JSON list of TieredAdamW keyword dicts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    numel = int(args.params)
    configs = json.loads(args.configs)
    params = build(numel)
    runs = []
    for cfg in configs:
        cfg = dict(cfg)
        diag = {"block": cfg.pop("block", DEFAULT_BLOCK), "checksums": cfg.pop("checksums", True)}
        _apply(diag)
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, q in zip(params, copies):
            q.grad = p.grad
        directory = tempfile.mkdtemp(dir=args.dir)
        cfg.setdefault("durable", False)
        opt = TieredAdamW(copies, state_dir=directory, ram_budget=int(numel * 8 * args.budget), backend="direct", **cfg)
        opt.step()  # warm-up
        runs.append({"config": {**cfg, **diag}, "opt": opt, "dir": directory, "diag": diag, "s": [], "split": []})
        print(json.dumps(runs[-1]["config"]), opt.describe())
    for _ in range(args.rounds):
        for run in runs:
            _apply(run["diag"])
            t0 = time.perf_counter()
            run["opt"].step()
            run["s"].append(time.perf_counter() - t0)
            st = run["opt"].last_step_stats
            run["split"].append({"read_wait": st.read_wait, "update": st.update, "write_wait": st.write_wait})
    base = runs[0]["s"]
    results = []
    for run in runs:
        row = {
            "config": run["config"],
            "median_s": statistics.median(run["s"]),
            "min_s": min(run["s"]),
            "paired_vs_first": statistics.median(a / b for a, b in zip(run["s"], base)),
            "split_median_s": {k: statistics.median(x[k] for x in run["split"]) for k in run["split"][0]},
            "steps_s": run["s"],
        }
        results.append(row)
        print(f"{json.dumps(row['config'])}: median {row['median_s']:.3f} s, paired vs first {row['paired_vs_first']:.3f}, split {row['split_median_s']}")
        run["opt"].close()
        shutil.rmtree(run["dir"], ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(__import__("sys").argv), "params": numel, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
