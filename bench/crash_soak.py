"""Kill a training process with SIGKILL hundreds of times, in every phase; resume; compare bitwise.

Each round trains a small model in a child process (state on disk, durable,
fp32 masters kept; a random backend, state placement and amsgrad) and kills
it either at a random named crash point counted only in a random phase
window (construction, early, middle or late steps), or at a random instant
inside a random phase (construction, a step, the forward/backward between
steps, close; the child holds at the end of that phase until killed, so the
kill cannot miss it). It checks where the kill landed, that the state
directory holds the last step the child saw committed (or the next, when it
died inside a commit) with every committed checksum intact, resumes to the
end and compares the result bitwise with torch.optim.AdamW(fused=True).

Needs a few MiB of RAM and disk per round; state goes on tmpfs (/dev/shm)
when it takes O_DIRECT (a killed process leaves its page cache, so fsyncs
cannot matter here; ``bench/powercut_soak.py`` covers power loss).

Usage::

    python bench/crash_soak.py --kills 300 --json /tmp/crash_soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from tierstore._platform import faults
from tierstore.backends import supports_direct_io
from tierstore.testing.crash import (
    CrashJob,
    compare,
    killed_state_problems,
    phase_names,
    run_child,
    step_windows,
)

CONFIGS = (
    dict(ram_budget="112KiB"),
    dict(ram_budget="200KiB", amsgrad=True),
    dict(ram_budget=None, amsgrad=True),
    dict(ram_budget=None),
)
CONSTRUCTION_POINTS = ("inflight-marker", "mid-write", "before-sync", "manifest-tmp", "manifest-renamed", "after-commit")


def scratch_root() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and supports_direct_io(shm) else tempfile.gettempdir()


def plan(rng: random.Random, job: CrashJob, durations: dict[str, float]) -> tuple[dict, list[str]]:
    """run_child's kill arguments for one round, and the phases the kill must land in."""
    streamed = job.ram_budget is not None
    if rng.random() < 0.5:
        window = rng.choice(["construction", "early", "middle", "late"])
        points = CONSTRUCTION_POINTS if window == "construction" else faults.POINTS
        points = [p for p in points if streamed or p != "after-read"]
        phases = ["construct"] if window == "construction" else step_windows(job)[window]
        point = rng.choice(points)
        # Building commits twice but marks the in-flight state once.
        after = 1 if (window, point) == ("construction", "inflight-marker") else rng.randint(1, 2)
        return {"crash": (point, after, phases)}, phases
    phase = rng.choice([p for p in phase_names(job.steps) if p not in ("start", "export", "done")])
    return {"kill_in": (phase, rng.uniform(0.0, 0.9) * durations.get(phase, 0.0))}, [phase]


def one_round(rng: random.Random, workdir: Path, steps: int, durations: dict) -> dict:
    backend = rng.choice(["direct", "buffered", "mmap"])
    config = rng.randrange(len(CONFIGS))
    job = CrashJob(state_dir=str(workdir / "state"), steps=steps, backend=backend, seed=rng.randrange(1000), **CONFIGS[config])
    key = (backend, config)
    if key not in durations:  # calibrate the phases' lengths once per configuration
        durations[key] = run_child(CrashJob(state_dir=str(workdir / "calibrate"), steps=steps, backend=backend, **CONFIGS[config])).durations
    kill, phases = plan(rng, job, durations[key])
    result = run_child(job, **kill)
    how = ("point", *kill["crash"][:2]) if "crash" in kill else ("instant", kill["kill_in"][0], round(kill["kill_in"][1], 4))
    record = {
        "how": how,
        "backend": backend,
        "config": CONFIGS[config],
        "killed": result.killed,
        "landed_phase": result.landed_phase,
        "landed_point": result.landed_point,
        "at_gate": result.at_gate,
        "landed_as_planned": result.killed and result.landed_phase in phases,
        "completed": result.completed,
    }
    record["state_problems"] = killed_state_problems(job, result)
    out = workdir / "final.pt"
    finished = run_child(job, out=str(out))
    record["resumed_ok"] = finished.exitcode == 0
    record["differences"] = compare(job, out) if finished.exitcode == 0 else ["resume failed"]
    record["bitwise_exact"] = record["resumed_ok"] and not record["differences"]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    records = []
    durations: dict = {}
    t0 = time.time()
    root = scratch_root()
    for _ in tqdm(range(args.kills), desc="kill/resume rounds"):
        workdir = Path(tempfile.mkdtemp(prefix="tierstore-soak-", dir=root))
        try:
            records.append(one_round(rng, workdir, args.steps, durations))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = {
        "rounds": len(records),
        "killed": sum(r["killed"] for r in records),
        "landed_as_planned": sum(r["landed_as_planned"] for r in records),
        "killed_at_phase_end": sum(r["at_gate"] for r in records),
        "bitwise_exact_resumes": sum(r["bitwise_exact"] for r in records),
        "consistent_after_kill": sum(not r["state_problems"] for r in records),
        "landed_in": dict(Counter((r["landed_phase"] or "none").split(" ")[0] for r in records)),
        "killed_by": dict(Counter(r["landed_point"] or "random-instant" for r in records if r["killed"])),
        "per_backend": dict(Counter(r["backend"] for r in records)),
        "seconds": round(time.time() - t0, 1),
        "workdir": root,
        "command": f"python bench/crash_soak.py --kills {args.kills} --steps {args.steps} --seed {args.seed}",
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "rounds": records}, indent=1))
    bad = [r for r in records if not (r["landed_as_planned"] and r["bitwise_exact"] and not r["state_problems"])]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
