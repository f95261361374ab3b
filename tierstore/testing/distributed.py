"""Multi-process test kit: gloo ranks on the CPU, deterministic FSDP2 / ZeRO jobs, a reference.

:func:`run_ranks` starts ``world_size`` processes from a fork server that has
already imported torch (and ``torch._dynamo``, which FSDP2 imports), gives
each a gloo process group with a short collective timeout, and watches them:
when one rank dies (a crash point's ``SIGKILL``, a planned kill, or an
exception) the others are killed too after ``kill_grace`` seconds, as a job
scheduler would, instead of waiting in a collective for a peer that is gone.
Given the ``phases`` a target goes through, each rank reports its phase
(:class:`~tierstore.testing.crash.Progress`): a crash point then counts only
in the phases named, ``kill_in`` kills a rank at a random instant inside one
phase, and every :class:`RankResult` says where its rank died.

:class:`DistJob` describes a small deterministic training run (an MLP whose
batches are a pure function of the step number, the same on every rank, so
that FSDP2's and DDP's averaged gradients equal the single-process ones bit
for bit). :func:`train_rank` runs it on one rank with FSDP2 ``fully_shard``
or DDP + ``ZeroRedundancyOptimizer``, with :class:`~tierstore.TieredAdamW` or
``torch.optim.AdamW(fused=True)``, resuming from the job's state directory,
optionally saving or loading a DCP checkpoint, and writes what it ended with
(local parameter shards with their global offsets, local optimizer states,
a forward pass on a probe batch) to ``out_dir``. :func:`reference` is the
same run in one process with torch's AdamW; :func:`compare` lists the
differences.

Example
-------
>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> job = DistJob(state_dir=f"{d}/state", out_dir=d, steps=3)
>>> results = run_ranks(train_rank, world_size=2, args=(job, "run"))  # doctest: +SKIP
>>> [r.exitcode for r in results], compare(job, "run", world_size=2)  # doctest: +SKIP
([0, 0], [])
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._platform import faults
from .._platform.torch_private import fused_adamw_kernel, local_shape_and_offset
from .crash import POLL_SECONDS, Progress, phase_names

__all__ = [
    "RankResult",
    "enter",
    "run_ranks",
    "job_phases",
    "DistJob",
    "build_model",
    "batch",
    "probe",
    "train_rank",
    "reference",
    "compare",
    "replace",
    "agree_rank",
    "torch_state_dict_rank",
    "measure_dcp_memory",
]

PRELOAD = (
    "torch",
    "torch._dynamo",  # FSDP2 imports it; seconds when not preloaded
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.optim",  # ZeroRedundancyOptimizer: 0.7 s when not preloaded
    "tierstore",
    "tierstore.dcp",
    "tierstore.testing.crash",
    "tierstore.testing.distributed",
)

_CONTEXT: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # The fork server is shared by the whole process (tierstore.testing.crash
        # uses it too); whichever kit starts it first decides what it preloads.
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


@dataclass
class RankResult:
    """How one rank's process ended, and where."""

    rank: int
    exitcode: int | None
    killed_by_harness: bool  # SIGKILLed by run_ranks because a peer died, or at the timeout
    seconds: float
    phase: str | None = None  # the phase it was in when it ended (None: phases not reported)
    landed_point: str | None = None  # the crash point that killed it
    completed: int = -1  # the step count it last saw committed

    @property
    def crashed(self) -> bool:
        """Died by the planned SIGKILL: an armed crash point, or ``kill_in``."""
        return self.exitcode == -signal.SIGKILL and not self.killed_by_harness


_PROGRESS: Progress | None = None  # this rank's reporter, when run_ranks was given phases


def enter(name: str) -> None:
    """Tell run_ranks (and :mod:`tierstore._platform.faults`) this rank's phase; targets call it."""
    from .._platform import faults

    if _PROGRESS is not None:
        _PROGRESS.enter(name)
    else:
        faults.set_phase(name)


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    collective_timeout: float,
    crash: tuple[str, int, Collection[str] | None] | None,
    progress: Progress | None,
    args: tuple,
) -> None:
    import torch.distributed as dist

    from .._platform import faults

    global _PROGRESS
    _PROGRESS = progress
    torch.set_num_threads(1)  # ranks share 2 cores; results do not depend on it
    if crash is not None:
        faults.arm(crash[0], after=crash[1], during=crash[2], on_fire=progress.fired if progress else None)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    try:
        target(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    phases: Sequence[str] | None = None,
    crash: tuple[int, str, int] | tuple[int, str, int, Collection[str]] | None = None,
    kill_in: tuple[int, str, float] | None = None,
    kill_grace: float = 0.0,
    collective_timeout: float = 20.0,
    timeout: float = 120.0,
) -> list[RankResult]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` gloo ranks and wait for them.

    Parameters
    ----------
    target
        A module-level function (children unpickle it by name).
    world_size
        Number of ranks.
    args
        Further positional arguments for ``target`` (picklable).
    phases
        Every phase ``target`` reports with :func:`enter`, in order (e.g.
        :func:`job_phases`); needed by ``kill_in`` and by ``crash`` with phases.
    crash
        ``(rank, point, after)`` or ``(rank, point, after, during)``: arm
        :mod:`tierstore._platform.faults` crash point ``point`` in ``rank`` (it SIGKILLs
        itself the ``after``-th time it is reached in a phase of ``during``).
    kill_in
        ``(rank, phase, delay)``: SIGKILL ``rank`` ``delay`` seconds after it
        entered ``phase``; it holds at the end of that phase until killed.
    kill_grace
        Seconds the other ranks may run on after one rank died (they may
        finish a step already under way) before they are SIGKILLed.
    collective_timeout
        The process group's timeout: a rank waiting for a dead peer fails
        after this long even if nobody kills it.
    timeout
        Kill every rank still running after this many seconds and raise.

    Raises
    ------
    TimeoutError
        If the ranks ran longer than ``timeout`` (they are killed first).

    Example
    -------
    >>> run_ranks(print, world_size=2, args=("hello",))  # doctest: +SKIP
    """
    ctx = _context()
    if (kill_in is not None or (crash is not None and len(crash) > 3)) and phases is None:
        raise ValueError("kill_in and crash points counted in phases need the target's phases=")
    init_dir = tempfile.mkdtemp(prefix="tierstore-pg-")
    init_file = os.path.join(init_dir, "store")
    procs = []
    progress: list[Progress | None] = []
    for rank in range(world_size):
        arm = None
        if crash is not None and crash[0] == rank:
            arm = (crash[1], crash[2], crash[3] if len(crash) > 3 else None)
        gate = kill_in[1] if kill_in is not None and kill_in[0] == rank else None
        progress.append(None if phases is None else Progress(ctx, list(phases), gate=gate))
        procs.append(
            ctx.Process(
                target=_rank_main,
                args=(target, rank, world_size, init_file, collective_timeout, arm, progress[rank], tuple(args)),
                name=f"rank{rank}",
            )
        )
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    harness_killed: set[int] = set()
    ended: dict[int, float] = {}
    first_failure: float | None = None
    timed_out = False
    try:
        while len(ended) < world_size:
            now = time.perf_counter()
            for rank, p in enumerate(procs):
                if rank not in ended and p.exitcode is not None:
                    ended[rank] = now - t0
                    if p.exitcode != 0 and first_failure is None:
                        first_failure = now
            if kill_in is not None and _kill_if_due(procs[kill_in[0]], progress[kill_in[0]], kill_in[1], kill_in[2]):
                kill_in = None
            if first_failure is not None and now - first_failure >= kill_grace:
                for rank, p in enumerate(procs):
                    if rank not in ended and p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                        harness_killed.add(rank)
            if now - t0 > timeout:
                timed_out = True
                for rank, p in enumerate(procs):
                    if rank not in ended and p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                        harness_killed.add(rank)
            waiting = [p.sentinel for r, p in enumerate(procs) if r not in ended]
            if waiting:
                nap = POLL_SECONDS if kill_in is not None else 0.005 if first_failure is not None else 0.2
                multiprocessing.connection.wait(waiting, timeout=nap)
    finally:
        for p in procs:
            p.join(5)
        for name in os.listdir(init_dir):
            os.unlink(os.path.join(init_dir, name))
        os.rmdir(init_dir)
    if timed_out:
        raise TimeoutError(f"ranks of {getattr(target, '__name__', target)} ran longer than {timeout} s")
    results = []
    for r, p in enumerate(procs):
        result = RankResult(r, p.exitcode, r in harness_killed, ended.get(r, 0.0))
        if progress[r] is not None:
            result.phase = progress[r].phase_name()
            result.completed = progress[r].completed.value
            point = progress[r].landed_point.value
            result.landed_point = faults.POINTS[point] if point >= 0 else None
        results.append(result)
    return results


def _kill_if_due(proc: mp.process.BaseProcess, progress: Progress, phase: str, delay: float) -> bool:
    """SIGKILL ``proc`` once ``delay`` seconds passed since it entered ``phase``; True when done with it."""
    target = progress.names.index(phase)
    if proc.exitcode is not None or progress.phase.value > target:
        return True  # ended, or went past without entering it: nothing to kill
    if progress.phase.value < target or time.monotonic() < progress.entered[target] + delay:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    return True


def job_phases(job: DistJob) -> list[str]:
    """The phases :func:`train_rank` reports for ``job``, in order."""
    return phase_names(job.steps)


# -- a deterministic job --------------------------------------------------------------


@dataclass(frozen=True)
class DistJob:
    """A small deterministic training run for FSDP2 / ZeRO tests.

    ``dims`` are the widths of an MLP (``Linear(dims[k], dims[k+1])``, tanh in
    between); uneven widths give uneven FSDP2 shards, and a width-1 output
    layer gives rank 1 empty local shards.
    """

    state_dir: str
    out_dir: str
    steps: int = 4
    dims: tuple[int, ...] = (64, 128, 96, 1)
    batch: int = 5
    seed: int = 0
    lr: float = 1e-2
    weight_decay: float = 1e-2
    amsgrad: bool = False
    wrap: str = "fsdp2"  # "fsdp2", "zero" (DDP + ZeroRedundancyOptimizer) or "none"
    commit_every: object = 1  # every step, so the kills land in commits ("auto" spaces them in a tight loop)
    attach: bool = False  # run each step behind the loop (TieredAdamW.attach on the wrapped model)
    optimizer: str = "tiered"  # "tiered" or "torch" (AdamW(fused=True))
    ram_budget: str | None = "64KiB"  # 10 of each rank's 11 shards on disk (with masters)
    shard_numel: int = 1024
    keep_master: bool = True
    resume: bool | str = "auto"  # a first run starts fresh, a rerun after a kill resumes the committed step
    save_at: int | None = None  # save a DCP checkpoint after this many steps...
    load: bool = False  # ...or start by loading the one in dcp_dir
    dcp_dir: str = ""
    single_file_per_rank: bool = False
    forward_seconds: float = 0.0  # a forward/backward stand-in: lets each step's background commit land


def build_model(job: DistJob) -> torch.nn.Module:
    """The job's MLP with seeded initial weights (identical in every process)."""
    torch.manual_seed(job.seed)
    layers: list[torch.nn.Module] = []
    for k in range(len(job.dims) - 1):
        layers.append(torch.nn.Linear(job.dims[k], job.dims[k + 1]))
        if k < len(job.dims) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def batch(job: DistJob, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``step``: a pure function of the job and the step."""
    gen = torch.Generator().manual_seed(job.seed * 100_003 + step + 1)
    x = torch.randn(job.batch, job.dims[0], generator=gen)
    y = torch.randn(job.batch, job.dims[-1], generator=gen)
    return x, y


def probe(job: DistJob) -> torch.Tensor:
    """A fixed batch whose forward pass shows whether updates reached the model."""
    return torch.randn(3, job.dims[0], generator=torch.Generator().manual_seed(12345))


def _loss(model: torch.nn.Module, job: DistJob, step: int) -> torch.Tensor:
    x, y = batch(job, step)
    return (model(x) - y).square().mean()


def _make_optimizer(job: DistJob, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from .. import TieredAdamW

    hyper = dict(lr=job.lr, weight_decay=job.weight_decay, amsgrad=job.amsgrad)
    if job.optimizer == "torch":
        cls, extra = torch.optim.AdamW, dict(fused=True)
    else:
        cls, extra = TieredAdamW, dict(
            state_dir=job.state_dir,
            ram_budget=job.ram_budget,
            shard_numel=job.shard_numel,
            keep_master=job.keep_master,
            resume=job.resume,
            commit_every=job.commit_every,
        )
    if job.wrap == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **hyper, **extra)
    return cls(params, **hyper, **extra)


def _local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the rank's own in .optim


def _steps_done(opt: torch.optim.Optimizer) -> int:
    """Steps taken: TieredAdamW counts them; for torch's AdamW, the largest parameter step."""
    local = _local_optimizer(opt)
    if hasattr(local, "step_count"):
        return int(local.step_count)
    return int(max((float(st["step"]) for st in local.state.values() if "step" in st), default=0))


def _local_with_offset(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A tensor's local part and where it starts in the global tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        _, offset = local_shape_and_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), offset
    return t, (0,) * t.dim()


def _local_states(opt: torch.optim.Optimizer, index: dict[int, int]) -> dict[int, dict[str, torch.Tensor]]:
    """The local optimizer's states by global parameter index, as local tensors."""
    local = _local_optimizer(opt)
    out: dict[int, dict[str, torch.Tensor]] = {}
    sd = local.state_dict()
    flat = [p for g in local.param_groups for p in g["params"]]
    for pid, entry in sd["state"].items():
        gi = index[id(flat[pid])]
        out[gi] = {k: _local_with_offset(v)[0].detach().clone() for k, v in entry.items()}
    return out


def _dcp_state(job: DistJob, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What the job checkpoints: the model, and the optimizer as TieredStateful or torch's way."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from ..dcp import TieredStateful

    if job.optimizer == "torch":
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    return {"model": get_model_state_dict(model), "optim": TieredStateful(opt, model)}


def _save_dcp(job: DistJob, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp

    from ..dcp import TieredSavePlanner

    writer = dcp.FileSystemWriter(job.dcp_dir, single_file_per_rank=job.single_file_per_rank)
    dcp.save(_dcp_state(job, model, opt), storage_writer=writer, planner=TieredSavePlanner())


def _load_dcp(job: DistJob, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _dcp_state(job, model, opt)
    # A checkpoint written by torch's AdamW lacks tierstore_step_count (and masters): partial.
    planner = dcp.DefaultLoadPlanner(allow_partial_load=job.optimizer != "torch")
    dcp.load(state, checkpoint_id=job.dcp_dir, planner=planner)
    set_model_state_dict(model, state["model"])
    if job.optimizer == "torch":
        set_optimizer_state_dict(model, opt, state["optim"])


def train_rank(rank: int, world_size: int, job: DistJob, tag: str) -> None:
    """Run ``job`` on this rank (resuming its state) and write ``out_dir/{tag}-rank{rank}.pt``.

    Reports its phases (:func:`job_phases`) with :func:`enter`.
    """
    enter("construct")
    model = build_model(job)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    if job.wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())  # now DTensors
        index = {id(p): i for i, p in enumerate(params)}
        trained = model
    elif job.wrap == "zero":
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    else:
        trained = model
    opt = _make_optimizer(job, params)
    if job.attach:
        _local_optimizer(opt).attach(trained)
    resumed_at = _steps_done(opt)
    if job.load:
        _load_dcp(job, trained, opt)
    first = _steps_done(opt)
    _report_completed(_committed(opt))
    for step in range(first, job.steps):
        enter(f"forward {step}")
        if job.forward_seconds:
            time.sleep(job.forward_seconds)
        _loss(trained, job, step).backward()
        enter(f"step {step}")
        opt.step()
        opt.zero_grad()
        _report_completed(_committed(opt))
        if job.save_at is not None and step + 1 == job.save_at:
            _save_dcp(job, trained, opt)
    enter("export")
    with torch.no_grad():
        out = trained(probe(job))
    result = {
        "params": {i: _local_with_offset(p.detach()) for i, p in enumerate(params)},
        "state": _local_states(opt, index),
        "probe": out,
        "steps": _steps_done(opt),
        "resumed_at": resumed_at,
        "first_step": first,
    }
    result["params"] = {i: (t.clone(), off) for i, (t, off) in result["params"].items()}
    torch.save(result, os.path.join(job.out_dir, f"{tag}-rank{rank}.pt"))
    enter("close")
    close = getattr(_local_optimizer(opt), "close", None)
    if close is not None:
        close()
    enter("done")


def _committed(opt: torch.optim.Optimizer) -> int:
    """The step a crash now would resume at (commits finish in the background), else the steps done."""
    committed = getattr(_local_optimizer(opt), "committed_step", None)
    return _steps_done(opt) if committed is None else int(committed)


def _report_completed(steps: int) -> None:
    if _PROGRESS is not None:
        _PROGRESS.completed.value = steps


def reference(job: DistJob, pieces: Sequence[tuple[int, int]] | int = 1) -> dict[str, Any]:
    """The job's uninterrupted result in one process, with torch's fused AdamW kernel.

    ``pieces`` says into how many dim-0 pieces (``torch.chunk``, FSDP2's
    ``Shard(0)`` rule) the AdamW kernel sees each parameter: an int, or
    ``[(until_step, pieces), ...]`` when the world size changes (a DCP
    checkpoint saved by 2 ranks and loaded by 1). It matters: torch's fused
    CPU kernel computes the last few elements of every tensor it is given in
    a scalar tail loop whose rounding differs from its vector loop, so FSDP2
    with 2 ranks is bitwise equal to 2-piece updates, not to 1-piece ones.
    """
    schedule = [(job.steps, pieces)] if isinstance(pieces, int) else list(pieces)
    model = build_model(job)
    params = list(model.parameters())
    states = [
        {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        | ({"max_exp_avg_sq": torch.zeros_like(p)} if job.amsgrad else {})
        for p in params
    ]
    for step in range(job.steps):
        n = next(k for until, k in schedule if step < until)
        _loss(model, job, step).backward()
        with torch.no_grad():
            for p, st in zip(params, states):
                st["step"] += 1
                split = [t.chunk(n) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"])]
                maxs = list(st["max_exp_avg_sq"].chunk(n)) if job.amsgrad else []
                fused_adamw_kernel()(
                    *[list(x) for x in split],
                    maxs,
                    [st["step"].clone() for _ in split[0]],
                    lr=job.lr,
                    beta1=0.9,
                    beta2=0.999,
                    weight_decay=job.weight_decay,
                    eps=1e-8,
                    amsgrad=job.amsgrad,
                    maximize=False,
                )
        model.zero_grad()
    with torch.no_grad():
        out = model(probe(job))
    return {"params": [p.detach().clone() for p in params], "state": dict(enumerate(states)), "probe": out}


def _region(full: torch.Tensor, local: torch.Tensor, offset: Sequence[int]) -> torch.Tensor:
    index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    return full[index]


def compare(job: DistJob, tag: str, *, world_size: int, against: dict[str, Any] | str | None = None) -> list[str]:
    """Differences between the ranks' ``{tag}-rank{N}.pt`` and the reference (empty: bitwise equal).

    ``against`` is a :func:`reference` result, or a tag whose rank files to
    compare with rank by rank; ``None`` computes :func:`reference` here.
    """
    problems: list[str] = []
    ref = reference(job) if against is None else against
    covered: dict[int, set[str]] = {}
    for rank in range(world_size):
        got = torch.load(Path(job.out_dir) / f"{tag}-rank{rank}.pt", weights_only=True)
        if isinstance(ref, str):
            other = torch.load(Path(job.out_dir) / f"{ref}-rank{rank}.pt", weights_only=True)
            for i, (t, _) in got["params"].items():
                if not torch.equal(t, other["params"][i][0]):
                    problems.append(f"rank {rank}: param {i} differs from {ref}")
            for i, st in other["state"].items():
                for key, value in st.items():
                    mine = got["state"].get(i, {}).get(key)
                    if value.numel() and (mine is None or not torch.equal(mine, value)):
                        problems.append(f"rank {rank}: param {i} {key} differs from {ref}")
            if not torch.equal(got["probe"], other["probe"]):
                problems.append(f"rank {rank}: probe output differs from {ref}")
            continue
        for i, (t, offset) in got["params"].items():
            if not torch.equal(t, _region(ref["params"][i], t, offset)):
                problems.append(f"rank {rank}: param {i} differs (offset {offset})")
            if t.numel():
                covered.setdefault(i, set()).update(got["state"].get(i, {}))
            if job.wrap == "fsdp2" and "step" not in got["state"].get(i, {}):
                problems.append(f"rank {rank}: param {i} has no step (torch's AdamW counts them on every rank)")
            for key, mine in got["state"].get(i, {}).items():
                value = ref["params"][i] if key == "master_param" else ref["state"][i][key]
                want = value if value.dim() == 0 else _region(value, t, offset)
                if (t.numel() or key == "step") and not torch.equal(mine, want):
                    problems.append(f"rank {rank}: param {i} {key} differs")
        if not torch.equal(got["probe"], ref["probe"]):
            problems.append(f"rank {rank}: probe output differs")
        if got["steps"] != job.steps:
            problems.append(f"rank {rank}: ended at step {got['steps']}, expected {job.steps}")
    if not isinstance(ref, str):
        for i, st in ref["state"].items():
            if set(st) - covered.get(i, set()) - {"max_exp_avg_sq"}:
                problems.append(f"param {i}: no rank holds its state {sorted(set(st) - covered.get(i, set()))}")
    return problems


def replace(job: DistJob, **changes: Any) -> DistJob:
    """``dataclasses.replace`` for jobs (so tests need not import dataclasses)."""
    return dataclasses.replace(job, **changes)


# -- small rank programs for tests ------------------------------------------------------


def agree_rank(rank: int, world_size: int, cases: list[list[list[int] | None]], out: str) -> None:
    """Call ``agree_on_step`` once per case (``case[rank]`` is this rank's steps); record the outcomes."""
    from .._platform.distributed import agree_on_step

    outcomes: list[Any] = []
    for case in cases:
        try:
            outcomes.append(agree_on_step(case[rank]))
        except Exception as exc:  # recorded: the test checks type and message
            outcomes.append(f"{type(exc).__name__}: {exc}")
    torch.save(outcomes, os.path.join(out, f"agree-rank{rank}.pt"))


def torch_state_dict_rank(rank: int, world_size: int, job: DistJob, tag: str) -> None:
    """Round-trip TieredAdamW's ``state_dict`` through ``get/set_optimizer_state_dict`` and DCP.

    Writes whether every local state came back equal (``{tag}-rank{N}.pt``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .._platform.dtensor import local_tensor as _local

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(state_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(job)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, _make_optimizer(replace(job, state_dir=state_dir), list(model.parameters()))

    model, opt = sharded(job.state_dir + "/saved")
    for step in range(job.steps):
        _loss(model, job, step).backward()
        opt.step()
        opt.zero_grad()
    before = opt.state_dict()
    path = os.path.join(job.out_dir, f"{tag}-dcp")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    model2, opt2 = sharded(job.state_dir + "/loaded")
    state = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model2, opt2, state["optim"])
    after = opt2.state_dict()
    equal = all(
        torch.equal(_local(value), _local(after["state"][i][key]))
        for i, entry in before["state"].items()
        for key, value in entry.items()
    )
    torch.save({"equal": equal}, os.path.join(job.out_dir, f"{tag}-rank{rank}.pt"))
    opt.close()
    opt2.close()


# -- what a DCP save and load cost in RAM ------------------------------------------------


def _rss_kib() -> tuple[int, int]:
    """(anonymous, file-backed) resident KiB of this process."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                fields[line.split(":")[0]] = int(line.split()[1])
    return fields.get("RssAnon", 0), fields.get("RssFile", 0) + fields.get("RssShmem", 0)


def _trim() -> None:
    """Give free heap pages back to the Linux kernel (glibc), so RSS growth shows new allocations."""
    import contextlib
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: measurements may read low
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def _peak_during(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """Run ``fn``; return (seconds, peak extra anonymous MiB, peak extra file-backed MiB)."""
    import threading

    base = _rss_kib()
    peak = list(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = _rss_kib()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
    return seconds, (peak[0] - base[0]) / 1024, (peak[1] - base[1]) / 1024


def measure_dcp_memory(
    directory: str,
    *,
    rows: int = 4096,
    cols: int = 2048,
    params: int = 8,
    shard_numel: int = 1 << 20,
    ram_budget: str = "64MiB",
) -> list[dict[str, Any]]:
    """Peak RAM of DCP saves and loads of a TieredAdamW state, one process, vs materialising it.

    Builds ``params`` fp32 ``rows x cols`` parameters (8 bytes of state per
    element), takes one step, then saves through :class:`~tierstore.dcp.TieredStateful`
    (default and :class:`~tierstore.dcp.TieredSavePlanner`, one file per rank
    or one per block) and through ``optimizer.state_dict()``, and loads back.
    Returns one record per operation: seconds, peak extra anonymous and
    file-backed MiB (sampled every 2 ms), state MiB.

    Example
    -------
    >>> measure_dcp_memory("/mnt/nvme/tmp")  # doctest: +SKIP
    """
    import gc
    import shutil

    import torch.distributed.checkpoint as dcp

    from .. import TieredAdamW
    from ..dcp import TieredSavePlanner, TieredStateful

    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(rows, cols, generator=gen)) for _ in range(params)]
    root = Path(directory)
    opt = TieredAdamW(weights, lr=1e-3, state_dir=str(root / "state"), ram_budget=ram_budget, shard_numel=shard_numel)
    for w in weights:
        w.grad = torch.randn(rows, cols, generator=gen)
    opt.step()
    for w in weights:
        w.grad = None
    gc.collect()
    state_mib = opt.plan.state_nbytes / 2**20
    records = []

    def record(name: str, fn: Callable[[], Any]) -> None:
        gc.collect()
        _trim()  # freed heap from earlier operations would hide this one's growth
        seconds, anon, filed = _peak_during(fn)
        records.append(dict(op=name, seconds=round(seconds, 2), extra_anon_mib=round(anon, 1), extra_file_mib=round(filed, 1), state_mib=round(state_mib, 1)))

    def save(path: str, planner: Any, single: bool) -> Callable[[], Any]:
        writer = dcp.FileSystemWriter(str(root / path), single_file_per_rank=single)
        return lambda: dcp.save({"optim": TieredStateful(opt)}, storage_writer=writer, planner=planner, no_dist=True)

    record("save TieredStateful + TieredSavePlanner, file per block", save("a", TieredSavePlanner(), False))
    record("save TieredStateful, default planner, file per block", save("b", None, False))
    record("save TieredStateful + TieredSavePlanner, file per rank", save("c", TieredSavePlanner(), True))
    record(
        "save optimizer.state_dict() (materialised)",
        lambda: dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(root / "d"), no_dist=True),
    )
    record("load TieredStateful (staging file)", lambda: dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=str(root / "a"), no_dist=True))
    record("save TieredStateful + TieredSavePlanner, file per block (again)", save("e", TieredSavePlanner(), False))
    opt.close()
    for name in ("a", "b", "c", "d", "e", "state"):
        shutil.rmtree(root / name, ignore_errors=True)
    return records
