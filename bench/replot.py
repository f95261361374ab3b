#!/usr/bin/env python
"""Re-render a benchmark's report, verdicts and plot from its JSON with today's code (nothing is measured).

Prints the terminal report a run of the current code prints for the
measurements the JSON holds (the hardware line, the figures with their spread
over rounds, each target with PASS/FAIL/UNDECIDED); ``--plot`` writes the PNG
of the benchmarks that draw one (``bench step``, ``bench io``,
``bench/convergence.py``). A JSON written by an older version is read as it
is: what it did not record is recomputed from what it did (per-round ratios
from per-step times, ``bench io``'s summary from its trials) or reported as
missing, never made up. The JSON itself is not changed.

Example
-------
    python bench/replot.py bench/results/step-disk-2e8.json --plot bench/results/step-disk-2e8.png
    python bench/replot.py bench/results/io.json --plot bench/results/io.png
    python bench/replot.py bench/results/durability-5e7.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from tierstore.cli.bench.report import hardware_line
from tierstore.cli.bench.verdict import format_verdicts

PLOTS = ("tierstore bench step", "tierstore bench io", "bench/convergence.py", "bench/multi_drive.py")


def _script(name: str) -> ModuleType:
    """A sibling script of this one (``bench/<name>.py``) as a module, for its report functions."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_of(doc: dict[str, Any]) -> str:
    """Which benchmark wrote ``doc`` (older JSON without a ``tool`` key are told by their ``command``).

    Example
    -------
    >>> tool_of({"tool": "bench overlap"}), tool_of({"command": "bench/ab_step.py --params 2e8"})
    ('bench overlap', 'bench/ab_step.py')
    """
    if not isinstance(doc, dict):
        return "unknown"
    if "tool" in doc:
        return doc["tool"]
    command = str(doc.get("command", ""))
    for script in ("ab_step", "ram_budget"):
        if f"{script}.py" in command:
            return f"bench/{script}.py"
    return "unknown"


def _step(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import step, step_report

    if plot:
        print(f"wrote {step_report.plot(doc, plot, title=step.plot_title(doc))}", file=sys.stderr)
    return step_report.render(doc, step_report.verdicts(doc))


def _io(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import io_report
    from tierstore.sizes import format_size

    if len(doc.get("config", {}).get("dirs") or []) > 1:
        return _io_drives(doc, plot)

    # The summary is recomputed from the trials: spreads and per-round ratios that older runs did not keep.
    trials = [SimpleNamespace(**t) for t in doc["trials"]]
    direct = doc["summary"].get("direct_io_supported", True)
    result = io_report.summarize(trials, memory_GBps=doc.get("memory_GBps_samples") or doc["summary"]["memory_GBps"],
                                 direct=direct)
    cfg = doc["config"]
    kinds = (["raw"] if direct else []) + [b for b in cfg["backends"] if b != "direct" or direct]
    if plot:
        title = f"tierstore bench io: {cfg['dir']} ({format_size(cfg['size'])} per transfer)"
        print(f"wrote {io_report.plot(result, plot, kinds=kinds, title=title)}", file=sys.stderr)
    return io_report.render(result, kinds, machine=doc.get("machine"))


def _io_drives(doc: dict[str, Any], plot: str | None) -> str:
    """``bench io`` over several directories: the sweep's summary recomputed from its trials."""
    from tierstore.cli.bench import drives_report
    from tierstore.sizes import format_size

    trials = [SimpleNamespace(**t) for t in doc["trials"]]
    result = drives_report.summarize(trials, drives=doc["drives"], memory_GBps=doc.get("memory_GBps_samples") or [])
    if plot:
        cfg = doc["config"]
        title = f"tierstore bench io: {', '.join(cfg['dirs'])} ({format_size(cfg['size'])} per transfer)"
        print(f"wrote {drives_report.plot(result, plot, title=title)}", file=sys.stderr)
    return drives_report.render(result, machine=doc.get("machine"))


def _multi_drive(doc: dict[str, Any], plot: str | None) -> str:
    script = _script("multi_drive")
    if plot:
        script.plot(doc, plot)
        print(f"wrote {plot}", file=sys.stderr)
    return script.render(doc)


def _convergence(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import convergence

    if plot:
        convergence.plot(doc, plot)
        print(f"wrote {plot}", file=sys.stderr)
    lines = [hardware_line(doc["machine"])] if doc.get("machine") else []
    for model, seeds in convergence.by_model(doc).items():
        for seed, run in sorted(seeds.items()):
            finals = ", ".join(f"{convergence.contender_label(n)} {100 * r['final_vs_fp32']:+.2f}%"
                               for n, r in run["contenders"].items()
                               if r.get("final_vs_fp32") is not None and n != convergence.BASELINE)
            lines.append(f"{model}, batch seed {seed}: final eval loss vs fp32: {finals}")
    return "\n".join([*lines, "", format_verdicts(convergence.verdicts(doc))])


def _formats_step(doc: dict[str, Any], plot: str | None) -> str:
    found = _script("formats_step").verdicts(doc["results"], keep_master=doc.get("keep_master", True),
                                                params=doc.get("params"))
    return _with_hardware(doc, format_verdicts(found))


def _ab_step(doc: dict[str, Any], plot: str | None) -> str:
    ab = _script("ab_step")
    base = doc["results"][0]["steps_s"]
    for row in doc["results"]:  # older JSON kept the steps, not their per-round ratios
        row.setdefault("paired_rounds", [a / b for a, b in zip(row["steps_s"], base)])
    return _with_hardware(doc, format_verdicts(ab.verdicts(doc["results"], ab.parse_target("<=1.0"))))


def _codec(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import codec_speed

    if "seconds" not in doc:
        return _with_hardware(doc, "targets: this JSON kept medians only, no per-round seconds: nothing to judge")
    return _with_hardware(doc, format_verdicts(codec_speed.verdicts(doc)))


def _ram_budget(doc: dict[str, Any], plot: str | None) -> str:
    return _with_hardware(doc, format_verdicts(_script("ram_budget").verdicts(doc["summary"])))


def _overlap(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import overlap

    return overlap.render(doc)


def _durability(doc: dict[str, Any], plot: str | None) -> str:
    from tierstore.cli.bench import durability

    return durability.render(doc)


def _kernel_parts(doc: dict[str, Any], plot: str | None) -> str:
    lines = [f"{name}: time / full's {statistics.median(a / b for a, b in zip(row['seconds'], doc['results']['full']['seconds'])):.3f}x"
             for name, row in doc["results"].items()]
    return _with_hardware(doc, "\n".join([*lines, format_verdicts([])]))


def _with_hardware(doc: dict[str, Any], text: str) -> str:
    machine = doc.get("machine") or {}
    if machine.get("cpus"):
        return f"{hardware_line(machine)}\n{text}"
    # Older JSON of some scripts kept the platform only: say so rather than print a line of unknowns.
    known = ", ".join(f"{k} {v}" for k, v in machine.items() if isinstance(v, str)) or "nothing"
    return f"hardware: not recorded in this JSON (it has {known})\n{text}"


REPORTS = {
    "tierstore bench step": _step,
    "tierstore bench io": _io,
    "bench/convergence.py": _convergence,
    "bench/formats_step.py": _formats_step,
    "bench/ab_step.py": _ab_step,
    "bench/codec.py": _codec,
    "bench/ram_budget.py": _ram_budget,
    "bench overlap": _overlap,
    "bench durability": _durability,
    "bench/kernel_parts.py": _kernel_parts,
    "bench/multi_drive.py": _multi_drive,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="a benchmark's JSON (bench/results/*.json)")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help=f"write its plot (benchmarks that draw one: {', '.join(PLOTS)})")
    args = parser.parse_args(argv)
    try:
        doc = json.loads(args.json.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"{args.json}: cannot read it as JSON ({exc})")
    tool = tool_of(doc)
    if tool not in REPORTS:
        parser.error(f"{args.json}: written by {tool!r}, which this script cannot re-render; it knows {sorted(REPORTS)}")
    if args.plot and tool not in PLOTS:
        parser.error(f"--plot: {tool} draws no plot; only {', '.join(PLOTS)} do")
    print(REPORTS[tool](doc, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
