"""Moment formats: what the bytes ``exp_avg`` and ``exp_avg_sq`` are kept in mean (no conversion here).

A :class:`MomentFormat` says how one moment field of a shard is stored; the
update always runs in fp32 (one math): the codecs (:mod:`tierstore._compute.codecs`)
widen a field into fp32 scratch and narrow it back. Three formats exist:

``"float32"``
    The fp32 bits themselves (4 B/element). Decode and encode are copies (and
    the optimizer calls neither), so it stays bitwise equal to
    ``torch.optim.AdamW(fused=True)``.
``"bfloat16"``
    Each element rounded to the nearest bfloat16 (2 B/element).
``"int8"``
    Blockwise dynamic quantization after Dettmers et al. (ICLR'22): blocks of
    :data:`BLOCK_NUMEL` elements share one fp32 scale (the block's largest
    finite magnitude); each element is one byte indexing a 255-value map that
    is dense near the scale and reaches six decades below it. ``exp_avg`` uses
    a signed map; ``exp_avg_sq`` is stored as its square root with an unsigned
    map (1 + 4/256 = 1.015625 B/element with the scales).

Encoded field: ``codes`` (``numel * code_itemsize`` bytes) from byte 0, then,
for ``int8``, the fp32 ``scales`` (one per block, the last block may be
partial) from :meth:`MomentFormat.scales_offset` (:func:`split` gives both as
views). :meth:`MomentFormat.field_nbytes` rounds a field up to
:data:`FIELD_ALIGN` so fields laid back to back in a shard extent each start
4 KiB aligned.

Rounding. The registered formats round to nearest: a pure function of the
input, idempotent, cheap. For ``int8`` "nearest" means: the decision
boundary between two neighbouring map values is their midpoint rounded up
(in magnitude) to a multiple of 2**-11 of itself (the fp32 patterns whose
low 12 bits are zero), which moves a boundary by at most 0.044 % of its value
(at most 2.3 % of the gap it splits). Why: every boundary
then falls between two 12-bit buckets of fp32 bit patterns, so the code of
``y = x / scale`` is one table lookup by ``y``'s upper 20 bits (exact, no
comparison), about 8x faster than a search. A format record with
``rounding="stochastic"`` (a variant for experiments; no registered format
uses it) rounds up with probability equal to the value's position between its
two neighbours, with bits from a counter-based hash of ``(seed, step, field,
i)`` for the element at flat index ``i`` (:class:`RoundingKey`,
:func:`random_bits_reference`).

Non-finite values. ``float32`` and ``bfloat16`` keep NaN and ±inf (bfloat16
NaNs become the canonical quiet NaN). In ``int8`` the scale of a block is the
largest *finite* magnitude, a non-finite element (NaN, +inf or -inf, in any
field) gets the reserved code :data:`NONFINITE_CODE` and decodes to NaN; its
finite neighbours in the block and every other block are encoded exactly as
without it. Negative finite inputs to a second-moment field (never produced
by AdamW) encode as 0.

The int8 maps and their lookup tables (:func:`int8_map`,
:func:`int8_boundaries`, :func:`kernel_tables`) are built here, once per
process, for the codecs, the NumPy reference codecs
(:mod:`tierstore._compute.reference_codecs`) and the compiled kernel.

Example
-------
>>> fmt = moment_format("int8")
>>> fmt.bytes_per_element, fmt.field_nbytes(1 << 20), fmt.encoded_nbytes(1000)
(1.015625, 1064960, 1040)
>>> m = int8_map(fmt, "exp_avg_sq")  # code c of a second moment means m[c] * scale
>>> m.size, float(m[0]), float(m[254])
(255, 0.0, 1.0)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError

__all__ = [
    "ALIASES", "BLOCK_NUMEL", "BUCKETS", "BUCKET_SHIFT", "CAPACITY_MULTIPLE", "CODED_FIELDS", "DEFAULT_FORMAT", "FIELDS",
    "FIELD_ALIGN", "FORMATS", "MASK32", "NONFINITE_CODE", "SIGNED_FIELDS", "MomentFormat", "RoundingKey",
    "check_field", "chunk_key", "int8_boundaries", "int8_map", "int8_tables", "kernel_tables", "map_kind",
    "moment_format", "nearest_codes", "random_bits_reference", "split",
]  # fmt: skip

BLOCK_NUMEL = 256  # elements per int8 scale: bitsandbytes' and torchao's block size
FIELD_ALIGN = 4096  # bytes; every encoded field starts on a page (O_DIRECT)
CAPACITY_MULTIPLE = 1024  # elements; shard capacities are multiples of this (layout.PAGE_NUMEL)
NONFINITE_CODE = 255  # int8 code of a NaN/inf element; decodes to NaN
FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's, in its order (the compiled update's)
# Every field a moment format may store, across algorithms (each FieldSpec says compressible=True).
CODED_FIELDS = (*FIELDS, "momentum_buffer", "square_avg", "acc_delta")
# Fields that may be negative, by name across every algorithm (each FieldSpec says signed=True;
# tests/test_algorithms.py checks the two agree): an int8 code table then spans both signs.
SIGNED_FIELDS = ("exp_avg", "momentum_buffer", "grad_avg")
_FIELD_STREAM = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 3, "momentum_buffer": 4, "square_avg": 5, "acc_delta": 6}
MASK32 = 0xFFFFFFFF
BUCKET_SHIFT = 12  # int8 nearest: codes are looked up by the upper 32 - 12 = 20 bits of x / scale
BUCKETS = 1 << (32 - BUCKET_SHIFT)


@dataclass(frozen=True)
class MomentFormat:
    """How one moment field is stored (part of the state's identity: save it, compare it).

    Attributes
    ----------
    name
        ``"float32"``, ``"bfloat16"`` or ``"int8"`` (variants carry a suffix).
    code_itemsize
        Bytes per element of the codes: 4, 2 or 1.
    block_numel
        Elements sharing one fp32 scale; 0 when there are no scales.
    rounding
        ``"exact"`` (float32), ``"nearest"`` or ``"stochastic"``.
    sqrt_second
        ``int8`` only: second moments are stored as their square root.
    """

    name: str
    code_itemsize: int
    block_numel: int = 0
    rounding: str = "exact"
    sqrt_second: bool = False

    @property
    def bytes_per_element(self) -> float:
        """Bytes per element including the amortised scales (float32: 4, bfloat16: 2, int8: 1.015625)."""
        return float(self.code_itemsize + (4 / self.block_numel if self.block_numel else 0))

    @property
    def exact(self) -> bool:
        """Whether decode(encode(x)) == x bitwise for every fp32 x."""
        return self.rounding == "exact"

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the codes: float32, bfloat16 or uint8."""
        return {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}[self.code_itemsize]

    def num_blocks(self, numel: int) -> int:
        """Scales in a field of ``numel`` elements (0 without scales)."""
        return -(-numel // self.block_numel) if self.block_numel else 0

    def scales_offset(self, numel: int) -> int:
        """Byte offset of the fp32 scales inside an encoded field (64-byte aligned)."""
        return -(-numel * self.code_itemsize // 64) * 64

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of an encoded field of ``numel`` elements, unpadded.

        Example
        -------
        >>> moment_format("int8").encoded_nbytes(1000)
        1040
        """
        if not self.block_numel:
            return numel * self.code_itemsize
        return self.scales_offset(numel) + 4 * self.num_blocks(numel)

    def field_nbytes(self, capacity: int) -> int:
        """Bytes one field of a shard takes, padded to :data:`FIELD_ALIGN`.

        Raises
        ------
        ConfigError
            If ``capacity`` is not a positive multiple of :data:`CAPACITY_MULTIPLE`.

        Example
        -------
        >>> moment_format("bfloat16").field_nbytes(1024)
        4096
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0 or capacity % CAPACITY_MULTIPLE:
            raise ConfigError(
                f"capacity={capacity!r} must be a positive multiple of {CAPACITY_MULTIPLE} elements "
                "(a shard capacity); round it up with layout.round_up"
            )
        return -(-self.encoded_nbytes(capacity) // FIELD_ALIGN) * FIELD_ALIGN


FORMATS: dict[str, MomentFormat] = {
    "float32": MomentFormat("float32", 4),
    "bfloat16": MomentFormat("bfloat16", 2, rounding="nearest"),
    "int8": MomentFormat("int8", 1, BLOCK_NUMEL, rounding="nearest", sqrt_second=True),
}
DEFAULT_FORMAT = FORMATS["float32"]


#: Other names users write for a format: torch dtypes and the usual short names.
ALIASES: dict[object, str] = {
    "fp32": "float32", "bf16": "bfloat16", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8",
}  # fmt: skip
_NOT_OFFERED = ("float16", "fp16", "half", torch.float16)


def moment_format(name: str | MomentFormat | torch.dtype) -> MomentFormat:
    """The :class:`MomentFormat` called ``name`` (a format record passes through).

    ``name`` is a format's name or one of :data:`ALIASES` (``torch.bfloat16``,
    ``"bf16"``, ``torch.int8`` ...).

    Raises
    ------
    ConfigError
        If ``name`` is not a known format.

    Example
    -------
    >>> moment_format("bfloat16").bytes_per_element
    2.0
    >>> moment_format(torch.int8).name
    'int8'
    """
    if isinstance(name, MomentFormat):
        return name
    try:
        return FORMATS[ALIASES.get(name, name)]
    except (KeyError, TypeError):
        if name in _NOT_OFFERED:
            raise ConfigError(
                f"moment_dtype={name!r}: float16 moments are not offered (exp_avg_sq underflows float16's "
                "range); use 'bfloat16' (the same 2 bytes, float32's range) or 'int8'"
            ) from None
        raise ConfigError(
            f"moment_dtype={name!r} is unknown; use one of {sorted(FORMATS)} (float32 is the "
            "default and bitwise equal to torch.optim.AdamW)"
        ) from None


@dataclass(frozen=True)
class RoundingKey:
    """What stochastic rounding draws its bits from.

    ``offset`` is the flat index (in the field's index space, e.g. the
    layout's flat space) of the first element passed to :func:`encode`, so the
    element at flat index ``i`` gets the same bits however the space is cut.
    """

    seed: int
    step: int
    offset: int = 0


# -- the int8 maps ---------------------------------------------------------------


def _dynamic_map(signed: bool) -> np.ndarray:
    """The 255 values of the dynamic map, ascending, in fp32.

    Dettmers' dynamic tree map: decade ``i`` (0..6) covers ``[0.1, 1] * 10**(i-6)``
    with ``2**i`` (signed) or ``2**(i+1)`` (unsigned) evenly spaced midpoints. We add
    -1 so the map is symmetric (a block whose largest magnitude is negative keeps
    it) and drop the smallest magnitudes to leave code 255 free for non-finite
    values: signed = {0, ±1, ±127 - 1 values}, unsigned = {0, 1, 253 values}.
    """
    values: list[float] = []
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        values += [10.0 ** (i - 6) * (0.1 + 0.9 * (j + 0.5) / k) for j in range(k)]
    values = sorted(values)[1:]  # the smallest magnitude makes room for the reserved code
    positive = np.array([*values, 1.0], dtype=np.float32)
    if signed:
        out = np.concatenate([-positive[::-1], np.zeros(1, np.float32), positive])
    else:
        out = np.concatenate([np.zeros(1, np.float32), positive])
    assert out.size == 255 and np.all(np.diff(out) > 0)
    return out


def _round_up_to_bucket(t: np.ndarray) -> np.ndarray:
    """Positive fp32 ``t`` rounded up to the next pattern whose low :data:`BUCKET_SHIFT` bits are 0."""
    low = (1 << BUCKET_SHIFT) - 1
    bits = t.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + low) >> BUCKET_SHIFT) << BUCKET_SHIFT).astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class _Int8Tables:
    """Constant tables of one int8 map (NumPy for the reference, torch for the fast path)."""

    signed: bool
    values: np.ndarray  # 255 map values, ascending
    boundaries: np.ndarray  # nearest: positive decision boundaries on the bucket grid, ascending
    inv_gap: np.ndarray  # 1 / (values[c+1] - values[c]) in fp32, for stochastic rounding
    decode: Tensor  # 256 int32: the fp32 bits of the values, then NaN for NONFINITE_CODE
    nearest: Tensor  # 2**20 uint8: the nearest code of every 20-bit bucket of y's bits
    # Stochastic rounding (floor, then up at random); fp32 tables hold int32 bit patterns.
    floor_next: Tensor  # 256: values[c+1] (+inf past the end)
    floor_value: Tensor  # 256: values[c]
    floor_inv_gap: Tensor  # 256: inv_gap[c] (0 past the end)

    @functools.cached_property
    def floor_start(self) -> Tensor:
        """65536 int32: count(values <= lowest value of bf16 bucket) - 1 (built when stochastic
        rounding first needs it: its temporaries are a few MiB of RSS the nearest formats never use)."""
        return torch.from_numpy(np.maximum(_bucket_start(self.values) - 1, 0))


def _bucket_start(points: np.ndarray) -> np.ndarray:
    """For each of the 65536 bf16 buckets of fp32 bit patterns: count(points <= lowest value).

    A bucket holds the fp32 values whose top 16 bits are its index; for a
    negative index the lowest value is the pattern with all low bits set.
    The stochastic path adds one comparison with the next point, which is
    exact if a bucket never holds two points: checked here.
    """
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    negative = top >> 31 == 1
    low_bits = np.where(negative, top | 0xFFFF, top).view(np.float32)
    high_bits = np.where(negative, top, top | 0xFFFF).view(np.float32)
    with np.errstate(invalid="ignore"):
        lo = np.searchsorted(points, low_bits, side="right")
        hi = np.searchsorted(points, high_bits, side="right")
    finite = np.isfinite(low_bits) & np.isfinite(high_bits)
    assert np.all(hi[finite] - lo[finite] <= 1), "a bf16 bucket holds two map points"
    return np.where(finite, lo, 0).astype(np.int32)


def nearest_codes(tables_signed: bool, boundaries: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Nearest codes of fp32 ``y`` (= x / scale), the rule both paths implement.

    Signed map: ``127 ± count(boundaries <= |y|)`` by the sign of ``y`` (-0.0
    counts as 0). Unsigned: ``count(boundaries <= y)``, 0 for negative ``y``.
    Non-finite ``y``: :data:`NONFINITE_CODE`.
    """
    with np.errstate(invalid="ignore"):
        mag = np.abs(y)
        k = np.searchsorted(boundaries, mag, side="right").astype(np.int64)
        negative = np.signbit(y)
        if tables_signed:
            code = np.where(negative, 127 - k, 127 + k)
        else:
            code = np.where(negative & (mag > 0), 0, k)
        code = np.where(np.isfinite(y), code, NONFINITE_CODE)
    return code.astype(np.uint8)


def _build_int8_tables(kind: str) -> _Int8Tables:
    """Tables of map ``kind``: ``"signed"``, ``"unsigned"`` or ``"unsigned_sq"`` (the unsigned
    map squared: codes of sqrt(v), boundaries at the squared sqrt-space midpoints)."""
    signed = kind == "signed"
    base = _dynamic_map(signed).astype(np.float64)
    positive = base[base >= 0]  # 0 and the positive values (the signed map is symmetric)
    if kind == "unsigned_sq":
        values = (base**2).astype(np.float32)
        midpoints = (((positive[:-1] + positive[1:]) / 2) ** 2).astype(np.float32)
    else:
        values = base.astype(np.float32)
        p32 = positive.astype(np.float32)
        midpoints = ((p32[:-1] + p32[1:]) / np.float32(2)).astype(np.float32)
    boundaries = _round_up_to_bucket(midpoints)
    assert np.all(np.diff(boundaries) > 0), "two decision boundaries fell into one bucket"
    inv_gap = (np.float32(1) / (values[1:] - values[:-1])).astype(np.float32)
    inf = np.float32(np.inf)

    def pad(a: np.ndarray, fill: float) -> Tensor:  # 256 entries, as int32 bits
        return torch.from_numpy(np.concatenate([a, np.full(256 - a.size, fill, np.float32)]).view(np.int32))

    # Every value of a bucket has the code of the bucket's first pattern (the
    # boundaries are on the bucket grid): one lookup per element, no comparison.
    nearest = np.empty(BUCKETS, np.uint8)
    piece = 1 << 14
    for lo in range(0, BUCKETS, piece):  # in pieces: the temporaries stay small (peak RSS)
        first = (np.arange(lo, lo + piece, dtype=np.uint32) << BUCKET_SHIFT).view(np.float32)
        nearest[lo : lo + piece] = nearest_codes(signed, boundaries, first)
    assert np.array_equal(nearest_codes(signed, boundaries, values), np.arange(255)), "a map value moved"
    return _Int8Tables(
        signed=signed,
        values=values,
        boundaries=boundaries,
        inv_gap=inv_gap,
        decode=pad(values, np.nan),
        nearest=torch.from_numpy(nearest),
        floor_next=pad(values[1:], inf),
        floor_value=pad(values, 0),
        floor_inv_gap=pad(inv_gap, 0),
    )


@functools.cache
def int8_tables(kind: str) -> _Int8Tables:
    """Built on first use (a 1 MiB lookup table per map), once per process."""
    return _build_int8_tables(kind)


def map_kind(fmt: MomentFormat, field: str) -> str:
    """Which int8 map ``field`` of ``fmt`` uses: ``"signed"``, ``"unsigned"`` or ``"unsigned_sq"``."""
    if field in SIGNED_FIELDS:
        return "signed"
    return "unsigned_sq" if fmt.sqrt_second else "unsigned"


def int8_map(fmt: MomentFormat | str, field: str) -> np.ndarray:
    """The 255 fp32 values code ``c`` stands for (times the block scale) in ``field`` of ``fmt``.

    Example
    -------
    >>> m = int8_map("int8", "exp_avg")
    >>> m.size, float(m[0]), float(m[127]), float(m[254])
    (255, -1.0, 0.0, 1.0)
    """
    return int8_tables(map_kind(moment_format(fmt), check_field(field))).values.copy()


def int8_boundaries(fmt: MomentFormat | str, field: str) -> np.ndarray:
    """The positive decision boundaries of nearest rounding in ``field`` of ``fmt`` (see the module docs)."""
    return int8_tables(map_kind(moment_format(fmt), check_field(field))).boundaries.copy()


def kernel_tables(fmt: MomentFormat | str, field: str) -> tuple[Tensor, Tensor]:
    """The compiled kernel's tables of an int8 ``field``: the 2**20 nearest codes (uint8, indexed by
    the upper 20 bits of x / scale) and the 256 decode values (fp32, NaN for the reserved code).

    Example
    -------
    >>> nearest, values = kernel_tables("int8", "exp_avg")
    >>> nearest.numel(), float(values[127])
    (1048576, 0.0)
    """
    t = int8_tables(map_kind(moment_format(fmt), check_field(field)))
    return t.nearest, t.decode.view(torch.float32)


# -- stochastic-rounding bits ----------------------------------------------------------


def _mix32(x: int) -> int:
    """A 32-bit integer hash (Wellons' lowbias32 constants, both < 2**31)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def chunk_key(key: RoundingKey, field: str, high: int) -> int:
    """The 32-bit key of elements whose flat index has upper 32 bits ``high`` (the fast path's too)."""
    k = _mix32(key.seed & MASK32)
    for word in (key.seed >> 32, key.step & MASK32, key.step >> 32, _FIELD_STREAM[field], high):
        k = _mix32((k ^ _mix32(word & MASK32)) + 0x9E3779B9 & MASK32)
    return k


def random_bits_reference(key: RoundingKey, field: str, index: int) -> int:
    """32 random bits of the element at flat ``index``: the definition stochastic rounding draws from.

    Example
    -------
    >>> random_bits_reference(RoundingKey(seed=0, step=1), "exp_avg", 5) < 2**32
    True
    """
    return _mix32((index & MASK32) + chunk_key(key, field, index >> 32) & MASK32)


# -- fields and the encoded field --------------------------------------------------------


def check_field(field: str) -> str:
    """``field`` if it is a moment field (:data:`CODED_FIELDS`).

    Raises
    ------
    ConfigError
        If it is not.
    """
    if field not in CODED_FIELDS:
        raise ConfigError(f"field={field!r} is not a moment field; use one of {CODED_FIELDS}")
    return field


def split(fmt: MomentFormat | str, encoded: Tensor, numel: int) -> tuple[Tensor, Tensor | None]:
    """Views of an encoded field: ``(codes, scales)``; ``scales`` is None without blocks.

    ``codes`` is float32, bfloat16 or uint8 of ``numel`` elements; ``scales``
    float32 of ``fmt.num_blocks(numel)``. What a checkpoint writes as arrays.

    Example
    -------
    >>> codes, scales = split("int8", torch.zeros(1040, dtype=torch.uint8), 1000)
    >>> codes.dtype, tuple(scales.shape)
    (torch.uint8, (4,))
    """
    fmt = moment_format(fmt)
    codes = encoded[: numel * fmt.code_itemsize].view(fmt.code_dtype)
    if not fmt.block_numel:
        return codes, None
    offset = fmt.scales_offset(numel)
    return codes, encoded[offset : offset + 4 * fmt.num_blocks(numel)].view(torch.float32)

