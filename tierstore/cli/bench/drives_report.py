"""What ``tierstore bench io DIR DIR...`` tells its reader: the sweep table, the JSON summary, the plot.

The trials are :class:`~tierstore.cli.bench.drives.DriveTrial`: each drive
alone (kind ``d0``, ``d1``, ...) and every drive at once (kind ``all``), at
each setting once per round. Per setting and round the drives' alone figures
are also added up (kind ``sum``: what perfect striping would reach), and
``all / sum`` is taken round by round. The table reads like DeepSpeed's
``ds_io`` sweep: one row per (request size, workers), read and write GB/s
per drive and all at once; the best settings follow, with a streamed step's
bandwidth (each byte read and written back once: ``1 / (1/read + 1/write)``).

``summary.best_read_GBps`` and ``best_write_GBps`` are the drives together
(what ``tierstore plan --io-json`` reads); ``summary.drives`` holds each
drive's own figures.

Example
-------
>>> from types import SimpleNamespace as T
>>> trials = [T(kind=k, op=op, request_bytes=1 << 20, workers=4, nbytes=10**9, seconds=s, round=r)
...           for r in range(3) for op in ("read", "write") for k, s in (("d0", 1.0), ("d1", 0.5), ("all", 0.4))]
>>> drives = [{"index": 0, "dir": "/a", "backend": "direct"}, {"index": 1, "dir": "/b", "backend": "direct"}]
>>> s = summarize(trials, drives=drives, memory_GBps=[10.0])["summary"]
>>> s["best_read_GBps"], [d["read_GBps"] for d in s["drives"]], round(s["combined"]["vs_sum"]["read"]["median"], 3)
(2.5, [1.0, 2.0], 0.833)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...sizes import format_size
from .palette import MARKERS, OKABE_ITO, SERIES, legend_below
from .report import format_table, gbps, hardware_line, median, new_figure, save_figure
from .verdict import spread

__all__ = ["summarize", "render", "plot", "drive_line", "SUM"]

MiB = 1 << 20
OPS = ("read", "write")
ALL, SUM = "all", "sum"


def _step(read: float | None, write: float | None) -> float | None:
    if not read or not write or read != read or write != write:
        return None
    return 1.0 / (1.0 / read + 1.0 / write)


def _cells(trials: Sequence[Any], drives: int) -> dict[tuple[str, str, int, int], dict[int, float]]:
    """(kind, op, request, workers) -> round -> GB/s, with the ``sum`` of the drives alone per round."""
    groups: dict[tuple[str, str, int, int], dict[int, list[float]]] = {}
    for t in trials:
        groups.setdefault((t.kind, t.op, t.request_bytes, t.workers), {}).setdefault(t.round, []).append(
            gbps(t.nbytes, t.seconds))
    cells = {k: {r: median(v) for r, v in rounds.items()} for k, rounds in groups.items()}
    for (kind, op, r, w), by_round in list(cells.items()):
        if kind != "d0":
            continue
        for rnd in by_round:
            parts = [cells.get((f"d{d}", op, r, w), {}).get(rnd) for d in range(drives)]
            if all(p is not None for p in parts):
                cells.setdefault((SUM, op, r, w), {})[rnd] = sum(parts)
    return cells


def _best_step(settings: Sequence[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The setting where ``kind`` reads and writes back fastest (the step bandwidth of its medians)."""
    by_point: dict[tuple[int, int], dict[str, float]] = {}
    for s in settings:
        if s["kind"] == kind:
            by_point.setdefault((s["request_bytes"], s["workers"]), {})[s["op"]] = s["GBps"]
    best = None
    for (r, w), ops in by_point.items():
        value = _step(ops.get("read"), ops.get("write"))
        if value is not None and (best is None or value > best["GBps"]):
            best = {"GBps": value, "request_bytes": r, "workers": w, "read_GBps": ops["read"], "write_GBps": ops["write"]}
    return best


def summarize(trials: Sequence[Any], *, drives: Sequence[dict[str, Any]], memory_GBps: Sequence[float]) -> dict[str, Any]:
    """Per setting medians and spreads, each drive's and the combined best, ``all / sum`` round by round.

    ``drives`` describe the directories (``index``, ``dir``, ``backend``, ...),
    in order; ``memory_GBps`` one memory-copy bandwidth per round.
    """
    cells = _cells(trials, len(drives))
    settings = []
    for (kind, op, r, w), by_round in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0], kv[0][1])):
        values = [by_round[i] for i in sorted(by_round)]
        s = spread(values)
        row = {"kind": kind, "op": op, "request_bytes": r, "workers": w, "GBps": s["median"], "min_GBps": s["min"],
               "max_GBps": s["max"], "runs": len(values), "GBps_per_round": values}
        if kind == ALL and (SUM, op, r, w) in cells:
            total = cells[(SUM, op, r, w)]
            ratios = [by_round[i] / total[i] for i in sorted(by_round) if total.get(i)]
            row["vs_sum"] = spread(ratios)["median"]
            row["vs_sum_per_round"] = ratios
        settings.append(row)
    best: dict[str, dict[str, dict[str, Any]]] = {}
    for s in settings:
        slot = best.setdefault(s["kind"], {})
        if s["GBps"] == s["GBps"] and (s["op"] not in slot or s["GBps"] > slot[s["op"]]["GBps"]):
            slot[s["op"]] = {"GBps": s["GBps"], "min_GBps": s["min_GBps"], "max_GBps": s["max_GBps"],
                             "request_bytes": s["request_bytes"], "workers": s["workers"]}
    for kind in best:
        step = _best_step(settings, kind)
        if step is not None:
            best[kind]["step"] = step

    def figure(kind: str, op: str) -> float | None:
        return best.get(kind, {}).get(op, {}).get("GBps")

    per_drive = []
    for d in drives:
        kind = f"d{d['index']}"
        per_drive.append({**d, "read_GBps": figure(kind, "read"), "write_GBps": figure(kind, "write"),
                          "step_GBps": best.get(kind, {}).get("step", {}).get("GBps"), "best": best.get(kind, {})})
    combined: dict[str, Any] = {"read_GBps": figure(ALL, "read"), "write_GBps": figure(ALL, "write"),
                                "step_GBps": best.get(ALL, {}).get("step", {}).get("GBps"), "best": best.get(ALL, {})}
    combined["sum_of_drives"] = {op: figure(SUM, op) for op in OPS}
    combined["vs_sum"] = {}
    for op in OPS:
        at = best.get(ALL, {}).get(op)
        if at is not None:
            row = next(s for s in settings if s["kind"] == ALL and s["op"] == op
                       and s["request_bytes"] == at["request_bytes"] and s["workers"] == at["workers"])
            if row.get("vs_sum_per_round"):
                combined["vs_sum"][op] = spread(row["vs_sum_per_round"])
    memory = list(memory_GBps)
    summary = {
        "best_read_GBps": combined["read_GBps"],
        "best_write_GBps": combined["write_GBps"],
        "memory_GBps": max(memory) if memory else float("nan"),
        "memory_GBps_spread": {**spread(memory), "samples": memory},
        "direct_io_supported": all(d.get("direct_io_supported", True) for d in drives),
        "rounds": len({t.round for t in trials}),
        "drives": per_drive,
        "combined": combined,
    }
    return {"settings": settings, "summary": summary}


# -- the terminal report ----------------------------------------------------------
def drive_line(drive: dict[str, Any]) -> str:
    """One drive as the report names it: index, directory, filesystem, backend.

    >>> drive_line({"index": 1, "dir": "/dev/shm/x", "backend": "direct",
    ...             "filesystem": {"fstype": "tmpfs", "device": "tmpfs", "mountpoint": "/dev/shm"}})
    'd1 = /dev/shm/x: tmpfs (tmpfs at /dev/shm), backend direct'
    """
    fs = drive.get("filesystem") or {}
    where = f"{fs['fstype']} ({fs['device']} at {fs['mountpoint']}" if fs else "filesystem unknown"
    what = (fs.get("drive") or {}).get("model") if fs else None
    if fs:
        where += f", {what})" if what else ")"
    return f"d{drive['index']} = {drive['dir']}: {where}, backend {drive['backend']}"


def _fmt(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f} GB/s"


def _at(v: dict[str, Any] | None) -> str:
    return "-" if not v else f"{_fmt(v['GBps'])} @ {format_size(v['request_bytes'])} x{v['workers']}"


def render(result: dict[str, Any], *, machine: dict[str, Any] | None = None) -> str:
    """The sweep table (one row per setting), each drive's best and the drives together."""
    s = result["summary"]
    drives = s["drives"]
    lines = []
    if machine:
        lines.append(hardware_line({k: v for k, v in machine.items() if k != "filesystem"}))
    lines += [drive_line(d) for d in drives]
    lines.append(f"{s['rounds']} interleaved rounds: at each setting every drive alone, then all at once, "
                 "each drive moving a share in proportion to its own read+write bandwidth that round"
                 if len(drives) > 1 else f"{s['rounds']} interleaved rounds of every setting")
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for row in result["settings"]:
        cell = rows.setdefault((row["request_bytes"], row["workers"]),
                               {"request": format_size(row["request_bytes"]), "workers": row["workers"]})
        cell[f"{row['kind']}_{row['op']}"] = row["GBps"]
        if "vs_sum" in row:
            cell[f"ratio_{row['op']}"] = row["vs_sum"]
    columns = [("request", "request", "{}"), ("workers", "workers", "{}")]
    for d in drives:
        columns += [(f"d{d['index']}_{op}", f"d{d['index']} {op[0]}", "{:.2f}") for op in OPS]
    several = len(drives) > 1
    if several:
        columns += [(f"all_{op}", f"all {op[0]}", "{:.2f}") for op in OPS]
        columns += [(f"sum_{op}", f"sum {op[0]}", "{:.2f}") for op in OPS]
        columns += [(f"ratio_{op}", f"all/sum {op[0]}", "{:.2f}") for op in OPS]
    lines += [f"GB/s (median over {s['rounds']} rounds); r = read, w = write; dN = drive N alone"
              + (", all = every drive at once, sum = the drives alone added up" if several else ""),
              format_table([rows[k] for k in sorted(rows)], columns), ""]
    for d in drives:
        b = d["best"]
        lines.append(f"best d{d['index']}: read {_at(b.get('read'))}, write {_at(b.get('write'))}; "
                     f"read+write {_at(b.get('step'))}")
    c = s["combined"]
    b = c["best"]
    if several:
        lines.append(f"best all at once: read {_at(b.get('read'))}, write {_at(b.get('write'))}; "
                     f"read+write {_at(b.get('step'))}")
    ratio = "; ".join(f"{op} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for op, v in c["vs_sum"].items())
    if ratio:
        lines.append(f"all at once / the drives alone added, at the best setting (median, min-max over rounds): {ratio}")
    lines.append(f"host memory copy {_fmt(s['memory_GBps'])}")
    lines.append("read+write: the bandwidth of a streamed step, which reads each byte and writes it back: "
                 "1 / (1/read + 1/write)")
    return "\n".join(lines)


# -- the plot -----------------------------------------------------------------------
def _curve(settings: Sequence[dict[str, Any]], kind: str, op: str, axis: str) -> list[tuple[int, dict[str, Any]]]:
    """Per value of ``axis`` (``request_bytes`` or ``workers``), the setting with the best median."""
    points: dict[int, dict[str, Any]] = {}
    for row in settings:
        if row["kind"] != kind or row["op"] != op or row["GBps"] != row["GBps"]:
            continue
        x = row[axis]
        if x not in points or row["GBps"] > points[x]["GBps"]:
            points[x] = row
    return [(x, points[x]) for x in sorted(points)]


def plot(result: dict[str, Any], path: Path | str, *, title: str) -> Path:
    """Bandwidth against request size (top) and against workers (bottom), reads and writes, per drive and all at once."""
    fig, axes = new_figure(2, width=5.6, height=3.4, nrows=2)
    s = result["summary"]
    kinds = [(f"d{d['index']}", f"d{d['index']} alone: {d['dir']}") for d in s["drives"]]
    kinds += [(ALL, "all drives at once, in proportion"), (SUM, "the drives alone, added up")]
    handles: dict[str, Any] = {}
    for row, (axis, xlabel) in enumerate((("request_bytes", "request size (MiB), at the best worker count"),
                                          ("workers", "workers per drive, at the best request size"))):
        for col, op in enumerate(OPS):
            ax = axes[row * 2 + col]
            for i, (kind, label) in enumerate(kinds):
                pts = _curve(result["settings"], kind, op, axis)
                if not pts:
                    continue
                xs = [x / MiB if axis == "request_bytes" else x for x, _ in pts]
                ys = [p["GBps"] for _, p in pts]
                low = [p["GBps"] - p["min_GBps"] for _, p in pts]
                high = [p["max_GBps"] - p["GBps"] for _, p in pts]
                colour = (OKABE_ITO["black"] if kind == ALL else OKABE_ITO["grey"] if kind == SUM
                          else SERIES[i % len(SERIES)])
                handles[label] = ax.errorbar(
                    xs, ys, yerr=[low, high], marker=MARKERS[i % len(MARKERS)], capsize=3, color=colour,
                    linewidth=2.0 if kind == ALL else 1.3, linestyle="--" if kind == SUM else "-", zorder=3)
            ax.set_xscale("log", base=2)
            values = sorted({row_[axis] for row_ in result["settings"]})
            if values:
                ticks = [v / MiB if axis == "request_bytes" else v for v in values]
                ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
                ax.minorticks_off()
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{op} bandwidth (GB/s)")
            ax.set_title(f"sequential {op}s", fontsize=10)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3, zorder=0)
    legend_below(axes[2], ncol=1, handles=list(handles.values()), labels=list(handles))
    fig.suptitle(f"{title}\npoints: median over {s['rounds']} rounds; whiskers: min to max", fontsize=9)
    return save_figure(fig, path)
