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

- save: each rank's part is cut into blocks: boxes of at most 2 MiB that
  are contiguous in memory and lie in one optimizer shard. DCP asks for one
  block at a time (``__get_tensor_shard__``); the block's shard is visited
  through the optimizer's arena (``visit_shards``: the shard stays in its
  arena slot for the blocks after it) and copied into a reused buffer
  (:class:`~tierstore._storage.dcp_memory.BlockRing`) that DCP's writer writes out
  before it asks for the next block. :class:`TieredSavePlanner` orders the
  blocks so that every shard is read once.
- load: DCP copies each piece it reads into a staging file (a shared,
  unlinked memory map in the state directory, the size of this rank's
  state); ``load_state_dict`` then streams it into the shards and commits.
  Pages leave the process once filled and once streamed
  (:class:`~tierstore._storage.dcp_memory.Staging`).

RAM beyond ``ram_budget`` (inside tierstore's fixed 16 MiB overhead):
saving, one 2 MiB block buffer per writer thread; loading, the chunk DCP's
reader unpickles (it keeps the previous one until the next is read: two
blocks) and the staged piece being filled. Torch's plan and metadata add
about 2 KB per block (0.1% of the state) during either. A writer that copies
ahead (``FileSystemWriter`` on a GPU host with ``thread_count=1``) keeps up to
twice ``per_thread_copy_ahead`` bytes of blocks (one warning; pass
``per_thread_copy_ahead=0``). Loading needs room on the state directory's
drive for one more copy of the rank's state, and its page cache.
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
import itertools
import logging
import math
import threading
import warnings
from collections.abc import Sequence
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

from ._layout.layout import STATE_KEY_OF_FIELD, Layout, ShardSpec
from ._layout.torch_format import require_amsgrad_field, step_tensor
from ._platform import torch_private
from ._platform.dtensor import local_tensor
from ._runtime.access import ShardAccess
from ._storage import dcp_memory
from ._storage.dcp_memory import BLOCK_NBYTES, BlockRing, StagingFile
from .errors import ConfigError

__all__ = ["TieredStateful", "TieredSavePlanner", "Stats", "STEP_COUNT_KEY"]

log = logging.getLogger(__name__)

STEP_COUNT_KEY = "tierstore_step_count"
_UNSET = -1.0  # a step slot DCP did not fill: the checkpoint has no state for the parameter
_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass
class Stats:
    """What the last save through a :class:`TieredStateful` cost."""

    shard_reads: int = 0  # shards read from the drive (a shard stays in its arena slot for the next block)
    buffer_bytes: int = 0  # host memory of the block buffers DCP's writer read from


@dataclass(frozen=True)
class _Block:
    """A box of a parameter's local part that is contiguous in memory and lies in one shard."""

    offsets: tuple[int, ...]  # local offsets of the box
    sizes: tuple[int, ...]
    lo: int  # local flat elements [lo, hi)
    hi: int
    shard: int
    shard_offset: int  # where element ``lo`` sits in each field of the shard


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
    blocks: tuple[_Block, ...]

    def box(self, block: _Block) -> tuple[torch.Size, torch.Size]:
        """The block's global ``(offsets, sizes)`` (what DCP records as its chunk)."""
        return torch.Size([o + g for o, g in zip(block.offsets, self.offset)]), torch.Size(block.sizes)


def _boxes(shape: tuple[int, ...], lo: int, hi: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """Boxes of at most ``cap`` elements, each contiguous, covering flat ``[lo, hi)`` of a C-contiguous ``shape``.

    A box fixes the indices of the dimensions before some ``d``, takes a range
    of ``d`` and all of the later ones: one run of memory. Greedy, widest first.

    Example
    -------
    >>> [(o, s) for o, s, _, _ in _boxes((3, 4), 2, 11, cap=8)]
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if not shape:
        return [((), (), 0, 1)] if lo < hi else []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    out = []
    pos = lo
    while pos < hi:
        room = min(hi - pos, cap)
        d = next(d for d, stride in enumerate(strides) if pos % stride == 0 and stride <= room)
        index = [(pos // stride) % size for stride, size in zip(strides, shape)]
        k = min(shape[d] - index[d], room // strides[d])
        sizes = (1,) * d + (k,) + tuple(shape[d + 1 :])
        out.append((tuple(index), sizes, pos, pos + k * strides[d]))
        pos += k * strides[d]
    return out


def _blocks(layout: Layout, index: int, shape: tuple[int, ...], cap: int) -> tuple[_Block, ...]:
    """Cut a parameter's local part into blocks: at most ``cap`` elements, within one shard."""
    if math.prod(shape) == 0:  # an empty local shard (FSDP2 gives some ranks none of a small parameter)
        return ()
    blocks = []
    for shard, seg in layout.segments_of(index):
        span = seg.param_slice
        for offsets, sizes, lo, hi in _boxes(shape, span.start, span.stop, cap):
            blocks.append(_Block(offsets, sizes, lo, hi, shard, seg.shard_offset + lo - span.start))
    return tuple(blocks)


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
        shape, offset = torch_private.local_shape_and_offset(param.shape, param.device_mesh, param.placements)
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
        return torch_private.make_wrapper_subclass(cls, (), dtype=torch.int64, device="cpu")

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
        return torch_private.make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

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
        block = self._session._block_of[(part.index, torch.Size(index.offset or ()))]
        return part.start + block.lo, self._session.layout.field_index(self._field)

    # -- DCP's _Checkpointable hooks ------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        session = self._session
        session.begin("save")
        if session.step_of(self._part) is None:
            return []  # no step taken yet: torch's AdamW has no state for it either
        boxes = [(torch.Size([]), torch.Size([]))] if self._field == "step" else [
            self._part.box(block) for block in self._part.blocks
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


class _Staged(torch.Tensor):
    """A box of one parameter's part inside the DCP staging file: what DCP's reader copies into.

    DCP narrows it to the piece it read (``aten.slice``) and ``copy_``-s the
    piece in, which writes it into the file; :meth:`_Session.copy` reads a
    flat box of it back into a shard. Nothing else is supported, and no
    memory holds its values.
    """

    @staticmethod
    def __new__(cls, file: StagingFile, base: int, full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> _Staged:
        return torch_private.make_wrapper_subclass(cls, sizes, dtype=torch.float32, device="cpu")

    def __init__(self, file: StagingFile, base: int, full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self._file, self._first, self._full, self._offsets, self._sizes = file, base, full, offsets, sizes

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        return f"TieredStaging(offsets={self._offsets}, sizes={self._sizes} of {self._full})"

    def _narrow(self, dim: int, start: int, length: int) -> _Staged:
        offsets, sizes = list(self._offsets), list(self._sizes)
        offsets[dim] += start
        sizes[dim] = length
        return _Staged(self._file, self._first, self._full, tuple(offsets), tuple(sizes))

    def runs(self) -> list[tuple[int, int]]:
        """``(first element in the file, elements)`` of each contiguous run of the box, in order."""
        full, off, size = self._full, self._offsets, self._sizes
        if not full:
            return [(self._first, 1)]
        strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
        k = len(full) - 1
        while k > 0 and size[k] == full[k]:  # trailing whole dimensions join the run
            k -= 1
        length = size[k] * strides[k]
        out = []
        for index in itertools.product(*(range(o, o + n) for o, n in zip(off[:k], size[:k]))):
            start = sum(i * st for i, st in zip(index, strides)) + off[k] * strides[k]
            out.append((self._first + start, length))
        return out

    def read_into(self, out: torch.Tensor) -> None:
        """Read the box (one contiguous run, as a flat view is) from the file into ``out``."""
        runs = self.runs()
        if len(runs) != 1 or not out.is_contiguous() or out.numel() != runs[0][1]:
            raise ValueError(f"{self!r} is not one contiguous run of {out.numel()} elements")
        self._file.read_into(runs[0][0], out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return args[0]
        if func is aten.slice.Tensor:
            t = args[0]
            dim, start, end, step = (
                args[i] if i < len(args) else kwargs.get(name, default)
                for i, (name, default) in enumerate((("dim", 0), ("start", None), ("end", None), ("step", 1)), start=1)
            )
            n = t.shape[dim]
            start = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
            end = n if end is None else min(max(end + n if end < 0 else end, start), n)
            if step != 1:
                raise RuntimeError("a TieredStateful staging tensor is sliced with step 1 only")
            return t._narrow(dim, start, end - start)
        if func is aten.narrow.default:
            t, dim, start, length = args
            return t._narrow(dim, start, length)
        if func is aten.copy_.default:
            target, src = args[0], args[1]
            flat = src.detach().to(torch.float32).contiguous().view(-1)
            done = 0
            for at, n in target.runs():
                target._file.write(at, flat[done : done + n])
                done += n
            return target
        raise RuntimeError(
            f"{func} on a TieredStateful staging tensor: it stands for a part of the DCP staging file "
            "and only receives what dcp.load reads"
        )


class _Session:
    """What one ``TieredStateful.state_dict()`` call hands to one ``dcp.save`` or ``dcp.load``."""

    def __init__(self, opt: ShardAccess, parts: list[_Part]) -> None:
        self.opt = opt
        self.layout = opt.layout
        self.parts = parts
        self.mode: str | None = None
        self._block_of = {(p.index, p.box(b)[0]): b for p in parts for b in p.blocks}
        self._ring: BlockRing | None = None
        self._gpu_host: bool | None = None
        self._staging: StagingFile | None = None
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

    # -- save: each block copied out of its shard into a reused buffer ----------------
    def block(self, part: _Part, field: str, offset: tuple[int, ...]) -> torch.Tensor:
        if self._gpu_host is None:
            self._gpu_host = dcp_memory.gpu_host()
        keep = dcp_memory.copy_ahead_of_caller(self._gpu_host)  # before the lock: the caller's frames
        with self._lock:
            return self._block(part, field, offset, keep)

    def _block(self, part: _Part, field: str, offset: tuple[int, ...], keep: int) -> torch.Tensor:
        block = self._block_of[(part.index, torch.Size(offset))]
        if self._ring is None:
            self._ring = BlockRing(BLOCK_NBYTES)
        out = self._ring.take(block.hi - block.lo, keep=keep)
        k = self.layout.field_index(field)

        def copy(shard: ShardSpec, flat: torch.Tensor) -> None:
            src = flat[k * shard.capacity + block.shard_offset :][: out.numel()]
            out.copy_(src)

        # A shard read for one block stays in its arena slot for the next (the arena's cache).
        reads = self.opt.visit_shards(copy, [block.shard])
        self.stats.shard_reads += int(reads or 0)
        self.stats.buffer_bytes = self._ring.buffer_nbytes
        return out.view(block.sizes)

    # -- load: DCP writes into a staging file ----------------------------------------
    def staged(self, part: _Part, field: str) -> torch.Tensor:
        with self._lock:
            if self._staging is None:
                self._staging = StagingFile(len(self.layout.fields) * self.layout.total_numel, self.opt.state_dir)
            self.loaded.add((part.index, field))
        zeros = (0,) * len(part.shape)
        return _Staged(self._staging, self._base(part, field), part.shape, zeros, part.shape)

    def _base(self, part: _Part, field: str) -> int:
        return self.layout.field_index(field) * self.layout.total_numel + part.start

    def _source(self, part: _Part, field: str) -> torch.Tensor:
        assert self._staging is not None
        return _Staged(self._staging, self._base(part, field), (part.numel,), (0,), (part.numel,))

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``; a staged ``src`` is read from the staging file into ``dst``."""
        if isinstance(src, _Staged):
            src.read_into(dst)
        else:
            dst.copy_(src)

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
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._staging is not None:
            self._staging.close()
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
            blocks = _blocks(layout, i, shape, BLOCK_NBYTES // 4)
            parts.append(_Part(i, self._fqns[i], global_shape, shape, offset, entry.start, entry.numel, blocks))
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Placeholders for DCP in ``torch.optim.AdamW``'s FQN layout (see the module docs).

        Every trainable local part is listed; ``dcp.save`` writes only those
        that have taken a step (as torch's AdamW has state only for them). A
        dict serves one ``dcp.save`` or one ``dcp.load``.
        """
        opt = self.opt
        opt.check_usable()
        session = _Session(opt, self._parts())
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
            (v._session for e in state.values() for v in e.values() if isinstance(v, _StateTensor)), None
        ) or _Session(opt, self._parts())
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
        for part in session.parts:
            if part.index not in steps or math.prod(part.shape) == 0:
                continue  # no state to carry (or no local elements: nothing of it on this rank)
            saved_group = saved_groups[layout.params[part.index].group]
            wanted = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if saved_group.get("amsgrad") else [])
            missing = [STATE_KEY_OF_FIELD[f] for f in wanted if f in layout.fields and (part.index, f) not in sources]
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
