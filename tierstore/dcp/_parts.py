"""This rank's part of every trainable parameter as DCP sees it: its FQN, global box and blocks.

A :class:`Part` is where a parameter's local part (FSDP2's ``DTensor``
shard, a ZeRO partition or the whole tensor) sits in the global tensor and
in the optimizer's layout; its :class:`Block`-s are the boxes a save hands
to DCP one at a time: contiguous in memory, within one shard.

Example
-------
>>> [(o, s) for o, s, _, _ in boxes((2, 3), 0, 6, cap=4)]
[((0, 0), (1, 3)), ((1, 0), (1, 3))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._layout.layout import Layout
from .._platform import torch_private
from ..errors import ConfigError

__all__ = ["Block", "Part", "boxes", "blocks_of", "fqns", "placement"]

_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass(frozen=True)
class Block:
    """A box of a parameter's local part that is contiguous in memory and lies in one shard."""

    offsets: tuple[int, ...]  # local offsets of the box
    sizes: tuple[int, ...]
    lo: int  # local flat elements [lo, hi)
    hi: int
    shard: int
    shard_offset: int  # where element ``lo`` sits in each field of the shard


@dataclass(frozen=True)
class Part:
    """One trainable parameter's part on this rank, where it sits globally and in the layout."""

    index: int  # position in the optimizer's parameters
    fqn: str
    global_shape: tuple[int, ...]
    shape: tuple[int, ...]  # local
    offset: tuple[int, ...]  # global offset of the local part
    start: int  # layout flat start
    numel: int
    blocks: tuple[Block, ...]

    def box(self, block: Block) -> tuple[torch.Size, torch.Size]:
        """The block's global ``(offsets, sizes)`` (what DCP records as its chunk)."""
        return torch.Size([o + g for o, g in zip(block.offsets, self.offset)]), torch.Size(block.sizes)


def boxes(shape: tuple[int, ...], lo: int, hi: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """Boxes of at most ``cap`` elements, each contiguous, covering flat ``[lo, hi)`` of a C-contiguous ``shape``.

    A box fixes the indices of the dimensions before some ``d``, takes a range
    of ``d`` and all of the later ones: one run of memory. Greedy, widest first.

    Example
    -------
    >>> [(o, s) for o, s, _, _ in boxes((3, 4), 2, 11, cap=8)]
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


def blocks_of(layout: Layout, index: int, shape: tuple[int, ...], cap: int) -> tuple[Block, ...]:
    """Cut a parameter's local part into blocks: at most ``cap`` elements, within one shard."""
    if math.prod(shape) == 0:  # an empty local shard (FSDP2 gives some ranks none of a small parameter)
        return ()
    blocks = []
    for shard, seg in layout.segments_of(index):
        span = seg.param_slice
        for offsets, sizes, lo, hi in boxes(shape, span.start, span.stop, cap):
            blocks.append(Block(offsets, sizes, lo, hi, shard, seg.shard_offset + lo - span.start))
    return tuple(blocks)


def clean_fqn(name: str, ddp: bool) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_NAMES]
    if ddp and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def fqns(model: torch.nn.Module | None, params: Sequence[torch.Tensor]) -> list[str]:
    """The FQN of every optimizer parameter, as ``get_optimizer_state_dict`` names them."""
    if model is None:
        return [str(i) for i in range(len(params))]
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), clean_fqn(name, ddp))
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ConfigError(
            f"optimizer parameters {missing[:5]} are not parameters of the given model; pass the "
            "model the optimizer was built from (after fully_shard / DDP wrapping), or model=None "
            "to key the state by parameter index"
        )
    return [names[id(p)] for p in params]


def placement(param: torch.Tensor, local_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global_shape, global_offset)`` of a parameter's local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        shape, offset = torch_private.local_shape_and_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != local_shape:  # pragma: no cover - a placement torch computes differently
            raise ConfigError(f"DTensor parameter's local shape {local_shape} differs from its placement's {tuple(shape)}")
        return tuple(param.shape), tuple(offset)
    return local_shape, (0,) * len(local_shape)

