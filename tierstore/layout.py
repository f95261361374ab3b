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
``capacity`` fp32 elements long.

The layout also owns the state's vocabulary, so that every interface names a
field the same way: :data:`FIELD_ORDER`, the field -> state-dict key map
(:data:`STATE_KEY_OF_FIELD`; zarr checkpoints name their arrays by the same
keys), :data:`DEFAULT_SHARD_NUMEL`, the slices of a :class:`Segment` and the
view of one field inside a shard's flat buffer (:meth:`Layout.field_view`).

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

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from .errors import ConfigError

PARAM_ALIGN = 64  # elements; a multiple of every CPU SIMD width for fp32 (AVX-512: 16)
PAGE_NUMEL = 1024  # elements; 4 KiB of fp32, the O_DIRECT alignment unit
STATE_DTYPE = torch.float32
STATE_ITEMSIZE = 4
FIELD_ORDER = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
LAYOUT_VERSION = 1
DEFAULT_SHARD_NUMEL = 1 << 22  # 4 Mi elements: 16 MiB per fp32 field

#: The state-dict key of each field, as ``torch.optim.AdamW`` names the moments
#: (``master_param`` is tierstore's extra key); zarr checkpoints and DCP use the same names.
STATE_KEY_OF_FIELD = {
    "master": "master_param",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "max_exp_avg_sq": "max_exp_avg_sq",
}
FIELD_OF_STATE_KEY = {key: field for field, key in STATE_KEY_OF_FIELD.items()}
MASTER_KEY = STATE_KEY_OF_FIELD["master"]


def fields_for(*, amsgrad: bool, master: bool) -> tuple[str, ...]:
    """The fields a state holds, in extent order.

    Example
    -------
    >>> fields_for(amsgrad=True, master=True)
    ('master', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq')
    """
    wanted = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set()) | ({"master"} if master else set())
    return tuple(f for f in FIELD_ORDER if f in wanted)


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
    ) -> None:
        self.params = tuple(params)
        self.shards = tuple(shards)
        self.shard_numel = shard_numel
        self.fields = tuple(fields)
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
    ) -> Layout:
        """Lay out the trainable tensors of ``groups`` (lists of tensors).

        Raises
        ------
        ConfigError
            If ``shard_numel`` is not a positive int or ``fields`` names an unknown field.
        """
        if isinstance(shard_numel, bool) or not isinstance(shard_numel, int) or shard_numel <= 0:
            raise ConfigError(
                f"shard_numel={shard_numel!r} must be a positive int (elements per shard), e.g. 1 << 22"
            )
        unknown = [f for f in fields if f not in FIELD_ORDER]
        if unknown:
            raise ConfigError(f"unknown state fields {unknown}; known fields are {FIELD_ORDER}")
        fields = tuple(f for f in FIELD_ORDER if f in fields)
        shard_numel = round_up(shard_numel, PAGE_NUMEL)
        entries: list[ParamEntry] = []
        cursor = 0
        index = 0
        for gi, group in enumerate(groups):
            for tensor in group:
                trainable = bool(tensor.requires_grad) and tensor.numel() > 0
                start = -1
                if trainable:
                    start = round_up(cursor, PARAM_ALIGN)
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
        return cls(entries, _cut(entries, round_up(cursor, PAGE_NUMEL), shard_numel), shard_numel=shard_numel, fields=fields)

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

    def shard_nbytes(self, shard: ShardSpec | int) -> int:
        """Bytes of one shard's extent (all its fields)."""
        capacity = self.shards[shard].capacity if isinstance(shard, int) else shard.capacity
        return capacity * STATE_ITEMSIZE * len(self.fields)

    @property
    def slot_nbytes(self) -> int:
        """Bytes an arena slot needs to hold any shard."""
        return self.max_capacity * STATE_ITEMSIZE * len(self.fields)

    @property
    def state_nbytes(self) -> int:
        """Bytes of all shards together (the state's size on disk, one copy)."""
        return sum(self.shard_nbytes(s) for s in self.shards)

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
    def field_view(self, flat: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        """The ``capacity`` elements of ``field`` inside a shard's flat buffer (a view)."""
        k = self.field_index(field)
        return flat[k * shard.capacity : (k + 1) * shard.capacity]

    def field_views(self, flat: torch.Tensor, shard: ShardSpec) -> dict[str, torch.Tensor]:
        """Every field's view inside a shard's flat buffer, in extent order."""
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
    ) -> None:
        """Zero the shard, then fill it from per-parameter flat tensors (``sources[param][field]``).

        Fields this layout does not hold are ignored; what no source covers
        stays zero. ``copy(dst, src)`` moves each piece (default
        ``dst.copy_(src)``; a source that lives in a file can be read
        straight into ``dst``).
        """
        flat.zero_()
        views = self.field_views(flat, shard)
        for seg in shard.segments:
            for field, t in sources.get(seg.param, {}).items():
                if field in views:
                    dst, src = views[field][seg.shard_slice], t[seg.param_slice]
                    if copy is None:
                        dst.copy_(src)
                    else:
                        copy(dst, src)

    # -- identity -----------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able description; shards are recomputed, not stored."""
        return {
            "layout_version": LAYOUT_VERSION,
            "shard_numel": self.shard_numel,
            "fields": list(self.fields),
            "params": [
                {k: (list(v) if k == "shape" else v) for k, v in asdict(p).items()} for p in self.params
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Inverse of :meth:`to_dict`."""
        version = data.get("layout_version")
        if version != LAYOUT_VERSION:
            raise ConfigError(f"layout_version {version!r} is not {LAYOUT_VERSION}; it was written by another tierstore")
        params = [ParamEntry(**{**p, "shape": tuple(p["shape"])}) for p in data["params"]]
        total = round_up(max((p.start + p.numel for p in params if p.trainable), default=0), PAGE_NUMEL)
        return cls(params, _cut(params, total, data["shard_numel"]), shard_numel=data["shard_numel"], fields=data["fields"])

    @property
    def fingerprint(self) -> str:
        """A hex digest of what the state *is*: shapes, dtypes, groups, shard size, fields."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def describe_difference(self, other: Layout) -> str:
        """A short human sentence saying how ``other`` differs from this layout."""
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
        return "no difference"


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
