"""Bringing an optimizer's state to life: its layout and tiers, its store, its first or resumed commit.

:func:`start` is what ``TieredAdamW.__init__`` does once its arguments are
checked and its state directory is open: decide what the state holds
(:mod:`tierstore._layout.spec`), lay it out and split the budget (with a resume, the
saved layout must match), open the store and the pipeline, and either zero
the shards and commit them (fresh state, masters seeded from the parameters)
or restore the committed state (step counts, hyperparameters, and with
masters the parameters themselves). A failure part-way releases everything
it made.

Example
-------
>>> import torch
>>> from collections import defaultdict
>>> from tierstore._state.journal import Journal
>>> from tierstore._config.knobs import Knobs
>>> w = torch.nn.Parameter(torch.ones(8))
>>> groups = [{"params": [w], "amsgrad": False}]
>>> s = start(Journal.open(None, resume=False, resume_step=None, durable=None), groups, [w],
...           defaultdict(dict), knobs=Knobs(), ram_budget=None, shard_numel=None, keep_master=None,
...           restore_params=True)
>>> s.layout.fields, s.runtime.step_count
(('exp_avg', 'exp_avg_sq'), 0)
>>> s.runtime.close()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torch import Tensor

from .._compute.algorithms import ADAMW, Algorithm
from .._compute.formats import MomentFormat
from .._config.knobs import Knobs
from .._layout.budget import TierPlan, plan_tiers
from .._layout.layout import Layout, ShardSpec
from .._layout.scalar_record import RECORD_KEY, tensors_of
from .._layout.spec import StateSpec, decide_for
from .._layout.torch_format import step_tensor
from .._platform.dtensor import local_tensor
from .._state.journal import Journal
from .._state.manifest import check_same_model, decode_group, other_algorithm, saved_layout
from .._storage.pipeline import ShardPipeline
from .._storage.store import ShardStore
from ..errors import BudgetError, CorruptStateError, LayoutMismatchError
from ..sizes import resolve_budget
from .runtime import Runtime
from .update import master_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Started:
    """What :func:`start` built."""

    spec: StateSpec
    layout: Layout
    plan: TierPlan
    runtime: Runtime


def start(
    journal: Journal,
    param_groups: list[dict[str, Any]],
    params: Sequence[Tensor],
    state: dict[Tensor, dict[str, Any]],
    *,
    knobs: Knobs,
    ram_budget: int | Fraction | None,
    shard_numel: int | None,
    keep_master: bool | None,
    restore_params: bool,
    moment_dtype: str | MomentFormat | None = None,
    algorithm: Algorithm = ADAMW,
    init: Mapping[str, float] | None = None,
    bandwidths: Sequence[float] | None = None,
) -> Started:
    """Lay the state out, open its store and bring it to its first (or resumed) commit.

    ``moment_dtype`` is the moments' format (``None``: ``"float32"``); ``ram_budget``
    is bytes or a share of the state's size (:func:`tierstore.sizes.budget_request`);
    ``algorithm`` the optimizer's, whose fields the state holds; ``init`` each
    field's value in a fresh state (:meth:`~tierstore._compute.algorithms.base.Algorithm.initial_values`;
    absent: zero). A fresh state of an :attr:`~tierstore._compute.algorithms.base.Algorithm.eager`
    algorithm gives every parameter that holds state a step count of 0, as torch does.
    ``bandwidths`` (bytes/s per directory of a fresh state over several) place its
    shards instead of a probe of each drive.

    ``param_groups``, ``params`` and ``state`` are the optimizer's own
    objects (the runtime keeps them for the step bookkeeping). On failure the
    store is closed and the journal released (removing what a fresh start made).

    Raises
    ------
    BudgetError, LayoutMismatchError, CorruptStateError, DiskFullError
        As ``TieredAdamW`` documents.
    """
    store = None
    try:
        spec, layout, plan = _lay_out(journal, param_groups, params, knobs, ram_budget, shard_numel, keep_master,
                                      moment_dtype, algorithm)  # fmt: skip
        if plan.disk_shards:
            journal.use_private_dir()
        store = ShardStore(
            layout,
            plan,
            drives=journal.drive_dirs(),
            placement=journal.placement_for(layout, backend=knobs.backend, bandwidths=bandwidths),
            backend=knobs.backend,
            io_workers=knobs.io_workers,
            request_bytes=knobs.request_bytes,
            pin=knobs.pin_memory,
            durable=journal.durable,
        )
        journal.bind(store, layout, plan.ram_budget)  # bytes, a share resolved
        pipeline = ShardPipeline(store, prefetch_depth=knobs.prefetch_depth)
        runtime = Runtime(journal, store, pipeline, state=state, param_groups=param_groups, params=params,
                          scalar_inits=algorithm.scalar_inits)  # fmt: skip
        if journal.saved is None:
            if algorithm.eager:  # before the first commit, which records the counts
                for p, meta in zip(params, layout.params):
                    if meta.trainable or meta.numel == 0:
                        state[p]["step"] = step_tensor(0.0)
            _fresh(runtime, layout, params, init or {})
        else:
            _resume(runtime, layout, param_groups, params, state, restore_params=restore_params and spec.master)
    except BaseException:
        if store is not None:
            store.close()
        journal.release(discard=True)
        raise
    return Started(spec, layout, plan, runtime)


def _lay_out(
    journal: Journal,
    param_groups: list[dict[str, Any]],
    params: Sequence[Tensor],
    knobs: Knobs,
    ram_budget: int | Fraction | None,
    shard_numel: int | None,
    keep_master: bool | None,
    moment_dtype: str | MomentFormat | None,
    algorithm: Algorithm,
) -> tuple[StateSpec, Layout, TierPlan]:
    where = str(journal.directory)
    old = saved_layout(journal.saved, where) if journal.saved else None
    if old is not None and old.algorithm is not algorithm:  # before anything is decided for the wrong fields
        raise LayoutMismatchError(other_algorithm(f"state_dir={where!r}", old.algorithm, algorithm))
    if isinstance(ram_budget, Fraction):
        ram_budget = _share_bytes(ram_budget, params, param_groups, keep_master, old, moment_dtype, knobs, algorithm)
    spec = decide_for(
        params,
        algorithm=algorithm,
        options=algorithm.options(param_groups),
        keep_master=keep_master,
        arena_slots=knobs.arena_slots,
        ram_budget=ram_budget,
        shard_numel=shard_numel,
        saved=old,
        moment_dtype=moment_dtype,
        workers=knobs.max_update_threads,
    )
    layout = Layout.build(
        [[local_tensor(p) if p.requires_grad else p for p in g["params"]] for g in param_groups],
        shard_numel=spec.shard_numel,
        fields=spec.fields,
        moment_dtype=spec.moment_format,
        algorithm=spec.algorithm,
    )
    if old is not None:
        check_same_model(old, layout, where)
    try:
        plan = plan_tiers(
            layout,
            ram_budget=ram_budget,
            arena_slots=spec.arena_slots,
            staging_buffers=spec.staging_buffers,
            workers=spec.workers,
        )
    except BudgetError as exc:
        if old is None:
            raise
        raise BudgetError(
            f"{exc}. Note: resuming, shard_numel={old.shard_numel} is fixed by the saved state; "
            "to stream with smaller shards, save_checkpoint() and load_checkpoint() into a new "
            "state_dir built with a smaller shard_numel"
        ) from None
    return spec, layout, plan


def _share_bytes(
    share: Fraction,
    params: Sequence[Tensor],
    param_groups: list[dict[str, Any]],
    keep_master: bool | None,
    old: Layout | None,
    moment_dtype: str | MomentFormat | None,
    knobs: Knobs,
    algorithm: Algorithm,
) -> int:
    """``share`` of the state's size (its fields in their stored format, unpadded), in bytes."""
    # The fields (master, the options' fields) and format decide the size, and no budget changes them.
    spec = decide_for(params, algorithm=algorithm, options=algorithm.options(param_groups), keep_master=keep_master,
                      arena_slots=knobs.arena_slots, ram_budget=None, shard_numel=old.shard_numel if old else 1 << 10,
                      saved=old, moment_dtype=moment_dtype)  # fmt: skip
    numel = sum(local_tensor(p).numel() for p in params if p.requires_grad)
    return resolve_budget(share, state_bytes=int(numel * spec.stored_bytes_per_element))


def _fresh(runtime: Runtime, layout: Layout, params: Sequence[Tensor], init: Mapping[str, float]) -> None:
    """Zero every shard, give fields their initial values, seed masters from the parameters, and commit
    (both copies when durable).

    Zero bytes are zero moments in every format (int8: zero scales), so only
    a field that starts elsewhere (Adagrad's ``sum``) is written: in place
    when stored as fp32, through the format's encoder otherwise.
    """
    seed = master_sync(layout, params, to_params=lambda i: False)
    starts = {f: v for f, v in init.items() if v != 0.0 and f in layout.fields}
    encode = layout.encoded and any(f in layout.encoded_fields for f in starts)

    def fill(shard: ShardSpec, flat: Tensor) -> None:
        flat.zero_()
        if encode:
            wide = runtime.store.scratch_buffer()[: layout.wide_nbytes(shard) // 4].zero_()
            layout.fill_initial(shard, wide, starts)
            layout.encode_shard(shard, wide, flat)
        else:
            for field, value in starts.items():
                view = layout.stored_fp32(flat, shard, field)
                for seg in shard.segments:
                    view[seg.shard_slice].fill_(value)
        seed(shard, flat)

    runtime.store.open()
    with runtime.mutation():
        runtime.pipeline.run(range(len(layout.shards)), fill, read=False)
        runtime.commit()
        if runtime.journal.durable and runtime.store.persists_anything:
            # Write the second copy too: both copies then hold verifiable bytes, and
            # later writes overwrite allocated blocks, which runs about twice as fast
            # as filling fresh ones.
            runtime.pipeline.run(range(len(layout.shards)), fill, read=False)
            runtime.commit()


def _resume(
    runtime: Runtime,
    layout: Layout,
    param_groups: list[dict[str, Any]],
    params: Sequence[Tensor],
    state: dict[Tensor, dict[str, Any]],
    *,
    restore_params: bool,
) -> None:
    """Open the committed state and restore the bookkeeping (and the parameters from masters)."""
    saved = runtime.journal.saved
    where = runtime.journal.directory
    # (The manifest's fields were checked when it was read: tierstore._state.manifest.validate.)
    if len(saved["param_groups"]) != len(param_groups) or len(saved["param_steps"]) != len(params):
        raise CorruptStateError(
            f"the manifest in {where} records {len(saved['param_groups'])} param groups and "
            f"{len(saved['param_steps'])} parameter steps, this optimizer has {len(param_groups)} and "
            f"{len(params)}; pass the param groups of the run that wrote it, or restore the state "
            "directory from a checkpoint"
        )
    runtime.store.open(committed=saved["shards"])
    runtime.step_count = int(saved["step_count"])
    for group, stored in zip(param_groups, saved["param_groups"]):
        group.update(decode_group(stored, layout.algorithm))
    # Each parameter's scalars besides its step (NAdam's mu_product): recorded beside the steps, never recomputed.
    scalars = tensors_of(saved.get(RECORD_KEY), len(params))
    for p, step, values in zip(params, saved["param_steps"], scalars):
        if step is not None:
            state[p]["step"] = step_tensor(step)
            state[p].update(values)
    if restore_params:
        restore = master_sync(layout, params, to_params=lambda i: True)
        runtime.pipeline.run(range(len(layout.shards)), restore, write=False)
    log.info("resumed %s at step %d", runtime.journal.directory, runtime.step_count)
