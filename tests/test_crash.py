"""Crash consistency: SIGKILL a training process anywhere, resume, compare bitwise.

Every kill must leave the state directory at the end of some completed step
(the last one the process reported, or the one after it), with every
committed checksum intact; training resumed from it must end bitwise equal
to an uninterrupted run of torch.optim.AdamW(fused=True).
"""

from __future__ import annotations

import random

import pytest

from tierstore import faults
from tierstore.reader import StateReader
from tierstore.testing.crash import CrashJob, compare, run_child

STEPS = 5


def _check_kill_and_resume(tmp_path, job: CrashJob, result) -> None:
    manifest = tmp_path / "state" / "manifest.json"
    if manifest.exists():
        with StateReader(job.state_dir) as reader:
            committed = reader.step_count
            errors = [p for p in reader.verify() if p.severity == "error"]
        assert not errors, errors
        # The directory holds a commit no earlier than the last one the child reported as
        # committed, and no later than the step it was working on.
        assert result.committed <= committed <= max(result.completed, 0) + 1, (committed, result)
    else:
        # Killed before the very first commit: nothing to resume, a fresh start is right.
        assert result.completed == -1
    out = tmp_path / "final.pt"
    finished = run_child(job, out=str(out))
    assert finished.exitcode == 0 and finished.completed == STEPS
    assert compare(job, out) == []


# The in-flight marker is made durable once per open (it stays until a clean close).
KILLS = [(p, a) for p in faults.POINTS for a in (1, 4) if not (p == "inflight-marker" and a > 1)]


@pytest.mark.parametrize("point, after", KILLS)
def test_kill_at_named_point_then_resume_is_bitwise_exact(tmp_path, point, after):
    job = CrashJob(state_dir=str(tmp_path / "state"), steps=STEPS, backend="direct")
    result = run_child(job, crash=(point, after))
    assert result.killed, f"crash point {point!r} (after={after}) was never reached"
    _check_kill_and_resume(tmp_path, job, result)


@pytest.mark.parametrize("seed", range(6))
def test_kill_at_random_instant_then_resume_is_bitwise_exact(tmp_path, seed):
    rng = random.Random(seed)
    backend = rng.choice(["direct", "mmap", "buffered"])
    job = CrashJob(state_dir=str(tmp_path / "state"), steps=STEPS, backend=backend, seed=seed)
    # Children start from a warm fork server; a run takes a few tenths of a second.
    result = run_child(job, kill_after=rng.uniform(0.05, 0.8))
    _check_kill_and_resume(tmp_path, job, result)


def test_two_crashes_in_a_row_then_resume(tmp_path):
    job = CrashJob(state_dir=str(tmp_path / "state"), steps=STEPS, backend="direct", amsgrad=True, ram_budget="160KiB")
    first = run_child(job, crash=("mid-write", 7))
    assert first.killed
    second = run_child(job, crash=("manifest-tmp", 2))
    assert second.killed
    _check_kill_and_resume(tmp_path, job, second)
