"""Moment codec throughput (params/s) beside a raw memory copy and the fused AdamW kernel.

Decode and encode of each format and moment field on one shard-sized field,
interleaved round by round with ``copy_`` and the fused AdamW update, so the
ratios hold on a noisy machine. The target (docs/formats.md, Speed): where
the compiled fused update runs int8 or bfloat16, it is faster than the same
update in torch ops, judged PASS/FAIL on the median of the per-round ratios
over >= 3 rounds (UNDECIDED with fewer). The report starts with the hardware
line. RAM: about 40 bytes x --numel (4 Mi elements: ~170 MiB). Disk: none.

    python bench/codec.py --numel 4Mi --rounds 9 --dir /mnt/nvme/scratch --json /tmp/codec.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from tierstore.cli.bench import codec_speed
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.step_report import ratio_text
from tierstore.cli.bench.verdict import MIN_REPEATS, format_verdicts, overall
from tierstore.cli.bench.workload import parse_elements

DEFAULT_FORMATS = "float32,bfloat16,bfloat16@torch,int8,int8@torch,bfloat16-stochastic,int8-stochastic"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="4Mi", help="elements per field, e.g. 4Mi (TieredAdamW's default shard)")
    ap.add_argument("--rounds", type=int, default=9,
                    help=f"timed rounds after a warm-up round (default 9; a verdict needs {MIN_REPEATS})")
    ap.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--dir", default=None, help="also measure this directory's drive (raw O_DIRECT, 12 B x --numel)")
    ap.add_argument("--json", required=True, help="where to write the JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give at least 1 ({MIN_REPEATS} for a verdict)")
    machine = machine_info(args.dir)
    print(hardware_line(machine), flush=True)
    result = codec_speed.measure(
        numel=parse_elements(args.numel), rounds=args.rounds, formats=args.formats.split(","), threads=args.threads,
        drive=args.dir,
    )
    found = codec_speed.verdicts(result)
    result = {"tool": "bench/codec.py", "argv": sys.argv, "machine": machine, "hardware": hardware_line(machine),
              "torch_threads": torch.get_num_threads(), **result, "verdicts": found, "verdict": overall(found)}
    per_s = result["params_per_s"]
    print(f"{result['numel']} elements, {result['threads']} threads, median of {result['rounds']} rounds (M params/s)")
    for name, value in per_s.items():
        print(f"  {name:36s} {value / 1e6:9.1f}   {value / per_s['adamw']:6.2f}x adamw")
    print("per format, a step's codec work (decode + encode of both moments), the whole update, the drive:")
    for name, row in result["summary"].items():
        drives = "  ".join(f"{g} GB/s: {row[f'drive_{g}GBps_params_per_s'] / 1e6:.0f}" for g in codec_speed.DRIVE_GBPS)
        update = f"update {row['update_params_per_s'] / 1e6:.0f} M/s; " if "update_params_per_s" in row else ""
        measured = (f"; this drive: {row['drive_measured_params_per_s'] / 1e6:.0f}"
                    if "drive_measured_params_per_s" in row else "")
        print(f"  {name:22s} codec {row['codec_params_per_s'] / 1e6:8.1f} M/s = {row['codec_over_adamw']:5.2f}x adamw; "
              f"{update}drive-bound M params/s at {drives}{measured} ({row['bytes_per_param']:.2f} B/param each way)")
    if "drive" in result:
        d = result["drive"]
        print(f"drive under {d['dir']}: read {d['read_GBps']:.2f} GB/s, write {d['write_GBps']:.2f} GB/s (raw O_DIRECT, same run)")
    seconds = result["seconds"]
    for name in codec_speed.COMPILED_TARGETS:
        if f"update/{name}" in seconds and f"update/{name}@torch" in seconds:
            rounds = [t / o for o, t in zip(seconds[f"update/{name}"], seconds[f"update/{name}@torch"]) if o > 0]
            how = "compiled" if result["compiled"].get(name) else "no compiled kernel here: torch ops both times"
            print(f"update/{name} params/s / update/{name}@torch's: {ratio_text(rounds)} ({how})")
    print()
    print(format_verdicts(found))
    print(f"wrote {write_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
