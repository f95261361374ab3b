"""Simulated power cuts at scale: thousands of images of recorded training runs, every backend.

Each scenario (backend x state placement x masters/amsgrad x durable or not,
fresh or resumed) is trained and recorded once per job seed
(``tierstore.testing.powercut.record_run``: every write, sync, create and
rename reaching its state directory). Then images of what a power cut at
points spread over the run would leave (synced data kept, unsynced writes
kept, dropped or torn by 4 KiB page, names durable only after a directory
fsync) are resumed one by one in a fresh directory: each must resume at a
committed step bitwise equal to torch.optim.AdamW(fused=True), never before
the step reported committed before the cut, and go on exactly; or refuse
with a clear error when nothing was committed.

Needs: a few MiB of RAM and disk per image (the jobs are tiny); the work
directory goes on tmpfs (/dev/shm) when it takes O_DIRECT, since the
simulated drive is the harness's model and real fsyncs only cost time.

Usage::

    python bench/powercut_soak.py --images 1000 --json /tmp/powercut-soak.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from tierstore.backends import supports_direct_io
from tierstore.testing.crash import CrashJob
from tierstore.testing.powercut import record_after_cut, record_run, run_powercuts

BACKENDS = ("direct", "buffered", "mmap")
STEPS = 5
# name -> (CrashJob fields, steps trained and closed before recording starts, or "cut": the
# recorded run resumes an image a power cut left of a first run, mid-training)
CONFIGS = {
    "streamed-masters": (dict(ram_budget="112KiB"), 0),
    "streamed-amsgrad-masters": (dict(ram_budget="200KiB", amsgrad=True), 0),
    "streamed-no-masters": (dict(ram_budget="64KiB", keep_master=False), 0),
    "resident-amsgrad-masters": (dict(ram_budget=None, amsgrad=True), 0),
    "resident-no-masters": (dict(ram_budget=None, keep_master=False), 0),
    "resumed-streamed-amsgrad-masters": (dict(ram_budget="200KiB", amsgrad=True), 2),
    "after-a-cut-streamed-amsgrad-masters": (dict(ram_budget="200KiB", amsgrad=True), "cut"),
    "after-a-cut-resident-no-masters": (dict(ram_budget=None, keep_master=False), "cut"),
    "non-durable-streamed-masters": (dict(ram_budget="112KiB", durable=False), 0),
    "non-durable-resident-masters": (dict(ram_budget=None, durable=False), 0),
    # A resumed durable=False run marks its manifest dirty before its first write (a bug the
    # harness found: it used to rewrite streamed shards first).
    "resumed-non-durable-streamed-no-masters": (dict(ram_budget="64KiB", keep_master=False, durable=False), 2),
    # With a forward/backward between steps, every step's background commit finishes before the
    # next step; without one (the scenarios above) commits are deferred while one is in flight.
    "with-forward-streamed-masters": (dict(ram_budget="112KiB", forward_seconds=0.005), 0),
    "with-forward-resident-amsgrad-masters": (dict(ram_budget=None, amsgrad=True, forward_seconds=0.005), 0),
    "with-forward-auto-policy-streamed": (dict(ram_budget="200KiB", forward_seconds=0.005, commit_every="auto"), 0),
}
KNOWN_BUGS: dict[str, tuple[dict, int | str]] = {}  # none known; --known-bugs runs any listed here


def scratch_root(requested: str | None) -> str:
    if requested:
        return requested
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and supports_direct_io(shm) else tempfile.gettempdir()


def soak_one(name: str, fields: dict, before: int | str, backend: str, seed: int, images: int, root: Path) -> dict:
    """Record one run of a scenario and check ``images`` images of it."""
    work = Path(tempfile.mkdtemp(prefix="powercut-soak-", dir=root))
    try:
        job = CrashJob(state_dir=str(work / "state"), steps=STEPS, backend=backend, seed=seed, **fields)
        if before == "cut":
            recording = record_after_cut(job, seed=seed, workdir=work)
        elif before:  # a run that resumes a closed directory: its files are the durable start
            record_run(dataclasses.replace(job, steps=before))
            recording = record_run(job, reported_before=before)
        else:
            recording = record_run(job)
        image_seed = zlib.crc32(f"{name}/{backend}/{seed}".encode())  # every run gets its own cuts and draws
        result = run_powercuts(job, images=images, seed=image_seed, workdir=work, recording=recording)
        return {"scenario": name, "backend": backend, "job_seed": seed, **result.summary(), "violation_list": result.violations}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000, help="images in all (spread over every scenario)")
    parser.add_argument("--seeds", type=int, default=2, help="recorded runs (job seeds) per scenario and backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where runs and images go (default: /dev/shm if it takes O_DIRECT, else the temp dir)")
    parser.add_argument("--known-bugs", action="store_true", help="also run scenarios with known, reported bugs")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ",".join(BACKENDS))
    parser.add_argument("--scenarios", help="comma-separated subset of the scenarios (default: all)")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tierstore-bench" / "powercut-soak.json",
        help="output JSON (default under the temp dir; never bench/results/ unless asked)",
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shards; results do not depend on it
    configs = {**CONFIGS, **(KNOWN_BUGS if args.known_bugs else {})}
    if args.scenarios:
        wanted = args.scenarios.split(",")
        unknown = sorted(set(wanted) - set(configs))
        if unknown:
            parser.error(f"unknown scenarios {unknown}; choose from {sorted(configs)}")
        configs = {n: configs[n] for n in wanted}
    backends = args.backends.split(",")
    if set(backends) - set(BACKENDS):
        parser.error(f"--backends {args.backends!r}: choose from {','.join(BACKENDS)}")
    runs = [(n, backend, args.seed * 1000 + k) for n in configs for backend in backends for k in range(args.seeds)]
    per_run = math.ceil(args.images / len(runs))
    root = Path(scratch_root(args.workdir))
    t0 = time.perf_counter()
    records = []
    for name, backend, seed in tqdm(runs, desc="recorded runs"):
        fields, before = configs[name]
        records.append(soak_one(name, fields, before, backend, seed, per_run, root))
    seconds = time.perf_counter() - t0
    torch.set_num_threads(threads)

    def total(rows: list[dict]) -> dict:
        outcomes = Counter()
        for r in rows:
            outcomes.update(r["outcomes"])
        return {"images": sum(r["images"] for r in rows), "outcomes": dict(outcomes), "violations": sum(r["violations"] for r in rows)}

    def counts(key: str) -> dict:
        out = Counter()
        for r in records:
            out.update(r[key])
        return dict(sorted(out.items()))

    summary = {
        **total(records),
        "per_backend": {b: total([r for r in records if r["backend"] == b]) for b in backends},
        "per_scenario": {n: total([r for r in records if r["scenario"] == n]) for n in configs},
        "cut_phases": counts("phases"),
        "image_styles": counts("styles"),
        "resumed_steps": counts("resumed_steps"),
        "recorded_runs": len(records),
        "steps_per_run": STEPS,
        "seconds": round(seconds, 1),
        "seconds_per_image": round(seconds / max(1, sum(r["images"] for r in records)), 4),
        "workdir": str(root),
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "torch": torch.__version__,
        "command": "python bench/powercut_soak.py " + " ".join(
            [f"--images {args.images}", f"--seeds {args.seeds}", f"--seed {args.seed}", f"--backends {args.backends}"]
            + ([f"--scenarios {args.scenarios}"] if args.scenarios else [])
            + (["--known-bugs"] if args.known_bugs else [])
        ),
    }
    print(json.dumps(summary, indent=1))
    for r in records:
        for v in r["violation_list"]:
            print(f"VIOLATION {r['scenario']}/{r['backend']}/seed {r['job_seed']}: {v}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, "runs": records}, indent=1))
    print(f"wrote {args.json}")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
