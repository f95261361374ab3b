"""Crash consistency: SIGKILL a training process in every phase, resume, compare bitwise.

Kills land at named crash points (counting only hits in the phase a test
names) and at random instants inside a phase (the child holds at the end of
its target phase until killed, so the kill cannot miss). Every test asserts
that the kill happened and where it landed: construction, early, middle or
late steps, between steps (where background persistence will run), close.
Every kill must leave the state directory at the last step the child saw
committed (or the next, when it died inside a commit) with every committed
checksum intact; training resumed from it must end bitwise equal to an
uninterrupted run of torch.optim.AdamW(fused=True). Every backend, masters
and amsgrad mid-training, streamed and all-resident state. A state over two
directories (issue 25): kills in its commits (mid-write, before the syncs of
both drives, with both synced and the manifest not yet renamed, renamed but
not synced, after), while it is built and at random instants; both
directories must hold the one committed step (every checksum on both drives
verifies) and resume bitwise.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from tierstore import CorruptStateError, TieredAdamW
from tierstore._platform import faults
from tierstore.testing.crash import (
    CrashJob,
    compare,
    initial_params,
    killed_state_problems,
    phase_names,
    run_child,
    step_windows,
)

STEPS = 6
BACKENDS = ("direct", "buffered", "mmap")
# Streamed with masters; streamed with masters and amsgrad; all resident with masters and amsgrad.
CONFIGS = (
    dict(ram_budget="112KiB"),
    dict(ram_budget="200KiB", amsgrad=True),
    dict(ram_budget=None, amsgrad=True),
)
STREAMED = (0, 1)  # configs whose steps read shards from disk (after-read fires mid-training)
FORWARD_SECONDS = 0.02  # the forward/backward stand-in of the "background" window


def _job(tmp_path, backend: str, config: int, **changes) -> CrashJob:
    return CrashJob(state_dir=str(tmp_path / "state"), steps=STEPS, backend=backend, **CONFIGS[config], **changes)


def _window(name: str) -> list[str]:
    """The phases a named window covers."""
    if name == "construction":
        return ["construct"]
    if name == "background":  # between steps: the loop's forward/backward, where persistence will overlap
        return [f"forward {k}" for k in range(1, STEPS)]
    if name == "close":
        return ["close"]
    return step_windows(CrashJob(state_dir="", steps=STEPS))[name]


def _finish_and_compare(tmp_path, job: CrashJob) -> None:
    out = tmp_path / "final.pt"
    finished = run_child(job, out=str(out))
    assert finished.exitcode == 0 and finished.completed == STEPS, finished
    assert compare(job, out) == []


def _assert_landed(result, phases: list[str], point: str | None = None) -> None:
    assert result.killed, f"the child was never killed: {result}"
    assert result.landed_phase in phases, f"kill landed in {result.landed_phase!r}, meant for {phases}: {result}"
    if point is not None:
        assert result.landed_point == point, result


# -- named crash points, counted only in the phase under test ------------------------------

# A step's commit finishes on a background thread, while the loop is already past the step:
# its points land in the step or in what follows it (the next forward, or export for the last).
COMMIT_POINTS = ("before-sync", "manifest-tmp", "manifest-renamed", "after-commit")


def _once_per_commit(point: str, config: int) -> bool:
    """Whether ``point`` fires once per commit, not once per step.

    Commits under the default policy skip a step while one is in flight, so a
    test counting two hits of such a point may see only one: these get the
    forward/backward stand-in and count a single hit.
    """
    return point in COMMIT_POINTS or point == "persist-issued" or (point == "mid-write" and CONFIGS[config].get("ram_budget") is None)


NAMED_IN_STEPS = [
    pytest.param(point, backend, window, config, after, id=f"{point}-{backend}-{window}")
    for i, point in enumerate(faults.POINTS)
    if point != "inflight-marker"  # made durable once per open, while it is built
    for j, backend in enumerate(BACKENDS)
    for window in [("early", "middle", "late")[(i + j) % 3]]
    for config in [STREAMED[(i + j) % 2] if point == "after-read" else (i + j) % 3]
    for after in [1 if _once_per_commit(point, config) else 1 + (i + j) % 2]
]
NAMED_IN_CONSTRUCTION = ("inflight-marker", "mid-write", "before-sync", "manifest-tmp", "manifest-renamed", "after-commit")


def _window_for(point: str, window: str, config: int) -> list[str]:
    phases = _window(window)
    if not _once_per_commit(point, config):
        return phases
    after = []
    for phase in phases:
        k = int(phase.split()[1])
        after += [f"forward {k + 1}"] if k + 1 < STEPS else ["export", "close"]
    return sorted(set(phases) | set(after), key=phases_order)


def phases_order(phase: str) -> tuple[int, int]:
    name, _, k = phase.partition(" ")
    return (int(k) if k else STEPS, {"forward": 0, "export": 2, "close": 3}.get(name, 1))


@pytest.mark.parametrize("point, backend, window, config, after", NAMED_IN_STEPS)
def test_kill_at_named_point_mid_training_then_resume_is_bitwise_exact(ram_tmp_path, point, backend, window, config, after):
    # A forward/backward stand-in lets each step's commit finish before the next step starts.
    job = _job(ram_tmp_path, backend, config, forward_seconds=FORWARD_SECONDS if _once_per_commit(point, config) else 0.0)
    phases = _window_for(point, window, config)
    result = run_child(job, crash=(point, after, phases))
    _assert_landed(result, phases, point)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)


@pytest.mark.parametrize("k, point", list(enumerate(NAMED_IN_CONSTRUCTION)), ids=NAMED_IN_CONSTRUCTION)
def test_kill_at_named_point_while_building_then_resume_is_bitwise_exact(ram_tmp_path, k, point):
    job = _job(ram_tmp_path, BACKENDS[k % 3], k % 3)
    after = 1 if point == "inflight-marker" else 1 + k % 2  # building marks the in-flight state once, commits twice
    result = run_child(job, crash=(point, after, "construct"))
    _assert_landed(result, ["construct"], point)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)


# Commits run in the background while the loop computes the next forward/backward: kill them there.
BACKGROUND = [
    pytest.param(point, backend, id=f"{point}-{backend}")
    for i, backend in enumerate(BACKENDS)
    for point in (("mid-write", "before-sync"), ("manifest-tmp", "manifest-renamed"), ("after-commit", "before-sync"))[i]
]


@pytest.mark.parametrize("point, backend", BACKGROUND)
def test_kill_at_named_point_during_background_persistence(ram_tmp_path, point, backend):
    job = _job(ram_tmp_path, backend, 2, forward_seconds=FORWARD_SECONDS)
    # The commit starts at a step's end and runs on while the loop computes the next forward; a
    # fast one (mmap's resident writes are memory copies) may finish before its step returned.
    phases = _window("background") + [f"step {k}" for k in range(1, STEPS)]
    result = run_child(job, crash=(point, 1, phases))
    _assert_landed(result, phases, point)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)


# -- random instants inside a phase ----------------------------------------------------------

_durations: dict[tuple, dict[str, float]] = {}


def _calibrated(job: CrashJob) -> dict[str, float]:
    """Seconds each phase of ``job`` takes, from one uninterrupted run (cached per configuration)."""
    key = (job.backend, job.ram_budget, job.amsgrad, job.durable, job.forward_seconds, len(job.directories))
    if key not in _durations:
        calib = job.in_directories(tuple(d + "-calibrate" for d in job.directories))
        result = run_child(calib)
        assert result.exitcode == 0, result
        _durations[key] = result.durations
    return _durations[key]


RANDOM_WINDOWS = ("construction", "early", "middle", "late", "background", "close")


@pytest.mark.parametrize("window", RANDOM_WINDOWS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_at_random_instant_in_each_phase_then_resume_is_bitwise_exact(ram_tmp_path, backend, window):
    rng = random.Random(f"{backend}-{window}")
    config = rng.randrange(3)
    job = _job(ram_tmp_path, backend, config, forward_seconds=FORWARD_SECONDS if window == "background" else 0.0)
    phase = rng.choice(_window(window))
    # A random instant within the phase's calibrated length; the child holds at the end
    # of the phase until killed, so a slow moment of the machine cannot carry it past.
    delay = rng.uniform(0.0, 0.9) * _calibrated(job).get(phase, 0.0)
    result = run_child(job, kill_in=(phase, delay))
    _assert_landed(result, [phase])
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)


def test_two_crashes_in_a_row_then_resume(ram_tmp_path):
    job = _job(ram_tmp_path, "direct", 1)
    first = run_child(job, crash=("mid-write", 3, _window("early")))
    _assert_landed(first, _window("early"), "mid-write")
    assert killed_state_problems(job, first) == []
    # Commits finish behind the loop, so a late step's manifest may land in the next
    # forward, or at close: the window is the rest of the run from the late steps on.
    late = _window("late")
    rest = phase_names(STEPS)[phase_names(STEPS).index(late[0]) : phase_names(STEPS).index("done")]
    second = run_child(job, crash=("manifest-tmp", 1, rest))
    _assert_landed(second, rest, "manifest-tmp")
    assert killed_state_problems(job, second, before=first.completed) == []
    _finish_and_compare(ram_tmp_path, job)


# -- durable=False: resumable only after a clean close ---------------------------------------


def _resume_refused(job: CrashJob) -> None:
    with pytest.raises(CorruptStateError, match="did not close.*cleanly.*empty state_dir.*durable=True"):
        TieredAdamW(initial_params(job), **job.optimizer_kwargs())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["named", "random"])
def test_non_durable_run_killed_mid_training_is_refused_on_resume(ram_tmp_path, backend, how):
    # Named: streamed state, whose shards a non-durable step rewrites in place.
    config = STREAMED[BACKENDS.index(backend) % 2] if how == "named" else BACKENDS.index(backend)
    job = _job(ram_tmp_path, backend, config, durable=False)
    phases = _window("middle")
    if how == "named":
        result = run_child(job, crash=("mid-write", 2, phases))
        _assert_landed(result, phases, "mid-write")
    else:
        delay = random.Random(backend).uniform(0.0, 0.9) * _calibrated(job).get(phases[0], 0.0)
        result = run_child(job, kill_in=(phases[0], delay))
        _assert_landed(result, phases[:1])
    _resume_refused(job)


@pytest.mark.parametrize("point, clean", [("before-sync", False), ("manifest-tmp", False), ("manifest-renamed", True)])
def test_non_durable_run_killed_while_closing(ram_tmp_path, point, clean):
    """Before its clean manifest replaces the dirty one the directory is refused; after, it resumes."""
    job = _job(ram_tmp_path, "buffered", 0, durable=False)
    result = run_child(job, crash=(point, 1, "close"))
    _assert_landed(result, ["close"], point)
    if clean:
        _finish_and_compare(ram_tmp_path, job)  # nothing left to train: the closed state is the final one
    else:
        _resume_refused(job)


def test_non_durable_directory_resumed_then_killed_in_its_first_step_is_refused(ram_tmp_path):
    job = _job(ram_tmp_path, "buffered", 0, durable=False, keep_master=False)
    half = dataclasses.replace(job, steps=3)
    assert run_child(half).exitcode == 0  # closed cleanly at step 3: resumable
    result = run_child(job, crash=("mid-write", 1, "step 3"))
    _assert_landed(result, ["step 3"], "mid-write")
    _resume_refused(job)


# -- a state over two directories (issue 25) ---------------------------------------------------


def _two_drive_job(tmp_path, backend: str, config: int, **changes) -> CrashJob:
    """A run over two directories, its shards placed by a knobs file's figures (the same in every child)."""
    from tierstore._config.knobs_file import (
        DriveFigure,
        device_of,
        encode_knobs_file,
        knobs_document,
    )

    knobs = tmp_path / "knobs.json"
    if not knobs.exists():
        figure = DriveFigure(str(tmp_path), device_of(tmp_path), 2e9)
        knobs.write_bytes(encode_knobs_file(knobs_document({}, drives=[figure])))
    home = str(tmp_path / "state")
    return CrashJob(state_dir=(home, home + "-drive1"), steps=STEPS, backend=backend, extra={"knobs": str(knobs)},
                    **CONFIGS[config], **changes)  # fmt: skip


def _spans_both(job: CrashJob) -> None:
    """The state really is over both directories: a member record there, shards placed on each."""
    import json

    manifest = json.loads((Path(job.home) / "manifest.json").read_text())
    assert set(manifest["drives"]["placement"]) == {0, 1}, manifest["drives"]
    assert (Path(job.directories[1]) / "drive.json").exists()


TWO_DRIVE_POINTS = [
    pytest.param(point, backend, config, id=f"{point}-{backend}")
    for point, backend, config in (
        ("mid-write", "direct", 0),
        ("before-sync", "buffered", 1),
        ("manifest-tmp", "mmap", 2),  # both drives synced, the manifest not yet renamed
        ("manifest-renamed", "direct", 1),
        ("after-commit", "buffered", 0),
    )
]


@pytest.mark.parametrize("point, backend, config", TWO_DRIVE_POINTS)
def test_kill_over_two_directories_at_named_point_then_resume_is_bitwise_exact(ram_tmp_path, point, backend, config):
    once = _once_per_commit(point, config)
    job = _two_drive_job(ram_tmp_path, backend, config, forward_seconds=FORWARD_SECONDS if once else 0.0)
    phases = _window_for(point, "middle", config)
    result = run_child(job, crash=(point, 1 if once else 2, phases))
    _assert_landed(result, phases, point)
    _spans_both(job)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)


@pytest.mark.parametrize("point, after", [("before-sync", 2), ("manifest-renamed", 1), ("mid-write", 3)])
def test_kill_over_two_directories_while_building_then_resume_is_bitwise_exact(ram_tmp_path, point, after):
    job = _two_drive_job(ram_tmp_path, "direct", 0)
    result = run_child(job, crash=(point, after, "construct"))
    _assert_landed(result, ["construct"], point)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)
    _spans_both(job)


@pytest.mark.parametrize("window", ["middle", "background"])
def test_kill_over_two_directories_at_a_random_instant_then_resume_is_bitwise_exact(ram_tmp_path, window):
    rng = random.Random(f"two-{window}")
    job = _two_drive_job(ram_tmp_path, "mmap", 0, forward_seconds=FORWARD_SECONDS if window == "background" else 0.0)
    phase = rng.choice(_window(window))
    delay = rng.uniform(0.0, 0.9) * _calibrated(job).get(phase, 0.0)
    result = run_child(job, kill_in=(phase, delay))
    _assert_landed(result, [phase])
    _spans_both(job)
    assert killed_state_problems(job, result) == []
    _finish_and_compare(ram_tmp_path, job)
