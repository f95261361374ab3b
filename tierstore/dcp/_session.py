"""What one ``TieredStateful.state_dict()`` call hands to DCP: the placeholders and the session behind their hooks.

The placeholders are storage-less tensors that DCP's default planners plan
with; their ``_Checkpointable`` hooks ask the :class:`Session` for a block
of a shard (save) or for the staged box that DCP's reader fills (load).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .._layout.layout import ShardSpec
from .._layout.torch_format import step_tensor
from .._platform import torch_private
from .._platform.dtensor import local_tensor
from .._runtime.access import ShardAccess
from .._storage import dcp_memory
from .._storage.dcp_memory import BLOCK_NBYTES, BlockRing, StagingFile
from ._parts import Part
from ._staging import Staged

__all__ = ["UNSET", "UNSET_SCALAR", "Stats", "Placeholder", "StepCount", "StateTensor", "Session"]

UNSET = -1.0  # a step slot DCP did not fill: the checkpoint has no state for the parameter
# A slot of another per-parameter scalar (NAdam's mu_product) DCP did not fill: NaN, which no recorded
# scalar is (tierstore._layout.scalar_record), since -1 may be one.
UNSET_SCALAR = float("nan")


@dataclass
class Stats:
    """What the last save through a :class:`TieredStateful` cost."""

    shard_reads: int = 0  # shards read from the drive (a shard stays in its arena slot for the next block)
    buffer_bytes: int = 0  # host memory of the block buffers DCP's writer read from



class Placeholder(torch.Tensor):
    """A storage-less stand-in that DCP plans with and reads through its ``_Checkpointable`` hooks.

    It supports no tensor operations: its values live in the optimizer's shards.
    """

    _session: Session

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


class StepCount(Placeholder):
    """The optimizer's ``step_count`` (an int64 scalar in the checkpoint)."""

    @staticmethod
    def __new__(cls, session: Session) -> StepCount:
        return torch_private.make_wrapper_subclass(cls, (), dtype=torch.int64, device="cpu")

    def __init__(self, session: Session) -> None:
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


class StateTensor(Placeholder):
    """One field (or the step, or another per-parameter scalar such as NAdam's ``mu_product``) of one
    parameter's state, with the parameter's global shape (a scalar's: ``()``)."""

    @staticmethod
    def __new__(cls, session: Session, part: Part, field: str) -> StateTensor:
        shape = () if session.is_scalar(field) else part.global_shape
        return torch_private.make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

    def __init__(self, session: Session, part: Part, field: str) -> None:
        self._session = session
        self._part = part
        self._field = field
        self._scalar = session.is_scalar(field)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        key = self._field if self._scalar else self._session.layout.state_key(self._field)
        return f"TieredState({self._part.fqn}.{key}, shape={tuple(self.shape)})"

    def _order(self, index: MetadataIndex) -> tuple[int, int]:
        """Where the block ``index`` names starts in the layout, then the field: shard order."""
        part = self._part
        if self._scalar:
            return part.start, -1
        block = self._session._block_of[(part.index, torch.Size(index.offset or ()))]
        return part.start + block.lo, self._session.layout.field_index(self._field)

    # -- DCP's _Checkpointable hooks ------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        session = self._session
        session.begin("save")
        if session.step_of(self._part) is None:
            return []  # no step taken yet: torch's optimizer has no state for it either
        boxes = [(torch.Size([]), torch.Size([]))] if self._scalar else [
            self._part.box(block) for block in self._part.blocks
        ]
        return [self._item(fqn, offsets, sizes) for offsets, sizes in boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        self._session.begin("load")
        part = self._part
        if self._scalar:
            return [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
        return [ChunkStorageMetadata(offsets=torch.Size(part.offset), sizes=torch.Size(part.shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        session, part = self._session, self._part
        if session.mode == "save":
            if self._field == "step":
                return session.step_of(part).clone()
            if self._scalar:
                return session.scalar_of(part, self._field)
            return session.block(part, self._field, tuple(index.offset or ()))
        if self._field == "step":
            return session.loaded_steps.setdefault(part.index, torch.tensor(UNSET))
        if self._scalar:
            return session.loaded_scalars.setdefault((part.index, self._field), torch.tensor(UNSET_SCALAR))
        return session.staged(part, self._field)



class Session:
    """What one ``TieredStateful.state_dict()`` call hands to one ``dcp.save`` or ``dcp.load``."""

    def __init__(self, opt: ShardAccess, parts: list[Part]) -> None:
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
        # (parameter, name) -> a loaded scalar besides the step (NAdam's mu_product), as DCP filled it
        self.loaded_scalars: dict[tuple[int, str], torch.Tensor] = {}
        self.loaded_step_count = torch.tensor(-1, dtype=torch.int64)
        self.stats = Stats()
        self._steps: list[float | None] | None = None
        self._scalars: dict[str, list[float | None]] | None = None
        self._lock = threading.Lock()  # DCP writers and readers may resolve from several threads

    def _read_steps(self) -> list[float | None]:
        """The steps and the scalars beside them, read together once per save."""
        if self._steps is None:
            self._scalars = self.opt.param_scalars() or {}
            self._steps = self.opt.param_steps()
        return self._steps

    def step_of(self, part: Part) -> torch.Tensor | None:
        """The parameter's step count, ``None`` before its first (read once per save)."""
        step = self._read_steps()[part.index]
        return None if step is None else step_tensor(step)

    def is_scalar(self, field: str) -> bool:
        """Whether ``field`` is a per-parameter scalar of the state (``step``, NAdam's ``mu_product``), not a field."""
        return field == "step" or field in self.layout.algorithm.scalar_inits

    def scalar_of(self, part: Part, name: str) -> torch.Tensor:
        """The parameter's scalar ``name`` besides its step (recorded once per save, with the steps)."""
        self._read_steps()
        assert self._scalars is not None  # read with the steps
        return torch.tensor(self._scalars[name][part.index], dtype=torch.float32)

    def begin(self, mode: str) -> None:
        if self.mode not in (None, mode):
            raise RuntimeError(
                "a TieredStateful state dict serves one dcp.save or one dcp.load; pass the "
                "TieredStateful itself to dcp (it calls state_dict() each time)"
            )
        self.mode = mode

    # -- save: each block copied out of its shard into a reused buffer ----------------
    def block(self, part: Part, field: str, offset: tuple[int, ...]) -> torch.Tensor:
        if self._gpu_host is None:
            self._gpu_host = dcp_memory.gpu_host()
        keep = dcp_memory.copy_ahead_of_caller(self._gpu_host)  # before the lock: the caller's frames
        with self._lock:
            return self._block(part, field, offset, keep)

    def _block(self, part: Part, field: str, offset: tuple[int, ...], keep: int) -> torch.Tensor:
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
    def staged(self, part: Part, field: str) -> torch.Tensor:
        with self._lock:
            if self._staging is None:
                self._staging = StagingFile(len(self.layout.fields) * self.layout.total_numel, self.opt.state_dir)
            self.loaded.add((part.index, field))
        zeros = (0,) * len(part.shape)
        return Staged(self._staging, self._base(part, field), part.shape, zeros, part.shape)

    def _base(self, part: Part, field: str) -> int:
        return self.layout.field_index(field) * self.layout.total_numel + part.start

    def _source(self, part: Part, field: str) -> torch.Tensor:
        assert self._staging is not None
        return Staged(self._staging, self._base(part, field), (part.numel,), (0,), (part.numel,))

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``; a staged ``src`` is read from the staging file into ``dst``."""
        if isinstance(src, Staged):
            src.read_into(dst)
        else:
            dst.copy_(src)

    def sources(self, state: dict[str, Any]) -> dict[tuple[int, str], torch.Tensor]:
        """Flat local views of the values to load, by (parameter, field)."""
        out = {}
        for part in self.parts:
            entry = state.get(part.fqn, {})
            for field in self.layout.fields:
                value = entry.get(self.layout.state_key(field))
                if isinstance(value, StateTensor):
                    if (part.index, field) in value._session.loaded:
                        out[(part.index, field)] = value._session._source(part, field)
                elif isinstance(value, torch.Tensor):
                    local = local_tensor(value).detach()
                    if tuple(local.shape) != part.shape:
                        raise ValueError(
                            f"{part.fqn}.{self.layout.state_key(field)} has local shape {tuple(local.shape)}, "
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

