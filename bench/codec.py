"""Moment codec throughput (params/s) beside a raw memory copy and the fused AdamW kernel.

Decode and encode of each format and moment field on one shard-sized field,
interleaved round by round with ``copy_`` and the fused AdamW update, so the
ratios hold on a noisy machine. RAM: about 40 bytes x --numel (4 Mi elements:
~170 MiB). Disk: none.

    python bench/codec.py --numel 4Mi --rounds 9 --dir /mnt/nvme/scratch --json /tmp/codec.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tierstore.cli.bench import codec_speed
from tierstore.cli.bench.report import machine_info
from tierstore.cli.bench.workload import parse_elements

DEFAULT_FORMATS = "float32,bfloat16,bfloat16@torch,int8,int8@torch,bfloat16-stochastic,int8-stochastic"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="4Mi", help="elements per field, e.g. 4Mi (TieredAdamW's default shard)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--dir", default=None, help="also measure this directory's drive (raw O_DIRECT, 12 B x --numel)")
    ap.add_argument("--json", required=True, help="where to write the JSON")
    args = ap.parse_args(argv)
    result = codec_speed.measure(
        numel=parse_elements(args.numel), rounds=args.rounds, formats=args.formats.split(","), threads=args.threads,
        drive=args.dir,
    )
    result = {"tool": "bench/codec.py", "argv": sys.argv, "machine": machine_info(),
              "torch_threads": torch.get_num_threads(), **result}
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
