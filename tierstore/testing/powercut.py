"""Simulated power cuts of a training run: record it, cut it anywhere, resume, compare bitwise.

A killed process leaves its page cache behind, so SIGKILL tests
(:mod:`tierstore.testing.crash`) cannot see a missing or misordered
``fsync``. This harness, in the spirit of ALICE (OSDI'14) and CrashMonkey
(OSDI'18), trains a :class:`~tierstore.testing.crash.CrashJob` in this
process while :class:`~tierstore.testing.fsrecord.Recorder` records every
operation that reaches its state directory, builds the on-disk images a
power cut at any point of that log could leave
(:meth:`~tierstore.testing.fsimage.Recording.image`, where the model is
stated), and resumes from each
in a fresh copy of the directory. Every image must resume at exactly some
committed step, bitwise equal to ``torch.optim.AdamW(fused=True)`` run
uninterrupted to that step (and go on to the next step equal too), never
earlier than the last step reported committed before the cut, or raise a
clear :class:`~tierstore.errors.TierstoreError` only when nothing was
reported committed.

How operations are recorded, and why
------------------------------------
In-process hooks on the ``os`` functions that change files and names
(``open``, ``write``, ``pwritev``, ``fsync``, ``fdatasync``, ``ftruncate``,
``posix_fallocate``, ``replace``, ``unlink``, ``mkdir``, ...), plus a seam in
the mmap backend (:meth:`~tierstore.backends.mmap_file.MmapFile._store`,
a copy into the shared mapping, and
:meth:`~tierstore.backends.mmap_file.MmapFile._msync`), because copies into
a mapping make no system call. This observes what reaches the Linux kernel, not
what a backend claims: a ``sync()`` that does nothing shows as a missing
``fdatasync`` or ``msync``, where a recording ``ShardFile`` wrapper would
log it as done and miss the manifest and marker files besides. tierstore,
``pathlib`` and ``tempfile`` look functions up as ``os.X`` at call time, so
the hooks see every caller in every thread, ``O_DIRECT`` ``pwritev`` calls
from the I/O workers included; one lock-protected counter, read before each
system call and after it returns, orders them globally. An ``LD_PRELOAD``
shim was ruled out (a compiler, and it cannot see stores into a mapping
either); recording in this process, not a child, keeps a run plus its
images well under a second.

What the harness depends on is only what reaches the file system, so it
tests any commit protocol: the lead's background commits (issue 9) included.
"Reported committed" comes from ``committed(opt)``, called after
construction, after each forward stand-in and after each ``step()``
(default: ``opt.committed_step``, which lags ``step_count`` while a commit
finishes in the background).

Example
-------
>>> import tempfile
>>> from tierstore.testing.crash import CrashJob
>>> job = CrashJob(state_dir=tempfile.mkdtemp() + "/state", steps=3, backend="buffered")
>>> result = run_powercuts(job, images=4, seed=0, workdir=tempfile.mkdtemp())
>>> result.images, result.violations
(4, [])
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .crash import CrashJob, Snapshot, differences, gradients, initial_params, trajectory
from .fsimage import Image, Recording
from .fsrecord import Recorder

__all__ = [
    "default_committed",
    "record_run",
    "record_after_cut",
    "Verdict",
    "check_image",
    "PowercutResult",
    "run_powercuts",
]

Committed = Callable[[object], "int | None"]


def default_committed(job: CrashJob) -> Committed:
    """The optimizer's own answer to "which step would a crash resume at": ``opt.committed_step``.

    Durable runs commit in the background, so it may lag ``step_count``; a
    ``durable=False`` run has nothing resumable until it closes cleanly
    (``committed_step`` is ``None``).
    """
    return lambda opt: opt.committed_step


def record_run(job: CrashJob, *, committed: Committed | None = None, reported_before: int | None = None) -> Recording:
    """Train ``job`` in this process from what ``job.state_dir`` holds, recording it.

    Parameters
    ----------
    job
        The run; ``job.state_dir`` may be missing (a fresh start) or hold a
        previous run's state (taken as durable).
    committed
        ``committed(opt)``: the step a crash now would resume at, or ``None``
        when nothing is resumable (see :func:`default_committed`).
    reported_before
        The step reported committed before this run started (``job.state_dir``
        holds it), or ``None``.
    """
    from .. import TieredAdamW

    committed = committed or default_committed(job)
    params = initial_params(job)
    with Recorder(list(job.directories)) as rec:
        rec.report(reported_before)
        rec.phase("construct")
        opt = TieredAdamW(params, **job.optimizer_kwargs())
        rec.report(committed(opt))
        for step in range(opt.step_count, job.steps):
            rec.phase(f"forward {step}")
            for p, g in zip(params, gradients(job, step)):
                p.grad = g
            if job.forward_seconds:
                time.sleep(job.forward_seconds)  # the loop's forward/backward: the last commit finishes meanwhile
            rec.report(committed(opt))
            rec.phase(f"step {step}")
            opt.step()
            rec.report(committed(opt))
        rec.phase("close")
        done = opt.step_count
        opt.close()
        rec.report(done)  # a returned close() leaves every step committed, durable or not
        rec.phase("closed")
    return rec.recording()


def record_after_cut(job: CrashJob, *, seed: int, workdir: str | Path, committed: Committed | None = None) -> Recording:
    """Record a run that resumes where a power cut left a first one, mid-training.

    Records a fresh run of ``job`` (in ``workdir``), draws images of cuts
    inside its steps until one resumes, puts that image in ``job.state_dir``
    (which must not exist) and records ``job`` resumed from it: leftovers of
    the first cut (torn stale copies, a temporary manifest, the in-flight
    marker) are the second run's durable starting point.
    """
    first_job = job.in_directories(_directories(Path(workdir) / "first-run", len(job.directories)))
    first = record_run(first_job, committed=committed)
    expected = trajectory(job)
    rng = random.Random(seed)
    cuts = [c for c in first.cut_points() if first.phase_at(c).startswith("step")]
    for _ in range(100):
        image = first.image(rng.choice(cuts), seed=rng.randrange(1 << 32), style="mixed")
        verdict = check_image(image, job, expected, Path(workdir) / "probe")
        if verdict.outcome == "resumed":
            break
    else:
        raise RuntimeError(f"no image of {job} resumed after 100 draws")
    for directory in first_job.directories:
        shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(Path(workdir) / "probe", ignore_errors=True)
    image.materialize(job.home, job.directories[1:])
    # The image holds that step durably now: nothing committed may be lost from here on.
    return record_run(job, committed=committed, reported_before=verdict.step)


def _directories(home: Path, count: int) -> tuple[str, ...]:
    """``count`` directories for a state: ``home``, then ``home-drive1``, ... beside it."""
    return (str(home), *(f"{home}-drive{k}" for k in range(1, count)))


@dataclass
class Verdict:
    """What resuming from one image gave."""

    image: Image
    outcome: str  # "resumed", "refused" (a clear error, nothing was committed) or "violation"
    step: int | None = None  # the step resumed at
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome != "violation"

    def __str__(self) -> str:
        what = f"resumed at step {self.step}" if self.step is not None else self.outcome
        text = f"{self.image.describe()}, reported {self.image.reported}: {what}"
        return f"{text}: {self.problem}" if self.problem else text


def check_image(image: Image, job: CrashJob, expected: list[Snapshot], workdir: str | Path) -> Verdict:
    """Resume ``job`` from ``image`` (in ``workdir/state``) and judge the result.

    ``expected[s]`` is the uninterrupted run after ``s`` steps (:func:`~tierstore.testing.crash.trajectory`).
    """
    from .. import TieredAdamW, TierstoreError

    directories = _directories(Path(workdir) / "state", len(job.directories))
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    image.materialize(directories[0], directories[1:])
    here = job.in_directories(directories)
    params = initial_params(here)  # a fresh start uses these; a resume with masters restores them
    try:
        opt = TieredAdamW(params, **here.optimizer_kwargs())
    except TierstoreError as exc:
        if image.reported is None:
            return Verdict(image, "refused", problem=f"{type(exc).__name__}: {exc}")
        return Verdict(image, "violation", problem=f"step {image.reported} was reported committed, resume raised {type(exc).__name__}: {exc}")
    except Exception as exc:  # anything but a tierstore error is not a clear error
        return Verdict(image, "violation", problem=f"resume raised {type(exc).__name__}: {exc}")
    step = opt.step_count
    try:
        with opt:
            problem = _resumed_problem(image, job, expected, opt, params)
    except Exception as exc:
        problem = f"resumed at step {step}, then {type(exc).__name__}: {exc}"
    return Verdict(image, "violation" if problem else "resumed", step, problem)


def _resumed_problem(image: Image, job: CrashJob, expected: list[Snapshot], opt, params: list) -> str:
    """What is wrong with an optimizer resumed from ``image`` ("" if nothing)."""
    step = opt.step_count
    if image.reported is not None and step < image.reported:
        return f"resumed at step {step}, before the reported step {image.reported}"
    if step >= len(expected):
        return f"resumed at step {step}, which the run never reached"
    masters = params if job.keep_master else None
    problems = differences(expected[step], masters, opt.state_dict())
    if not problems and step < job.steps:  # it must also go on exactly
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        opt.step()
        problems = [f"after one more step: {p}" for p in differences(expected[step + 1], masters, opt.state_dict())]
    return f"not bitwise equal to the uninterrupted run: {problems[:3]}" if problems else ""


@dataclass
class PowercutResult:
    """Images checked for one recorded run."""

    job: CrashJob
    images: int
    outcomes: Counter = field(default_factory=Counter)  # resumed / refused / violation
    resumed_steps: Counter = field(default_factory=Counter)
    phases: Counter = field(default_factory=Counter)  # where the cuts fell
    styles: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)  # recorded operations by kind
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "images": self.images,
            "outcomes": dict(self.outcomes),
            "resumed_steps": {str(k): v for k, v in sorted(self.resumed_steps.items())},
            "phases": dict(self.phases),
            "styles": dict(self.styles),
            "recorded_ops": dict(self.ops),
            "violations": len(self.violations),
            "seconds": round(self.seconds, 2),
        }


def run_powercuts(
    job: CrashJob,
    *,
    images: int,
    seed: int,
    workdir: str | Path,
    committed: Committed | None = None,
    recording: Recording | None = None,
    cuts: Iterable[Image] | None = None,
) -> PowercutResult:
    """Record ``job`` (unless ``recording`` is given), then check ``images`` power-cut images of it.

    ``job.state_dir`` must not hold state unless ``recording`` is given (a
    tuple of directories: a state over several drives, recorded in one log;
    each image is resumed from as many fresh directories).
    ``cuts`` replaces the default choice of images. Images of tiny jobs
    check fastest with one intra-op thread (``torch.set_num_threads(1)``)
    and ``workdir`` on tmpfs; neither changes results.

    Raises
    ------
    ValueError
        If the run did something the file-system model does not cover.
    """
    t0 = time.perf_counter()
    if recording is None:
        recording = record_run(job, committed=committed)
    if recording.unsupported:
        raise ValueError(f"the recorded run did what the power-cut model does not cover: {recording.unsupported}")
    expected = trajectory(job)
    result = PowercutResult(job, 0, ops=Counter(op.kind for op in recording.ops))
    for image in cuts if cuts is not None else recording.images(images, seed=seed):
        verdict = check_image(image, job, expected, workdir)
        result.images += 1
        result.outcomes[verdict.outcome] += 1
        result.phases[image.phase.split(" ")[0]] += 1
        result.styles[image.style] += 1
        if verdict.step is not None and verdict.ok:
            result.resumed_steps[verdict.step] += 1
        if not verdict.ok:
            result.violations.append(str(verdict))
    result.seconds = time.perf_counter() - t0
    return result
