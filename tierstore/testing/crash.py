"""Crash-and-resume harness: train in a child process, SIGKILL it, resume, compare.

A :class:`CrashJob` describes a small deterministic training run (parameter
shapes, gradients derived from the step number, budget, backend). :func:`run_child`
trains it in a child process that resumes from the job's state directory and
optionally kills it with ``SIGKILL``:

- at a named crash point (:mod:`tierstore._platform.faults`), counting only the hits in
  the phases the test names (``crash=(point, after, during)``), or
- at a random instant inside one phase (``kill_in=(phase, delay)``): the
  parent watches the child's phase and kills it ``delay`` seconds after the
  child entered that phase. The child holds at the end of that phase until
  it is killed, so the kill cannot miss the phase, however the machine's
  speed drifts.

The child reports its phase through shared memory (``construct``; then per
step ``forward k``, where the training loop's forward/backward would run,
and ``step k``; then ``export``, ``close``, ``done``), so every
:class:`ChildResult` says where the kill landed; :func:`killed_state_problems`
checks what the directory holds against it. :func:`reference` and
:func:`trajectory` compute the uninterrupted result with
``torch.optim.AdamW(fused=True)`` (a job with a compressed ``moment_dtype``
in ``extra``: with its oracle, :class:`~tierstore.testing.formats.FormatOracle`);
a crash-and-resume run must equal it bitwise.

Children start from a fork server that has already imported torch, so a
kill-and-resume round costs a fraction of a second.

Example
-------
>>> import tempfile
>>> job = CrashJob(state_dir=tempfile.mkdtemp(), steps=3)
>>> result = run_child(job, kill_in=("step 1", 0.01))  # doctest: +SKIP
>>> result.killed, result.landed_phase  # doctest: +SKIP
(True, 'step 1')
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = [
    "CrashJob", "initial_params", "gradients", "Snapshot", "trajectory", "moment_dtype", "reference",
    "differences", "compare", "phase_names", "step_windows", "Progress", "train", "ChildResult",
    "kill_when_due", "run_child", "killed_state_problems",
]  # fmt: skip

_CONTEXT: mp.context.BaseContext | None = None
POLL_SECONDS = 0.0002  # how often the parent looks at the child's phase while it waits to kill


@dataclass(frozen=True)
class CrashJob:
    """A deterministic training run whose state lives in ``state_dir``: a directory, or a tuple of them
    (a state over several drives, the home first)."""

    state_dir: str | tuple[str, ...]
    steps: int = 8
    shapes: tuple[tuple[int, ...], ...] = ((257, 33), (1000,), (17,), (64, 64), (5000,))
    ram_budget: str | None = "112KiB"
    shard_numel: int = 2048
    backend: str = "auto"
    seed: int = 0
    lr: float = 1e-2
    weight_decay: float = 1e-2
    amsgrad: bool = False
    keep_master: bool = True
    durable: bool | None = None
    skip_every: int = 3  # parameter k gets no gradient on steps where (step + k) % skip_every == 0
    forward_seconds: float = 0.0  # a stand-in for forward/backward between steps (busy wait)
    commit_every: object = 1  # every step, so the kills land in commits too ("auto" spaces them in a tight loop)
    extra: dict = field(default_factory=dict)

    @property
    def directories(self) -> tuple[str, ...]:
        """Every directory of the state, the home first."""
        return tuple(self.state_dir) if isinstance(self.state_dir, tuple) else (self.state_dir,)

    @property
    def home(self) -> str:
        """The directory holding the manifest."""
        return self.directories[0]

    def in_directories(self, directories: tuple[str, ...]) -> CrashJob:
        """This job with its state in ``directories`` (as many as it has; one: a plain path)."""
        return replace(self, state_dir=directories[0] if len(directories) == 1 else tuple(directories))

    def optimizer_kwargs(self) -> dict:
        """TieredAdamW's keyword arguments for this job (resuming whatever committed state the directory holds)."""
        return dict(
            lr=self.lr,
            weight_decay=self.weight_decay,
            amsgrad=self.amsgrad,
            state_dir=list(self.state_dir) if isinstance(self.state_dir, tuple) else self.state_dir,
            ram_budget=self.ram_budget,
            shard_numel=self.shard_numel,
            backend=self.backend,
            keep_master=self.keep_master,
            durable=self.durable,
            resume="auto",  # a first run starts fresh, a rerun after a kill resumes the committed step
            commit_every=self.commit_every,
            **self.extra,
        )


def initial_params(job: CrashJob) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(job.seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in job.shapes]


def gradients(job: CrashJob, step: int) -> list[torch.Tensor | None]:
    """The gradients of ``step``: a pure function of the job and the step number."""
    gen = torch.Generator().manual_seed(job.seed * 100_003 + step + 1)
    out: list[torch.Tensor | None] = []
    for k, s in enumerate(job.shapes):
        g = torch.randn(s, generator=gen)
        out.append(None if job.skip_every and (step + k) % job.skip_every == 0 else g)
    return out


@dataclass
class Snapshot:
    """The uninterrupted run after some number of steps."""

    params: list[torch.Tensor]
    state_dict: dict


_trajectories: dict[tuple, list[Snapshot]] = {}


def trajectory(job: CrashJob) -> list[Snapshot]:
    """The uninterrupted run of torch's fused AdamW after 0, 1, ..., ``job.steps`` steps.

    Cached per run identity (many crash tests share one); treat it as read-only.
    """
    key = (job.steps, job.shapes, job.seed, job.lr, job.weight_decay, job.amsgrad, job.skip_every, moment_dtype(job))
    if key not in _trajectories:
        if len(_trajectories) >= 16:  # a few MiB each at most: keep the recent ones
            _trajectories.pop(next(iter(_trajectories)))
        _trajectories[key] = _trajectory(job)
    return _trajectories[key]


def moment_dtype(job: CrashJob) -> str:
    """The job's moment format (``extra["moment_dtype"]``, float32 by default)."""
    return str(job.extra.get("moment_dtype", "float32"))


def _trajectory(job: CrashJob) -> list[Snapshot]:
    params = initial_params(job)
    if moment_dtype(job) == "float32":
        opt = torch.optim.AdamW(params, lr=job.lr, weight_decay=job.weight_decay, amsgrad=job.amsgrad, fused=True)
    else:  # the format's oracle: decode -> fused AdamW -> encode, per tensor
        from .formats import FormatOracle

        opt = FormatOracle(params, lr=job.lr, weight_decay=job.weight_decay, amsgrad=job.amsgrad,
                           moment_dtype=moment_dtype(job))

    def snap() -> Snapshot:
        sd = opt.state_dict()
        state = {i: {k: v.clone() for k, v in entry.items()} for i, entry in sd["state"].items()}
        return Snapshot([p.detach().clone() for p in params], {"state": state, "param_groups": sd["param_groups"]})

    out = [snap()]
    for step in range(job.steps):
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        opt.step()
        out.append(snap())
    return out


def reference(job: CrashJob) -> tuple[list[torch.Tensor], dict]:
    """Params and state dict after ``job.steps`` uninterrupted steps of torch's fused AdamW."""
    last = trajectory(job)[-1]
    return last.params, last.state_dict


def differences(
    want: Snapshot, params: list[torch.Tensor] | None, state_dict: dict, *, strict_state: bool = True
) -> list[str]:
    """What differs between ``want`` and a run's params and state dict (empty: bitwise equal).

    ``params=None`` skips the parameters (a run without masters does not
    restore them). ``strict_state`` also reports states the reference lacks.
    """
    problems = []
    if params is not None:
        for i, (a, b) in enumerate(zip(want.params, params)):
            if not torch.equal(a, b):
                problems.append(f"param {i} differs (max abs {float((a - b).abs().max()):.3g})")
    got = state_dict["state"]
    for i, ref_state in want.state_dict["state"].items():
        state = got.get(i)
        if state is None:
            problems.append(f"param {i} has no state")
            continue
        for key, value in ref_state.items():
            if key not in state:
                problems.append(f"param {i} has no {key}")
            elif not torch.equal(value, state[key]):
                problems.append(f"param {i} {key} differs")
    if strict_state:
        extra = sorted(set(got) - set(want.state_dict["state"]))
        if extra:
            problems.append(f"params {extra} have state the reference has not (no step taken yet)")
    return problems


def compare(job: CrashJob, out: str | Path) -> list[str]:
    """Differences between a finished run's ``out`` file and :func:`reference` (empty: bitwise equal)."""
    got = torch.load(out, weights_only=True)
    return differences(trajectory(job)[-1], got["params"], got["state_dict"], strict_state=False)


# -- phases: where a child is, and where its kill landed ---------------------------------


def phase_names(steps: int) -> list[str]:
    """Every phase a run of ``steps`` steps goes through, in order (a phase's code is its index)."""
    names = ["start", "construct"]
    for k in range(steps):
        names += [f"forward {k}", f"step {k}"]
    return names + ["export", "close", "done"]


def step_windows(job: CrashJob) -> dict[str, list[str]]:
    """Step phases split into ``early``, ``middle`` and ``late`` thirds of the run."""
    steps = [f"step {k}" for k in range(job.steps)]
    third = max(1, len(steps) // 3)
    return {"early": steps[:third], "middle": steps[third : len(steps) - third], "late": steps[len(steps) - third :]}


class Progress:
    """What a training child tells its parent through shared memory.

    The child calls :meth:`enter` at each phase change; the parent reads
    :attr:`phase`, the committed step count the child last saw returned,
    and, after a kill, where it landed. Built by the parent before the child
    starts (shared values travel with the process).
    """

    def __init__(self, ctx: mp.context.BaseContext, names: list[str], *, gate: str | None = None) -> None:
        self.names = names
        self.phase = ctx.Value("i", 0, lock=False)
        self.completed = ctx.Value("i", -1, lock=False)
        self.landed_point = ctx.Value("i", -1, lock=False)
        self.landed_phase = ctx.Value("i", -1, lock=False)
        self.waiting = ctx.Value("i", 0, lock=False)
        self.entered = ctx.Array("d", len(names), lock=False)  # time.monotonic() at entry (0: never)
        self.gate = -1 if gate is None else names.index(gate)

    # -- child side
    def enter(self, name: str) -> None:
        """Start phase ``name``; hold first if the phase being left is the gate (wait for the kill)."""
        from .._platform import faults

        if self.phase.value == self.gate:
            self.waiting.value = 1
            while True:  # the parent kills this process; it never releases the gate
                time.sleep(0.01)
        code = self.names.index(name)
        self.entered[code] = time.monotonic()
        self.phase.value = code
        faults.set_phase(name)

    def fired(self, point: str, phase: str) -> None:
        """``faults.arm(on_fire=...)``: record the crash point and phase a moment before the kill."""
        from .._platform import faults

        self.landed_point.value = faults.POINTS.index(point)
        self.landed_phase.value = self.names.index(phase) if phase in self.names else -1

    # -- parent side
    def phase_name(self) -> str:
        return self.names[self.phase.value]

    def durations(self) -> dict[str, float]:
        """Seconds spent in each phase the child went through (from entry to the next entry)."""
        times = [(t, n) for t, n in zip(self.entered, self.names) if t > 0]
        return {n: round(t2 - t1, 6) for (t1, n), (t2, _) in zip(times, times[1:])}


def train(
    job: CrashJob,
    *,
    crash: tuple[str, int, Collection[str] | None] | None = None,
    progress: Progress | None = None,
    out: str | None = None,
) -> None:
    """Resume (or start) the job in ``job.state_dir`` and train to ``job.steps``.

    ``crash`` arms a crash point (``(point, after, during)``); ``progress``
    hears every phase change and the committed step count after each step;
    ``out`` receives the final params and state dict.
    """
    from .. import TieredAdamW
    from .._platform import faults

    def enter(name: str) -> None:
        if progress is not None:
            progress.enter(name)
        else:
            faults.set_phase(name)

    if crash is not None:
        faults.arm(crash[0], after=crash[1], during=crash[2], on_fire=progress.fired if progress else None)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes]
    fresh = initial_params(job)
    with torch.no_grad():
        for p, f in zip(params, fresh):
            p.copy_(f)  # a fresh start uses these; a resume overwrites them from the masters
    enter("construct")
    opt = TieredAdamW(params, **job.optimizer_kwargs())

    def report() -> None:  # commits finish in the background: report what is durable
        if progress is not None:
            progress.completed.value = opt.step_count if opt.committed_step is None else opt.committed_step

    report()
    for step in range(opt.step_count, job.steps):
        enter(f"forward {step}")
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        if job.forward_seconds:
            end = time.monotonic() + job.forward_seconds
            while time.monotonic() < end:  # holds a core, as a model's forward/backward would
                pass
        enter(f"step {step}")
        opt.step()
        report()
    enter("export")
    if out is not None:
        torch.save({"params": [p.detach().clone() for p in params], "state_dict": opt.state_dict()}, out)
    enter("close")
    opt.close()
    if progress is not None:  # a clean close commits the last step
        progress.completed.value = opt.step_count
    enter("done")


@dataclass
class ChildResult:
    """How a training child ended, and where it was when it died."""

    exitcode: int | None
    killed: bool
    completed: int  # committed step count the child last reported (-1: none)
    seconds: float
    landed_phase: str | None = None  # the phase the child was in when it died (None: it was not killed)
    landed_point: str | None = None  # the crash point that killed it (None: killed from outside, or not at all)
    at_gate: bool = False  # killed while holding at the end of its target phase (its work there was done)
    durations: dict[str, float] = field(default_factory=dict)  # seconds per phase it went through


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch._dynamo",
                "torch.distributed.checkpoint",
                "torch.distributed.optim",
                "tierstore",
                "tierstore.testing.crash",
            ]
        )
        _CONTEXT = ctx
    return _CONTEXT


def kill_when_due(proc: mp.process.BaseProcess, progress: Progress, phase: str, delay: float) -> bool:
    """SIGKILL ``proc`` ``delay`` seconds after it entered ``phase``; False if it never entered it.

    The child holds at the end of ``phase`` (its gate), so a late parent
    still kills it inside the phase.
    """
    target = progress.names.index(phase)
    while proc.is_alive() and progress.phase.value < target:
        time.sleep(POLL_SECONDS)
    if not proc.is_alive() or progress.phase.value != target:
        return False
    due = progress.entered[target] + delay
    while (now := time.monotonic()) < due:
        time.sleep(min(POLL_SECONDS, due - now))
    os.kill(proc.pid, signal.SIGKILL)
    return True


def run_child(
    job: CrashJob,
    *,
    crash: tuple[str, int] | tuple[str, int, Collection[str] | None] | None = None,
    kill_in: tuple[str, float] | None = None,
    out: str | None = None,
    timeout: float = 120.0,
) -> ChildResult:
    """Run :func:`train` in a child and report where it ended.

    Parameters
    ----------
    crash
        ``(point, after)`` or ``(point, after, during)``: arm that crash point
        in the child, counting only hits during the named phases.
    kill_in
        ``(phase, delay)``: SIGKILL the child ``delay`` seconds after it
        entered ``phase`` (see :func:`phase_names`); it holds at the end of
        that phase until killed.
    out
        Where the child saves its final params and state dict.
    timeout
        Kill the child and raise if it runs longer.

    Raises
    ------
    TimeoutError
        If the child ran longer than ``timeout``.
    """
    if crash is not None and len(crash) == 2:
        crash = (crash[0], crash[1], None)
    ctx = _context()
    names = phase_names(job.steps)
    progress = Progress(ctx, names, gate=kill_in[0] if kill_in else None)
    proc = ctx.Process(target=train, args=(job,), kwargs={"crash": crash, "progress": progress, "out": out})
    t0 = time.perf_counter()
    proc.start()
    killed = False
    if kill_in is not None:
        killed = kill_when_due(proc, progress, *kill_in)
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"training child for {job.home} ran longer than {timeout} s")
    from .._platform import faults

    killed = killed or proc.exitcode == -signal.SIGKILL
    point = progress.landed_point.value
    return ChildResult(
        exitcode=proc.exitcode,
        killed=killed,
        completed=progress.completed.value,
        seconds=time.perf_counter() - t0,
        landed_phase=progress.phase_name() if killed else None,
        landed_point=faults.POINTS[point] if point >= 0 else None,
        at_gate=bool(progress.waiting.value),
        durations=progress.durations(),
    )


def killed_state_problems(job: CrashJob, result: ChildResult, *, before: int | None = None) -> list[str]:
    """What is wrong with the state directory a killed durable child left (empty: nothing).

    It must hold the last step the child saw committed, or a later one whose
    commit started before the kill (commits finish in the background, and
    under load one may start while an earlier one the child never saw
    finish was skipped): at most the step the kill interrupted, whose own
    commit starts at its end, or the final step when killed in export or
    close. A child that died before it saw any commit leaves what the
    directory held ``before`` it started (``None``: it was empty, so
    nothing, or step 0). Every committed checksum must verify.
    """
    from .._state.reader import StateReader

    manifest = Path(job.home) / "manifest.json"
    phase = result.landed_phase or ""
    name, _, k = phase.partition(" ")
    if result.completed < 0:
        allowed = {None, 0} if before is None else {before}
    else:
        # The latest step a commit can have started before the kill: in step k, step k's own
        # (its commit starts at its end); in forward k, step k-1's; in export or close, the last.
        latest = {"step": int(k or 0) + 1, "forward": int(k or 0)}.get(name, job.steps)
        if name == "construct":
            latest = result.completed + 2  # building a fresh state commits twice
        allowed = set(range(result.completed, max(latest, result.completed) + 1))
    if not manifest.exists():
        return [] if None in allowed else [f"no manifest after a kill in {phase!r}; expected step {sorted(allowed)}"]
    with StateReader(list(job.directories)) as reader:
        committed = reader.step_count
        problems = [str(p) for p in reader.verify() if p.severity == "error"]
    if committed not in allowed:
        problems.append(
            f"killed in {phase!r} after step {result.completed} was committed, the directory holds step "
            f"{committed}; expected one of {sorted(a for a in allowed if a is not None)}"
        )
    return problems
