"""Convergence of the moment formats beside fp32 AdamW, torchao and bitsandbytes 8-bit AdamW.

Trains the demo model and a ~10.8 M-parameter GPT-2 (built from a config, no
download) on the shipped text, the same batches for every optimizer, and
reports final and best held-out eval loss of each and their relative
difference to ``torch.optim.AdamW(fused=True)``. Every model runs once per
batch seed (``--seeds``, three by default: a single run of a small model
scatters by about 2% for any optimizer that is not bitwise fp32); the target,
each compressed format's final eval loss at most 1% above fp32's, is judged
PASS/FAIL on the median over seeds, UNDECIDED with fewer than three. Needs the
``bench`` extra (torchao, bitsandbytes; a contender that cannot run is
reported with its error) and ``matplotlib`` for the PNG. RAM: < 2 GiB. Disk:
none.

    python bench/convergence.py --models demo,gpt2 --steps 1000 \
        --json /tmp/convergence.json --plot /tmp/convergence.png
    # merge JSONs of runs made in parallel processes (one per model or seed):
    python bench/convergence.py --merge a.json b.json --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tierstore.cli.bench import convergence
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.verdict import format_verdicts, overall

# ours-<format>: TieredAdamW(moment_dtype=<format>); ours-<format>-<variant>: the stand-in doing that
# codec variant's math (the rounding and square-root ablations behind the formats' choices).
DEFAULT_CONTENDERS = {
    "demo": [
        "torch-adamw-fp32", "torchao-adamw8bit", "bnb-adamw8bit", "ours-float32", "ours-bfloat16", "ours-int8",
        "ours-bfloat16-stochastic", "ours-int8-stochastic", "ours-int8-nearest-raw",
    ],
    "gpt2": ["torch-adamw-fp32", "torchao-adamw8bit", "bnb-adamw8bit", "ours-bfloat16", "ours-int8"],
}
# Seeds after the first repeat what the targets need (and bitsandbytes, the closest peer), not the ablations.
REPEAT_CONTENDERS = ["torch-adamw-fp32", "ours-bfloat16", "ours-int8", "bnb-adamw8bit"]


def summary(results: dict) -> dict:
    table = {}
    for model, data in results["models"].items():
        for name, rec in data["contenders"].items():
            table[f"{model}/{name}"] = {
                k: rec.get(k) for k in ("final_eval", "best_eval", "final_vs_fp32", "best_vs_fp32", "optimizer_seconds", "error")
            }
    return table


def print_table(results: dict) -> None:
    if results.get("machine"):
        print(hardware_line(results["machine"]))
    print(f"{'model/contender':44s} {'final':>8s} {'best':>8s} {'final vs fp32':>14s} {'best vs fp32':>13s} {'opt s':>7s}")
    for key, row in summary(results).items():
        if row["error"]:
            print(f"{key:44s} error: {row['error']}")
            continue
        final_vs, best_vs = (f"{100 * row[k]:+.2f}%" if row[k] is not None else "no fp32" for k in ("final_vs_fp32", "best_vs_fp32"))
        print(f"{key:44s} {row['final_eval']:8.4f} {row['best_eval']:8.4f} {final_vs:>14s} {best_vs:>13s} {row['optimizer_seconds']:7.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,gpt2")
    ap.add_argument("--contenders", default=None, help="comma list (default: a per-model set)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (results do not depend on it)")
    ap.add_argument("--seeds", default="0,1,2",
                    help="batch seeds, one run of every model each (default 0,1,2: a verdict needs three)")
    ap.add_argument("--batch-seed", type=int, default=None, help="one batch seed only (the same as --seeds N)")
    ap.add_argument("--json", required=True, help="where to write the JSON")
    ap.add_argument("--plot", default=None, help="where to write the loss-curve PNG")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these JSONs instead of training")
    args = ap.parse_args(argv)
    try:
        seeds = [args.batch_seed] if args.batch_seed is not None else [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 0,1,2")
    if not seeds or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds {args.seeds!r}: give each seed once, e.g. 0,1,2")
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        results = {**parts[0], "models": {}, "merged_from": args.merge,
                   "seconds": {name: p.get("seconds") for name, p in zip(args.merge, parts)}}
        for part in parts:  # runs of one model split over processes: their contenders together
            for model, data in part["models"].items():
                if model in results["models"]:
                    results["models"][model]["contenders"].update(data["contenders"])
                else:
                    results["models"][model] = data
        for data in results["models"].values():
            convergence.relative_to_baseline(data)
    else:
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        results = {"tool": "bench/convergence.py", "argv": sys.argv, "machine": machine_info(), "models": {},
                   "schedule": {"warmup_steps": convergence.WARMUP_STEPS, "min_lr_fraction": convergence.MIN_LR_FRACTION,
                                "clip_norm": convergence.CLIP_NORM, "betas": [0.9, 0.999], "eps": 1e-8}}
        for seed in seeds:
            for model_name in args.models.split(","):
                model = model_name if seed == 0 else f"{model_name}@seed{seed}"
                names = (args.contenders.split(",") if args.contenders
                         else DEFAULT_CONTENDERS[model_name] if seed == seeds[0] else REPEAT_CONTENDERS)

                def save(partial: dict, model: str = model) -> None:  # partial results survive an interrupted run
                    results["models"][model] = partial
                    with open(args.json, "w") as fh:
                        json.dump(results, fh, indent=1)

                save(convergence.run_model(
                    model_name, names, steps=args.steps, eval_every=args.eval_every, batch_seed=seed,
                    progress=lambda s: print(s, flush=True), on_contender=save,
                ))
        results["seconds"] = time.perf_counter() - t0
    results["summary"] = summary(results)
    results["verdicts"] = convergence.verdicts(results)
    results["verdict"] = overall(results["verdicts"])
    if results.get("machine"):
        results["hardware"] = hardware_line(results["machine"])
    write_json(args.json, results)
    print_table(results)
    print(format_verdicts(results["verdicts"]))
    if args.plot:
        convergence.plot(results, args.plot)
        print(f"wrote {args.plot}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
