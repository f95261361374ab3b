"""``TieredStateful``: the DCP ``Stateful`` of a tiered optimizer, its state dict and the load into the shards.

The state dict is in the FQN layout of the optimizer's torch class (its
algorithm's: ``torch.optim.AdamW`` for a ``TieredAdamW``, ``torch.optim.SGD``
for a ``TieredSGD``): ``step`` where the algorithm keeps one, the other
per-parameter scalars it keeps (``mu_product`` for a ``TieredNAdam``, a 0-d
tensor as torch keeps it), each field a group uses. The state of an
algorithm other than AdamW also records the algorithm's name
(:data:`ALGORITHM_KEY`; AdamW checkpoints keep their keys), so loading it
into an optimizer of another algorithm is refused, naming both.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._compute.algorithms import ADAMW
from .._compute.algorithms.identify import foreign_state, state_owners
from .._layout.layout import MASTER, ShardSpec
from .._layout.scalar_record import within_float32
from .._layout.torch_format import require_option_fields
from .._platform.dtensor import local_tensor
from .._runtime.access import ShardAccess
from .._storage.dcp_memory import BLOCK_NBYTES
from ..errors import ConfigError, LayoutMismatchError
from ._parts import Part, blocks_of, fqns, placement
from ._session import UNSET, Session, StateTensor, Stats, StepCount

__all__ = ["TieredStateful", "STEP_COUNT_KEY", "ALGORITHM_KEY"]

log = logging.getLogger("tierstore.dcp")  # the public module's name, as before it became a package

STEP_COUNT_KEY = "tierstore_step_count"
#: The key naming the optimizer algorithm of a state other than AdamW's (its registered name, a string).
ALGORITHM_KEY = "tierstore_algorithm"


def _local_optimizer(optimizer: Any) -> ShardAccess:
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the rank's own
    if not isinstance(local, ShardAccess):
        raise ConfigError(
            f"TieredStateful needs a tiered optimizer such as TieredAdamW (or a ZeroRedundancyOptimizer built with "
            f"optimizer_class=TieredAdamW), got {type(optimizer).__name__}"
        )
    return local


class TieredStateful:
    """A DCP ``Stateful`` that saves and loads a tiered optimizer's state without materialising it.

    Parameters
    ----------
    optimizer
        A tiered optimizer (:class:`~tierstore.TieredAdamW`, ``TieredSGD``, ...),
        or a ``ZeroRedundancyOptimizer`` whose ``optimizer_class`` is one.
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
        If ``optimizer`` is not a tiered optimizer (or ZeRO over one), or
        ``model`` does not hold its parameters.

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
        """Placeholders for DCP in the FQN layout of the algorithm's torch class (see the module docs).

        Every trainable local part is listed; ``dcp.save`` writes only those
        that have taken a step (as torch's optimizers have state only for them). A
        dict serves one ``dcp.save`` or one ``dcp.load``.
        """
        opt = self.opt
        opt.check_usable()
        algorithm = opt.layout.algorithm
        session = Session(opt, self._parts())
        self.stats = session.stats  # the session itself goes when DCP drops the dict (and its cache)
        state: dict[str, dict[str, Any]] = {}
        for part in session.parts:
            group = opt.param_groups[opt.layout.params[part.index].group]
            # step where the algorithm keeps one, then its other per-parameter scalars, in torch's key order
            scalars = [*(["step"] if "step" in algorithm.state_scalars else []), *algorithm.scalar_inits]
            state[part.fqn] = {k: StateTensor(session, part, k) for k in scalars}
            state[part.fqn].update({opt.layout.state_key(f): StateTensor(session, part, f) for f in _used(opt, group)})
        groups = []
        for group in opt.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = [self._fqns[i] for i in self._group_indices(group)]
            groups.append(packed)
        named = {} if algorithm.name == ADAMW.name else {ALGORITHM_KEY: algorithm.name}
        return {"state": state, "param_groups": groups, STEP_COUNT_KEY: StepCount(session), **named}

    def _group_indices(self, group: dict[str, Any]) -> list[int]:
        ids = {id(p): i for i, p in enumerate(self._params)}
        return [ids[id(p)] for p in group["params"]]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stream loaded values into the optimizer's shards and commit them.

        Takes what ``dcp.load`` filled in (the placeholders of :meth:`state_dict`),
        or a dict of real tensors / DTensors in the same layout (such as
        ``get_optimizer_state_dict`` of a ``torch.optim.AdamW``). Restores
        moments, steps (and the scalars an algorithm keeps beside them: NAdam's
        ``mu_product``), hyperparameters, ``step_count`` (the checkpoint's, or
        the largest parameter step when it has none) and, when both sides
        keep one, the fp32 master copy, which is then written into the
        parameters. A parameter with a step must come with the fields its
        algorithm always keeps (AdamW: ``exp_avg`` and ``exp_avg_sq``) and
        those of the options its saved group uses (``max_exp_avg_sq`` with
        amsgrad), as the torch class needs them: a missing one is an error,
        never zeros. Masters a checkpoint lacks are seeded from the parameters;
        ``max_exp_avg_sq`` of a group saved without amsgrad is zeros (unused
        under the restored groups, as in torch). State of another algorithm
        (named by :data:`ALGORITHM_KEY`, or real tensors under another
        algorithm's keys) is refused, naming both.

        Raises
        ------
        ValueError
            If a value has the wrong local shape, the param-group counts differ,
            or a parameter with a step lacks a moment (a ``ConfigError``); a
            ``LayoutMismatchError`` for another algorithm's state.
        """
        opt = self.opt
        algorithm = opt.layout.algorithm
        saved = state_dict.get(ALGORITHM_KEY, ADAMW.name if algorithm.name == ADAMW.name else None)
        if saved is not None and saved != algorithm.name:
            raise LayoutMismatchError(
                f"the loaded DCP state holds {_label(saved)} state; this is {algorithm.label}: load it into a "
                f"{_front(saved)}, or load a checkpoint of this optimizer's algorithm"
            )
        state = state_dict.get("state", {})
        for fqn, entry in state.items():
            owners = state_owners(entry, algorithm) if isinstance(entry, dict) else []
            if owners:  # real tensors of another algorithm (get_optimizer_state_dict of a torch.optim.SGD)
                raise LayoutMismatchError(foreign_state(owners, algorithm, f"the loaded state of {fqn} ({sorted(map(str, entry))})"))
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
        layout = opt.layout
        for part in session.parts:
            step = state.get(part.fqn, {}).get("step")
            if isinstance(step, StateTensor):
                step = step._session.loaded_steps.get(part.index)
            if step is not None and float(step) != UNSET:
                steps[part.index] = float(step)
            elif "step" not in algorithm.state_scalars:  # torch keeps no count (SGD): the algorithm reads the entry
                loaded = {layout.state_key(f): src for (i, f), src in sources.items() if i == part.index}
                step = algorithm.loaded_step(loaded)
                if step is not None:
                    steps[part.index] = float(step)
        step_count = state_dict.get(STEP_COUNT_KEY)
        if isinstance(step_count, StepCount):
            step_count = step_count._session.loaded_step_count
        step_count = -1 if step_count is None else int(step_count)
        if step_count < 0:  # a checkpoint written by torch's AdamW: its steps say how far it got
            step_count = int(max(steps.values(), default=0))
        for part in session.parts:
            if part.index not in steps or math.prod(part.shape) == 0:
                continue  # no state to carry (or no local elements: nothing of it on this rank)
            saved_group = saved_groups[layout.params[part.index].group]
            wanted = [*algorithm.required_fields()]
            wanted += [f.name for f in algorithm.fields if f.option is not None and algorithm.uses(saved_group, f.option)]
            missing = [layout.state_key(f) for f in wanted if f in layout.fields and (part.index, f) not in sources]
            if missing:
                raise ConfigError(
                    f"the loaded state of {part.fqn} has a step but no {missing}; a missing moment is never "
                    "loaded as zeros. Load a complete checkpoint (every parameter with a step has its moments)"
                )
        scalars = _loaded_scalars(state, session, algorithm.scalar_inits, steps)
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for (i, field), src in sources.items():
            by_param.setdefault(i, {})[field] = src

        def fill(shard: ShardSpec, flat: torch.Tensor) -> None:
            # Staged values are read from the staging file into the shard, never mapped again.
            layout.copy_in(shard, flat, by_param, copy=session.copy)

        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
        require_option_fields(groups, layout, "loaded")
        masters = {i for (i, field) in sources if field == "master"}
        try:
            opt.replace_shards(fill, param_steps=steps, groups=groups, masters_given=masters, step_count=step_count,
                               **({"param_scalars": scalars} if scalars is not None else {}))  # fmt: skip
        finally:
            session.close()
        outer = self.optimizer
        if outer is not opt and hasattr(outer, "param_groups"):  # ZeRO copies its groups into the local one
            for mine, saved in zip(outer.param_groups, groups):
                mine.update({k: v for k, v in saved.items() if k in mine})
        log.info("loaded DCP state into %s at step %d", opt.state_dir or "RAM", step_count)



def _loaded_scalars(
    state: dict[str, Any], session: Session, inits: Mapping[str, float], steps: dict[int, float]
) -> dict[str, list[float | None]] | None:
    """The loaded per-parameter scalars besides the step (NAdam's ``mu_product``) of each part with a step,
    as ``replace_shards`` takes them; ``None`` for an algorithm without such scalars.

    Raises
    ------
    ConfigError
        For a part with a step whose scalar is missing or not a finite number (never made up).
    """
    if not inits:
        return None
    record: dict[str, list[float | None]] = {name: [None] * len(session.layout.params) for name in inits}
    for part in session.parts:
        if part.index not in steps:
            continue
        for name in inits:
            value = state.get(part.fqn, {}).get(name)
            if isinstance(value, StateTensor):
                value = value._session.loaded_scalars.get((part.index, name))
            if isinstance(value, torch.Tensor):
                value = local_tensor(value).detach()
                value = float(value) if value.numel() == 1 else None
            if not within_float32(value):
                raise ConfigError(
                    f"the loaded state of {part.fqn} has a step but no {name} that is a finite number (found "
                    f"{value!r}); it is never made up. Load a complete checkpoint (every parameter with a step has its {name})"
                )
            record[name][part.index] = float(value)
    return record


def _used(opt: ShardAccess, group: dict[str, Any]) -> list[str]:
    """The fields of ``opt``'s state a parameter of ``group`` has in torch's state: the master, the algorithm's
    always-kept ones, and those of the options the group uses (``max_exp_avg_sq`` with amsgrad)."""
    algorithm = opt.layout.algorithm
    used = []
    for field in opt.layout.fields:
        option = None if field == MASTER else algorithm.field(field).option
        if option is None or algorithm.uses(group, option):
            used.append(field)
    return used


def _label(name: Any) -> str:
    """A recorded algorithm name as messages show it (its front where it is registered)."""
    from .._compute.algorithms import ALGORITHMS

    found = ALGORITHMS.get(name) if isinstance(name, str) else None
    return found.label if found is not None else repr(name)


def _front(name: Any) -> str:
    from .._compute.algorithms import ALGORITHMS

    found = ALGORITHMS.get(name) if isinstance(name, str) else None
    return found.front if found is not None else f"tiered optimizer of the algorithm {name!r}"
