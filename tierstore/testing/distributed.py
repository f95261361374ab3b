"""Deterministic FSDP2 / ZeRO training jobs for gloo ranks, their single-process reference, the comparison.

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
differences. :func:`agree_rank` and :func:`torch_state_dict_rank` are
smaller rank programs for single questions.

The ranks run under :func:`~tierstore.testing.ranks.run_ranks`, which reports
their phases (:func:`job_phases`); it, :class:`~tierstore.testing.ranks.RankResult`,
:func:`~tierstore.testing.ranks.enter` and
:func:`~tierstore.testing.dcp_ram.measure_dcp_memory` are importable from
here too, where they lived before.

Example
-------
>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> job = DistJob(state_dir=f"{d}/state", out_dir=d, steps=3)
>>> torch.equal(batch(job, 2)[0], batch(replace(job, out_dir=""), 2)[0])  # the same on every rank
True
>>> results = run_ranks(train_rank, world_size=2, args=(job, "run"))  # doctest: +SKIP
>>> [r.exitcode for r in results], compare(job, "run", world_size=2)  # doctest: +SKIP
([0, 0], [])
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._platform.torch_private import fused_adamw_kernel, local_shape_and_offset
from .crash import phase_names
from .dcp_ram import measure_dcp_memory
from .ranks import RankResult, enter, report_completed, run_ranks

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
    report_completed(_committed(opt))
    for step in range(first, job.steps):
        enter(f"forward {step}")
        if job.forward_seconds:
            time.sleep(job.forward_seconds)
        _loss(trained, job, step).backward()
        enter(f"step {step}")
        opt.step()
        opt.zero_grad()
        report_completed(_committed(opt))
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
