"""What ``tierstore bench step`` tells its reader: targets and verdicts, the terminal report, the plot.

The targets are the project's own claims (``README.md``'s Performance table
and ``bench/README.md``'s full runs); each verdict is decided on the median
of the per-round ratios (rounds interleave the contenders) with the spread
beside it (:mod:`.verdict`). The same functions work on a result just
measured and on a JSON document kept from an earlier run
(``bench/replot.py``).

Example
-------
>>> label("floor-serial 8.00 MiBx4")
'raw I/O: read all, then write all (8 MiB requests, 4 in flight)'
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from ...sizes import format_size
from .palette import OKABE_ITO, legend_below
from .report import format_table, hardware_line, new_figure, save_figure
from .verdict import Target, format_verdicts, judge, spread

MiB = 1 << 20
SPLIT_PARTS = ("read_wait", "update", "write_wait", "commit_wait")  # measured parts; "rest" is the remainder
SOURCE_RAM = "README.md, Performance; bench/README.md, full run 2"
SOURCE_DISK = "README.md, Performance; bench/README.md, full run 3"
SOURCE_DURABLE = "README.md, Performance (durable / not durable, streamed)"
SOURCE_FORMATS = "README.md, Performance; bench/README.md (formats_step.py)"
FORMAT_TARGETS = {"bfloat16": 0.72, "int8": 0.60}  # step time / float32's, with fp32 masters
RSS_SLACK = 64 * MiB  # peak RSS may exceed ram_budget by this much (allocator, interpreter, torch)

# The split of a step, in plain words (the JSON keys are the names on the left).
SPLIT_LABELS = {
    "read_wait": "waiting for reads",
    "update": "AdamW update",
    "write_wait": "waiting for writes",
    "commit_wait": "waiting for a background commit",
    "rest": "rest of the step: gradients in, parameters out, starting a commit, bookkeeping",
}
# Okabe-Ito yellow is hard to see on white: the commit wait is reddish purple.
SPLIT_COLOURS = {"read_wait": OKABE_ITO["sky blue"], "update": OKABE_ITO["bluish green"],
                 "write_wait": OKABE_ITO["vermillion"], "commit_wait": OKABE_ITO["reddish purple"],
                 "rest": OKABE_ITO["grey"]}
TITLE_CHARS = 170  # a plot title's lines wrap here (the figure is 10 inches wide, 9-point text)
SAME_FLOOR = 0.05  # the bandwidth floor within 5% of the I/O floor is drawn as one line, not two


def is_durable(name: str, entry: dict[str, Any]) -> bool:
    """Whether a disk contender ran durable: its entry says so; JSON kept from before durability was
    the default named the durable runs ``...-durable`` and left the others plain."""
    if "durable" in entry:
        return bool(entry["durable"])
    return "-durable" in name and "-not-durable" not in name


def label(name: str, entry: dict[str, Any] | None = None) -> str:
    """A contender's name in plain words, for plots (``entry``: its JSON entry, for its durability)."""
    if name.startswith("floor-"):
        mode, _, setting = name.partition(" ")
        request, _, depth = setting.partition("x")
        how = "read all, then write all" if mode == "floor-serial" else "reads and writes overlapped"
        size = request.replace(".00 ", " ")
        return f"raw I/O: {how} ({size} requests, {depth} in flight)" if setting else f"raw I/O: {how}"
    if name == "tierstore-ram":
        return "TieredAdamW, all state in RAM"
    if name == "torch-fused":
        return "torch.optim.AdamW(fused=True)"
    if name == "peer-pipelined-swap":
        return "DeepSpeed-style swapper (re-created)"
    if name.startswith("tierstore-disk"):
        durable = is_durable(name, {"durable": "-not-durable" not in name} if entry is None else entry)
        rest = name.removeprefix("tierstore-disk").replace("not-durable", "").replace("durable", "").strip("-")
        rest = rest.replace("--", "-")
        words = ["TieredAdamW, state on disk", "durable" if durable else "not durable"]
        if rest:
            words.append(rest.replace("-", ", "))
        return ", ".join(words)
    return name


def _colour(name: str) -> str:
    if name.startswith("floor-"):
        return OKABE_ITO["grey"]
    if name == "torch-fused":
        return OKABE_ITO["orange"]
    if name == "peer-pipelined-swap":
        return OKABE_ITO["reddish purple"]
    return OKABE_ITO["blue"]


def split_of(entry: dict[str, Any]) -> dict[str, float]:
    """A contender's median step split: read wait, update, write wait, commit wait, and the rest.

    ``rest`` is the step's wall time outside those: gathering gradients and
    writing parameters back, starting a commit, and the loop's bookkeeping.

    Example
    -------
    >>> split_of({"median_s": 1.0, "read_wait": 0.25, "update": 0.5, "write_wait": 0.125})
    {'read_wait': 0.25, 'update': 0.5, 'write_wait': 0.125, 'rest': 0.125}
    """
    split = {k: entry[k] for k in SPLIT_PARTS if k in entry}
    if split:
        split["rest"] = max(0.0, entry["median_s"] - sum(split.values()))
    return split


def round_floors(
    per: dict[str, dict[str, Any]], summary: dict[str, Any], *, disk_bytes: int, read_bytes: int, written_bytes: int
) -> list[float] | None:
    """The I/O floor of every round: for the floors' own bytes, the fastest floor contender of that
    round or that round's bandwidth floor, whichever is smaller; for other bytes (durable, compressed),
    the bandwidth floor of those bytes at that round's raw bandwidths (the run's best where a JSON
    from before per-round bandwidths was kept holds none)."""
    floors = [e for n, e in per.items() if n.startswith("floor-")]
    if not floors:
        return None
    rounds = min(len(e["steps_s"]) for e in floors)
    serial = [e for n, e in per.items() if n.startswith("floor-serial")]

    def bandwidth(r: int, key: str, best: str) -> float | None:
        values = [e[f"{key}_steps"][r] for e in serial if f"{key}_steps" in e]
        return max(values) if values else summary.get(best)

    out = []
    for r in range(rounds):
        read_bw, write_bw = bandwidth(r, "read_GBps", "raw_read_GBps"), bandwidth(r, "write_GBps", "raw_write_GBps")
        bw_floor = None
        if read_bw and write_bw:
            bw_floor = read_bytes / (read_bw * 1e9) + written_bytes / (write_bw * 1e9)
        if (read_bytes, written_bytes) == (disk_bytes, disk_bytes):
            measured = min(e["steps_s"][r] for e in floors)
            out.append(measured if bw_floor is None else min(measured, bw_floor))
        elif bw_floor is not None:
            out.append(bw_floor)
        else:
            return None
    return out


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Round by round ``a / b`` (rounds both ran)."""
    return [x / y for x, y in zip(a, b) if y > 0]


def ratio_text(rounds: list[float] | None, fallback: float | None = None) -> str:
    """A ratio as the verdicts use it: the median of per-round ratios with their range.

    ``fallback`` (a ratio of medians) is shown only where no per-round ratios exist.

    Example
    -------
    >>> ratio_text([1.1, 0.9, 1.3])
    '1.10x (median of 3 per-round ratios, range 0.90-1.30)'
    >>> ratio_text([1.2]), ratio_text(None, 0.95)
    ('1.20x (one round)', '0.95x (ratio of medians; no per-round ratios)')
    """
    s = spread(rounds or [])
    if s["repeats"] == 0:
        return "-" if fallback is None else f"{fallback:.2f}x (ratio of medians; no per-round ratios)"
    if s["repeats"] == 1:
        return f"{s['median']:.2f}x (one round)"
    return f"{s['median']:.2f}x (median of {s['repeats']} per-round ratios, range {s['min']:.2f}-{s['max']:.2f})"


# -- targets and verdicts ---------------------------------------------------------
def verdicts(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target that applies to this run, judged (``document``: ``contenders``, ``summary``,
    ``footprint``, ``config`` as ``bench step`` writes them)."""
    per, s = document["contenders"], document["summary"]
    cfg = document.get("config", {})
    out: list[dict[str, Any]] = []
    if "ram_vs_torch_rounds" in s or ("tierstore-ram" in per and "torch-fused" in per):
        rounds = s.get("ram_vs_torch_rounds") or [t / o for t, o in zip(per["torch-fused"]["steps_s"],
                                                                         per["tierstore-ram"]["steps_s"])]
        out.append(judge(Target("ram_vs_torch", "all in RAM: TieredAdamW's params/s / torch.optim.AdamW(fused=True)'s "
                                "(= torch's step time / ours)", ">=", 0.95, source=SOURCE_RAM), rounds,
                         note=scale_note(cfg, 5 * 10**7)))
    for name, d in s.get("disk", {}).items():
        floor_rounds = over_floor_rounds(document, name)
        if floor_rounds is not None:
            out.append(judge(Target(f"over_floor[{name}]", f"{name}: step time / I/O floor (its bytes moved, "
                                    "no update)", "<=", 1.10, source=SOURCE_DISK), floor_rounds,
                             note=scale_note(cfg, 2 * 10**8)))
        if "peer_over_ours_rounds" in d or ("peer_over_ours" in d and "peer-pipelined-swap" in per):
            rounds = d.get("peer_over_ours_rounds") or [p / o for p, o in zip(per["peer-pipelined-swap"]["steps_s"],
                                                                               per[name]["steps_s"])]
            out.append(judge(Target(f"peer_over_ours[{name}]", f"{name}: DeepSpeed-style swapper's step time / "
                                    "ours", ">", 1.0, source=SOURCE_DISK), rounds, note=scale_note(cfg, 2 * 10**8)))
        twin = name.replace("-durable", "") if "-not-durable" not in name else None  # a JSON from before
        if "vs_not_durable_rounds" not in d and twin in per and is_durable(name, per[name]) \
                and not is_durable(twin, per[twin]):
            d = {**d, "vs_not_durable_rounds": ratios(per[name]["steps_s"], per[twin]["steps_s"])}
        if "vs_not_durable_rounds" in d:
            out.append(judge(Target(f"durable_over_not_durable[{name}]", f"{name}: step time / durable=False's",
                                    "<=", 1.05, source=SOURCE_DURABLE), d["vs_not_durable_rounds"]))
        fmt = next((f for f in FORMAT_TARGETS if name.endswith(f"-{f}")), None)
        if fmt and "vs_float32_rounds" in d:
            note = None if cfg.get("keep_master") else "the target is stated for fp32 masters (--keep-master)"
            out.append(judge(Target(f"vs_float32[{name}]", f"{name}: step time / float32's", "<=",
                                    FORMAT_TARGETS[fmt], source=SOURCE_FORMATS), d["vs_float32_rounds"], note=note))
    for name, f in (document.get("footprint") or {}).items():
        if "error" in f or f.get("peak_over_baseline_bytes") is None:
            continue
        budget = f["ram_budget"]
        out.append(judge(Target(f"peak_rss[{name}]", f"{name}, alone in a child process: peak RSS above its "
                                f"baseline (ram_budget {format_size(budget)} + 64 MiB)", "<=", budget + RSS_SLACK,
                                unit="B", source=SOURCE_DISK, min_repeats=1), [f["peak_over_baseline_bytes"]],
                         note="a peak over the whole run"))
        if f.get("backend") == "direct" and f.get("state_file_cached_bytes") is not None:
            out.append(judge(Target(f"page_cache[{name}]", f"{name}, direct backend: its state files in the "
                                    "page cache", "<=", 0, unit="B", source=SOURCE_DISK, min_repeats=1),
                             [f["state_file_cached_bytes"]], note="measured at the end of the run"))
    return out


def over_floor_rounds(document: dict[str, Any], name: str) -> list[float] | None:
    """Disk contender ``name``'s step / I/O floor, round by round (recomputed for a JSON from before
    per-round ratios were kept); None where no floor ran."""
    per, s = document["contenders"], document["summary"]
    d = s.get("disk", {}).get(name, {})
    if "over_floor_rounds" in d:
        return d["over_floor_rounds"]
    if "over_floor" not in d:
        return None
    floors = round_floors(per, s, disk_bytes=s["disk_bytes"], read_bytes=d.get("read_bytes", s["disk_bytes"]),
                          written_bytes=d.get("written_bytes", s["disk_bytes"]))
    return ratios(per[name]["steps_s"], floors) if floors else None


def scale_note(cfg: dict[str, Any], stated: int) -> str | None:
    """A warning when the run is much smaller than the size the target is stated for: per-step
    overheads (thread hand-offs, Python) weigh more in a small step."""
    params = cfg.get("params")
    if params and params < stated / 4:
        return f"the target is stated for {stated:.0e} params; at {params:.1e} fixed per-step costs weigh more"
    return None


# -- the terminal report ---------------------------------------------------------
def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def durability_line(cfg: dict[str, Any]) -> str:
    """Which durability the disk runs used, against TieredAdamW's default."""
    modes = cfg.get("durable", [True])
    if modes == [True]:
        return ("disk runs: durable=True, TieredAdamW's default with a state_dir (every commit survives a crash); "
                "--durable off or both to measure durable=False")
    if modes == [False]:
        return ("disk runs: durable=False (--durable off): unlike TieredAdamW's default, nothing survives a crash; "
                "drop --durable off to measure what users run")
    return "disk runs: durable=True (TieredAdamW's default) and durable=False side by side (--durable both)"


def render(document: dict[str, Any], verdict_list: list[dict[str, Any]]) -> str:
    """The terminal report: hardware, durability, the table, the floors and splits, the verdicts."""
    per, s = document["contenders"], document["summary"]
    floor = s.get("floor_seconds")
    rounds = max((len(e["steps_s"]) for e in per.values()), default=0)
    rows = []
    for name, e in per.items():
        rows.append({
            "name": name, "median": e["median_s"], "min": e["min_s"], "max": e.get("max_s", max(e["steps_s"])),
            "mps": e["params_per_s"] / 1e6, "floor": e["median_s"] / floor if floor else None, "cpu": e.get("cpu_s"),
            **{k: e.get(k) for k in ("read_wait", "update", "write_wait")},
        })
    columns = [("name", "contender", "{}"), ("median", "median s", "{:.3f}"), ("min", "min s", "{:.3f}"),
               ("max", "max s", "{:.3f}"), ("mps", "Mparams/s", "{:.1f}"), ("floor", "x floor", "{:.2f}"),
               ("cpu", "cpu s", "{:.3f}"), ("read_wait", "read wait", "{:.3f}"), ("update", "update", "{:.3f}"),
               ("write_wait", "write wait", "{:.3f}")]
    lines = []
    if document.get("machine"):
        lines.append(hardware_line(document["machine"]))
    if s.get("disk"):  # no disk run (--skip disk): nothing to say about durability
        lines.append(durability_line(document.get("config", {})))
    lines.append(f"{rounds} timed rounds, each running every contender once in a rotating order (interleaved)")
    lines += [format_table(rows, columns), ""]
    lines.append(f"{s['params']:,} params; {format_size(s['disk_bytes'])} on disk, moved each way per step")
    if "ram_vs_torch" in s:
        rounds_ram = s.get("ram_vs_torch_rounds") or ratios(per["torch-fused"]["steps_s"], per["tierstore-ram"]["steps_s"])
        lines.append(f"all in RAM: TieredAdamW's params/s / torch.optim.AdamW(fused=True)'s "
                     f"{ratio_text(rounds_ram, s['ram_vs_torch'])}")
    if floor:
        lines.append(
            f"I/O floor {_fmt_s(floor)}: fastest raw {_fmt_s(s.get('floor_fastest_measured_seconds'))} "
            f"({s.get('floor_fastest_measured', '-')}), bandwidth floor {_fmt_s(s.get('floor_bandwidth_seconds'))} "
            f"(read {s.get('raw_read_GBps', float('nan')):.2f} GB/s, write {s.get('raw_write_GBps', float('nan')):.2f} GB/s)"
        )
    for name, d in s.get("disk", {}).items():
        head = f"{name}: median step {_fmt_s(d['step_s'])}"
        if "over_floor" in d:
            head += (f"; step / I/O floor {ratio_text(over_floor_rounds(document, name), d['over_floor'])}; "
                     f"overlap efficiency (floor / median step) {d['overlap_efficiency']:.2f}")
        if "update_hidden_fraction" in d:
            head += f", update hidden {d['update_hidden_fraction']:.0%}"
        lines.append(head)
        parts = []
        if "peer_over_ours" in d:
            peer_rounds = d.get("peer_over_ours_rounds")
            if peer_rounds is None and "peer-pipelined-swap" in per:  # a JSON from before per-round ratios
                peer_rounds = ratios(per["peer-pipelined-swap"]["steps_s"], per[name]["steps_s"])
            parts.append(f"DeepSpeed-style swapper's step / ours {ratio_text(peer_rounds, d['peer_over_ours'])}")
        if "vs_float32_paired" in d:
            parts.append(f"step / float32's {ratio_text(d.get('vs_float32_rounds'), d['vs_float32_paired'])}")
        if "vs_not_durable_paired" in d:
            parts.append(f"step / durable=False's "
                         f"{ratio_text(d.get('vs_not_durable_rounds'), d['vs_not_durable_paired'])}")
        lines += [f"  {p}" for p in parts]
        if "split_s" in d:
            # "other" is what JSON kept from before the remainder was named "rest" calls it.
            split = ", ".join(f"{'rest' if k == 'other' else k.replace('_', ' ')} {v:.3f} s"
                              for k, v in d["split_s"].items())
            lines.append(f"  split: {split}; shards read {d.get('reads')}, still in RAM from the last step "
                         f"{d.get('cache_hits')}")
    if any("split_s" in d for d in s.get("disk", {}).values()):
        lines.append(f"  (rest: {SPLIT_LABELS['rest'].removeprefix('rest of the step: ')})")
    for name, f in (document.get("footprint") or {}).items():
        if "error" in f:
            lines.append(f"footprint ({name}): failed: {f['error']}")
            continue
        over = f.get("peak_over_baseline_bytes")
        lines.append(
            f"footprint ({name}: {f.get('backend')}, alone): peak RSS {format_size(over or 0)} above baseline "
            f"{format_size(f.get('baseline_rss_bytes') or 0)}, budget {format_size(f['ram_budget'])}; "
            f"state {f['state_bytes'] / max(1, f['ram_budget']):.1f}x the budget; state file in page cache "
            f"{format_size(f.get('state_file_cached_bytes') or 0)}, system page cache "
            f"{'+' if (f.get('meminfo_cached_delta_bytes') or 0) >= 0 else '-'}"
            f"{format_size(abs(f.get('meminfo_cached_delta_bytes') or 0))}"
        )
    lines += [f"note: {n}" for n in document.get("notes", [])]
    lines += ["", format_verdicts(verdict_list)]
    return "\n".join(lines)


# -- the plot ----------------------------------------------------------------------
def plot(document: dict[str, Any], path: Path | str, *, title: str) -> Path:
    """Step time per contender (median, range over rounds) with the I/O floor, and the disk steps' split."""
    per, s = document["contenders"], document["summary"]
    names = list(per)
    split_names = [n for n in names if "read_wait" in per[n]]
    rows = [len(names) + 2.5, max(1, len(split_names)) + 3.0]  # bars plus room for the legend below
    fig, (top, bottom_ax) = new_figure(1, width=10.0, height=0.3 * sum(rows), nrows=2, height_ratios=rows)
    labels = [label(n, per[n]) for n in names]
    medians = [per[n]["median_s"] for n in names]
    lows = [per[n]["median_s"] - per[n]["min_s"] for n in names]
    highs = [per[n].get("max_s", max(per[n]["steps_s"])) - per[n]["median_s"] for n in names]
    top.barh(labels, medians, xerr=[lows, highs], color=[_colour(n) for n in names], ecolor="black",
             capsize=3, height=0.6, zorder=2)
    floor, bandwidth = s.get("floor_seconds"), s.get("floor_bandwidth_seconds")
    refs = []
    if floor:
        # Two lines a few pixels apart read as one smudge: within 5%, one line names both.
        same = bandwidth and abs(bandwidth - floor) <= SAME_FLOOR * floor
        both = "" if not same else " (= the bandwidth floor)" if f"{bandwidth:.3g}" == f"{floor:.3g}" \
            else f" (the bandwidth floor, {bandwidth:.3g} s, is within 5%)"
        refs.append((floor, "-", f"I/O floor {floor:.3g} s: the fastest way found to read and write the same bytes "
                     "with no update" + both))
        if bandwidth and not same:
            refs.append((bandwidth, ":", f"bandwidth floor {bandwidth:.3g} s: bytes / read GB/s + bytes / write GB/s "
                         "(raw I/O, same run)"))
    for value, style, text in refs:
        # Drawn over the bars (zorder): the floor is the reference every bar is read against.
        top.axvline(value, color="black", linestyle=style, linewidth=1.8, label=text, zorder=4)
    top.set_xlabel("seconds per step (bar: median over rounds; whisker: min to max)")
    top.set_title("step time per contender", fontsize=10)
    split_labels = [label(n, per[n]) for n in split_names]
    # Parts no contender spent time in (an all-in-RAM step's read wait) would only lengthen the legend.
    splits = [split_of(per[n]) for n in split_names]
    tallest = max((sum(sp.values()) for sp in splits), default=0.0)
    keys = [k for k in SPLIT_LABELS if any(sp.get(k, 0.0) > 0.005 * tallest for sp in splits)]
    left = [0.0] * len(split_names)
    for key in keys:
        values = [split_of(per[n]).get(key, 0.0) for n in split_names]
        bottom_ax.barh(split_labels, values, left=left, color=SPLIT_COLOURS[key], label=SPLIT_LABELS[key],
                       height=0.6, edgecolor="white", linewidth=0.5, zorder=2)
        left = [b + v for b, v in zip(left, values)]
    if floor and split_names:
        bottom_ax.axvline(floor, color="black", linestyle="-", linewidth=1.8, zorder=4, label=f"I/O floor {floor:.3g} s")
    bottom_ax.set_xlabel("seconds per step, median of each part")
    bottom_ax.set_title("where the step's time goes", fontsize=10)
    limit = max([*medians, *(m + h for m, h in zip(medians, highs)), *left, floor or 0.0]) * 1.05
    for ax in (top, bottom_ax):
        ax.invert_yaxis()
        ax.set_xlim(0, limit)  # one scale for both panels: the parts add up to the bars above
        ax.grid(axis="x", alpha=0.3, zorder=0)
    if refs:
        legend_below(top, ncol=1)
    if split_names:
        legend_below(bottom_ax, ncol=2)
    else:
        bottom_ax.set_visible(False)
    # Wrapped: with several disk runs the targets run to a dozen, and one line would widen the figure.
    lines = textwrap.wrap(title, TITLE_CHARS)
    found = verdicts(document)
    if found:
        lines += textwrap.wrap("targets: " + "; ".join(short_verdict(v, several=len(s.get("disk", {})) > 1)
                                                      for v in found), TITLE_CHARS)
    fig.suptitle("\n".join(lines), fontsize=9)
    return save_figure(fig, path)


SHORT = {"ram_vs_torch": "RAM vs torch", "over_floor": "step / floor", "peer_over_ours": "DeepSpeed-style / ours",
         "durable_over_not_durable": "durable / not", "vs_float32": "vs float32", "peak_rss": "peak RSS",
         "page_cache": "page cache"}


def short_verdict(v: dict[str, Any], *, several: bool = False) -> str:
    """A verdict in a few words, for a plot's title: ``'step / floor 1.17x (<= 1.10x) FAIL'``.

    Example
    -------
    >>> from .verdict import Target, judge
    >>> short_verdict(judge(Target("over_floor[tierstore-disk]", "", "<=", 1.1), [1.2, 1.17, 1.1]))
    'step / floor 1.17x (<= 1.10x) FAIL'
    """
    kind, _, name = v["key"].partition("[")
    text = SHORT.get(kind, kind)
    if several and name:
        text = f"{short_name(name.rstrip(']'))}: {text}"
    value = "" if v["repeats"] == 0 else _short_value(v["median"], v["target"]["unit"]) + " "
    return f"{text} {value}({v['target']['text']}) {v['verdict']}"


def short_name(name: str) -> str:
    """A disk contender in a few plain words, for a plot's title.

    Example
    -------
    >>> short_name("tierstore-disk-not-durable-int8"), short_name("tierstore-disk-mmap")
    ('on disk, not durable, int8', 'on disk, mmap')
    """
    if not name.startswith("tierstore-disk"):
        return name
    rest = name.removeprefix("tierstore-disk").replace("not-durable", "not durable")
    return ", ".join(["on disk", *(part for part in rest.split("-") if part)])


def _short_value(value: float, unit: str) -> str:
    if unit == "B":
        return format_size(int(value))
    return f"{value:.2f}{unit}" if unit == "x" else f"{value:.3g} {unit}"
