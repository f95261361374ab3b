"""What ``tierstore bench io`` tells its reader: the summary, ratios and verdicts, the report, the plot.

Every kind (``raw``, each backend, the ``dd`` baselines) runs once per round
at every setting, in a rotating order, so each setting has one measurement
per round. Ratios are taken round by round (the direct backend against raw
``O_DIRECT`` at the same setting in the same round, against ``dd`` of the
same round), and their spread over the rounds is reported with the median;
the one stated target (direct backend >= 0.9x raw, ``README.md``'s
Performance table) is decided on the median (:mod:`.verdict`).

Example
-------
>>> from types import SimpleNamespace as T
>>> trials = [T(kind=k, op="read", request_bytes=1 << 20, workers=1, nbytes=10**9, seconds=s, round=r)
...           for r in range(3) for k, s in (("raw", 1.0), ("direct", 1.05))]
>>> result = summarize(trials, memory_GBps=[10.0], direct=True)
>>> v = verdicts(result)[0]
>>> v["verdict"], round(v["median"], 3), v["repeats"]
('PASS', 0.952, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...backends import BACKENDS
from ...sizes import format_size
from .palette import MARKERS, OKABE_ITO, SERIES
from .report import format_table, gbps, hardware_line, median, new_figure, save_figure
from .verdict import Target, format_verdicts, judge, spread

__all__ = ["summarize", "verdicts", "render", "plot", "KIND_LABELS", "SOURCE_IO"]

MiB = 1 << 20
OPS = ("read", "write")
DIRECT_KINDS = ("raw", "direct")
SOURCE_IO = "README.md (Performance)"
DIRECT_VS_RAW = 0.9
# What each kind is, in words a reader who never opened the code understands.
KIND_LABELS = {
    "raw": "raw O_DIRECT, no tierstore (the baseline)",
    "direct": "tierstore, direct backend (O_DIRECT)",
    "buffered": "tierstore, buffered backend (page cache)",
    "mmap": "tierstore, mmap backend (page cache)",
}
KIND_COLOURS = {"raw": OKABE_ITO["black"], "direct": SERIES[0], "buffered": SERIES[1], "mmap": SERIES[2]}


def _gbps(t: Any) -> float:
    return gbps(t.nbytes, t.seconds)


def _per_round(trials: Sequence[Any]) -> dict[tuple[str, str, int, int], dict[int, float]]:
    """(kind, op, request, workers) -> round -> GB/s (the median where a kind ran several times in a round)."""
    groups: dict[tuple[str, str, int, int], dict[int, list[float]]] = {}
    for t in trials:
        groups.setdefault((t.kind, t.op, t.request_bytes, t.workers), {}).setdefault(t.round, []).append(_gbps(t))
    return {k: {r: median(v) for r, v in rounds.items()} for k, rounds in groups.items()}


def _with_samples(samples: Sequence[float]) -> dict[str, Any]:
    return {**spread(samples), "samples": [float(v) for v in samples]}


def summarize(trials: Sequence[Any], *, memory_GBps: Sequence[float] | float, direct: bool) -> dict[str, Any]:
    """Medians and spreads per setting, the best setting per kind, per-round ratios and the headline numbers.

    ``trials`` are :class:`~tierstore.cli.bench.io.Trial` (any object with
    ``kind``, ``op``, ``request_bytes``, ``workers``, ``nbytes``, ``seconds``
    and ``round``); ``memory_GBps`` one memory-copy bandwidth per round.
    """
    memory = [memory_GBps] if isinstance(memory_GBps, (int, float)) else list(memory_GBps)
    cells = _per_round(trials)
    settings = []
    for (k, op, r, w), by_round in cells.items():
        values = [by_round[i] for i in sorted(by_round)]
        s = spread(values)
        settings.append({"kind": k, "op": op, "request_bytes": r, "workers": w, "GBps": s["median"],
                         "min_GBps": s["min"], "max_GBps": s["max"], "runs": len(values), "GBps_per_round": values})
    best: dict[str, dict[str, dict[str, Any]]] = {}
    for s in settings:
        slot = best.setdefault(s["kind"], {})
        if s["op"] not in slot or s["GBps"] > slot[s["op"]]["GBps"]:
            slot[s["op"]] = {"GBps": s["GBps"], "min_GBps": s["min_GBps"], "max_GBps": s["max_GBps"],
                             "request_bytes": s["request_bytes"], "workers": s["workers"]}

    def best_of(kinds: Sequence[str], op: str) -> float | None:
        values = [best[k][op]["GBps"] for k in kinds if k in best and op in best[k]]
        return max(values) if values else None

    def only(kind: str, op: str) -> float | None:
        return best.get(kind, {}).get(op, {}).get("GBps")

    drive_kinds = DIRECT_KINDS if direct else tuple(k for k in best if k in BACKENDS)
    summary: dict[str, Any] = {
        "best_read_GBps": best_of(drive_kinds, "read"),
        "best_write_GBps": best_of(drive_kinds, "write"),
        "dd_read_GBps": only("dd", "read"),
        "dd_write_GBps": only("dd", "write"),
        "ddlike_read_GBps": only("dd-like", "read"),
        "ddlike_write_GBps": only("dd-like", "write"),
        "memory_GBps": max(memory) if memory else float("nan"),
        "memory_GBps_spread": _with_samples(memory),
        "direct_io_supported": direct,
        "rounds": len({t.round for t in trials}),
        "best": {k: v for k, v in best.items() if k in ("raw", *BACKENDS)},
    }
    summary["ratios"] = ratios = _ratios(cells, best)
    if "direct" in best and "raw" in best:
        summary["direct_vs_raw"] = {
            op: best["direct"][op]["GBps"] / best["raw"][op]["GBps"]
            for op in OPS if op in best["direct"] and op in best["raw"]
        }
    if "direct_vs_raw_per_setting" in ratios:
        # The README's key: the median over rounds of each round's median over settings.
        summary["direct_vs_raw_per_setting"] = {op: v["median"] for op, v in ratios["direct_vs_raw_per_setting"].items()}
    summary["allocation"] = {
        "fresh_blocks_GBps": only("fresh-blocks", "write"),
        "fallocated_blocks_GBps": only("fallocated-blocks", "write"),
        "overwrite_GBps": only("overwrite-blocks", "write"),
        "tierstore_writes_into": "overwritten blocks: the state file is fallocated at open and every "
        "shard is written once at construction, so steps overwrite allocated, written blocks",
    }
    summary["buffers"] = {
        "untouched_GBps": only("untouched-buffer", "read"),
        "pretouched_GBps": only("pretouched-buffer", "read"),
        "tierstore_reads_into": "pre-touched buffers: HostBuffer faults every arena page in at allocation",
    }
    summary["spread"] = {
        name: {"min_GBps": best[kind][op]["min_GBps"], "max_GBps": best[kind][op]["max_GBps"]}
        for name, kind, op in (("fresh_blocks", "fresh-blocks", "write"), ("fallocated_blocks", "fallocated-blocks", "write"),
                               ("overwrite", "overwrite-blocks", "write"), ("untouched", "untouched-buffer", "read"),
                               ("pretouched", "pretouched-buffer", "read"), ("dd_read", "dd", "read"),
                               ("dd_write", "dd", "write"), ("ddlike_read", "dd-like", "read"),
                               ("ddlike_write", "dd-like", "write"))
        if op in best.get(kind, {})
    }
    return {"settings": settings, "summary": summary}


def _ratios(cells: dict[tuple[str, str, int, int], dict[int, float]],
            best: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per-round ratios with their spread: direct vs raw at each setting, and each backend vs ``dd``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    rounds = sorted({r for by_round in cells.values() for r in by_round})
    for op in OPS:
        per_round = []
        for rnd in rounds:
            # One round's ratio: the median over settings of direct / raw at the same setting.
            values = [cells[("direct", op, r, w)][rnd] / g[rnd]
                      for (k, o, r, w), g in cells.items()
                      if k == "raw" and o == op and g.get(rnd) and rnd in cells.get(("direct", op, r, w), {})]
            if values:
                per_round.append(median(values))
        if per_round:
            out.setdefault("direct_vs_raw_per_setting", {})[op] = _with_samples(per_round)
        dd = next((by_round for (k, o, _, _), by_round in cells.items() if k == "dd" and o == op), None)
        for kind in ("raw", *BACKENDS):
            at = best.get(kind, {}).get(op)
            if dd is None or at is None:
                continue
            mine = cells[(kind, op, at["request_bytes"], at["workers"])]
            samples = [mine[r] / dd[r] for r in rounds if r in mine and dd.get(r)]
            if samples:
                out.setdefault(f"{kind}_vs_dd", {})[op] = _with_samples(samples)
    return out


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets that apply to this run, judged on the per-round ratios."""
    per = result["summary"].get("ratios", {}).get("direct_vs_raw_per_setting", {})
    return [
        judge(Target(f"direct_vs_raw[{op}]", f"{op}s: tierstore's direct backend / raw O_DIRECT at the same request "
                     "size and workers (each round: the median over settings)", ">=", DIRECT_VS_RAW,
                     source=SOURCE_IO), per[op]["samples"])
        for op in OPS if op in per
    ]


# -- the terminal report --------------------------------------------------------
def _fmt(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f} GB/s"


def _range(lo: float | None, hi: float | None) -> str:
    return "" if lo is None or hi is None else f" ({lo:.2f}-{hi:.2f})"


def _grid_rows(settings: Sequence[dict[str, Any]], kinds: Sequence[str]) -> list[dict[str, Any]]:
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for s in settings:
        if s["kind"] not in kinds:
            continue
        row = rows.setdefault((s["request_bytes"], s["workers"]),
                              {"request": format_size(s["request_bytes"]), "workers": s["workers"]})
        row[f"{s['kind']}_{s['op']}"] = s["GBps"]
    return [rows[k] for k in sorted(rows)]


def render(result: dict[str, Any], kinds: Sequence[str], *, machine: dict[str, Any] | None = None,
           verdict_list: Sequence[dict[str, Any]] | None = None) -> str:
    """The terminal report: hardware, the grid table, baselines, ratios with their spread, the verdicts."""
    s = result["summary"]
    rounds = _rounds(result)
    lines = []
    if machine:
        lines.append(hardware_line(machine))
    lines.append(f"{rounds} interleaved rounds: each runs every kind at every setting once, in a rotating order")
    columns = [("request", "request", "{}"), ("workers", "workers", "{}")]
    for op in OPS:
        columns += [(f"{k}_{op}", f"{k} {op[0]}", "{:.2f}") for k in kinds]
    lines += [f"GB/s (median over {rounds} rounds); r = read, w = write",
              format_table(_grid_rows(result["settings"], kinds), columns), ""]
    sp = s.get("spread", {})

    def ranged(key: str, name: str) -> str:
        entry = sp.get(name, {})
        return _fmt(s.get(key) if key in s else None) + _range(entry.get("min_GBps"), entry.get("max_GBps"))

    lines.append(f"best drive read {_fmt(s['best_read_GBps'])}, write {_fmt(s['best_write_GBps'])} (O_DIRECT kinds)")
    lines.append(f"dd (1 MiB, direct)  read {ranged('dd_read_GBps', 'dd_read')}, "
                 f"write {ranged('dd_write_GBps', 'dd_write')} (median, min-max over rounds)")
    lines.append(f"dd-like (python)    read {ranged('ddlike_read_GBps', 'ddlike_read')}, "
                 f"write {ranged('ddlike_write_GBps', 'ddlike_write')}")
    for kind, ops in s["best"].items():
        parts = [f"{op} {_fmt(v['GBps'])} @ {format_size(v['request_bytes'])} x{v['workers']}" for op, v in ops.items()]
        lines.append(f"best {kind:<9} " + ", ".join(parts))
    ratio_names = {"direct_vs_raw_per_setting": "direct / raw at the same setting",
                   **{f"{k}_vs_dd": f"{k} / dd (at its best setting)" for k in ("raw", *BACKENDS)}}
    ratios = s.get("ratios", {})
    if ratios:
        lines.append(f"ratios, round by round (median, min-max over {rounds} rounds):")
    for key, name in ratio_names.items():
        if key in ratios:
            parts = [f"{op} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for op, v in ratios[key].items()]
            lines.append(f"  {name}: " + ", ".join(parts))
    a, b = s["allocation"], s["buffers"]
    lines.append(
        f"writes: new blocks {_fmt(a['fresh_blocks_GBps'])}, fallocated {_fmt(a['fallocated_blocks_GBps'])}, "
        f"overwrite {_fmt(a['overwrite_GBps'])} (tierstore overwrites)"
    )
    lines.append(
        f"reads: into untouched buffer {_fmt(b['untouched_GBps'])}, pre-touched {_fmt(b['pretouched_GBps'])} "
        "(tierstore's arena is pre-touched)"
    )
    mem = s.get("memory_GBps_spread") or {}
    lines.append(f"host memory copy {_fmt(s['memory_GBps'])}"
                 + (f" (best of {mem['repeats']} rounds; range {mem['min']:.2f}-{mem['max']:.2f})"
                    if mem.get("repeats", 0) > 1 else ""))
    lines += ["", format_verdicts(verdicts(result) if verdict_list is None else verdict_list)]
    return "\n".join(lines)


# -- the plot ----------------------------------------------------------------------
def _rounds(result: dict[str, Any]) -> int:
    """Rounds of a result; a JSON from before the summary counted them gives its ``config.rounds``."""
    return result["summary"].get("rounds") or result.get("config", {}).get("rounds") or 1


def _curve(settings: Sequence[dict[str, Any]], kind: str, op: str) -> list[dict[str, Any]]:
    """Per request size, the setting (worker count) with the best median."""
    points: dict[int, dict[str, Any]] = {}
    for row in settings:
        better = row["request_bytes"] not in points or row["GBps"] > points[row["request_bytes"]]["GBps"]
        if row["kind"] == kind and row["op"] == op and row["GBps"] == row["GBps"] and better:
            points[row["request_bytes"]] = row
    return [points[x] for x in sorted(points)]


LABEL_GAP_PT = 9.0  # the centres of two 7-point value labels at least this far apart


def label_offsets(heights_pt: Sequence[float], *, gap: float = LABEL_GAP_PT) -> list[float]:
    """Vertical nudges (points) that keep labels at ``heights_pt`` at least ``gap`` apart, in input order.

    Labels are pushed apart from the middle of each crowded run, so a label
    moves no further than it must.

    Example
    -------
    >>> label_offsets([100.0, 104.0]), label_offsets([10.0, 50.0])
    ([-2.5, 2.5], [0.0, 0.0])
    """
    order = sorted(range(len(heights_pt)), key=lambda i: heights_pt[i])
    # Clusters of labels spaced ``gap`` apart, each centred on the mean of its labels' heights;
    # a cluster that reaches into the one below joins it, until none overlap.
    clusters: list[list[float]] = []  # each: [mean height, count]
    for i in order:
        clusters.append([heights_pt[i], 1])
        while len(clusters) > 1:
            (m0, n0), (m1, n1) = clusters[-2], clusters[-1]
            if (m1 - (n1 - 1) * gap / 2) - (m0 + (n0 - 1) * gap / 2) >= gap - 1e-9:
                break
            clusters[-2:] = [[(m0 * n0 + m1 * n1) / (n0 + n1), n0 + n1]]
    placed = [m + (k - (n - 1) / 2) * gap for m, n in clusters for k in range(n)]
    out = [0.0] * len(heights_pt)
    for rank, i in enumerate(order):
        out[i] = placed[rank] - heights_pt[i]
    return out


def _label_lines(ax: Any, values: Sequence[float]) -> None:
    """The value of each horizontal reference line at its right end, nudged apart where lines lie close
    (the legend names the line, the label gives its height)."""
    if not values:
        return
    bottom, top = ax.get_ylim()
    height_pt = ax.bbox.height * 72.0 / ax.figure.dpi
    heights = [(v - bottom) / (top - bottom) * height_pt for v in values]
    for value, nudge in zip(values, label_offsets(heights)):
        ax.annotate(f"{value:.2f}", xy=(1.0, value), xycoords=("axes fraction", "data"), xytext=(3, nudge),
                    textcoords="offset points", va="center", fontsize=7, color="#555555")


def plot(result: dict[str, Any], path: Path | str, *, kinds: Sequence[str], title: str) -> Path:
    """Bandwidth against request size per kind, reads and writes, beside ``dd``; then blocks and buffers.

    Top: one panel per direction. Bottom left: writes into new, fallocated
    and written blocks, reads into untouched and pre-touched memory. Bottom
    right: the legend of the top panels, where it covers no data.
    """
    fig, axes = new_figure(2, width=6.4, height=3.6, nrows=2, height_ratios=[3.0, 2.0])
    s = result["summary"]
    rounds = _rounds(result)
    sizes = sorted({row["request_bytes"] for row in result["settings"] if row["kind"] in kinds})
    handles: dict[str, Any] = {}
    for ax, op in zip(axes[:2], OPS):
        values: list[float] = []  # the reference lines' heights, labelled once the axis is scaled
        for i, kind in enumerate(kinds):
            pts = _curve(result["settings"], kind, op)
            if not pts:
                continue
            # Nudged apart on the log axis so that whiskers at one request size do not overlap.
            xs = [p["request_bytes"] / MiB * 1.06 ** (i - (len(kinds) - 1) / 2) for p in pts]
            ys = [p["GBps"] for p in pts]
            low = [p["GBps"] - p.get("min_GBps", p["GBps"]) for p in pts]
            high = [p.get("max_GBps", p["GBps"]) - p["GBps"] for p in pts]
            handles[KIND_LABELS.get(kind, kind)] = ax.errorbar(
                xs, ys, yerr=[low, high], marker=MARKERS[i % len(MARKERS)], capsize=3, linewidth=1.5,
                color=KIND_COLOURS.get(kind, SERIES[i % len(SERIES)]), zorder=3)
        for key, style, text in ((f"dd_{op}_GBps", "--", "dd, one thread, 1 MiB O_DIRECT requests"),
                                 (f"ddlike_{op}_GBps", ":", "the same in a Python loop")):
            if s.get(key):
                handles[text] = ax.axhline(s[key], linestyle=style, color=OKABE_ITO["grey"], linewidth=1.5, zorder=2)
                values.append(s[key])
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks([x / MiB for x in sizes], [f"{x / MiB:g}" for x in sizes])
            ax.minorticks_off()
        ax.set_xlabel("request size (MiB), at the best worker count")
        ax.set_ylabel(f"{op} bandwidth (GB/s)")
        ax.set_title(f"sequential {op}s of the test file", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, zorder=0)
        _label_lines(ax, values)
    bars = [
        ("writes into new blocks", s["allocation"]["fresh_blocks_GBps"], False, "fresh_blocks"),
        ("writes into fallocated blocks", s["allocation"]["fallocated_blocks_GBps"], False, "fallocated_blocks"),
        ("overwrites of written blocks", s["allocation"]["overwrite_GBps"], True, "overwrite"),
        ("reads into untouched memory", s["buffers"]["untouched_GBps"], False, "untouched"),
        ("reads into the arena (pre-touched)", s["buffers"]["pretouched_GBps"], True, "pretouched"),
    ]
    bars = [b for b in bars if b[1] is not None]
    from matplotlib.patches import Patch

    ax = axes[2]
    if bars:
        colours = [SERIES[0] if b[2] else OKABE_ITO["orange"] for b in bars]
        sp = s.get("spread", {})
        err = [[max(0.0, v - sp.get(name, {}).get("min_GBps", v)) for _, v, _, name in bars],
               [max(0.0, sp.get(name, {}).get("max_GBps", v) - v) for _, v, _, name in bars]]
        ax.barh([b[0] for b in bars], [b[1] for b in bars], xerr=err, color=colours, height=0.6, capsize=3,
                ecolor="black", zorder=2)
        handles["bar: what tierstore does"] = Patch(color=SERIES[0])
        handles["bar: the alternative"] = Patch(color=OKABE_ITO["orange"])
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3, zorder=0)
    else:
        ax.text(0.5, 0.5, "not measured: the drive refuses O_DIRECT", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("bandwidth (GB/s), raw O_DIRECT, 16 MiB requests x 4 in flight; bar: median, whisker: min-max")
    mem = s.get("memory_GBps")
    ax.set_title("blocks and buffers" + (f" (host memory copy: {mem:.1f} GB/s)" if mem and mem == mem else ""),
                 fontsize=10)
    key = axes[3]
    key.axis("off")
    key.legend(list(handles.values()), list(handles), loc="center left", fontsize=8, frameon=False,
               title=f"points: median over {rounds} rounds; whiskers: min to max", title_fontsize=8)
    lines = [title]
    found = verdicts(result)
    if found:
        lines.append("target: " + "; ".join(
            f"direct / raw {v['key'].partition('[')[2].rstrip(']')}s "
            + (f"{v['median']:.2f}x " if v["repeats"] else "") + f"({v['target']['text']}) {v['verdict']}"
            for v in found))
    fig.suptitle("\n".join(lines), fontsize=9)
    return save_figure(fig, path)
