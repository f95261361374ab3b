"""Moment formats: the bytes ``exp_avg`` and ``exp_avg_sq`` are kept in, and their codecs.

A :class:`MomentFormat` says how one moment field of a shard is stored; the
update always runs in fp32 (one math): :func:`decode` widens a field into an
fp32 scratch buffer, the fused AdamW kernel updates it, :func:`encode` narrows
it back. Three formats exist:

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
partial) from :meth:`MomentFormat.scales_offset`. :meth:`MomentFormat.field_nbytes`
rounds a field up to :data:`FIELD_ALIGN` so fields laid back to back in a
shard extent each start 4 KiB aligned.

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
i)`` for the element at flat index ``i`` (:class:`RoundingKey`).

Non-finite values. ``float32`` and ``bfloat16`` keep NaN and ±inf (bfloat16
NaNs become the canonical quiet NaN). In ``int8`` the scale of a block is the
largest *finite* magnitude, a non-finite element (NaN, +inf or -inf, in any
field) gets the reserved code :data:`NONFINITE_CODE` and decodes to NaN; its
finite neighbours in the block and every other block are encoded exactly as
without it. Negative finite inputs to a second-moment field (never produced
by AdamW) encode as 0.

Every codec has a plain NumPy reference (``impl="reference"``), the test
oracle, which the fast path matches bitwise. The fast path runs a few torch
ops on cache-sized chunks of :data:`CHUNK_NUMEL` elements, on
single-threaded workers (:mod:`tierstore._platform.workers`); for int8 nearest it
calls a small compiled kernel instead where one could be built
(:mod:`tierstore._compute.native`: the same bytes, 2-3x faster; ``impl="torch"``
keeps torch ops). :func:`encode_chunk` and :func:`decode_chunk` are one
chunk's work, for callers that run their own chunks (the optimizer's update).

Example
-------
>>> import torch
>>> fmt = moment_format("int8")
>>> fmt.bytes_per_element, fmt.field_nbytes(1 << 20)
(1.015625, 1064960)
>>> x = torch.linspace(-1, 1, 1024)
>>> enc = torch.empty(fmt.encoded_nbytes(1024), dtype=torch.uint8)
>>> encode(fmt, "exp_avg", x, enc)
>>> y = torch.empty(1024)
>>> decode(fmt, "exp_avg", enc, y)
>>> bool((y - x).abs().max() <= 0.0073)
True
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._platform.workers import check_threads, run_each
from ..errors import ConfigError
from . import native

BLOCK_NUMEL = 256  # elements per int8 scale: bitsandbytes' and torchao's block size
FIELD_ALIGN = 4096  # bytes; every encoded field starts on a page (O_DIRECT)
CAPACITY_MULTIPLE = 1024  # elements; shard capacities are multiples of this (layout.PAGE_NUMEL)
NONFINITE_CODE = 255  # int8 code of a NaN/inf element; decodes to NaN
IMPLS = ("fast", "torch", "reference")  # the codec paths; every one gives the same bytes
# Elements per chunk of the fast path: several torch ops run on a chunk while it is in
# the CPU cache. Measured on the dev machine (2 cores, one thread): int8 encode ran at
# 540 M elements/s in chunks of 64 Ki, 820 M/s in 256 Ki, 610 M/s in 1 Mi (op overhead
# below, cache misses above).
CHUNK_NUMEL = 1 << 18
FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_SIGNED_FIELDS = ("exp_avg",)
_FIELD_STREAM = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 3}
_MASK32 = 0xFFFFFFFF
_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of an fp32 holds its upper bits
BUCKET_SHIFT = 12  # int8 nearest: codes are looked up by the upper 32 - 12 = 20 bits of x / scale
_BUCKETS = 1 << (32 - BUCKET_SHIFT)
_TINY = float(np.float32(1e-45))  # the smallest positive fp32 (a subnormal): divisor of a zero block


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


def _nearest_codes(tables_signed: bool, boundaries: np.ndarray, y: np.ndarray) -> np.ndarray:
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


def _int8_tables(kind: str) -> _Int8Tables:
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
    nearest = np.empty(_BUCKETS, np.uint8)
    piece = 1 << 14
    for lo in range(0, _BUCKETS, piece):  # in pieces: the temporaries stay small (peak RSS)
        first = (np.arange(lo, lo + piece, dtype=np.uint32) << BUCKET_SHIFT).view(np.float32)
        nearest[lo : lo + piece] = _nearest_codes(signed, boundaries, first)
    assert np.array_equal(_nearest_codes(signed, boundaries, values), np.arange(255)), "a map value moved"
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
def _tables(kind: str) -> _Int8Tables:
    """Built on first use (a 1 MiB lookup table per map), once per process."""
    return _int8_tables(kind)


def _map_kind(fmt: MomentFormat, field: str) -> str:
    if field in _SIGNED_FIELDS:
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
    return _tables(_map_kind(moment_format(fmt), _check_field(field))).values.copy()


def int8_boundaries(fmt: MomentFormat | str, field: str) -> np.ndarray:
    """The positive decision boundaries of nearest rounding in ``field`` of ``fmt`` (see the module docs)."""
    return _tables(_map_kind(moment_format(fmt), _check_field(field))).boundaries.copy()


def kernel_tables(fmt: MomentFormat | str, field: str) -> tuple[Tensor, Tensor]:
    """The compiled kernel's tables of an int8 ``field``: the 2**20 nearest codes (uint8, indexed by
    the upper 20 bits of x / scale) and the 256 decode values (fp32, NaN for the reserved code).

    Example
    -------
    >>> nearest, values = kernel_tables("int8", "exp_avg")
    >>> nearest.numel(), float(values[127])
    (1048576, 0.0)
    """
    t = _tables(_map_kind(moment_format(fmt), _check_field(field)))
    return t.nearest, t.decode.view(torch.float32)


# -- stochastic-rounding bits ----------------------------------------------------------


def _mix32(x: int) -> int:
    """A 32-bit integer hash (Wellons' lowbias32 constants, both < 2**31)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _chunk_key(key: RoundingKey, field: str, high: int) -> int:
    """The 32-bit key of elements whose flat index has upper 32 bits ``high``."""
    k = _mix32(key.seed & _MASK32)
    for word in (key.seed >> 32, key.step & _MASK32, key.step >> 32, _FIELD_STREAM[field], high):
        k = _mix32((k ^ _mix32(word & _MASK32)) + 0x9E3779B9 & _MASK32)
    return k


def _random_bits_reference(key: RoundingKey, field: str, index: int) -> int:
    """32 random bits of the element at flat ``index``."""
    return _mix32((index & _MASK32) + _chunk_key(key, field, index >> 32) & _MASK32)


def _random_bits(key: RoundingKey, field: str, start: int, numel: int) -> Tensor:
    """:func:`_random_bits_reference` for flat indices ``start .. start+numel-1`` (int64 tensor).

    The flat indices of one call share their upper 32 bits (the caller splits there).
    """
    x = torch.arange(numel, dtype=torch.int64) + ((start & _MASK32) + _chunk_key(key, field, start >> 32))
    x.bitwise_and_(_MASK32)
    # int64 arithmetic on values < 2**32 times constants < 2**31: no overflow anywhere.
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


def _split_high(offset: int, begin: int, end: int) -> list[tuple[int, int]]:
    """``[begin, end)`` cut where the flat index ``offset + i`` crosses a multiple of 2**32."""
    cut = ((offset + begin) >> 32) + 1 << 32
    if offset + end <= cut:
        return [(begin, end)]
    return [(begin, cut - offset), (cut - offset, end)]


# -- argument checks -----------------------------------------------------------------


def _check_field(field: str) -> str:
    if field not in FIELDS:
        raise ConfigError(f"field={field!r} is not a moment field; use one of {FIELDS}")
    return field


def _check_buffers(fmt: MomentFormat, fp32: Tensor, encoded: Tensor, what: str) -> int:
    if fp32.dtype != torch.float32 or fp32.dim() != 1 or not fp32.is_contiguous() or fp32.device.type != "cpu":
        raise ConfigError(
            f"the fp32 buffer of {what} is {fp32.dtype} {tuple(fp32.shape)} on {fp32.device}; "
            "pass a contiguous 1-D float32 CPU tensor"
        )
    numel = fp32.numel()
    need = fmt.encoded_nbytes(numel)
    if encoded.dtype != torch.uint8 or encoded.dim() != 1 or not encoded.is_contiguous() or encoded.numel() < need:
        raise ConfigError(
            f"the encoded buffer of {what} is {encoded.dtype} {tuple(encoded.shape)}; pass a contiguous "
            f"1-D uint8 tensor of at least {need} bytes ({fmt.name}, {numel} elements)"
        )
    if fmt.block_numel and encoded.data_ptr() % 4:
        raise ConfigError(f"the encoded buffer of {what} starts at an address not divisible by 4; align it")
    return numel


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ConfigError(f"impl={impl!r} is unknown; use one of {IMPLS}")


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


# -- per-thread temporaries -------------------------------------------------------------

_TEMPS = threading.local()


def _temp(numel: int) -> Tensor:
    """A per-thread fp32 buffer of at least ``numel`` elements (reused: chunks are small)."""
    buf = getattr(_TEMPS, "buffer", None)
    if buf is None or buf.numel() < numel:
        buf = _TEMPS.buffer = torch.empty(max(numel, CHUNK_NUMEL))
    return buf[:numel]


# -- one chunk (the fast path's unit of work) ---------------------------------------------


def encode_chunk(
    fmt: MomentFormat,
    field: str,
    src: Tensor,
    codes: Tensor,
    scales: Tensor | None,
    *,
    temp: Tensor | None = None,
    key: RoundingKey | None = None,
    start: int = 0,
    native: bool = True,
) -> None:
    """Encode ``src`` (fp32) into ``codes`` and, for int8, ``scales``, on this thread.

    The chunk must start on a block boundary of its field. ``temp`` is fp32
    scratch of ``src``'s size; it may be ``src`` itself when ``src`` is no
    longer needed (it is then overwritten). ``start`` is the chunk's element
    offset in the field (stochastic rounding keys by ``key.offset + start``).
    ``native=False`` keeps int8 nearest in torch ops even where the compiled
    kernel (:mod:`tierstore._compute.native`) is available; the bytes are the same.
    Arguments are not checked: :func:`encode` is the checked entry point.
    """
    if fmt.exact:
        codes.copy_(src)
    elif fmt.code_itemsize == 2:
        if fmt.rounding == "nearest":
            _encode_bf16_nearest(src, codes)
        else:
            _encode_bf16_sr(src, codes.view(torch.int16), key, field, key.offset + start)
    elif fmt.rounding == "nearest":
        k = _native_kernel(fmt) if native else None
        if k is not None:
            tables = _tables(_map_kind(fmt, field))
            k.int8_encode(src, codes, scales, fmt.block_numel, field in _SIGNED_FIELDS, tables.nearest)
        else:
            _encode_int8_nearest(fmt, field, src, codes, scales, temp)
    else:
        _encode_int8_sr(fmt, field, src, codes, scales, key, key.offset + start)


def decode_chunk(
    fmt: MomentFormat,
    field: str,
    codes: Tensor,
    scales: Tensor | None,
    out: Tensor,
    *,
    temp: Tensor | None = None,
    native: bool = True,
) -> None:
    """Decode ``codes`` (and ``scales``) into the fp32 ``out``, on this thread.

    The chunk must start on a block boundary of its field; ``temp`` is scratch
    of ``out``'s size (any 4-byte dtype). ``native`` as in :func:`encode_chunk`.
    """
    if fmt.code_itemsize != 1:
        out.copy_(codes)
        return
    k = _native_kernel(fmt) if native else None
    if k is not None:
        k.int8_decode(codes, scales, out, fmt.block_numel, _tables(_map_kind(fmt, field)).decode.view(torch.float32))
        return
    n = out.numel()
    idx = (temp if temp is not None else _temp(n)).view(torch.int32)[:n]
    idx.copy_(codes)
    torch.index_select(_tables(_map_kind(fmt, field)).decode, 0, idx, out=out.view(torch.int32))
    _per_block(out, scales, fmt.block_numel, torch.Tensor.mul_)


def native_kernel() -> native.Kernel | None:
    """The compiled int8 codec (:mod:`tierstore._compute.native`), checked against the torch path; None where unused.

    A failed check disables the compiled int8 codec only (the fused update of
    :mod:`tierstore._compute.fused_update` checks itself, per format).

    Example
    -------
    >>> k = native_kernel()  # loaded (or built) on the first call of the process
    >>> (k is None) == (native.library() is None or native.part_status("int8 codec") != "")
    True
    """
    return native.checked("int8 codec", _native_self_check)


def _native_kernel(fmt: MomentFormat) -> native.Kernel | None:
    """The compiled int8 kernel when it applies to ``fmt`` (blocks it accepts) and could be built."""
    return native_kernel() if 0 < fmt.block_numel <= native.MAX_BLOCK else None


def _native_self_check(k: native.Kernel) -> str | None:
    """Why ``k`` does not match the torch path (None when it does), on values chosen to hit every rule."""
    gen = torch.Generator().manual_seed(0)
    n = 4 * 256 + 77  # whole blocks and a partial one
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(6)
    x[3], x[300], x[301], x[600] = float("nan"), float("inf"), -float("inf"), -0.0
    x[768:1024] = 0.0  # a zero block
    x[1024:1030] = torch.tensor([1e-42, -1e-44, 3e38, -3e38, 1e-39, 0.0])
    fmt = FORMATS["int8"]
    for field, data in (("exp_avg", x), ("exp_avg_sq", x.abs().square() * torch.sign(x + 0.4))):
        want_codes = torch.empty(n, dtype=torch.uint8)
        want_scales = torch.empty(fmt.num_blocks(n))
        encode_chunk(fmt, field, data, want_codes, want_scales, native=False)
        codes, scales = torch.empty_like(want_codes), torch.empty_like(want_scales)
        tables = _tables(_map_kind(fmt, field))
        k.int8_encode(data, codes, scales, fmt.block_numel, field in _SIGNED_FIELDS, tables.nearest)
        if not (torch.equal(codes, want_codes) and torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))):
            return f"encode of {field} differs from the torch path"
        want, got = torch.empty(n), torch.empty(n)
        decode_chunk(fmt, field, codes, scales, want, native=False)
        k.int8_decode(codes, scales, got, fmt.block_numel, tables.decode.view(torch.float32))
        if not torch.equal(want.view(torch.int32), got.view(torch.int32)):
            return f"decode of {field} differs from the torch path"
    return None


def _per_block(x: Tensor, scales: Tensor, bn: int, op) -> None:  # noqa: ANN001
    """``op(block, scale)`` on every block of ``x`` (whole blocks in one op, then the tail)."""
    n = x.numel()
    full = n // bn * bn
    if full:
        op(x[:full].view(-1, bn), scales[: full // bn, None])
    if full < n:
        op(x[full:], scales[full // bn])


def _encode_bf16_nearest(src: Tensor, codes: Tensor) -> None:
    """Round half to even (torch's conversion); NaNs become the canonical quiet NaN."""
    codes.copy_(src)
    # One cheap reduction finds NaNs (max propagates them); torch's vectorised
    # conversion writes a NaN pattern that depends on where the chunk ends.
    if bool(torch.isnan(src.amax())):
        codes.view(torch.int16).masked_fill_(torch.isnan(src), 0x7FC0)


def _encode_bf16_sr(src: Tensor, bits16: Tensor, key: RoundingKey, field: str, offset: int) -> None:
    """Stochastic rounding to bf16: add 16 random bits below the kept half, truncate."""
    for b, e in _split_high(offset, 0, src.numel()):
        x = src[b:e]
        bits = x.view(torch.int32)
        # NaNs become the canonical quiet NaN first, so the addition below cannot
        # overflow int32 (the largest remaining pattern is +inf, 0x7F800000).
        bits = torch.where(torch.isnan(x), 0x7FC00000, bits)
        r = _random_bits(key, field, offset + b, e - b).bitwise_and_(0xFFFF).to(torch.int32)
        bits16[b:e].copy_(bits.add_(r).bitwise_right_shift_(16))


def _block_scales(fmt: MomentFormat, field: str, src: Tensor, scales: Tensor) -> None:
    """Every block's scale into ``scales``: its largest finite magnitude (signed field) or
    value (non-negative fields, at least 0)."""
    signed = field in _SIGNED_FIELDS
    bn = fmt.block_numel
    n = src.numel()
    full = n // bn * bn
    nf = full // bn
    # Signed: the largest magnitude, from the largest and smallest value (no |x|
    # temporary). Non-negative fields: the largest value; a negative element then
    # maps to code 0.
    if full:
        blocks = src[:full].view(-1, bn)
        torch.amax(blocks, dim=1, out=scales[:nf])
        if signed:  # (torch.aminmax measured 40x slower than amax and amin here)
            torch.maximum(scales[:nf], torch.amin(blocks, dim=1).neg_(), out=scales[:nf])
    if full < n:
        scales[nf] = src[full:].abs().max() if signed else src[full:].max()
    if not math.isfinite(float(scales.amax())):  # amax is NaN when any is (one op, 1/5 the cost of isfinite.all)
        # Rare: blocks holding NaN/inf are scaled by their finite values.
        for i in (~torch.isfinite(scales)).nonzero().flatten().tolist():
            x = src[i * bn : (i + 1) * bn]
            if not signed:
                x = torch.clamp(x, min=0.0)
            x = torch.where(torch.isfinite(x), x, 0.0)
            scales[i] = (x.abs() if signed else x).max()
    if not signed:
        scales.clamp_(min=0.0)
    scales.abs_()  # a block of -0.0 has scale +0.0, as in the reference


def _encode_int8_nearest(
    fmt: MomentFormat, field: str, src: Tensor, codes: Tensor, scales: Tensor, temp: Tensor | None
) -> None:
    """Scales, then ``y = x / scale`` and one table lookup by ``y``'s upper 20 bits."""
    _block_scales(fmt, field, src, scales)
    n = src.numel()
    y = temp[:n] if temp is not None else _temp(n)
    # A zero block (scale 0) holds only zeros and non-finite values: any positive
    # divisor keeps them (0 / d = 0, inf / d = inf), and NaN stays NaN.
    divisor = torch.clamp(scales, min=_TINY)
    bn = fmt.block_numel
    full = n // bn * bn
    if full:
        torch.div(src[:full].view(-1, bn), divisor[: full // bn, None], out=y[:full].view(-1, bn))
    if full < n:
        torch.div(src[full:], divisor[full // bn], out=y[full:])
    idx = y.view(torch.int32)
    idx.bitwise_right_shift_(BUCKET_SHIFT).bitwise_and_(_BUCKETS - 1)
    torch.index_select(_tables(_map_kind(fmt, field)).nearest, 0, idx, out=codes)


def _encode_int8_sr(
    fmt: MomentFormat, field: str, src: Tensor, codes: Tensor, scales: Tensor, key: RoundingKey, offset: int
) -> None:
    """Stochastic rounding: the map value below ``y``, then up with probability = position in the gap."""
    signed = field in _SIGNED_FIELDS
    tables = _tables(_map_kind(fmt, field))
    _block_scales(fmt, field, src, scales)
    n = src.numel()
    t = src
    nonfinite = None
    if not bool(torch.isfinite(src).all()):
        nonfinite = ~torch.isfinite(src)
        t = torch.where(nonfinite, 0.0, src)
    if not signed:
        t = torch.clamp(t, min=0.0)
    y = torch.empty(n)
    _per_block(y, torch.where(scales > 0, scales, 1.0), fmt.block_numel, lambda a, s: a.copy_(s))
    torch.div(t, y, out=y)
    bucket = y.view(torch.uint16)[_HIGH_HALF::2].to(torch.int32)  # the upper 16 bits
    c = torch.index_select(tables.floor_start, 0, bucket)
    c += torch.ge(y, torch.index_select(tables.floor_next, 0, c).view(torch.float32))
    frac = y.sub_(torch.index_select(tables.floor_value, 0, c).view(torch.float32)).mul_(
        torch.index_select(tables.floor_inv_gap, 0, c).view(torch.float32)
    )
    bits = [_random_bits(key, field, offset + b, e - b) for b, e in _split_high(offset, 0, n)]
    u = (bits[0] if len(bits) == 1 else torch.cat(bits)).bitwise_right_shift_(8).to(torch.float32)
    c += torch.lt(u.mul_(2.0**-24), frac)
    if nonfinite is not None:
        c.masked_fill_(nonfinite, NONFINITE_CODE)
    codes.copy_(c)


# -- public entry points ---------------------------------------------------------------


def _chunks(fmt: MomentFormat, numel: int) -> list[tuple[int, int]]:
    return [(b, min(b + CHUNK_NUMEL, numel)) for b in range(0, numel, CHUNK_NUMEL)]


def _scales_of(fmt: MomentFormat, scales: Tensor | None, begin: int, end: int) -> Tensor | None:
    if scales is None:
        return None
    bn = fmt.block_numel
    return scales[begin // bn : -(-end // bn)]


def encode(
    fmt: MomentFormat | str,
    field: str,
    src: Tensor,
    out: Tensor,
    *,
    key: RoundingKey | None = None,
    threads: int | None = None,
    impl: str = "fast",
) -> None:
    """Narrow the fp32 moment ``src`` into the encoded bytes ``out`` (``src`` is not changed).

    Parameters
    ----------
    fmt
        The format (a name or a :class:`MomentFormat`).
    field
        ``"exp_avg"`` (signed) or ``"exp_avg_sq"`` / ``"max_exp_avg_sq"`` (non-negative).
    src
        Contiguous 1-D float32 CPU tensor.
    out
        Contiguous 1-D uint8 tensor of at least ``fmt.encoded_nbytes(src.numel())`` bytes.
    key
        Required when ``fmt.rounding == "stochastic"``; ignored otherwise.
    threads
        Worker threads of the fast path (default ``torch.get_num_threads()``);
        never changes the bytes.
    impl
        ``"fast"`` (the compiled int8 kernel where available, else torch ops),
        ``"torch"`` (torch ops only) or ``"reference"`` (the plain NumPy oracle);
        all three give the same bytes.

    Raises
    ------
    ConfigError
        On a bad buffer, field, format, ``impl``, ``threads`` or a missing ``key``.

    Example
    -------
    >>> out = torch.empty(8, dtype=torch.uint8)
    >>> encode("bfloat16", "exp_avg", torch.tensor([1.0, -2.0, 0.5, 3.0]), out)
    >>> out.view(torch.bfloat16).tolist()
    [1.0, -2.0, 0.5, 3.0]
    """
    fmt = moment_format(fmt)
    _check_field(field)
    numel = _check_buffers(fmt, src, out, "encode")
    _check_impl(impl)
    threads = check_threads(torch.get_num_threads() if threads is None else threads)
    if fmt.rounding == "stochastic" and key is None:
        raise ConfigError(f"format {fmt.name!r} rounds stochastically; pass key=RoundingKey(seed, step, offset)")
    if impl == "reference":
        from_numpy = _reference_encode(fmt, field, src.numpy(), key)
        out[: from_numpy.size].copy_(torch.from_numpy(from_numpy))
        return
    codes, scales = split(fmt, out, numel)

    def work(_worker: int, chunk: tuple[int, int]) -> None:
        b, e = chunk
        encode_chunk(
            fmt, field, src[b:e], codes[b:e], _scales_of(fmt, scales, b, e), key=key, start=b, native=impl == "fast"
        )

    run_each(_chunks(fmt, numel), work, threads=threads)


def decode(
    fmt: MomentFormat | str,
    field: str,
    src: Tensor,
    out: Tensor,
    *,
    threads: int | None = None,
    impl: str = "fast",
) -> None:
    """Widen the encoded bytes ``src`` into the fp32 buffer ``out`` (its length is the element count).

    Raises
    ------
    ConfigError
        On a bad buffer, field, format, ``impl`` or ``threads``.

    Example
    -------
    >>> enc = torch.tensor([1.5, -0.25]).view(torch.uint8)
    >>> out = torch.empty(2)
    >>> decode("float32", "exp_avg", enc, out)
    >>> out.tolist()
    [1.5, -0.25]
    """
    fmt = moment_format(fmt)
    _check_field(field)
    numel = _check_buffers(fmt, out, src, "decode")
    _check_impl(impl)
    threads = check_threads(torch.get_num_threads() if threads is None else threads)
    if impl == "reference":
        out.copy_(torch.from_numpy(_reference_decode(fmt, field, src.numpy(), numel)))
        return
    codes, scales = split(fmt, src, numel)

    def work(_worker: int, chunk: tuple[int, int]) -> None:
        b, e = chunk
        decode_chunk(fmt, field, codes[b:e], _scales_of(fmt, scales, b, e), out[b:e], native=impl == "fast")

    run_each(_chunks(fmt, numel), work, threads=threads)


# -- reference (the oracle) -------------------------------------------------------------


def _reference_encode(fmt: MomentFormat, field: str, x: np.ndarray, key: RoundingKey | None) -> np.ndarray:
    """The encoded bytes of ``x``: NumPy, block by block, written for reading, not speed."""
    n = x.size
    if fmt.exact:
        return x.astype(np.float32).view(np.uint8).copy()
    if fmt.code_itemsize == 2:
        bits = x.view(np.uint32).astype(np.uint64)
        if fmt.rounding == "nearest":  # round half to even on the upper 16 bits
            kept = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        else:
            noise = np.array([_random_bits_reference(key, field, key.offset + i) & 0xFFFF for i in range(n)], np.uint64)
            kept = (bits + noise) >> 16
        kept = np.where(np.isnan(x), 0x7FC0, kept & 0xFFFF).astype(np.uint16)
        return kept.view(np.uint8).copy()
    signed = field in _SIGNED_FIELDS
    tables = _tables(_map_kind(fmt, field))
    out = np.zeros(fmt.encoded_nbytes(n), np.uint8)
    scales = out[fmt.scales_offset(n) :].view(np.float32)
    for b in range(fmt.num_blocks(n)):
        lo, hi = b * fmt.block_numel, min((b + 1) * fmt.block_numel, n)
        t = x[lo:hi].astype(np.float32)
        finite = np.isfinite(t)
        magnitudes = np.abs(t[finite]) if signed else np.maximum(t[finite], np.float32(0))
        scale = np.float32(magnitudes.max()) if magnitudes.size else np.float32(0)
        scales[b] = scale
        with np.errstate(invalid="ignore", over="ignore"):
            y = t / scale if scale > 0 else t
        if fmt.rounding == "nearest":
            out[lo:hi] = _nearest_codes(signed, tables.boundaries, y)
            continue
        for i in range(hi - lo):  # stochastic: up with probability (y - lower value) / gap
            if not finite[i]:
                out[lo + i] = NONFINITE_CODE
                continue
            yi = y[i] if signed or y[i] >= 0 else np.float32(0)
            c = max(np.count_nonzero(tables.values <= yi) - 1, 0)
            frac = (yi - tables.values[c]) * (tables.inv_gap[c] if c < 254 else np.float32(0))
            u = np.float32(_random_bits_reference(key, field, key.offset + lo + i) >> 8) * np.float32(2.0**-24)
            out[lo + i] = c + (u < frac)
    return out


def _reference_decode(fmt: MomentFormat, field: str, enc: np.ndarray, n: int) -> np.ndarray:
    if fmt.code_itemsize == 4:
        return enc[: 4 * n].view(np.float32).copy()
    if fmt.code_itemsize == 2:
        return (enc[: 2 * n].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    values = np.append(_tables(_map_kind(fmt, field)).values, np.float32(np.nan))
    scales = enc[fmt.scales_offset(n) : fmt.scales_offset(n) + 4 * fmt.num_blocks(n)].view(np.float32)
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = values[enc[i]] * scales[i // fmt.block_numel]
    return out
