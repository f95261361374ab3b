"""Peak RSS growth over ram_budget in every mode, each run alone in a fresh process.

Runs the scenarios of ``tierstore.testing.memory`` (the kit the RAM-budget
tests use) at a chosen scale and prints, per mode, the budget, the peak RSS
growth over the baseline (taken once the model and its gradients exist and
torch's one-time optimizer import is paid), the overhead beyond the budget
and the state files' page cache. One extra row, ``first optimizer (cold)``,
leaves torch's ``torch._dynamo`` import inside the measurement, as a new user
sees it.

The target (docs/choosing-budget-and-drive.md): peak RSS growth <=
``ram_budget`` + 16 MiB in every mode, one PASS or FAIL per mode (a peak over
a whole run is one measurement). ``--ram-budget`` takes bytes (``'96MiB'``) or
a share of the fp32 state (8 B/param: ``'1/8'``, ``'12.5%'``, ``0.125``); the
report starts with the hardware line. Exit 1 when any mode fails.

Needs RAM for the model (params x 8 bytes for fp32 parameters and gradients)
plus the budget, and disk for two copies of the state (params x 16 bytes
with fp32 parameters, durable) plus a checkpoint (params x 8 bytes).

Usage (the issue's configuration: 1.2e8 params, 96 MiB, ~1 GiB RAM, ~3 GiB disk)::

    python bench/ram_budget.py --params 1.2e8 --ram-budget 96MiB --dir /nvme/tmp \\
        --json bench/results/ram-budget-1.2e8.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.verdict import Target, format_verdicts, judge, overall
from tierstore.errors import ConfigError
from tierstore.sizes import format_size, parse_budget
from tierstore.testing.memory import OVERHEAD_BYTES, run_in_child

SOURCE = "docs/choosing-budget-and-drive.md (the fixed overhead)"

MODES: dict[str, tuple[str, dict]] = {
    "direct": ("steps", {"backend": "direct", "durable": False}),
    "direct durable": ("steps", {"backend": "direct", "durable": True}),
    "direct durable io_workers=1": ("steps", {"backend": "direct", "durable": True, "io_workers": 1}),
    "buffered": ("steps", {"backend": "buffered", "durable": False}),
    "buffered durable": ("steps", {"backend": "buffered", "durable": True}),
    "mmap": ("steps", {"backend": "mmap", "durable": False}),
    "mmap durable": ("steps", {"backend": "mmap", "durable": True}),
    "bf16 params, fp32 masters": ("steps", {"backend": "direct", "durable": True, "dtype": "bfloat16", "params_scale": 2 / 3}),
    "first optimizer (cold)": ("steps", {"backend": "direct", "durable": True, "warm_torch_optim": False}),
    "zarr checkpoint save+load": ("checkpoint", {"backend": "direct", "durable": True, "steps": 1}),
    "DCP save+load": ("dcp", {"backend": "direct", "durable": True, "steps": 1, "load": True}),
    "DCP save, one file per item": ("dcp", {"backend": "direct", "durable": True, "steps": 1, "single_file_per_rank": False}),
}
OFFLINE = ("verify", "export")


def verdicts(rows: list[dict]) -> list[dict]:
    """Each mode's peak RSS growth against its ``ram_budget`` + the fixed overhead (one measurement each).

    Example
    -------
    >>> rows = [{"mode": "direct", "ram_budget": 100 << 20, "peak_growth": 110 << 20},
    ...         {"mode": "mmap", "ram_budget": 100 << 20, "peak_growth": 120 << 20}]
    >>> [v["verdict"] for v in verdicts(rows)]
    ['PASS', 'FAIL']
    """
    return [judge(Target(f"peak_rss[{row['mode']}]", f"{row['mode']}, alone in a child process: peak RSS growth "
                         f"(ram_budget {format_size(row['ram_budget'])} + {format_size(OVERHEAD_BYTES)})", "<=",
                         row["ram_budget"] + OVERHEAD_BYTES, unit="B", source=SOURCE, min_repeats=1),
                  [row["peak_growth"]], note="a peak over the whole run")
            for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="1.2e8", help="fp32 parameters (bf16 runs use 2/3 as many: same state)")
    parser.add_argument("--ram-budget", default="96MiB",
                        help="bytes ('96MiB') or a share of the fp32 state, 8 B/param ('1/8', '12.5%%', 0.125)")
    parser.add_argument("--dir", default=None, help="where state and checkpoints go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated mode names (see MODES; also 'verify', 'export')")
    parser.add_argument("--json", type=Path, default=None, help="write the reports here (never overwritten by default runs)")
    args = parser.parse_args(argv)
    try:
        params = int(float(args.params))
    except ValueError:
        parser.error(f"--params {args.params!r} is not a number; write e.g. 1.2e8")
    try:  # the API's parser and errors; a share is of the fp32 state (exp_avg and exp_avg_sq)
        budget = parse_budget(args.ram_budget, state_bytes=params * 8, name="--ram-budget")
    except ConfigError as exc:
        parser.error(str(exc))
    wanted = None if args.only is None else {m.strip() for m in args.only.split(",")}
    if wanted is not None and wanted - set(MODES) - set(OFFLINE):
        parser.error(f"--only lists unknown {sorted(wanted - set(MODES) - set(OFFLINE))}; "
                     f"choose from {[*MODES, *OFFLINE]}")
    machine = machine_info(args.dir)
    print(hardware_line(machine), flush=True)
    root = Path(tempfile.mkdtemp(prefix="tierstore-ram-budget-", dir=args.dir))
    rows, reports = [], {}
    print(f"{'mode':<30}{'budget':>12}{'peak growth':>14}{'overhead':>12}{'page cache':>14}{'seconds':>9}")
    try:
        for name, (scenario, extra) in MODES.items():
            if wanted is not None and name not in wanted:
                continue
            config = {"params": params, "ram_budget": budget, "steps": args.steps, **extra}
            config["params"] = int(params * config.pop("params_scale", 1))
            config["state_dir"] = str(root / "state")
            config["work_dir"] = str(root)
            rows.append(_run(name, scenario, config, reports))
            shutil.rmtree(root / "state", ignore_errors=True)
        if wanted is None or wanted & set(OFFLINE):
            state = str(root / "offline-state")
            run_in_child("steps", {"params": params, "ram_budget": budget, "durable": True, "steps": 1, "state_dir": state, "work_dir": str(root)})
            for name in OFFLINE:
                if wanted is None or name in wanted:
                    rows.append(_run(f"tierstore {name}", name, {"ram_budget": budget, "state_dir": state, "work_dir": str(root)}, reports))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    found = verdicts(rows)
    print()
    print(format_verdicts(found))
    if args.json:
        out = {
            "tool": "bench/ram_budget.py",
            "command": " ".join(sys.argv),
            "machine": machine,
            "hardware": hardware_line(machine),
            "params": params,
            "ram_budget": budget,
            "overhead_bytes": OVERHEAD_BYTES,
            "summary": rows,
            "reports": reports,
            "verdicts": found,
            "verdict": overall(found),
        }
        print(f"wrote {write_json(args.json, out)}")
    return 0 if all(r["within"] for r in rows) else 1


def _run(name: str, scenario: str, config: dict, reports: dict) -> dict:
    t0 = time.perf_counter()
    report = run_in_child(scenario, config)
    seconds = time.perf_counter() - t0
    cache = "-" if report.cache_peak is None else format_size(report.cache_peak)
    sign = "+" if report.overhead >= 0 else "-"
    print(
        f"{name:<30}{format_size(report.ram_budget):>12}{format_size(report.peak_growth):>14}"
        f"{sign + format_size(abs(report.overhead)):>12}{cache:>14}{seconds:>9.1f}",
        flush=True,
    )
    reports[name] = report.to_json()
    return {
        "mode": name,
        "ram_budget": report.ram_budget,
        "peak_growth": report.peak_growth,
        "overhead": report.overhead,
        "cache_peak": report.cache_peak,
        "within": report.within(),
        "phases": {p.name: p.peak_growth for p in report.phases},
    }


if __name__ == "__main__":
    sys.exit(main())
