"""Crash-and-resume harness: train in a child process, SIGKILL it, resume, compare.

A :class:`CrashJob` describes a small deterministic training run (parameter
shapes, gradients derived from the step number, budget, backend). :func:`run_child`
trains it in a child process that resumes from the job's state directory,
optionally killed with ``SIGKILL`` after a delay or at a named crash point
(:mod:`tierstore.faults`). :func:`reference` computes the uninterrupted result
with ``torch.optim.AdamW(fused=True)``; a crash-and-resume run must equal it
bitwise.

Children start from a fork server that has already imported torch, so a
kill-and-resume round costs a fraction of a second.

Example
-------
>>> import tempfile
>>> job = CrashJob(state_dir=tempfile.mkdtemp(), steps=3)
>>> result = run_child(job, out="final.pt")  # doctest: +SKIP
>>> result.exitcode, result.completed  # doctest: +SKIP
(0, 3)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

_CONTEXT: mp.context.BaseContext | None = None


@dataclass(frozen=True)
class CrashJob:
    """A deterministic training run whose state lives in ``state_dir``."""

    state_dir: str
    steps: int = 8
    shapes: tuple[tuple[int, ...], ...] = ((257, 33), (1000,), (17,), (64, 64), (5000,))
    ram_budget: str | None = "112KiB"
    shard_numel: int = 2048
    backend: str = "auto"
    seed: int = 0
    lr: float = 1e-2
    weight_decay: float = 1e-2
    amsgrad: bool = False
    skip_every: int = 3  # parameter k gets no gradient on steps where (step + k) % skip_every == 0
    commit_every: object = 1  # every step, so the kills land in commits too ("auto" spaces them in a tight loop)
    extra: dict = field(default_factory=dict)

    def optimizer_kwargs(self) -> dict:
        """TieredAdamW's keyword arguments for this job (resuming, fp32 masters kept)."""
        return dict(
            lr=self.lr,
            weight_decay=self.weight_decay,
            amsgrad=self.amsgrad,
            state_dir=self.state_dir,
            ram_budget=self.ram_budget,
            shard_numel=self.shard_numel,
            backend=self.backend,
            keep_master=True,
            resume=True,
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


def reference(job: CrashJob) -> tuple[list[torch.Tensor], dict]:
    """Params and state dict after ``job.steps`` uninterrupted steps of torch's fused AdamW."""
    params = initial_params(job)
    opt = torch.optim.AdamW(params, lr=job.lr, weight_decay=job.weight_decay, amsgrad=job.amsgrad, fused=True)
    for step in range(job.steps):
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def train(
    job: CrashJob, *, crash: tuple[str, int] | None = None, progress=None, committed=None, out: str | None = None
) -> None:
    """Resume (or start) the job in ``job.state_dir`` and train to ``job.steps``.

    ``progress`` (a shared int) is set to the completed step count after each
    step, ``committed`` to the optimizer's ``committed_step`` (commits finish
    in the background, so it may lag); ``out`` receives the final params and
    state dict.
    """
    from tierstore import TieredAdamW, faults

    if crash is not None:
        faults.arm(crash[0], after=crash[1])
    params = [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes]
    fresh = initial_params(job)
    with torch.no_grad():
        for p, f in zip(params, fresh):
            p.copy_(f)  # a fresh start uses these; a resume overwrites them from the masters
    opt = TieredAdamW(params, **job.optimizer_kwargs())

    def report() -> None:
        if progress is not None:
            progress.value = opt.step_count
        if committed is not None and opt.committed_step is not None:
            committed.value = opt.committed_step

    report()
    for step in range(opt.step_count, job.steps):
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        opt.step()
        report()
    if out is not None:
        torch.save({"params": [p.detach().clone() for p in params], "state_dict": opt.state_dict()}, out)
    opt.close()


@dataclass
class ChildResult:
    exitcode: int | None
    killed: bool
    completed: int  # step count the child last reported (-1: none)
    seconds: float
    committed: int = -1  # committed step the child last reported (-1: none)


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


def run_child(
    job: CrashJob,
    *,
    crash: tuple[str, int] | None = None,
    kill_after: float | None = None,
    out: str | None = None,
    timeout: float = 120.0,
) -> ChildResult:
    """Run :func:`train` in a child; SIGKILL it after ``kill_after`` seconds if still running."""
    ctx = _context()
    progress = ctx.Value("i", -1)
    committed = ctx.Value("i", -1)
    kwargs = {"crash": crash, "progress": progress, "committed": committed, "out": out}
    proc = ctx.Process(target=train, args=(job,), kwargs=kwargs)
    t0 = time.perf_counter()
    proc.start()
    killed = False
    if kill_after is not None:
        proc.join(kill_after)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"training child for {job.state_dir} ran longer than {timeout} s")
    killed = killed or proc.exitcode == -signal.SIGKILL
    return ChildResult(proc.exitcode, killed, progress.value, time.perf_counter() - t0, committed.value)


def compare(job: CrashJob, out: str | Path) -> list[str]:
    """Differences between a finished run's ``out`` file and :func:`reference` (empty: bitwise equal)."""
    ref_params, ref_sd = reference(job)
    got = torch.load(out, weights_only=True)
    problems = []
    for i, (a, b) in enumerate(zip(ref_params, got["params"])):
        if not torch.equal(a, b):
            problems.append(f"param {i} differs (max abs {float((a - b).abs().max()):.3g})")
    for i, ref_state in ref_sd["state"].items():
        state = got["state_dict"]["state"].get(i)
        if state is None:
            problems.append(f"param {i} has no state")
            continue
        for key, value in ref_state.items():
            if not torch.equal(value, state[key]):
                problems.append(f"param {i} {key} differs")
    return problems
