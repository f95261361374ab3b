#!/usr/bin/env python
"""Issue 25's targets for a state over several drives, interleaved in one run, with a verdict per target.

Two drives of different speed: ``--dir`` (the disk under test) and a faster
second drive (``--fast DIR``; else an ext4 loop device backed by a file in
tmpfs where ``losetup``/``mkfs.ext4``/``mount`` are allowed, else a tmpfs
directory: :func:`tierstore.testing.drives.second_drive`, and the report
says which). Five optimizers over copies of the same parameters, each under
the same ``ram_budget`` with ``durable=False`` (the streamed step alone, as
the tuning tables measure it), and the striped I/O floor, step in a rotating
order round by round:

- ``striped``: the state over both drives, placed by the optimizer's own
  probe (the defaults);
- ``disk alone``, ``fast alone``: the state on one drive;
- ``same-drive pair``: the state over two directories of the disk;
- ``tuned``: over both drives with the knobs file ``tierstore tune`` wrote
  for them in this run (the knobs it picked are in the JSON);
- the **striped floor**: each drive's raw bandwidth is measured alone (read
  and write back the step's streamed bytes through tierstore's I/O queue,
  no update), then both drives at once each read and write back a share in
  proportion to it: the time the combined drives need for the step's bytes.

Targets (judged on per-round ratios; ``tierstore.cli.bench.verdict``):
``striped`` <= 1.15x the striped floor, and < 1x the faster drive alone;
``same-drive pair`` <= 1.05x ``disk alone``; ``tuned`` <= 1x ``striped``.

Then **a state larger than RAM** (``--big-params``, bf16 parameters whose
state with fp32 masters is 12 B/param, 3x the parameters' RAM) streams over
two directories of the disk in child processes confined by a memory cgroup
(where this machine allows one; the report says) to less RAM than the
state: run X takes 4 durable steps; run Y takes 2, closes, and a new process
resumes it for 2 more. Targets: each run's peak RSS growth <= ram_budget +
16 MiB (the budget's contract), and Y's committed state is bitwise X's
(every shard's stored bytes, read back with the state reader).

Needs (checked first): about 4 B/param x 7 of RAM and 12 B/param x 6 of
disk for ``--params``; the big state twice over on the disk (durable: two
copies each), and 4 B/param + the budget + ``--big-headroom`` (1.5 GiB) of RAM for ``--big-params``.

Usage::

    python bench/multi_drive.py --dir /tmp/scratch --params 2e7 --rounds 7 --big-params 4e8 \\
        --json bench/results/multi-drive-2e7.json --plot bench/results/multi-drive-2e7.png
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
SOURCE = "issue 25 (targets)"
ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("striped", "disk alone", "fast alone", "same-drive pair", "tuned")


# -- the child of the larger-than-RAM runs ----------------------------------------------------
def child(config: dict[str, Any]) -> int:
    """One run of the big state, in its own process: build (or resume), step, close; peak RSS per phase."""
    from tierstore import TieredAdamW
    from tierstore.testing.memory import MemoryProbe, _warm_torch_optim, build_params

    params = build_params(int(config["params"]), "bfloat16")
    _warm_torch_optim()
    probe = MemoryProbe()
    probe.baseline()
    with probe.phase("construct"):
        opt = TieredAdamW(params, lr=1e-3, state_dir=config["dirs"], ram_budget=int(config["ram_budget"]),
                          durable=True, resume=bool(config["resume"]))
    info = {"describe": opt.describe(), "state_bytes": opt.plan.state_nbytes, "step_count": opt.step_count}
    with probe.phase("steps"):
        for _ in range(int(config["steps"])):
            opt.step()
    with probe.phase("close"):
        opt.close()
    import torch

    digest = hashlib.sha256()
    for p in params:  # bf16: hashed as its 16-bit patterns
        digest.update(p.detach().view(torch.int16).numpy().tobytes())
    out = {**info, "baseline_rss": probe.base_rss, "params_sha256": digest.hexdigest(),
           "phases": [{"name": ph.name, "peak_growth": ph.peak_growth, "end_growth": ph.end_growth,
                       "seconds": ph.seconds} for ph in probe.phases]}
    print("MULTI-DRIVE-CHILD " + json.dumps(out), flush=True)
    return 0


def _memory_roots() -> list[tuple[Path, str]]:
    """Where a memory cgroup can be made, and its limit file: cgroup v2's root, else v1's memory hierarchy."""
    roots = []
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "memory" in (v2 / "cgroup.controllers").read_text().split():
            roots.append((v2, "memory.max"))
    if (Path("/sys/fs/cgroup/memory") / "memory.limit_in_bytes").exists():
        roots.append((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"))
    return roots


class MemoryCgroup:
    """A memory cgroup limiting a child process to ``limit`` bytes; ``why`` says which, or why there is none."""

    def __init__(self, limit: int) -> None:
        self.limit, self.path, self.procs = limit, None, None
        self.why = "no memory cgroup hierarchy is mounted here: the runs are not confined"
        for base, limit_file in _memory_roots():
            path = base / f"tierstore-multi-drive-{os.getpid()}"
            try:
                path.mkdir()
                (path / limit_file).write_text(str(limit))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    path.rmdir()
                self.why = f"no memory cgroup could be made under {base} ({exc.strerror}): the runs are not confined"
                continue
            with contextlib.suppress(OSError):  # v1: no swap either, where the kernel has that knob
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            self.path, self.procs = path, path / "cgroup.procs"
            self.why = f"memory cgroup {path} limits each run to {limit / 2**30:.2f} GiB"
            return

    def enter(self) -> None:
        """Move the calling process into the cgroup (the child runs it before exec)."""
        if self.procs is not None:
            self.procs.write_text(str(os.getpid()))

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None


def run_child(config: dict[str, Any], cgroup: MemoryCgroup) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True,
                          env=env, preexec_fn=cgroup.enter, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MULTI-DRIVE-CHILD ")]
    if proc.returncode != 0 or not lines:
        killed = " (killed: over the memory limit?)" if proc.returncode in (-9, 137) else ""
        raise RuntimeError(f"big-state child failed, exit {proc.returncode}{killed}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def state_digest(home: Path) -> tuple[str, int]:
    """sha256 over every shard's stored bytes in layout order (placement-independent), and the step."""
    from tierstore._state.reader import StateReader

    digest = hashlib.sha256()
    with StateReader(home) as reader:
        for _, extent in reader.iter_extents():
            digest.update(extent.numpy().tobytes())
        return digest.hexdigest(), reader.step_count


def big_state(args: argparse.Namespace, disk: Path, report: dict[str, Any]) -> list[dict[str, Any]]:
    """The larger-than-RAM runs: X uninterrupted, Y stopped and resumed in a new process; peaks and bitwise check."""
    from tierstore.cli.bench.verdict import Target, judge
    from tierstore.sizes import format_size
    from tierstore.testing.memory import OVERHEAD_BYTES

    params, budget = args.big_params, args.big_budget
    state = 12 * params
    limit = 4 * params + budget + OVERHEAD_BYTES + args.big_headroom
    cgroup = MemoryCgroup(limit)
    runs: dict[str, dict[str, Any]] = {}
    folders = {name: [disk / f"big-{name}-a", disk / f"big-{name}-b"] for name in ("X", "Y")}
    try:
        plan = (("X", 4, False), ("Y first", 2, False), ("Y resumed", 2, True))
        for name, steps, resume in plan:
            dirs = [str(d) for d in folders[name[0]]]
            print(f"big state: run {name} ({steps} steps{', resumed' if resume else ''}) in a child: {cgroup.why}", flush=True)
            runs[name] = run_child({"params": params, "ram_budget": budget, "dirs": dirs, "steps": steps,
                                    "resume": resume}, cgroup)
        x, y = (state_digest(folders[n][0]) for n in ("X", "Y"))
    finally:
        cgroup.close()
        for dirs in folders.values():
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
    same = x == y and runs["X"]["params_sha256"] == runs["Y resumed"]["params_sha256"]
    report["big"] = {"params": params, "ram_budget": budget, "state_bytes": runs["X"]["state_bytes"],
                     "memory_limit": limit if cgroup.procs is not None else None, "cgroup": cgroup.why,
                     "state_over_limit": runs["X"]["state_bytes"] / limit, "runs": runs,
                     "x_digest": x[0], "y_digest": y[0], "steps": [x[1], y[1]], "bitwise": same}
    found = []
    for name, run in runs.items():
        top = max(run["phases"], key=lambda ph: ph["peak_growth"])
        found.append(judge(Target(f"big_peak_rss[{name}]", f"state {format_size(state)} over two directories, run {name}: "
                                  f"peak RSS growth (ram_budget {format_size(budget)} + {format_size(OVERHEAD_BYTES)})",
                                  "<=", budget + OVERHEAD_BYTES, unit="B", source=SOURCE, min_repeats=1),
                           [top["peak_growth"]], note=f"the run's peak, in its {top['name']} phase"))
    found.append(judge(Target("big_resume_bitwise", "the resumed run's committed state and parameters are the "
                              "uninterrupted run's, byte for byte (1 = identical)", ">=", 1.0, source=SOURCE,
                              min_repeats=1), [1.0 if same else 0.0]))
    return found


# -- the interleaved runs --------------------------------------------------------------------
def _clone(base: list) -> list:
    copies = [p.detach().clone().requires_grad_() for p in base]
    for copy, p in zip(copies, base):
        copy.grad = p.grad
    return copies


def interleaved(args: argparse.Namespace, disk: Path, fast: Path, knobs: Path | None) -> dict[str, Any]:
    """Every configuration and the floor, one step each per round in a rotating order."""
    from tierstore import TieredAdamW
    from tierstore.cli.bench.drives import DriveSet, proportional_shares
    from tierstore.cli.bench.workload import build

    layout = {"striped": [disk / "striped", fast / "striped"], "disk alone": [disk / "alone"],
              "fast alone": [fast / "alone"], "same-drive pair": [disk / "pair-1", disk / "pair-2"],
              "tuned": [disk / "tuned", fast / "tuned"]}
    names = [n for n in CONFIGS if n != "tuned" or knobs is not None]
    base = build(args.params)
    opts = {}
    rows: dict[str, Any] = {n: {"seconds": [], "split": []} for n in [*names, "floor"]}
    drives = None
    load: list[float] = []
    try:
        for name in names:
            dirs = [str(d) for d in layout[name]]
            opts[name] = TieredAdamW(_clone(base), lr=1e-3, state_dir=dirs if len(dirs) > 1 else dirs[0],
                                     ram_budget=args.budget, durable=False,
                                     knobs=str(knobs) if name == "tuned" else None)
            rows[name]["describe"] = opts[name].describe()
            print(f"{name}: {rows[name]['describe']}", flush=True)
        streamed = opts["striped"].plan.disk_nbytes
        for d in (disk / "floor", fast / "floor"):
            d.mkdir()
        drives = DriveSet([disk / "floor", fast / "floor"], size=streamed - streamed % MiB).open()
        for opt in opts.values():
            opt.step()  # warm-up: the arena fills, the update's threads start
        for rnd in range(args.rounds):
            rows_load = os.getloadavg()[0]  # other work on the machine, before the round: noise to read with the ratios
            order = [*names, "floor"]
            order = order[rnd % len(order):] + order[: rnd % len(order)]
            for name in order:
                if name == "floor":
                    request, workers = 1 << 20, 8  # the defaults' requests in flight
                    # No sync after the writes: the steps are not durable either (a commit would sync). Reads
                    # and writes overlap, as the store's separate read and write workers let them.
                    io = dict(request_bytes=request, workers=workers, sync=False, overlap=True)
                    alone = [drives.read_write_back([drives.size if k == i else 0 for k in range(2)], **io)
                             for i in range(2)]
                    shares = proportional_shares(drives.size, [drives.size / s for s in alone], align=MiB, cap=drives.size)
                    seconds = drives.read_write_back(shares, **io)
                    rows["floor"]["seconds"].append(seconds * streamed / drives.size)
                    rows["floor"]["split"].append({"alone_s": alone, "shares": shares})
                    continue
                t0 = time.perf_counter()
                opts[name].step()
                rows[name]["seconds"].append(time.perf_counter() - t0)
                s = opts[name].last_step_stats
                rows[name]["split"].append({"read_wait": s.read_wait, "update": s.update, "write_wait": s.write_wait,
                                            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written})
            load.append(rows_load)
            print(f"round {rnd + 1}/{args.rounds} (load {rows_load:.1f}): " + ", ".join(f"{n} {rows[n]['seconds'][-1]:.3f} s" for n in order), flush=True)
    finally:
        for opt in opts.values():
            opt.close()
        if drives is not None:
            drives.close()
        for d in [*(d for dirs in layout.values() for d in dirs), disk / "floor", fast / "floor"]:
            shutil.rmtree(d, ignore_errors=True)
    return {"streamed_bytes": streamed, "rows": rows, "load_average_before_rounds": load}


def verdicts_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-round ratios of the interleaved runs against their targets."""
    from tierstore.cli.bench.verdict import Target, judge

    r = {n: v["seconds"] for n, v in result["rows"].items()}
    rounds = range(len(r["striped"]))
    found = [
        judge(Target("striped_vs_floor", "two drives of different speed: striped step / the striped I/O floor", "<=",
                     1.15, source=SOURCE), [r["striped"][k] / r["floor"][k] for k in rounds]),
        judge(Target("striped_vs_fastest_alone", "striped step / the faster drive alone (each round's faster)", "<",
                     1.0, source=SOURCE), [r["striped"][k] / min(r["disk alone"][k], r["fast alone"][k]) for k in rounds]),
        judge(Target("same_drive_pair_vs_one", "two directories on the same drive: step / the one-directory step",
                     "<=", 1.05, source=SOURCE), [r["same-drive pair"][k] / r["disk alone"][k] for k in rounds]),
    ]
    if "tuned" in r:
        found.append(judge(Target("tuned_vs_defaults", "tierstore tune's knobs: step / the defaults' (striped) step",
                                  "<=", 1.0, source=SOURCE), [r["tuned"][k] / r["striped"][k] for k in rounds]))
    return found


def render(doc: dict[str, Any]) -> str:
    """The terminal report (bench/replot.py prints it again from the JSON)."""
    from tierstore.cli.bench.report import format_table, hardware_line
    from tierstore.cli.bench.verdict import format_verdicts
    from tierstore.sizes import format_size

    lines = [hardware_line({k: v for k, v in doc["machine"].items() if k != "filesystem"}),
             f"disk: {doc['drives']['disk']}", f"fast: {doc['drives']['fast']}"]
    inter = doc.get("interleaved")
    if inter:
        rows = []
        for name, row in inter["rows"].items():
            s = row["seconds"]
            split = row["split"]
            entry = {"config": name, "median": statistics.median(s), "min": min(s), "max": max(s)}
            if name != "floor":
                for key in ("read_wait", "update", "write_wait"):
                    entry[key] = statistics.median(x[key] for x in split)
            rows.append(entry)
        loads = inter.get("load_average_before_rounds") or [float("nan")]
        lines += [f"{doc['config']['params']:,} fp32 params, ram_budget {doc['config']['budget']}, durable=False; "
                  f"{format_size(inter['streamed_bytes'])} streamed a step; {len(inter['rows']['striped']['seconds'])} "
                  f"rounds, the order rotating; load average {min(loads):.1f}-{max(loads):.1f} before the rounds",
                  format_table(rows, [("config", "config", "{}"), ("median", "step s (median)", "{:.3f}"),
                                      ("min", "min", "{:.3f}"), ("max", "max", "{:.3f}"),
                                      ("read_wait", "read wait", "{:.3f}"), ("update", "update", "{:.3f}"),
                                      ("write_wait", "write wait", "{:.3f}")])]
        for name, row in inter["rows"].items():
            if "; over " in row.get("describe", ""):
                lines.append(f"  {name}: {row['describe'].split('; over ', 1)[-1]}")
    if doc.get("tune"):
        lines.append(f"tune picked {doc['tune']['knobs']}" + (" (THE DEFAULTS: its picks were not faster)" if doc["tune"]["fallback"] else ""))
    big = doc.get("big")
    if big and "error" in big:
        lines.append(f"big state: a run failed: {big['error'].splitlines()[0]}")
    elif big:
        limit = "not confined" if big["memory_limit"] is None else f"a {format_size(big['memory_limit'])} memory limit"
        lines.append(f"big state: {format_size(big['state_bytes'])} ({big['params']:,} bf16 params) over two directories "
                     f"under {limit} ({big['state_over_limit']:.2f}x the limit); {big['cgroup']}")
        for name, run in big["runs"].items():
            peaks = ", ".join(f"{ph['name']} {format_size(ph['peak_growth'])}" for ph in run["phases"])
            lines.append(f"  run {name}: peak RSS growth {peaks}")
    lines += ["", format_verdicts(doc["verdicts"])]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> None:
    """Step seconds per configuration and round beside the floor; the per-round ratios against their targets."""
    from tierstore.cli.bench.palette import MARKERS, OKABE_ITO, SERIES
    from tierstore.cli.bench.report import new_figure, save_figure

    fig, axes = new_figure(2, width=5.6, height=3.6)
    rows = doc["interleaved"]["rows"]
    ax = axes[0]
    for i, (name, row) in enumerate(rows.items()):
        colour = OKABE_ITO["grey"] if name == "floor" else SERIES[i % len(SERIES)]
        ax.plot(range(1, len(row["seconds"]) + 1), row["seconds"], marker=MARKERS[i % len(MARKERS)], color=colour,
                linestyle="--" if name == "floor" else "-", label="striped I/O floor" if name == "floor" else name)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("step seconds")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("each step, round by round (interleaved)", fontsize=10)
    ax = axes[1]
    ratios = [v for v in doc["verdicts"] if v["target"]["unit"] == "x" and v["repeats"] > 1]
    for i, v in enumerate(ratios):
        ax.scatter([i] * len(v["samples"]), v["samples"], color=SERIES[i % len(SERIES)], zorder=3)
        ax.hlines(v["median"], i - 0.3, i + 0.3, color="black", zorder=4)
        ax.hlines(v["target"]["bound"], i - 0.4, i + 0.4, color=OKABE_ITO["vermillion"], linestyle=":", zorder=2)
    names = [v["key"].replace("_vs_", "\n/ ").replace("_", " ") for v in ratios]
    ax.set_xticks(range(len(ratios)), [f"{n}\n{v['verdict']}" for n, v in zip(names, ratios)], fontsize=7)
    ax.set_ylabel("ratio (per round; bar: median; dotted: target)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("targets", fontsize=10)
    fig.suptitle(f"bench/multi_drive.py: {doc['hardware']}", fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help="a directory on the disk under test (removed files only)")
    parser.add_argument("--fast", default=None, help="a directory on a faster drive (default: a loop device in tmpfs, else tmpfs)")
    parser.add_argument("--no-loop", action="store_true", help="a tmpfs directory as the fast drive, not a loop device")
    parser.add_argument("--params", default="2e7", help="fp32 parameters of the interleaved runs (default 2e7)")
    parser.add_argument("--budget", default="1/8", help="their ram_budget (default 1/8 of the state)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7; a verdict needs 3)")
    parser.add_argument("--big-params", default="4e8", help="bf16 parameters of the larger-than-RAM runs (0: skip)")
    parser.add_argument("--big-budget", default="256MiB", help="their ram_budget (default 256MiB)")
    parser.add_argument("--big-headroom", default="1536MiB", help="RAM the child gets beyond parameters, budget and "
                        "overhead: the interpreter, torch and what building the parameters leaves, 0.3-0.9 GB on "
                        "Linux with torch 2.13 (default 1536MiB)")
    parser.add_argument("--tune-size", default="256MiB", help="tune's bytes per transfer per drive (default 256MiB)")
    parser.add_argument("--skip", default="", help="comma list: tune, big")
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like an exception, so the loop device, the cgroup and the state files are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.child:
        return child(json.loads(args.child))
    from tierstore.cli import main as cli
    from tierstore.cli.bench.report import hardware_line, machine_info, write_json
    from tierstore.cli.bench.resources import PROCESS_BYTES, Needs, check
    from tierstore.cli.bench.verdict import overall
    from tierstore.errors import ConfigError
    from tierstore.planner.inputs import parse_count
    from tierstore.sizes import parse_size
    from tierstore.testing.drives import filesystem_of, second_drive

    if not args.dir:
        parser.error("--dir is required")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"tune", "big"}:
        raise ConfigError(f"--skip {args.skip!r}: only tune and big can be skipped")
    if args.rounds < 1:
        raise ConfigError(f"--rounds={args.rounds} must be >= 1")
    args.params = parse_count(args.params, name="--params")
    args.big_params = 0 if args.big_params in ("0", "") or "big" in skip else parse_count(args.big_params, name="--big-params")
    args.big_budget = parse_size(args.big_budget, name="--big-budget")
    args.big_headroom = parse_size(args.big_headroom, name="--big-headroom")
    args.tune_size = parse_size(args.tune_size, name="--tune-size")
    work = Path(args.dir).expanduser() / f"multi-drive-{os.getpid()}"
    state = 8 * args.params
    check(Needs(f"multi_drive.py --params {args.params:.3g}", ram=PROCESS_BYTES + 4 * args.params * 7,
                disk=8 * state + 2 * 2 * 12 * args.big_params), Path(args.dir), fix="lower --params or --big-params")
    work.mkdir(parents=True)
    fast_drive = None
    started = time.time()
    doc: dict[str, Any] = {"tool": "bench/multi_drive.py", "argv": sys.argv, "config": {
        "params": args.params, "budget": args.budget, "rounds": args.rounds, "big_params": args.big_params,
        "big_budget": args.big_budget, "skip": sorted(skip)}}
    try:
        if args.fast:
            fast = Path(args.fast).expanduser() / f"multi-drive-{os.getpid()}"
            fast.mkdir(parents=True)
            kind = f"given: {args.fast}"
        else:
            # The fast drive holds three states' streamed shards, the floor's file and tune's test files.
            fast_drive = second_drive(work, loop=not args.no_loop, loop_bytes=6 * state + 2 * args.tune_size + 256 * MiB)
            fast, kind = fast_drive.path, fast_drive.describe()
        doc["drives"] = {"disk": f"{work} on {filesystem_of(work)}", "fast": kind if fast_drive else f"{kind} on {filesystem_of(fast)}"}
        doc["machine"] = machine_info(work)
        doc["hardware"] = hardware_line({k: v for k, v in doc["machine"].items() if k != "filesystem"})
        print(doc["hardware"], flush=True)
        knobs = None
        if "tune" not in skip:
            knobs = work / "tuned.json"
            (work / "tune-disk").mkdir()
            (fast / "tune-fast").mkdir()
            rc = cli(["tune", str(work / "tune-disk"), str(fast / "tune-fast"), "--out", str(knobs),
                      "--step-params", str(args.params), "--size", str(args.tune_size), "--step-rounds", "3"])
            if rc != 0:
                raise RuntimeError(f"tierstore tune failed (exit {rc})")
            tuned = json.loads(knobs.read_text())
            doc["tune"] = {"knobs": tuned["knobs"], "fallback": tuned["fallback"], "file": tuned}
        doc["interleaved"] = interleaved(args, work, fast, knobs)
        doc["verdicts"] = verdicts_of(doc["interleaved"])
        if args.big_params:
            try:
                doc["verdicts"] += big_state(args, work, doc)
            except RuntimeError as exc:  # a run killed or failed: a finding, with the figures of the rest kept
                from tierstore.cli.bench.verdict import Target, judge

                print(exc, file=sys.stderr)
                doc["big"] = {"error": str(exc)[-2000:]}
                doc["verdicts"].append(judge(Target("big_runs", "the larger-than-RAM runs completed (1 = all did)",
                                                    ">=", 1.0, source=SOURCE, min_repeats=1), [0.0],
                                             note=str(exc).splitlines()[0]))
    finally:
        if fast_drive is not None:
            fast_drive.close()  # unmounted first: the mount point lies under the work directory
        shutil.rmtree(work, ignore_errors=True)
        if args.fast:
            shutil.rmtree(Path(args.fast).expanduser() / f"multi-drive-{os.getpid()}", ignore_errors=True)
    doc["duration_s"] = time.time() - started
    doc["verdict"] = overall(doc["verdicts"])
    print(render(doc))
    if args.json:
        print(f"wrote {write_json(args.json, doc)}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
