"""Where every element of optimizer state lives: a pure function of the parameters.

Trainable parameters of all param groups are placed, in order, in one flat
index space; each start is aligned to :data:`PARAM_ALIGN` elements. The space
is cut into shards of ``shard_numel`` elements. A parameter may span shards
and a shard may hold many small parameters; the piece of a parameter inside a
shard is a :class:`Segment`.

Why the alignment: PyTorch's fused CPU AdamW kernel processes each tensor in
SIMD blocks from the tensor's first element and finishes with a scalar tail
whose rounding can differ from the SIMD body. Cutting a parameter only at
multiples of the SIMD width (8 or 16 floats) makes every cut piece see the
same blocks as the whole tensor, so the sharded update is bitwise equal to
``torch.optim.AdamW(fused=True)``. Shard capacities are multiples of
:data:`PAGE_NUMEL` so every field of a shard starts on a 4 KiB boundary, as
``O_DIRECT`` requires.

A shard's bytes are one extent: its fields (``master``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq`` as present) one after the other, each
``capacity`` elements long, in the state's **moment format**
(:mod:`tierstore._compute.formats`): the master is always fp32; the moments are fp32
(``"float32"``, the default), bfloat16 or blockwise int8, each field padded
to whole 4 KiB pages (:meth:`Layout.field_nbytes`). The format is part of the
layout's identity. With a compressed format a shard has two forms: its
*extent* (the stored bytes: what the store keeps, checksums, writes and
commits) and its *wide* form (every field fp32, back to back: what the
kernel and the adapters see). :meth:`Layout.decode_shard` and
:meth:`Layout.encode_shard` convert one into the other; in ``"float32"`` the
two are the same bytes and nothing is converted. Block formats (int8, 256
elements per scale) start every parameter on a block boundary
(:attr:`Layout.param_align`), so no block mixes two parameters and a
parameter without a gradient keeps its moments bit for bit.

A layout records the optimizer algorithm whose state it holds
(:mod:`tierstore._compute.algorithms`): its fields are ``master`` and the
algorithm's, and it is part of the identity (written by :meth:`Layout.to_dict`
only when it is not ``"adamw"``, so every AdamW layout keeps the fingerprint it
had before algorithms were recorded). The layout owns the state's vocabulary,
so that every interface names a field the same way: its fields' order
(:attr:`Layout.field_order`), the field <-> state-dict key map
(:meth:`Layout.state_key`, :meth:`Layout.field_of_key`; zarr checkpoints name
their arrays by the same keys), the fields a moment format stores
(:attr:`Layout.encoded_fields`), :data:`DEFAULT_SHARD_NUMEL`, the slices of a
:class:`Segment` and the view of one field inside a shard's flat buffer
(:meth:`Layout.field_view`). The module's constants (:data:`FIELD_ORDER`,
:data:`STATE_KEY_OF_FIELD`, :data:`MOMENT_FIELDS`, :func:`fields_for`) are
AdamW's.

Example
-------
>>> import torch
>>> w, b = torch.zeros(3000, requires_grad=True), torch.zeros(10, requires_grad=True)
>>> layout = Layout.build([[w, b]], shard_numel=2048, fields=("exp_avg", "exp_avg_sq"))
>>> [s.capacity for s in layout.shards]
[2048, 1024]
>>> [(g.param, g.param_offset, g.shard_offset, g.length) for g in layout.shards[1].segments]
[(0, 2048, 0, 952), (1, 0, 960, 10)]
>>> seg = layout.shards[1].segments[1]
>>> seg.param_slice, seg.shard_slice
(slice(0, 10, None), slice(960, 970, None))
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from dataclasses import fields as fields_of
from typing import Any

import torch

from .._compute import codecs, formats
from .._compute.algorithms import ADAMW, ALGORITHMS, Algorithm, algorithm_named
from .._compute.algorithms.generic import Recorded
from .._compute.algorithms.in_use import GENERIC_PREFIX, in_use
from .._compute.formats import DEFAULT_FORMAT, FORMATS, MomentFormat
from ..errors import ConfigError

PARAM_ALIGN = 64  # elements; a multiple of every CPU SIMD width for fp32 (AVX-512: 16)
PAGE_NUMEL = 1024  # elements; 4 KiB of fp32, the O_DIRECT alignment unit
STATE_DTYPE = torch.float32
STATE_ITEMSIZE = 4
MASTER = "master"  # the engine's own field: an fp32 copy of the parameter, first in every extent
MASTER_KEY = "master_param"  # its state-dict key (torch's optimizers ignore it)
FIELD_ORDER = (MASTER, *ADAMW.field_names)  # AdamW's fields in extent order (Layout.field_order: any algorithm's)
LAYOUT_VERSION = 1
DEFAULT_SHARD_NUMEL = 1 << 22  # 4 Mi elements: 16 MiB per fp32 field
# Bounds of a layout, checked when one is built and when one is read back (a layout read
# from a file sizes buffers and loops, so no number in it is used before it is checked).
MAX_SHARD_NUMEL = 1 << 30  # elements per shard: 4 GiB per fp32 field, 1024 times the default
MAX_SHARDS = 1 << 21  # 2 Mi shards: 8 Pi elements at the default shard size
MAX_PARAMS = 1 << 24  # parameters (frozen ones included)
MAX_NDIM = 64  # dimensions of a parameter
MAX_NUMEL = (1 << 63) - 1  # elements of one parameter (torch's int64 sizes)

#: The state-dict key of each of AdamW's fields, as ``torch.optim.AdamW`` names the moments
#: (``master_param`` is tierstore's extra key); zarr checkpoints and DCP use the same names.
#: A layout's own map, for its algorithm: :meth:`Layout.state_key`.
STATE_KEY_OF_FIELD = {MASTER: MASTER_KEY, **{f: f for f in ADAMW.field_names}}
FIELD_OF_STATE_KEY = {key: field for field, key in STATE_KEY_OF_FIELD.items()}
#: AdamW's fields a moment format applies to (a layout's own: :attr:`Layout.encoded_fields`).
MOMENT_FIELDS = tuple(f.name for f in ADAMW.fields if f.compressible)


def layout_format(moment_dtype: str | MomentFormat | None) -> MomentFormat:
    """The registered moment format a layout may hold (``None``: ``"float32"``).

    Raises
    ------
    ConfigError
        For an unknown name, or a format record that is not one of the registered formats.

    Example
    -------
    >>> layout_format("int8").block_numel
    256
    """
    fmt = DEFAULT_FORMAT if moment_dtype is None else formats.moment_format(moment_dtype)
    if FORMATS.get(fmt.name) != fmt:
        raise ConfigError(
            f"moment_dtype={fmt.name!r} is a codec variant, not a state format; use one of {sorted(FORMATS)}"
        )
    return fmt


def fields_for(*, amsgrad: bool, master: bool) -> tuple[str, ...]:
    """The fields an AdamW state holds, in extent order (any algorithm's: :func:`state_fields`).

    Example
    -------
    >>> fields_for(amsgrad=True, master=True)
    ('master', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq')
    """
    return state_fields(ADAMW, {"amsgrad"} if amsgrad else (), master=master)


def state_fields(algorithm: Algorithm, options: Iterable[str], *, master: bool) -> tuple[str, ...]:
    """The fields a state of ``algorithm`` holds with ``options`` in use, in extent order (``master`` first).

    Example
    -------
    >>> from tierstore._compute.algorithms import ADAMW
    >>> state_fields(ADAMW, (), master=True)
    ('master', 'exp_avg', 'exp_avg_sq')
    """
    return (MASTER,) * bool(master) + algorithm.fields_for(frozenset(options))


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as the optimizer was given it.

    ``index`` counts every parameter of every group in order, frozen ones too,
    exactly as ``torch.optim.Optimizer.state_dict`` numbers them. Frozen
    parameters have ``trainable=False`` and ``start=-1``: they get no state.
    """

    index: int
    group: int
    shape: tuple[int, ...]
    dtype: str
    numel: int
    trainable: bool
    start: int


@dataclass(frozen=True, slots=True)
class Segment:
    """The part ``[param_offset, param_offset + length)`` of a parameter's flat
    elements that sits at ``[shard_offset, shard_offset + length)`` of a shard."""

    param: int
    param_offset: int
    shard_offset: int
    length: int

    @property
    def param_slice(self) -> slice:
        """Where the segment lies in the parameter's flat elements."""
        return slice(self.param_offset, self.param_offset + self.length)

    @property
    def shard_slice(self) -> slice:
        """Where the segment lies in each field of its shard."""
        return slice(self.shard_offset, self.shard_offset + self.length)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """A shard: ``capacity`` elements per field starting at flat ``start``."""

    index: int
    start: int
    capacity: int
    segments: tuple[Segment, ...]


class Layout:
    """The placement of every parameter's state in shards (no I/O, no memory).

    Use :meth:`build`; :meth:`to_dict`/:meth:`from_dict` round-trip it and
    :attr:`fingerprint` identifies it.
    """

    def __init__(
        self,
        params: Sequence[ParamEntry],
        shards: Sequence[ShardSpec],
        *,
        shard_numel: int,
        fields: Sequence[str],
        moment_dtype: str | MomentFormat | None = None,
        algorithm: Algorithm | str = ADAMW,
    ) -> None:
        self.params = tuple(params)
        self.shards = tuple(shards)
        self.shard_numel = shard_numel
        self.fields = tuple(fields)
        self.format = layout_format(moment_dtype)
        self.algorithm = algorithm_named(algorithm)  # whose fields these are (part of the identity)
        self._segments_of: dict[int, list[tuple[int, Segment]]] = {p.index: [] for p in self.params}
        for shard in self.shards:
            for seg in shard.segments:
                self._segments_of[seg.param].append((shard.index, seg))

    # -- construction -------------------------------------------------
    @classmethod
    def build(
        cls,
        groups: Iterable[Iterable[torch.Tensor]],
        *,
        shard_numel: int,
        fields: Sequence[str],
        moment_dtype: str | MomentFormat | None = None,
        algorithm: Algorithm | str = ADAMW,
    ) -> Layout:
        """Lay out the trainable tensors of ``groups`` (lists of tensors).

        ``moment_dtype`` is the moments' format (``None``: ``"float32"``);
        ``fields`` are any of ``master`` and ``algorithm``'s fields (a
        registered algorithm or its name), put in extent order.

        Raises
        ------
        ConfigError
            If ``shard_numel`` is not a positive int, ``fields`` names a field
            ``algorithm`` does not have, or ``moment_dtype`` or ``algorithm`` is
            unknown.
        """
        if isinstance(shard_numel, bool) or not isinstance(shard_numel, int) or shard_numel <= 0:
            raise ConfigError(
                f"shard_numel={shard_numel!r} must be a positive int (elements per shard), e.g. 1 << 22"
            )
        if shard_numel > MAX_SHARD_NUMEL:
            raise ConfigError(
                f"shard_numel={shard_numel} is above the largest shard tierstore lays out "
                f"({MAX_SHARD_NUMEL} elements); pass a smaller one, e.g. 1 << 22 (the default)"
            )
        algorithm = algorithm_named(algorithm)
        order = (MASTER, *algorithm.field_names)
        unknown = [f for f in fields if f not in order]
        if unknown:
            raise ConfigError(f"unknown state fields {unknown}; known fields are {order}")
        fields = tuple(f for f in order if f in fields)
        fmt = layout_format(moment_dtype)
        align = param_align(fmt)
        shard_numel = round_up(shard_numel, PAGE_NUMEL)
        entries: list[ParamEntry] = []
        cursor = 0
        index = 0
        for gi, group in enumerate(groups):
            for tensor in group:
                trainable = bool(tensor.requires_grad) and tensor.numel() > 0
                start = -1
                if trainable:
                    start = round_up(cursor, align)
                    cursor = start + tensor.numel()
                entries.append(
                    ParamEntry(
                        index=index,
                        group=gi,
                        shape=tuple(tensor.shape),
                        dtype=str(tensor.dtype).removeprefix("torch."),
                        numel=tensor.numel(),
                        trainable=trainable,
                        start=start,
                    )
                )
                index += 1
        total = round_up(cursor, PAGE_NUMEL)
        if -(-total // shard_numel) > MAX_SHARDS:
            raise ConfigError(
                f"shard_numel={shard_numel} cuts {total} elements into {-(-total // shard_numel)} shards, more "
                f"than {MAX_SHARDS}; pass a larger shard_numel (at least {-(-total // MAX_SHARDS)}) or leave it "
                "at its default"
            )
        shards = _cut(entries, total, shard_numel)
        return cls(entries, shards, shard_numel=shard_numel, fields=fields, moment_dtype=fmt, algorithm=algorithm)

    # -- queries ------------------------------------------------------
    @property
    def total_numel(self) -> int:
        """Elements of the flat space, padding included (per field)."""
        return sum(s.capacity for s in self.shards)

    @property
    def trainable_numel(self) -> int:
        """Elements that carry state (sum of trainable parameter sizes)."""
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def max_capacity(self) -> int:
        """Largest shard capacity in elements (what an arena slot must hold)."""
        return max((s.capacity for s in self.shards), default=0)

    @property
    def param_align(self) -> int:
        """Elements every parameter's start is a multiple of (64; 256 with int8 blocks)."""
        return param_align(self.format)

    @property
    def encoded(self) -> bool:
        """True when the moments are stored in another form than fp32 (extent != wide form)."""
        return not self.format.exact

    # -- the state's vocabulary ---------------------------------------
    @property
    def field_order(self) -> tuple[str, ...]:
        """Every field a state of this algorithm may hold, in extent order (``master`` first)."""
        return (MASTER, *self.algorithm.field_names)

    @functools.cached_property
    def encoded_fields(self) -> tuple[str, ...]:
        """The fields stored in the moment format (the others, ``master`` included, are always fp32)."""
        return tuple(f for f in self.fields if f != MASTER and self.algorithm.field(f).compressible)

    def state_key(self, field: str) -> str:
        """The state-dict key of ``field`` (``master_param`` for the master; else the field's name, as torch's).

        Raises
        ------
        KeyError
            For a field this layout's algorithm does not have.

        Example
        -------
        >>> import torch
        >>> Layout.build([[torch.zeros(1, requires_grad=True)]], shard_numel=1024, fields=("master",)).state_key("master")
        'master_param'
        """
        if field == MASTER:
            return MASTER_KEY
        return self.algorithm.field(field).name

    def field_of_key(self, key: str) -> str | None:
        """The field whose state-dict key is ``key``, or ``None`` (a key this algorithm does not store)."""
        if key == MASTER_KEY:
            return MASTER
        return key if key in self.algorithm.field_names else None

    def field_nbytes(self, field: str, capacity: int) -> int:
        """Bytes ``field`` takes in the extent of a shard of ``capacity`` elements (page padded)."""
        if field not in self.fields:
            raise KeyError(f"this layout has no field {field!r}; it has {self.fields}")
        if field in self.encoded_fields:
            return self.format.field_nbytes(capacity)
        return capacity * STATE_ITEMSIZE

    def _capacity(self, shard: ShardSpec | int) -> int:
        return self.shards[shard].capacity if isinstance(shard, int) else shard.capacity

    def extent_nbytes(self, capacity: int) -> int:
        """Bytes of the extent of a shard of ``capacity`` elements (all its fields, as stored)."""
        return sum(self.field_nbytes(f, capacity) for f in self.fields)

    def shard_nbytes(self, shard: ShardSpec | int) -> int:
        """Bytes of one shard's extent (all its fields, as stored)."""
        return self.extent_nbytes(self._capacity(shard))

    def wide_nbytes(self, shard: ShardSpec | int) -> int:
        """Bytes of one shard's wide (all-fp32) form."""
        return self._capacity(shard) * STATE_ITEMSIZE * len(self.fields)

    @property
    def wide_slot_nbytes(self) -> int:
        """Bytes of the largest shard's wide (all-fp32) form."""
        return self.max_capacity * STATE_ITEMSIZE * len(self.fields)

    @property
    def slot_nbytes(self) -> int:
        """Bytes an arena slot needs to hold any shard's extent."""
        return self.extent_nbytes(self.max_capacity) if self.shards else 0

    @functools.cached_property
    def state_nbytes(self) -> int:
        """Bytes of all shards together (the state's size on disk, one copy)."""
        # A layout never changes once built; shards come in few capacities (most are full), so this
        # is one pass over the shards, whatever their number (the planner asks often, of millions).
        capacities = collections.Counter(s.capacity for s in self.shards)
        return sum(count * self.extent_nbytes(capacity) for capacity, count in capacities.items())

    @property
    def bytes_per_element(self) -> float:
        """Stored bytes per element of the flat space: 4 per fp32 field plus the moments' format."""
        return sum(self.format.bytes_per_element if f in self.encoded_fields else STATE_ITEMSIZE for f in self.fields)

    def scratch_nbytes(self, workers: int) -> int:
        """Bytes of fp32 scratch a compressed layout needs to decode into (0 for ``"float32"``).

        The larger of one shard's wide form (what adapters read and write) and
        the update's per-worker chunks (:func:`update_chunk_numel` elements of
        every moment field, plus an index buffer) for ``workers`` workers.
        """
        if not self.encoded or not self.shards:
            return 0
        chunk = update_chunk_numel(self.max_capacity)
        used = min(workers, -(-self.max_capacity // chunk))
        moments = len(self.encoded_fields)
        wide = self.max_capacity * STATE_ITEMSIZE * len(self.fields)
        return max(wide, used * chunk * (moments + 1) * STATE_ITEMSIZE)

    def field_index(self, field: str) -> int:
        """Position of ``field`` inside a shard's extent."""
        try:
            return self.fields.index(field)
        except ValueError:
            raise KeyError(f"this layout has no field {field!r}; it has {self.fields}") from None

    def segments_of(self, param_index: int) -> list[tuple[int, Segment]]:
        """``(shard index, segment)`` pairs covering parameter ``param_index`` in order."""
        return self._segments_of[param_index]

    def shards_of(self, param_indices: Iterable[int]) -> list[int]:
        """Sorted indices of the shards holding any part of the given parameters."""
        return sorted({shard for i in param_indices for shard, _ in self._segments_of[i]})

    # -- shard buffers ------------------------------------------------
    def field_offset(self, field: str, capacity: int) -> int:
        """Byte offset of ``field`` in the extent of a shard of ``capacity`` elements."""
        offset = 0
        for f in self.fields:
            if f == field:
                return offset
            offset += self.field_nbytes(f, capacity)
        raise KeyError(f"this layout has no field {field!r}; it has {self.fields}")

    def stored_field(self, extent: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        """The stored bytes of ``field`` inside a shard's extent (a uint8 view, page padded).

        ``extent`` is the extent's memory as a 1-D tensor of any dtype. For
        the master and for ``"float32"`` moments, ``.view(torch.float32)[:capacity]``
        of it is the field's values.
        """
        raw = extent.view(torch.uint8)
        start = self.field_offset(field, shard.capacity)
        return raw[start : start + self.field_nbytes(field, shard.capacity)]

    def stored_fp32(self, extent: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        """The fp32 values of a field stored as fp32 (the master; any field in ``"float32"``)."""
        if field in self.encoded_fields and self.encoded:
            raise KeyError(f"{field} is stored as {self.format.name}, not fp32; decode it (decode_shard)")
        return self.stored_field(extent, shard, field).view(torch.float32)[: shard.capacity]

    def decode_shard(
        self, shard: ShardSpec, extent: torch.Tensor, wide: torch.Tensor, *, threads: int | None = None
    ) -> None:
        """Fill ``wide`` (fp32, :meth:`wide_nbytes` long) with the shard's values from its extent."""
        for field, out in self.field_views(wide, shard).items():
            stored = self.stored_field(extent, shard, field)
            if field in self.encoded_fields:
                codecs.decode(self.format, field, stored, out, threads=threads)
            else:
                out.copy_(stored.view(torch.float32)[: shard.capacity])

    def encode_shard(
        self, shard: ShardSpec, wide: torch.Tensor, extent: torch.Tensor, *, threads: int | None = None
    ) -> None:
        """Store the wide (fp32) values of a shard into its extent, in the layout's format.

        Padding bytes of the extent are zeroed, so an extent's bytes (and its
        checksum) depend only on the values.
        """
        for field, values in self.field_views(wide, shard).items():
            stored = self.stored_field(extent, shard, field)
            if field in self.encoded_fields:
                used = self.format.encoded_nbytes(shard.capacity)
                codecs.encode(self.format, field, values, stored, threads=threads)
                stored[used:].zero_()
            else:
                stored.view(torch.float32)[: shard.capacity].copy_(values)

    def field_view(self, flat: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        """The ``capacity`` elements of ``field`` inside a shard's wide (fp32) buffer (a view)."""
        k = self.field_index(field)
        return flat[k * shard.capacity : (k + 1) * shard.capacity]

    def field_views(self, flat: torch.Tensor, shard: ShardSpec) -> dict[str, torch.Tensor]:
        """Every field's view inside a shard's wide (fp32) buffer, in extent order."""
        return {f: flat[k * shard.capacity : (k + 1) * shard.capacity] for k, f in enumerate(self.fields)}

    def copy_out(self, shard: ShardSpec, flat: torch.Tensor, dests: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Copy the shard's values into per-parameter tensors.

        ``dests[param][field]`` is the parameter's flat fp32 tensor for that
        field; parameters or fields absent from ``dests`` are skipped.
        """
        views = self.field_views(flat, shard)
        for seg in shard.segments:
            for field, t in dests.get(seg.param, {}).items():
                t[seg.param_slice].copy_(views[field][seg.shard_slice])

    def copy_in(
        self,
        shard: ShardSpec,
        flat: torch.Tensor,
        sources: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        copy: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
        init: Mapping[str, float] | None = None,
    ) -> None:
        """Zero the shard, then fill it from per-parameter flat tensors (``sources[param][field]``).

        Fields this layout does not hold are ignored; what no source covers
        stays zero, except that a parameter's elements of a field it has no
        source for take ``init[field]`` where given (the field's value before
        a first step: :meth:`~tierstore._compute.algorithms.base.Algorithm.initial_values`).
        ``copy(dst, src)`` moves each piece (default ``dst.copy_(src)``; a
        source that lives in a file can be read straight into ``dst``).
        """
        flat.zero_()
        views = self.field_views(flat, shard)
        starts = {f: v for f, v in (init or {}).items() if v != 0.0 and f in views}
        for seg in shard.segments:
            given = sources.get(seg.param, {})
            for field, t in given.items():
                if field in views:
                    dst, src = views[field][seg.shard_slice], t[seg.param_slice]
                    if copy is None:
                        dst.copy_(src)
                    else:
                        copy(dst, src)
            for field, value in starts.items():
                if field not in given:
                    views[field][seg.shard_slice].fill_(value)

    def fill_initial(self, shard: ShardSpec, flat: torch.Tensor, init: Mapping[str, float]) -> None:
        """Set every parameter element of each field in ``init`` to its value, in a wide (fp32) buffer.

        Padding between parameters is left as it is (zero in a fresh buffer),
        as :meth:`copy_in` leaves it. Fields this layout does not hold are ignored.

        Example
        -------
        >>> w = torch.zeros(3, requires_grad=True)
        >>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
        >>> flat = torch.zeros(2 * 1024)
        >>> layout.fill_initial(layout.shards[0], flat, {"exp_avg_sq": 0.5})
        >>> flat[1024:1028].tolist()
        [0.5, 0.5, 0.5, 0.0]
        """
        views = self.field_views(flat, shard)
        for field, value in init.items():
            if field in views:
                for seg in shard.segments:
                    views[field][seg.shard_slice].fill_(value)

    # -- identity -----------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able description; shards are recomputed, not stored.

        ``moment_dtype`` is written only when it is not ``"float32"``, and
        ``algorithm`` only when it is not ``"adamw"``, so a float32 AdamW
        layout has the fingerprint it had before formats and algorithms
        existed, and its state directories, manifests and checkpoints resume
        and read back byte for byte.
        """
        data = {
            "layout_version": LAYOUT_VERSION,
            "shard_numel": self.shard_numel,
            "fields": list(self.fields),
            "params": [
                {k: (list(v) if k == "shape" else v) for k, v in asdict(p).items()} for p in self.params
            ],
        }
        if self.format != DEFAULT_FORMAT:
            data["moment_dtype"] = self.format.name
        if self.algorithm is not ADAMW:
            data["algorithm"] = self.algorithm.name
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`, checking every field first (the dict may come from a file).

        Every number is checked before it sizes anything: types (an ``int``
        is never a ``bool`` or a ``float``), bounds (:data:`MAX_SHARD_NUMEL`,
        :data:`MAX_SHARDS`, :data:`MAX_PARAMS`, :data:`MAX_NDIM`), each
        parameter's ``numel`` against its ``shape``, its ``dtype``, its group
        (groups in order), and its ``start``: exactly where :meth:`build`
        puts it, so the ranges are contiguous, aligned, do not overlap and
        lie inside the shards.

        Raises
        ------
        ConfigError
            Naming the first field that is not what :meth:`to_dict` writes (the
            caller adds the file it came from).

        Example
        -------
        >>> import torch
        >>> w = torch.zeros(3, requires_grad=True)
        >>> data = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq")).to_dict()
        >>> Layout.from_dict(data).trainable_numel
        3
        >>> Layout.from_dict({**data, "shard_numel": True})
        Traceback (most recent call last):
        ...
        tierstore.errors.ConfigError: layout shard_numel=True must be an int, not bool
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a layout must be a JSON object, not {type(data).__name__}")
        version = data.get("layout_version")
        if type(version) is not int or version != LAYOUT_VERSION:
            raise ConfigError(f"layout_version {version!r} is not {LAYOUT_VERSION}; it was written by another tierstore")
        unknown = sorted(set(data) - {"layout_version", "shard_numel", "fields", "params", "moment_dtype", "algorithm"})
        if unknown:
            raise ConfigError(f"layout has unknown keys {unknown}; it was not written by this tierstore")
        shard_numel = _int(data, "shard_numel", "layout", lo=PAGE_NUMEL, hi=MAX_SHARD_NUMEL)
        if shard_numel % PAGE_NUMEL:
            raise ConfigError(f"layout shard_numel={shard_numel} is not a multiple of {PAGE_NUMEL}")
        name = data.get("algorithm", ADAMW.name)
        # A registered algorithm, or the one the optimizer being built declared (never anything imported by name).
        algorithm = (ALGORITHMS.get(name) if isinstance(name, str) else None) or in_use(name)
        if algorithm is None and isinstance(name, str) and name.startswith(GENERIC_PREFIX):
            algorithm = Recorded(name, data.get("fields"))  # the generic adapter's, read without its class: runs nothing
        if algorithm is None:
            raise ConfigError(f"layout algorithm={name!r} is not one of {sorted(ALGORITHMS)}")
        fields = _field_list(data.get("fields"), (MASTER, *algorithm.field_names), algorithm.fields_for(()))
        moment_dtype = data.get("moment_dtype", DEFAULT_FORMAT.name)
        if not isinstance(moment_dtype, str) or moment_dtype not in FORMATS:
            raise ConfigError(f"layout moment_dtype={moment_dtype!r} is not one of {sorted(FORMATS)}")
        fmt = FORMATS[moment_dtype]
        params = _param_entries(data.get("params"), param_align(fmt))
        total = round_up(max((p.start + p.numel for p in params if p.trainable), default=0), PAGE_NUMEL)
        if -(-total // shard_numel) > MAX_SHARDS:
            raise ConfigError(
                f"layout holds {total} elements in shards of {shard_numel}: {-(-total // shard_numel)} shards, "
                f"more than {MAX_SHARDS}"
            )
        return cls(params, _cut(params, total, shard_numel), shard_numel=shard_numel, fields=fields, moment_dtype=fmt,
                   algorithm=algorithm)  # fmt: skip

    @property
    def fingerprint(self) -> str:
        """A hex digest of what the state *is*: shapes, dtypes, groups, shard size, fields, moment format, algorithm."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def describe_difference(self, other: Layout) -> str:
        """A short human sentence saying how ``other`` differs from this layout (the algorithm first)."""
        if self.algorithm is not other.algorithm:
            return f"algorithm {other.algorithm.name!r} instead of {self.algorithm.name!r}"
        if len(self.params) != len(other.params):
            return f"{len(other.params)} parameters instead of {len(self.params)}"
        for a, b in zip(self.params, other.params):
            if a != b:
                return (
                    f"parameter {a.index} is {b.shape} {b.dtype} group {b.group}"
                    f"{'' if b.trainable else ' frozen'} instead of {a.shape} {a.dtype} group {a.group}"
                    f"{'' if a.trainable else ' frozen'}"
                )
        if self.shard_numel != other.shard_numel:
            return f"shard_numel {other.shard_numel} instead of {self.shard_numel}"
        if self.fields != other.fields:
            return f"state fields {other.fields} instead of {self.fields}"
        if self.format != other.format:
            return f"moment_dtype={other.format.name!r} instead of {self.format.name!r}"
        return "no difference"


def _int(entry: Mapping[str, Any], key: str, where: str, *, lo: int, hi: int) -> int:
    """``entry[key]``, an int (not a bool) in ``[lo, hi]``, else a ConfigError naming it."""
    value = entry.get(key)
    if type(value) is not int:
        raise ConfigError(f"{where} {key}={value!r} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where} {key}={value} is outside [{lo}, {hi}]")
    return value


def _field_list(fields: Any, order: tuple[str, ...], always: tuple[str, ...]) -> tuple[str, ...]:
    """``fields`` checked against ``order`` (``master`` and the algorithm's fields, in extent order)
    and ``always`` (the fields its state always holds).

    A list may be empty: a state of SGD without momentum and without masters holds no field.
    """
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise ConfigError(f"layout fields={fields!r} must be a list of names from {order}")
    canonical = tuple(f for f in order if f in fields)
    if tuple(fields) != canonical:
        raise ConfigError(f"layout fields={fields!r} must be distinct names from {order}, in that order")
    missing = [f for f in always if f not in canonical]
    if missing:
        raise ConfigError(f"layout fields={fields!r} lack {missing}, which this algorithm's state always holds")
    return canonical


_PARAM_KEYS = frozenset(f.name for f in fields_of(ParamEntry))


def _dtype_name(value: Any, where: str) -> str:
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or str(dtype) != f"torch.{value}":
        raise ConfigError(f"{where} dtype={value!r} is not the name of a torch dtype (e.g. 'float32')")
    return value


def _param_entries(raw: Any, align: int) -> list[ParamEntry]:
    """Checked :class:`ParamEntry` records; each trainable start is where :meth:`Layout.build` puts it."""
    if not isinstance(raw, list):
        raise ConfigError(f"layout params must be a list, not {type(raw).__name__}")
    if len(raw) > MAX_PARAMS:
        raise ConfigError(f"layout lists {len(raw)} parameters, more than {MAX_PARAMS}")
    entries: list[ParamEntry] = []
    cursor = 0
    group = 0
    for i, p in enumerate(raw):
        where = f"layout params[{i}]"
        if not isinstance(p, Mapping) or set(p) != _PARAM_KEYS:
            keys = sorted(p) if isinstance(p, Mapping) else type(p).__name__
            raise ConfigError(f"{where} has {keys}; a parameter entry has exactly {sorted(_PARAM_KEYS)}")
        _int(p, "index", where, lo=i, hi=i)
        gi = _int(p, "group", where, lo=group, hi=MAX_PARAMS)  # groups come in order
        group = gi
        shape = p["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or any(type(d) is not int or d < 0 for d in shape):
            raise ConfigError(f"{where} shape={shape!r} must be a list of at most {MAX_NDIM} ints >= 0")
        numel = math.prod(shape)
        if type(p["numel"]) is not int or p["numel"] != numel or numel > MAX_NUMEL:
            raise ConfigError(f"{where} numel={p['numel']!r} is not the product of its shape {shape} ({numel})")
        dtype = _dtype_name(p["dtype"], where)
        trainable = p["trainable"]
        if not isinstance(trainable, bool):
            raise ConfigError(f"{where} trainable={trainable!r} must be true or false")
        if trainable and (numel == 0 or not (getattr(torch, dtype).is_floating_point or getattr(torch, dtype).is_complex)):
            raise ConfigError(f"{where} is trainable but has {numel} elements of {dtype}; only non-empty float parameters are")
        expected = round_up(cursor, align) if trainable else -1
        start = _int(p, "start", where, lo=expected, hi=expected)
        if trainable:
            cursor = start + numel
        entries.append(ParamEntry(index=i, group=gi, shape=tuple(shape), dtype=dtype, numel=numel, trainable=trainable, start=start))
    return entries


def param_align(fmt: MomentFormat) -> int:
    """Elements a parameter's start is a multiple of: :data:`PARAM_ALIGN`, and whole blocks of ``fmt``."""
    return math.lcm(PARAM_ALIGN, fmt.block_numel) if fmt.block_numel else PARAM_ALIGN


def update_chunk_numel(capacity: int) -> int:
    """Elements per chunk of a compressed shard's update (decode, kernel, encode in cache)."""
    return min(codecs.CHUNK_NUMEL, capacity)


def _cut(params: Sequence[ParamEntry], total: int, shard_numel: int) -> list[ShardSpec]:
    """Cut ``[0, total)`` into shards and list the parameter segments of each."""
    shards: list[ShardSpec] = []
    trainable = [p for p in params if p.trainable]
    cursor = 0  # index into trainable, which is sorted by start
    for index, start in enumerate(range(0, total, shard_numel)):
        end = min(start + shard_numel, total)
        segments = []
        while cursor < len(trainable) and trainable[cursor].start + trainable[cursor].numel <= start:
            cursor += 1
        probe = cursor
        while probe < len(trainable) and trainable[probe].start < end:
            p = trainable[probe]
            lo = max(p.start, start)
            hi = min(p.start + p.numel, end)
            segments.append(Segment(param=p.index, param_offset=lo - p.start, shard_offset=lo - start, length=hi - lo))
            probe += 1
        shards.append(ShardSpec(index=index, start=start, capacity=end - start, segments=tuple(segments)))
    return shards
