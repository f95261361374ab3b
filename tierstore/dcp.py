"""``torch.distributed.checkpoint`` (DCP) for TieredAdamW, streamed shard by shard.

:class:`TieredStateful` is a DCP ``Stateful``: put it in the dict given to
``dcp.save``/``dcp.load`` and the optimizer's state is written and read in
``torch.optim.AdamW``'s FQN-keyed layout (what
``get_optimizer_state_dict`` produces)::

    {"state": {fqn: {"step", "exp_avg", "exp_avg_sq", ["max_exp_avg_sq"], ["master_param"]}},
     "param_groups": [{..., "params": [fqn, ...]}],
     "tierstore_step_count": int64 scalar}

Every moment is presented with its *global* shape and the offsets of this
rank's part (FSDP2's ``DTensor`` shard, a ``ZeroRedundancyOptimizer``
partition, or the whole tensor), so DCP reshards it on load: a checkpoint
written by 2 ranks loads on 1 and back, and loads into (or from)
``torch.optim.AdamW`` under ``get/set_optimizer_state_dict``.

Nothing is materialised up front. The values are placeholders (tensor
subclasses without storage) implementing DCP's ``_Checkpointable`` hooks,
so the *default* planners work:

- save: each rank's part is cut into row blocks that follow the optimizer's
  shards; DCP asks for one block at a time (``__get_tensor_shard__``) and a
  block is copied out of the shards read through the optimizer's arena
  (the last few shards are kept in a small cache). :class:`TieredSavePlanner`
  orders the blocks so that every shard is read once.
- load: DCP copies each piece it reads into a staging file (a shared,
  unlinked memory map beside the state directory, the size of this rank's
  state); ``load_state_dict`` then streams it into the shards and commits.

Peak RAM beyond ``ram_budget``: saving, the shard cache (``cache_bytes``,
default two shards in fp32: two arena slots in ``"float32"``) plus one block; with
``FileSystemWriter(single_file_per_rank=True)`` (the default writer) torch
also keeps the last block of every (parameter, field) referenced until the
rank's file is complete, so pass ``single_file_per_rank=False`` to stay
bounded. Loading, one saved chunk (what ``FileSystemReader`` unpickles) plus
page cache of the staging file, which the kernel can write back and drop.
Details in ``docs/distributed.md``.

Example
-------
>>> import tempfile, torch
>>> import torch.distributed.checkpoint as dcp
>>> from tierstore import TieredAdamW
>>> model = torch.nn.Linear(4, 3)
>>> path = tempfile.mkdtemp()
>>> with TieredAdamW(model.parameters(), lr=0.1) as opt:
...     model(torch.ones(2, 4)).sum().backward(); _ = opt.step()
...     _ = dcp.save({"optim": TieredStateful(opt, model)}, checkpoint_id=path, no_dist=True)
>>> sd = {"optim": {"state": {"weight": {"exp_avg": torch.zeros(3, 4)}}}}
>>> dcp.load(sd, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
>>> sd["optim"]["state"]["weight"]["exp_avg"][0].tolist()
[0.20000000298023224, 0.20000000298023224, 0.20000000298023224, 0.20000000298023224]
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .access import ShardAccess
from .dtensor import local_tensor
from .errors import ConfigError
from .layout import STATE_KEY_OF_FIELD, Layout, ShardSpec
from .torch_format import require_amsgrad_field, step_tensor

log = logging.getLogger(__name__)

STEP_COUNT_KEY = "tierstore_step_count"
_UNSET = -1.0  # a step slot DCP did not fill: the checkpoint has no state for the parameter
_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass
class Stats:
    """What the last save through a :class:`TieredStateful` cost."""

    shard_reads: int = 0  # shards read out of the optimizer (the cache saves re-reads)


@dataclass(frozen=True)
class _Part:
    """One trainable parameter's part on this rank, where it sits globally and in the layout."""

    index: int  # position in the optimizer's parameters
    fqn: str
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]  # local
    offset: tuple[int, ...]  # global offset of the local part
    start: int  # layout flat start
    numel: int
    row_numel: int
    blocks: tuple[tuple[int, int], ...]  # local row ranges, one per shard a row starts in

    def block_box(self, block: tuple[int, int]) -> tuple[torch.Size, torch.Size]:
        if not self.shape:
            return torch.Size([]), torch.Size([])
        a, b = block
        offsets = torch.Size([self.offset[0] + a, *self.offset[1:]])
        return offsets, torch.Size([b - a, *self.shape[1:]])


def _row_blocks(layout: Layout, index: int, shape: tuple[int, ...]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Cut a parameter into row ranges: rows whose first element lies in the same shard."""
    numel = math.prod(shape)
    if not shape:
        return 1, ((0, 1),)
    if numel == 0:  # an empty local shard (FSDP2 gives some ranks none of a small parameter)
        return 0, ()
    row_numel = numel // shape[0]
    blocks = []
    for _, seg in layout.segments_of(index):
        span = seg.param_slice
        a, b = -(-span.start // row_numel), -(-span.stop // row_numel)
        if a < b:
            blocks.append((a, b))
    return row_numel, tuple(blocks)


def _clean_fqn(name: str, ddp: bool) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_NAMES]
    if ddp and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _fqns(model: torch.nn.Module | None, params: Sequence[torch.Tensor]) -> list[str]:
    """The FQN of every optimizer parameter, as ``get_optimizer_state_dict`` names them."""
    if model is None:
        return [str(i) for i in range(len(params))]
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), _clean_fqn(name, ddp))
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ConfigError(
            f"optimizer parameters {missing[:5]} are not parameters of the given model; pass the "
            "model the optimizer was built from (after fully_shard / DDP wrapping), or model=None "
            "to key the state by parameter index"
        )
    return [names[id(p)] for p in params]


def _placement(param: torch.Tensor, local_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global_shape, global_offset)`` of a parameter's local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != local_shape:  # pragma: no cover - a placement torch computes differently
            raise ConfigError(f"DTensor parameter's local shape {local_shape} differs from its placement's {tuple(shape)}")
        return tuple(param.shape), tuple(offset)
    return local_shape, (0,) * len(local_shape)


class _Placeholder(torch.Tensor):
    """A storage-less stand-in that DCP plans with and reads through its ``_Checkpointable`` hooks.

    It supports no tensor operations: its values live in the optimizer's shards.
    """

    _session: _Session

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(
            f"{func} on a TieredStateful placeholder: its values live in the optimizer's shards and "
            "are read only by torch.distributed.checkpoint; call optimizer.state_dict() for tensors"
        )

    def _item(self, fqn: str, offsets: torch.Size, sizes: torch.Size) -> WriteItem:
        return WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties(dtype=self.dtype),
                size=self.shape,
            ),
        )


class _StepCount(_Placeholder):
    """The optimizer's ``step_count`` (an int64 scalar in the checkpoint)."""

    @staticmethod
    def __new__(cls, session: _Session) -> _StepCount:
        return torch.Tensor._make_wrapper_subclass(cls, (), dtype=torch.int64, device="cpu")

    def __init__(self, session: _Session) -> None:
        self._session = session

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        return "TieredState(step_count)"

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        self._session.begin("save")
        return [self._item(fqn, torch.Size([]), torch.Size([]))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        self._session.begin("load")
        return [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        session = self._session
        if session.mode == "save":
            return torch.tensor(session.opt.step_count, dtype=torch.int64)
        return session.loaded_step_count


class _StateTensor(_Placeholder):
    """One field (or the step) of one parameter's state, with the parameter's global shape."""

    @staticmethod
    def __new__(cls, session: _Session, part: _Part, field: str) -> _StateTensor:
        shape = () if field == "step" else part.global_shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

    def __init__(self, session: _Session, part: _Part, field: str) -> None:
        self._session = session
        self._part = part
        self._field = field

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        return f"TieredState({self._part.fqn}.{STATE_KEY_OF_FIELD.get(self._field, self._field)}, shape={tuple(self.shape)})"

    def _order(self, index: MetadataIndex) -> tuple[int, int]:
        """Where the block ``index`` names starts in the layout, then the field: shard order."""
        part = self._part
        if self._field == "step":
            return part.start, -1
        a, _ = self._session._block_of[(part.index, torch.Size(index.offset or ()))]
        return part.start + a * part.row_numel, self._session.layout.field_index(self._field)

    # -- DCP's _Checkpointable hooks ------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        session = self._session
        session.begin("save")
        if session.step_of(self._part) is None:
            return []  # no step taken yet: torch's AdamW has no state for it either
        boxes = [(torch.Size([]), torch.Size([]))] if self._field == "step" else [
            self._part.block_box(block) for block in self._part.blocks
        ]
        return [self._item(fqn, offsets, sizes) for offsets, sizes in boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        self._session.begin("load")
        part = self._part
        if self._field == "step":
            return [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        return [ChunkStorageMetadata(offsets=torch.Size(part.offset), sizes=torch.Size(part.shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        session, part = self._session, self._part
        if session.mode == "save":
            if self._field == "step":
                return session.step_of(part).clone()
            return session.block(part, self._field, tuple(index.offset or ()))
        if self._field == "step":
            return session.loaded_steps.setdefault(part.index, torch.tensor(_UNSET))
        return session.staged(part, self._field)


class _Session:
    """What one ``TieredStateful.state_dict()`` call hands to one ``dcp.save`` or ``dcp.load``."""

    def __init__(self, opt: ShardAccess, parts: list[_Part], cache_bytes: int) -> None:
        self.opt = opt
        self.layout = opt.layout
        self.parts = parts
        self.mode: str | None = None
        self.cache_bytes = cache_bytes
        self._shards: OrderedDict[int, torch.Tensor] = OrderedDict()  # shard -> copy of its fields
        self._spare: list[torch.Tensor] = []
        self._block_of = {(p.index, p.block_box(b)[0]): b for p in parts for b in p.blocks}
        self._staging: torch.Tensor | None = None
        self.loaded: set[tuple[int, str]] = set()
        self.loaded_steps: dict[int, torch.Tensor] = {}
        self.loaded_step_count = torch.tensor(-1, dtype=torch.int64)
        self.stats = Stats()
        self._steps: list[float | None] | None = None
        self._lock = threading.Lock()  # DCP writers and readers may resolve from several threads

    def step_of(self, part: _Part) -> torch.Tensor | None:
        """The parameter's AdamW step, ``None`` before its first (read once per save)."""
        if self._steps is None:
            self._steps = self.opt.param_steps()
        step = self._steps[part.index]
        return None if step is None else step_tensor(step)

    def begin(self, mode: str) -> None:
        if self.mode not in (None, mode):
            raise RuntimeError(
                "a TieredStateful state dict serves one dcp.save or one dcp.load; pass the "
                "TieredStateful itself to dcp (it calls state_dict() each time)"
            )
        self.mode = mode

    # -- save: blocks copied out of cached shards -----------------------------------
    def block(self, part: _Part, field: str, offset: tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            return self._block(part, field, offset)

    def _block(self, part: _Part, field: str, offset: tuple[int, ...]) -> torch.Tensor:
        a, b = self._block_of[(part.index, torch.Size(offset))]
        lo, hi = part.start + a * part.row_numel, part.start + b * part.row_numel
        shape = (b - a, *part.shape[1:]) if part.shape else ()
        out = torch.empty(shape, dtype=torch.float32)
        flat = out.view(-1)
        shard_numel = self.layout.shard_numel
        wanted = range(lo // shard_numel, (hi - 1) // shard_numel + 1)
        self._fetch(wanted)
        k = self.layout.field_index(field)
        for s in wanted:
            shard = self.layout.shards[s]
            s0, s1 = max(lo, shard.start), min(hi, shard.start + shard.capacity)
            src = self._shards[s][k * shard.capacity : (k + 1) * shard.capacity]
            flat[s0 - lo : s1 - lo].copy_(src[s0 - shard.start : s1 - shard.start])
        return out

    def _fetch(self, wanted: Iterable[int]) -> None:
        wanted = list(wanted)
        for s in wanted:
            if s in self._shards:
                self._shards.move_to_end(s)
        missing = [s for s in wanted if s not in self._shards]
        if not missing:
            return
        slot = self.layout.wide_slot_nbytes  # a cached shard: every field in fp32
        while self._shards and (len(self._shards) + len(missing)) * slot > self.cache_bytes:
            victim = next((s for s in self._shards if s not in wanted), None)
            if victim is None:
                break
            self._spare.append(self._shards.pop(victim))  # reused: no allocation per shard

        def keep(shard: ShardSpec, flat: torch.Tensor) -> None:
            n = len(self.layout.fields) * shard.capacity
            spare = next((b for b in self._spare if b.numel() >= n), None)
            if spare is None:
                spare = torch.empty(len(self.layout.fields) * self.layout.shard_numel, dtype=torch.float32)
            else:
                self._spare.remove(spare)
            self._shards[shard.index] = spare
            spare[:n].copy_(flat[:n])

        self.opt.visit_shards(keep, missing)
        self.stats.shard_reads += len(missing)

    # -- load: DCP writes into a staging map ----------------------------------------
    def staged(self, part: _Part, field: str) -> torch.Tensor:
        with self._lock:
            if self._staging is None:
                self._staging = self._map_staging()
            self.loaded.add((part.index, field))
        return self._source(part, field).view(part.shape)

    def _source(self, part: _Part, field: str) -> torch.Tensor:
        assert self._staging is not None
        base = self.layout.field_index(field) * self.layout.total_numel + part.start
        return self._staging[base : base + part.numel]

    def _map_staging(self) -> torch.Tensor:
        numel = len(self.layout.fields) * self.layout.total_numel
        where = self.opt.state_dir
        if where is None:  # all state fits in RAM: so does its staging copy
            return torch.zeros(numel, dtype=torch.float32)
        fd, path = tempfile.mkstemp(prefix=".dcp-staging-", dir=where)
        try:
            os.ftruncate(fd, numel * 4)
            staging = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
        finally:
            os.close(fd)
            os.unlink(path)  # the map keeps the space until it is dropped; a crash leaves nothing
        return staging

    def sources(self, state: dict[str, Any]) -> dict[tuple[int, str], torch.Tensor]:
        """Flat local views of the values to load, by (parameter, field)."""
        out = {}
        for part in self.parts:
            entry = state.get(part.fqn, {})
            for field in self.layout.fields:
                value = entry.get(STATE_KEY_OF_FIELD[field])
                if isinstance(value, _StateTensor):
                    if (part.index, field) in value._session.loaded:
                        out[(part.index, field)] = value._session._source(part, field)
                elif isinstance(value, torch.Tensor):
                    local = local_tensor(value).detach()
                    if tuple(local.shape) != part.shape:
                        raise ValueError(
                            f"{part.fqn}.{STATE_KEY_OF_FIELD[field]} has local shape {tuple(local.shape)}, "
                            f"this rank's part of the parameter is {part.shape}"
                        )
                    out[(part.index, field)] = local.reshape(-1).to(torch.float32)
        return out

    def close(self) -> None:
        self._shards.clear()
        self._spare.clear()
        self._staging = None


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
        RAM for shards kept between save requests (in fp32). ``None``: two shards.

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
        if cache_bytes is not None and (isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0):
            raise ConfigError(f"cache_bytes={cache_bytes!r} must be an int >= 0 (bytes), e.g. 256 << 20")
        self.cache_bytes = cache_bytes
        self._params = [p for g in self.opt.param_groups for p in g["params"]]
        self._fqns = _fqns(model, self._params)
        self.stats = Stats()

    def _parts(self) -> list[_Part]:
        layout = self.opt.layout
        parts = []
        for i, (p, entry) in enumerate(zip(self._params, layout.params)):
            if not p.requires_grad:
                continue  # frozen: no state, as in torch
            # An empty local shard has no blocks but, as in torch, a step.
            shape = tuple(local_tensor(p).shape)
            global_shape, offset = _placement(p, shape)
            row_numel, blocks = _row_blocks(layout, i, shape)
            parts.append(_Part(i, self._fqns[i], global_shape, shape, offset, entry.start, entry.numel, row_numel, blocks))
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Placeholders for DCP in ``torch.optim.AdamW``'s FQN layout (see the module docs).

        Every trainable local part is listed; ``dcp.save`` writes only those
        that have taken a step (as torch's AdamW has state only for them). A
        dict serves one ``dcp.save`` or one ``dcp.load``.
        """
        opt = self.opt
        opt.check_usable()
        cache = 2 * opt.layout.wide_slot_nbytes if self.cache_bytes is None else self.cache_bytes
        session = _Session(opt, self._parts(), cache)
        self.stats = session.stats  # the session itself goes when DCP drops the dict (and its cache)
        state: dict[str, dict[str, Any]] = {}
        for part in session.parts:
            group = opt.param_groups[opt.layout.params[part.index].group]
            fields = [f for f in opt.layout.fields if f != "max_exp_avg_sq" or group["amsgrad"]]
            state[part.fqn] = {STATE_KEY_OF_FIELD.get(f, f): _StateTensor(session, part, f) for f in ("step", *fields)}
        groups = []
        for group in opt.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = [self._fqns[i] for i in self._group_indices(group)]
            groups.append(packed)
        return {"state": state, "param_groups": groups, STEP_COUNT_KEY: _StepCount(session)}

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
        parameters. Fields a checkpoint lacks load as zeros (masters are
        seeded from the parameters).

        Raises
        ------
        ValueError
            If a value has the wrong local shape, or the param-group counts differ.
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
            (v._session for e in state.values() for v in e.values() if isinstance(v, _StateTensor)), None
        ) or _Session(opt, self._parts(), 0)
        sources = session.sources(state)
        steps: dict[int, float] = {}
        for part in session.parts:
            step = state.get(part.fqn, {}).get("step")
            if isinstance(step, _StateTensor):
                step = step._session.loaded_steps.get(part.index)
            if step is not None and float(step) != _UNSET:
                steps[part.index] = float(step)
        step_count = state_dict.get(STEP_COUNT_KEY)
        if isinstance(step_count, _StepCount):
            step_count = step_count._session.loaded_step_count
        step_count = -1 if step_count is None else int(step_count)
        if step_count < 0:  # a checkpoint written by torch's AdamW: its steps say how far it got
            step_count = int(max(steps.values(), default=0))
        layout = opt.layout
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for (i, field), src in sources.items():
            by_param.setdefault(i, {})[field] = src

        def fill(shard: ShardSpec, flat: torch.Tensor) -> None:
            layout.copy_in(shard, flat, by_param)

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


class TieredSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes tierstore blocks shard by shard.

    DCP writes a tensor's chunks one field after another, which reads a
    parameter's shards once per field when they do not fit the
    :class:`TieredStateful` cache; this planner orders the blocks by shard
    (all fields of a block together) so that every shard is read once.
    Other entries keep their order.

    Example
    -------
    >>> import torch.distributed.checkpoint as dcp
    >>> planner = TieredSavePlanner()  # dcp.save(state, checkpoint_id=path, planner=planner)
    """

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        positions, keyed = [], []
        for n, item in enumerate(plan.items):
            value = self.state_dict.get(item.index.fqn)
            if isinstance(value, _StateTensor):
                positions.append(n)
                keyed.append((value._order(item.index), item))
        if not positions:
            return plan
        items = list(plan.items)
        for n, (_, item) in zip(positions, sorted(keyed, key=lambda kv: kv[0])):
            items[n] = item
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan
