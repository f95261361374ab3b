"""``TieredStateful``: the DCP ``Stateful`` of a TieredAdamW, its state dict and the load into the shards."""

from __future__ import annotations

import copy
import logging
import math
import warnings
from typing import Any

import torch

from .._layout.layout import ShardSpec
from .._layout.torch_format import require_amsgrad_field
from .._platform.dtensor import local_tensor
from .._runtime.access import ShardAccess
from .._storage.dcp_memory import BLOCK_NBYTES
from ..errors import ConfigError
from ._parts import Part, blocks_of, fqns, placement
from ._session import UNSET, Session, StateTensor, Stats, StepCount

__all__ = ["TieredStateful", "STEP_COUNT_KEY"]

log = logging.getLogger("tierstore.dcp")  # the public module's name, as before it became a package

STEP_COUNT_KEY = "tierstore_step_count"


def _local_optimizer(optimizer: Any) -> ShardAccess:
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the rank's own
    if not isinstance(local, ShardAccess):
        raise ConfigError(
            f"TieredStateful needs a TieredAdamW (or a ZeroRedundancyOptimizer built with "
            f"optimizer_class=TieredAdamW), got {type(optimizer).__name__}"
        )
    return local


class TieredStateful:
    """A DCP ``Stateful`` that saves and loads a TieredAdamW's state without materialising it.

    Parameters
    ----------
    optimizer
        A :class:`~tierstore.TieredAdamW`, or a ``ZeroRedundancyOptimizer``
        whose ``optimizer_class`` is TieredAdamW.
    model
        The model the optimizer trains (after ``fully_shard``/DDP), to key the
        state by parameter FQN as ``get_optimizer_state_dict`` does; ``None``
        keys it by parameter index.
    cache_bytes
        Deprecated and ignored: blocks are read through the optimizer's arena,
        whose slots keep the shards last read (a warning says so when given).

    Raises
    ------
    ConfigError
        If ``optimizer`` is not a TieredAdamW (or ZeRO over one), or ``model``
        does not hold its parameters.

    Example
    -------
    >>> import tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.ones(8)); w.grad = torch.ones(8)
    >>> path = tempfile.mkdtemp()
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step()
    ...     _ = dcp.save({"optim": TieredStateful(opt)}, checkpoint_id=path, no_dist=True)
    >>> with TieredAdamW([w], lr=0.5) as fresh:
    ...     dcp.load({"optim": TieredStateful(fresh)}, checkpoint_id=path, no_dist=True)
    ...     fresh.step_count, fresh.param_groups[0]["lr"]
    (1, 0.1)
    """

    def __init__(self, optimizer: Any, model: torch.nn.Module | None = None, *, cache_bytes: int | None = None) -> None:
        self.optimizer = optimizer
        self.opt = _local_optimizer(optimizer)
        self.model = model
        if cache_bytes is not None:
            if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
                raise ConfigError(f"cache_bytes={cache_bytes!r} must be an int >= 0 (bytes), or leave it out (it is ignored)")
            warnings.warn(
                "TieredStateful(cache_bytes=...) is ignored: blocks are read through the optimizer's arena, "
                "whose slots keep the shards last read, so a save needs no RAM beyond ram_budget; drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        self._params = [p for g in self.opt.param_groups for p in g["params"]]
        self._fqns = fqns(model, self._params)
        self.stats = Stats()

    def _parts(self) -> list[Part]:
        layout = self.opt.layout
        parts = []
        for i, (p, entry) in enumerate(zip(self._params, layout.params)):
            if not p.requires_grad:
                continue  # frozen: no state, as in torch
            # An empty local shard has no blocks but, as in torch, a step.
            shape = tuple(local_tensor(p).shape)
            global_shape, offset = placement(p, shape)
            blocks = blocks_of(layout, i, shape, BLOCK_NBYTES // 4)
            parts.append(Part(i, self._fqns[i], global_shape, shape, offset, entry.start, entry.numel, blocks))
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Placeholders for DCP in ``torch.optim.AdamW``'s FQN layout (see the module docs).

        Every trainable local part is listed; ``dcp.save`` writes only those
        that have taken a step (as torch's AdamW has state only for them). A
        dict serves one ``dcp.save`` or one ``dcp.load``.
        """
        opt = self.opt
        opt.check_usable()
        session = Session(opt, self._parts())
        self.stats = session.stats  # the session itself goes when DCP drops the dict (and its cache)
        state: dict[str, dict[str, Any]] = {}
        for part in session.parts:
            group = opt.param_groups[opt.layout.params[part.index].group]
            fields = [f for f in opt.layout.fields if f != "max_exp_avg_sq" or group["amsgrad"]]
            state[part.fqn] = {"step": StateTensor(session, part, "step")}
            state[part.fqn].update({opt.layout.state_key(f): StateTensor(session, part, f) for f in fields})
        groups = []
        for group in opt.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = [self._fqns[i] for i in self._group_indices(group)]
            groups.append(packed)
        return {"state": state, "param_groups": groups, STEP_COUNT_KEY: StepCount(session)}

    def _group_indices(self, group: dict[str, Any]) -> list[int]:
        ids = {id(p): i for i, p in enumerate(self._params)}
        return [ids[id(p)] for p in group["params"]]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stream loaded values into the optimizer's shards and commit them.

        Takes what ``dcp.load`` filled in (the placeholders of :meth:`state_dict`),
        or a dict of real tensors / DTensors in the same layout (such as
        ``get_optimizer_state_dict`` of a ``torch.optim.AdamW``). Restores
        moments, steps, hyperparameters, ``step_count`` (the checkpoint's, or
        the largest parameter step when it has none) and, when both sides
        keep one, the fp32 master copy, which is then written into the
        parameters. A parameter with a step must come with ``exp_avg`` and
        ``exp_avg_sq`` (and ``max_exp_avg_sq`` when its saved group uses
        amsgrad), as torch's AdamW needs them: a missing one is an error, never
        zeros. Masters a checkpoint lacks are seeded from the parameters;
        ``max_exp_avg_sq`` of a group saved without amsgrad is zeros (unused
        under the restored groups, as in torch).

        Raises
        ------
        ValueError
            If a value has the wrong local shape, the param-group counts differ,
            or a parameter with a step lacks a moment (a ``ConfigError``).
        """
        opt = self.opt
        state = state_dict.get("state", {})
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(opt.param_groups):
            raise ValueError(
                f"the loaded state has {len(saved_groups)} param groups, this optimizer has "
                f"{len(opt.param_groups)}; build the optimizer with the same groups as the run that saved it"
            )
        session = next(
            (v._session for e in state.values() for v in e.values() if isinstance(v, StateTensor)), None
        ) or Session(opt, self._parts())
        sources = session.sources(state)
        steps: dict[int, float] = {}
        for part in session.parts:
            step = state.get(part.fqn, {}).get("step")
            if isinstance(step, StateTensor):
                step = step._session.loaded_steps.get(part.index)
            if step is not None and float(step) != UNSET:
                steps[part.index] = float(step)
        step_count = state_dict.get(STEP_COUNT_KEY)
        if isinstance(step_count, StepCount):
            step_count = step_count._session.loaded_step_count
        step_count = -1 if step_count is None else int(step_count)
        if step_count < 0:  # a checkpoint written by torch's AdamW: its steps say how far it got
            step_count = int(max(steps.values(), default=0))
        layout = opt.layout
        for part in session.parts:
            if part.index not in steps or math.prod(part.shape) == 0:
                continue  # no state to carry (or no local elements: nothing of it on this rank)
            saved_group = saved_groups[layout.params[part.index].group]
            wanted = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if saved_group.get("amsgrad") else [])
            missing = [layout.state_key(f) for f in wanted if f in layout.fields and (part.index, f) not in sources]
            if missing:
                raise ConfigError(
                    f"the loaded state of {part.fqn} has a step but no {missing}; a missing moment is never "
                    "loaded as zeros. Load a complete checkpoint (every parameter with a step has its moments)"
                )
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for (i, field), src in sources.items():
            by_param.setdefault(i, {})[field] = src

        def fill(shard: ShardSpec, flat: torch.Tensor) -> None:
            # Staged values are read from the staging file into the shard, never mapped again.
            layout.copy_in(shard, flat, by_param, copy=session.copy)

        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
        require_amsgrad_field(groups, layout, "loaded")
        masters = {i for (i, field) in sources if field == "master"}
        try:
            opt.replace_shards(fill, param_steps=steps, groups=groups, masters_given=masters, step_count=step_count)
        finally:
            session.close()
        outer = self.optimizer
        if outer is not opt and hasattr(outer, "param_groups"):  # ZeRO copies its groups into the local one
            for mine, saved in zip(outer.param_groups, groups):
                mine.update({k: v for k, v in saved.items() if k in mine})
        log.info("loaded DCP state into %s at step %d", opt.state_dir or "RAM", step_count)

