"""Kill a training process with SIGKILL at hundreds of random instants; resume; compare bitwise.

Each round trains a small model in a child process (state on disk, durable,
fp32 masters kept), kills it at a random instant or at a random named crash
point, checks that the state directory holds a completed step (the last one
reported or the next) with every committed checksum intact, resumes it to the
end and compares the result bitwise with torch.optim.AdamW(fused=True).

Usage::

    python bench/crash_soak.py --kills 300 --json bench/results/crash_soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from tierstore import faults
from tierstore.reader import StateReader
from tierstore.testing.crash import CrashJob, compare, run_child


def one_round(rng: random.Random, workdir: Path, steps: int, run_seconds: float) -> dict:
    backend = rng.choice(["direct", "buffered", "mmap"])
    budget = rng.choice([None, "112KiB", "200KiB"])
    job = CrashJob(
        state_dir=str(workdir / "state"),
        steps=steps,
        backend=backend,
        ram_budget=budget,
        seed=rng.randrange(1000),
        amsgrad=False,
    )
    if rng.random() < 0.5:
        how = ("point", rng.choice(faults.POINTS), rng.randint(1, 12))
        result = run_child(job, crash=how[1:])
    else:
        delay = rng.uniform(0.0, run_seconds)
        how = ("time", round(delay, 3))
        result = run_child(job, kill_after=delay)
    record = {"how": how, "backend": backend, "budget": budget, "killed": result.killed, "completed": result.completed}
    manifest = Path(job.state_dir) / "manifest.json"
    if manifest.exists():
        with StateReader(job.state_dir) as reader:
            record["committed"] = reader.step_count
            record["errors"] = [str(p) for p in reader.verify() if p.severity == "error"]
        record["consistent"] = record["committed"] in (result.completed, result.completed + 1) or (
            result.completed == -1 and record["committed"] == 0
        )
    else:
        record.update(committed=None, errors=[], consistent=result.completed == -1)
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
    t0 = time.time()
    # Calibrate: random kill instants are drawn over one uninterrupted run's duration.
    # The first child also starts the fork server; time the second.
    for _ in range(2):
        with tempfile.TemporaryDirectory() as calib:
            full = run_child(CrashJob(state_dir=calib + "/state", steps=args.steps))
    run_seconds = full.seconds
    for _ in tqdm(range(args.kills), desc="kill/resume rounds"):
        workdir = Path(tempfile.mkdtemp(prefix="tierstore-soak-"))
        try:
            records.append(one_round(rng, workdir, args.steps, run_seconds))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    killed = [r for r in records if r["killed"]]
    summary = {
        "rounds": len(records),
        "killed": len(killed),
        "bitwise_exact_resumes": sum(r["bitwise_exact"] for r in records),
        "consistent_after_kill": sum(r["consistent"] for r in records),
        "checksum_errors_after_kill": sum(bool(r["errors"]) for r in records),
        "killed_by": dict(Counter(r["how"][1] if r["how"][0] == "point" else "random-time" for r in killed)),
        "seconds": round(time.time() - t0, 1),
        "uninterrupted_run_seconds": round(run_seconds, 3),
        "command": f"python bench/crash_soak.py --kills {args.kills} --steps {args.steps} --seed {args.seed}",
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "rounds": records}, indent=1))
    bad = [r for r in records if not (r["bitwise_exact"] and r["consistent"] and not r["errors"])]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
