"""A/B of TieredAdamW configurations on one drive, interleaved step by step in one process.

Each configuration gets its own optimizer over copies of the same parameters
(durable, as ``TieredAdamW`` with a ``state_dir`` runs, unless a configuration
says ``"durable": false``); every round steps each optimizer once, in a
rotating order, so every round's times saw the same drive weather, and the
paired ratio (config k / config 0, per round) is robust to the drift of a
virtual disk. Each configuration's ratio is judged against ``--target``
(default ``<=1.0``: no slower than the first configuration) on the median of
the per-round ratios: PASS or FAIL over >= 3 rounds, UNDECIDED with fewer;
the report starts with the hardware line. ``--budget`` is bytes or a share of
the float32 state (``'1/8'``, ``'12.5%'``, ``0.125``). Three diagnostic switches go beyond the
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
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import tierstore._storage.integrity as integrity
from tierstore import TieredAdamW
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.resources import ab_needs, check
from tierstore.cli.bench.step_report import ratio_text
from tierstore.cli.bench.verdict import MIN_REPEATS, OPS, Target, format_verdicts, judge, overall
from tierstore.cli.bench.workload import build
from tierstore.errors import ConfigError
from tierstore.sizes import format_size, parse_budget

TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+)\s*x?\s*$")

REAL_UPDATE = integrity.BlockDigests.update
DEFAULT_BLOCK = integrity.CHECKSUM_BLOCK


def _apply(diag: dict) -> None:
    integrity.CHECKSUM_BLOCK = diag["block"]
    integrity.BlockDigests.update = REAL_UPDATE if diag["checksums"] else (lambda self, rel, view: None)
    os.environ["TIERSTORE_HUGEPAGES"] = "1" if diag["hugepages"] else "0"  # read by every new host buffer


def _row(run: dict, base: list[float]) -> dict:
    rounds = [a / b for a, b in zip(run["s"], base)]
    return {
        "config": run["config"],
        "median_s": statistics.median(run["s"]),
        "min_s": min(run["s"]),
        "paired_vs_first": statistics.median(rounds),
        "paired_rounds": rounds,
        "split_median_s": {k: statistics.median(x[k] for x in run["split"]) for k in run["split"][0]},
        "steps_s": run["s"],
    }


def parse_target(text: str) -> tuple[str, float]:
    """``'<=1.0'``, ``'< 0.95x'``, ``'>=1'``: the operator and the bound of config k's step / the first's.

    Example
    -------
    >>> parse_target("<=1.0"), parse_target("< 0.95x")
    (('<=', 1.0), ('<', 0.95))
    """
    match = TARGET.match(text)
    if match is None:
        raise ConfigError(f"--target {text!r}: write an operator and a ratio, e.g. '<=1.0' (no slower than the "
                          f"first configuration) or '<0.95'; operators: {', '.join(OPS)}")
    return match.group(1), float(match.group(2))


def verdicts(results: list[dict], target: tuple[str, float]) -> list[dict]:
    """Every configuration after the first: its step / the first's, round by round, against ``target``.

    Example
    -------
    >>> rows = [{"config": {}, "paired_rounds": [1, 1, 1]}, {"config": {"prefetch_depth": 1},
    ...         "paired_rounds": [1.1, 1.2, 1.15]}]
    >>> [(v["key"], v["verdict"]) for v in verdicts(rows, ("<=", 1.0))]
    [('vs_first[1]', 'FAIL')]
    """
    op, bound = target
    return [judge(Target(f"vs_first[{k}]", f"config {k} {json.dumps(row['config'])}: step / config 0's "
                         "(round by round)", op, bound, source="--target (default '<=1.0': no slower than the first)"),
                  row["paired_rounds"])
            for k, row in enumerate(results) if k > 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True)
    parser.add_argument("--dir", required=True, help="a directory on the drive under test")
    parser.add_argument("--budget", default="1/8",
                        help="ram_budget: bytes ('512MiB') or a share of the float32 state ('1/8', '12.5%%', 0.125; "
                             "default 1/8), the same for every configuration")
    parser.add_argument("--configs", required=True, help="JSON list of TieredAdamW keyword dicts")
    parser.add_argument("--rounds", type=int, default=5,
                        help=f"timed rounds, each stepping every configuration once (default 5; a verdict needs "
                             f"{MIN_REPEATS})")
    parser.add_argument("--target", default="<=1.0",
                        help="what each configuration's step / the first's must meet (default '<=1.0': no slower)")
    parser.add_argument("--no-durable", action="store_true",
                        help="run every configuration that does not say \"durable\" with durable=False "
                             "(how docs/tuning.md's tables were measured)")
    parser.add_argument("--json", type=Path, help="write the results here (nothing is written without it)")
    args = parser.parse_args(argv)
    numel = int(args.params)
    configs = json.loads(args.configs)
    if args.no_durable:
        configs = [{"durable": False, **c} for c in configs]
    try:  # the API's parsers and errors; a share is of the float32 state (8 B/param)
        budget = parse_budget(args.budget, state_bytes=numel * 8, name="--budget")
        target = parse_target(args.target)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1 ({MIN_REPEATS} for a verdict)")
    # TieredAdamW's default with a state_dir is durable=True: a configuration says when it is not.
    needs = ab_needs(params=numel, ram_budget=budget, configs=len(configs),
                     durable_configs=sum(bool(c.get("durable", True)) for c in configs))
    try:
        check(needs, args.dir, fix="lower --params, or compare fewer configurations per run")
    except ConfigError as exc:
        raise SystemExit(f"ab_step.py: {exc}") from None
    machine = machine_info(args.dir)
    print(hardware_line(machine), flush=True)
    params = build(numel)
    runs = []
    hugepages_env = os.environ.get("TIERSTORE_HUGEPAGES")
    try:
        for cfg in configs:
            cfg = dict(cfg)
            diag = {"block": cfg.pop("block", DEFAULT_BLOCK), "checksums": cfg.pop("checksums", True),
                    "hugepages": cfg.pop("hugepages", True)}
            _apply(diag)
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for p, q in zip(params, copies):
                q.grad = p.grad
            run = {"config": {**cfg, **diag}, "opt": None, "dir": tempfile.mkdtemp(dir=args.dir), "diag": diag,
                   "s": [], "split": []}
            runs.append(run)  # registered before the optimizer exists, so its directory is removed on any error
            run["opt"] = TieredAdamW(copies, state_dir=run["dir"], ram_budget=budget, backend="direct", **cfg)
            run["opt"].step()  # warm-up
            print(json.dumps(run["config"]), run["opt"].describe())
        for r in range(args.rounds):
            for run in runs[r % len(runs):] + runs[: r % len(runs)]:  # a rotating order: no one always first
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
        # The diagnostic switches are process-wide: leave the process as it was (a caller may go on).
        _apply({"block": DEFAULT_BLOCK, "checksums": True, "hugepages": True})
        if hugepages_env is None:
            os.environ.pop("TIERSTORE_HUGEPAGES", None)
        else:
            os.environ["TIERSTORE_HUGEPAGES"] = hugepages_env
    print(f"\n{numel:.3g} fp32 params, ram_budget {format_size(budget)}, {args.rounds} interleaved rounds")
    for k, row in enumerate(results):
        split = ", ".join(f"{key.replace('_', ' ')} {v:.3f} s" for key, v in row["split_median_s"].items())
        print(f"config {k} {json.dumps(row['config'])}: median step {row['median_s']:.3f} s; step / config 0's "
              f"{ratio_text(row['paired_rounds'])}\n  split (medians): {split}")
    found = verdicts(results, target)
    print()
    print(format_verdicts(found))
    if args.json:
        document = {"tool": "bench/ab_step.py", "command": " ".join(sys.argv), "params": numel, "ram_budget": budget,
                    "rounds": args.rounds, "machine": machine, "hardware": hardware_line(machine), "results": results,
                    "verdicts": found, "verdict": overall(found)}
        print(f"wrote {write_json(args.json, document)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
