"""What the state holds for a set of parameters: the one decision every caller shares.

Given the trainable parameters (their dtypes, whether any lives on a GPU),
the optimizer's algorithm and options and its budget, :func:`decide` chooses
the state's fields (the algorithm's: AdamW's moments, ``max_exp_avg_sq`` with
amsgrad; an fp32 master copy when some parameter is not fp32 on the CPU or
``keep_master`` asks), the moments' format (``moment_dtype``: its bytes per element come from the layout), how
many staging buffers the update needs, the arena's slots and the shard size.
``TieredAdamW``, the planner (``tierstore plan``) and the DeepSpeed-config
mapping all call it, so they never disagree about bytes.

Example
-------
>>> import torch
>>> spec = decide(numel=10_000, dtypes=[torch.bfloat16], cuda=False, amsgrad=False,
...               keep_master=None, arena_slots=4, ram_budget=None, shard_numel=None)
>>> spec.fields, spec.staging_buffers, spec.shard_numel, spec.moment_format.name
(('master', 'exp_avg', 'exp_avg_sq'), 1, 4194304, 'float32')
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .._compute.algorithms import ADAMW, Algorithm
from .._compute.codecs import CHUNK_NUMEL
from .._compute.formats import FIELD_ALIGN, MomentFormat
from .._platform.dtensor import local_tensor
from ..errors import ConfigError
from .layout import (
    DEFAULT_SHARD_NUMEL,
    MASTER,
    STATE_ITEMSIZE,
    Layout,
    layout_format,
    state_fields,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RESIDENT_SHARD_NUMEL = 1 << 24  # 16 Mi elements, when all state is resident and unstaged
MIN_AUTO_SHARD_NUMEL = 1 << 10  # 4 KiB per field: tiny budgets still stream, slowly
CUDA_STAGING_BUFFERS = 4  # fp32 grads, raw grads, two alternating upload buffers


@dataclass(frozen=True)
class StateSpec:
    """The decided shape of the state (the layout is built from it)."""

    fields: tuple[str, ...]
    master: bool  # an fp32 master copy is the authoritative parameter value
    options: frozenset[str]  # the algorithm's options whose fields the state has ("amsgrad": max_exp_avg_sq)
    cuda: bool  # some parameter lives on a GPU
    staged: bool  # gradients pass through a staging buffer (cast to fp32 or copied from a GPU)
    staging_buffers: int
    arena_slots: int
    shard_numel: int
    moment_format: MomentFormat  # how the moments are stored (formats.FORMATS)
    workers: int = 1  # the most threads a compressed update uses (sizes its decode scratch)
    algorithm: Algorithm = ADAMW  # whose fields these are

    @property
    def amsgrad(self) -> bool:
        """The state has ``max_exp_avg_sq`` (AdamW's ``amsgrad`` option)."""
        return "amsgrad" in self.options

    @property
    def encoded_fields(self) -> tuple[str, ...]:
        """The fields a moment format stores (as :attr:`Layout.encoded_fields` will say)."""
        return _encoded(self.algorithm, self.fields)

    @property
    def stored_bytes_per_element(self) -> float:
        """Bytes one element of the flat space takes in an extent (the layout's arithmetic, unpadded)."""
        return _stored_bytes_per_element(self.fields, self.moment_format, self.encoded_fields)


def decide(
    *,
    numel: int,
    dtypes: Iterable[torch.dtype],
    cuda: bool,
    amsgrad: bool = False,
    keep_master: bool | None,
    arena_slots: int,
    ram_budget: int | None,
    shard_numel: int | None,
    saved: Layout | None = None,
    moment_dtype: str | MomentFormat | None = None,
    workers: int = 1,
    algorithm: Algorithm = ADAMW,
    options: Iterable[str] = (),
) -> StateSpec:
    """Decide what the state holds for ``numel`` trainable elements of the given dtypes.

    ``algorithm`` is the optimizer's, ``options`` the ones in use that add a
    field (:meth:`~tierstore._compute.algorithms.base.Algorithm.options`);
    ``amsgrad=True`` is AdamW's ``options={"amsgrad"}``. ``saved`` is the
    layout of a state being resumed: it fixes the shard size and keeps its
    master and optional fields (amsgrad's) where the caller left them open.
    ``moment_dtype`` (``None``: ``"float32"``) is the moments' format;
    ``workers`` the most threads a compressed update runs on.

    Raises
    ------
    ConfigError
        For an unknown ``moment_dtype``, or one the algorithm refuses with these
        options (:meth:`~tierstore._compute.algorithms.base.Algorithm.check_format`).
    """
    fmt = layout_format(moment_dtype)
    dtypes = set(dtypes)
    low_precision = any(d != torch.float32 for d in dtypes)
    master = bool(keep_master) or low_precision or cuda
    options = frozenset(options) | ({"amsgrad"} if amsgrad else frozenset())
    if saved is not None:
        shard_numel = saved.shard_numel if shard_numel is None else shard_numel
        master = master or (keep_master is None and MASTER in saved.fields)
        options |= {f.option for f in algorithm.fields if f.option is not None and f.name in saved.fields}
    fields = state_fields(algorithm, options, master=master)
    if not fmt.exact:
        algorithm.check_format(options, fmt.name)  # fields that may not be compressed together (centered RMSprop)
    encoded = _encoded(algorithm, fields)
    staged = low_precision or cuda
    staging = CUDA_STAGING_BUFFERS if cuda else (1 if staged else 0)
    if shard_numel is None:
        shard_numel = auto_shard_numel(
            numel,
            ram_budget=ram_budget,
            nfields=len(fields),
            arena_slots=arena_slots,
            staging_buffers=staging,
            stored_bytes=_stored_bytes_per_element(fields, fmt, encoded),
            # Layout.scratch_nbytes: a shard's wide form, or the update's chunk of every moment plus one
            scratch_bytes=0.0 if fmt.exact else float(max(len(fields), len(encoded) + 1) * STATE_ITEMSIZE),
            workers=workers,
        )
    return StateSpec(
        fields=fields,
        master=master,
        options=options,
        cuda=cuda,
        staged=staged,
        staging_buffers=staging,
        arena_slots=arena_slots,
        shard_numel=shard_numel,
        moment_format=fmt,
        workers=workers,
        algorithm=algorithm,
    )


def _encoded(algorithm: Algorithm, fields: Iterable[str]) -> tuple[str, ...]:
    """The fields of ``fields`` a moment format stores: the algorithm's compressible ones (never the master)."""
    return tuple(f for f in fields if f != MASTER and algorithm.field(f).compressible)


def _stored_bytes_per_element(fields: Iterable[str], fmt: MomentFormat, encoded: Iterable[str]) -> float:
    """Bytes one element of the flat space takes in an extent (the layout's arithmetic, unpadded)."""
    encoded = set(encoded)
    return sum(fmt.bytes_per_element if f in encoded else STATE_ITEMSIZE for f in fields)


def decide_for(
    params: Sequence[torch.Tensor],
    *,
    amsgrad: bool = False,
    keep_master: bool | None,
    arena_slots: int,
    ram_budget: int | None,
    shard_numel: int | None,
    saved: Layout | None = None,
    moment_dtype: str | MomentFormat | None = None,
    workers: int = 1,
    algorithm: Algorithm = ADAMW,
    options: Iterable[str] = (),
) -> StateSpec:
    """:func:`decide` for real tensors: the trainable ones among ``params`` (local parts of DTensors)."""
    trainable = [local_tensor(p) for p in params if p.requires_grad]
    return decide(
        numel=sum(p.numel() for p in trainable),
        dtypes=(p.dtype for p in trainable),
        cuda=any(p.device.type == "cuda" for p in trainable),
        amsgrad=amsgrad,
        keep_master=keep_master,
        arena_slots=arena_slots,
        ram_budget=ram_budget,
        shard_numel=shard_numel,
        saved=saved,
        moment_dtype=moment_dtype,
        workers=workers,
        algorithm=algorithm,
        options=options,
    )


def auto_shard_numel(
    numel: int,
    *,
    ram_budget: int | None,
    nfields: int,
    arena_slots: int,
    staging_buffers: int,
    stored_bytes: float | None = None,
    scratch_bytes: float = 0.0,
    workers: int = 1,
) -> int:
    """Largest power-of-two shard size up to 4 Mi whose arena, staging and scratch fit in half the budget.

    ``stored_bytes`` is what one element takes in a shard's extent (default:
    ``nfields`` fp32 fields), ``scratch_bytes`` what a compressed format's
    decode scratch takes per element of one shard, ``workers`` the threads a
    compressed update runs a shard's chunks on. When everything stays
    resident and nothing is staged or decoded, shards are 16 Mi: each shard
    piece is one call of the fused kernel, and fewer calls run closer to
    torch's one call per parameter.

    Example
    -------
    >>> auto_shard_numel(10**8, ram_budget=64 << 20, nfields=2, arena_slots=4, staging_buffers=0)
    1048576
    """
    stored = nfields * STATE_ITEMSIZE if stored_bytes is None else stored_bytes
    size = DEFAULT_SHARD_NUMEL
    per_shard = staging_buffers * STATE_ITEMSIZE + scratch_bytes  # bytes per element of one shard

    def resident_bytes(size: int) -> float:  # everything in RAM: the state (fields padded to pages), one shard's buffers
        return numel * stored + nfields * FIELD_ALIGN * -(-numel // size) + per_shard * min(size, numel)

    def resident(size: int) -> bool:
        return ram_budget is None or resident_bytes(size) <= ram_budget

    if not scratch_bytes:
        if resident(size):
            return RESIDENT_SHARD_NUMEL if staging_buffers == 0 else size
    else:
        # A compressed format's decode scratch is one shard's fp32 form, and each field of a
        # shard is padded to a page: where everything stays resident, the size with the least
        # RAM (the largest within 5% of it: fewer shards).
        # Where the state is large enough that it costs little, shards of a chunk per worker
        # (a shard's chunks are what the update runs in parallel).
        sizes = [s for s in (MIN_AUTO_SHARD_NUMEL << k for k in range(13)) if s <= size and resident(s)]
        if sizes:
            least = min(resident_bytes(s) for s in sizes)
            best = max(s for s in sizes if resident_bytes(s) <= 1.05 * least)
            parallel = min(size, 1 << max(0, workers * CHUNK_NUMEL - 1).bit_length())
            if best < parallel and resident(parallel) and scratch_bytes * min(parallel, numel) <= numel * stored / 8:
                best = parallel
            return best
    while size > MIN_AUTO_SHARD_NUMEL and (arena_slots * stored + per_shard) * size > ram_budget // 2:
        size //= 2
    return size


def check_param_kinds(params: Sequence[torch.Tensor]) -> None:
    """Refuse trainable parameters TieredAdamW cannot hold state for, naming the fix.

    Raises
    ------
    ConfigError
        For a dtype other than fp32/bf16/fp16, a device other than cpu/cuda,
        or a non-contiguous parameter.
    """
    for i, p in enumerate(params):
        if not p.requires_grad:
            continue
        local = local_tensor(p)
        if p.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"parameter {i} has dtype {p.dtype}; TieredAdamW supports {[str(d) for d in SUPPORTED_DTYPES]}. "
                "Freeze it (requires_grad=False) or convert it"
            )
        if local.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"parameter {i} is on device {local.device}; TieredAdamW supports cpu and cuda")
        if not local.is_contiguous():
            # Note: torch.optim.AdamW takes them (its fused CPU kernel then updates them wrongly in
            # torch 2.13); every kernel here reads dense runs, so they are refused with the fix.
            raise ConfigError(
                f"parameter {i} (shape {tuple(p.shape)}) is not contiguous; make it contiguous "
                "(param.data = param.data.contiguous()) before building the optimizer"
            )
