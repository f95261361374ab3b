"""Moment codecs: narrow an fp32 moment into its stored bytes and widen it back.

What the bytes mean (the formats, their sizes, the int8 maps, the rounding
rules) is :mod:`tierstore._compute.formats`; this module converts. The update
always runs in fp32 (one math): :func:`decode` widens a field into an fp32
scratch buffer, the fused AdamW kernel updates it, :func:`encode` narrows it
back; for ``float32`` both are copies (and the optimizer calls neither).

Three paths (``impl``) give the same bytes. ``"reference"`` is the plain
NumPy oracle (:mod:`tierstore._compute.reference_codecs`), which the others
match bitwise. ``"torch"`` runs a few torch ops on cache-sized chunks of
:data:`CHUNK_NUMEL` elements, on single-threaded workers
(:mod:`tierstore._platform.workers`). ``"fast"`` (the default) is the torch
path, except that for int8 nearest it calls a small compiled kernel where one
could be built (:mod:`tierstore._compute.native`: the same bytes, 2-3x
faster). :func:`encode_chunk` and :func:`decode_chunk` are one chunk's work,
for callers that run their own chunks (the optimizer's update).

Example
-------
>>> import torch
>>> from tierstore._compute.formats import moment_format
>>> fmt = moment_format("int8")
>>> x = torch.linspace(-1, 1, 1024)
>>> enc = torch.empty(fmt.encoded_nbytes(1024), dtype=torch.uint8)
>>> encode(fmt, "exp_avg", x, enc)
>>> y = torch.empty(1024)
>>> decode(fmt, "exp_avg", enc, y)
>>> bool((y - x).abs().max() <= 0.0073)
True
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import torch
from torch import Tensor

from .._platform.workers import check_threads, run_each
from ..errors import ConfigError
from . import native
from .formats import (
    BUCKET_SHIFT,
    BUCKETS,
    FORMATS,
    MASK32,
    NONFINITE_CODE,
    SIGNED_FIELDS,
    MomentFormat,
    RoundingKey,
    check_field,
    chunk_key,
    int8_tables,
    map_kind,
    moment_format,
    split,
)
from .reference_codecs import reference_decode, reference_encode

__all__ = ["CHUNK_NUMEL", "IMPLS", "decode", "decode_chunk", "encode", "encode_chunk", "native_kernel"]

IMPLS = ("fast", "torch", "reference")  # the codec paths; every one gives the same bytes
# Elements per chunk of the fast path: several torch ops run on a chunk while it is in
# the CPU cache. Measured on the dev machine (2 cores, one thread): int8 encode ran at
# 540 M elements/s in chunks of 64 Ki, 820 M/s in 256 Ki, 610 M/s in 1 Mi (op overhead
# below, cache misses above).
CHUNK_NUMEL = 1 << 18
_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of an fp32 holds its upper bits
_TINY = float(np.float32(1e-45))  # the smallest positive fp32 (a subnormal): divisor of a zero block


# -- stochastic-rounding bits (the fast path's; formats.random_bits_reference defines them) --


def _random_bits(key: RoundingKey, field: str, start: int, numel: int) -> Tensor:
    """:func:`~tierstore._compute.formats.random_bits_reference` for flat indices ``start .. start+numel-1`` (int64 tensor).

    The flat indices of one call share their upper 32 bits (the caller splits there).
    """
    x = torch.arange(numel, dtype=torch.int64) + ((start & MASK32) + chunk_key(key, field, start >> 32))
    x.bitwise_and_(MASK32)
    # int64 arithmetic on values < 2**32 times constants < 2**31: no overflow anywhere.
    x.bitwise_xor_(x >> 16).mul_(0x21F0AAAD).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15).mul_(0x735A2D97).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def _split_high(offset: int, begin: int, end: int) -> list[tuple[int, int]]:
    """``[begin, end)`` cut where the flat index ``offset + i`` crosses a multiple of 2**32."""
    cut = ((offset + begin) >> 32) + 1 << 32
    if offset + end <= cut:
        return [(begin, end)]
    return [(begin, cut - offset), (cut - offset, end)]


# -- argument checks -----------------------------------------------------------------


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
            tables = int8_tables(map_kind(fmt, field))
            k.int8_encode(src, codes, scales, fmt.block_numel, field in SIGNED_FIELDS, tables.nearest)
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
        k.int8_decode(codes, scales, out, fmt.block_numel, int8_tables(map_kind(fmt, field)).decode.view(torch.float32))
        return
    n = out.numel()
    idx = (temp if temp is not None else _temp(n)).view(torch.int32)[:n]
    idx.copy_(codes)
    torch.index_select(int8_tables(map_kind(fmt, field)).decode, 0, idx, out=out.view(torch.int32))
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
        tables = int8_tables(map_kind(fmt, field))
        k.int8_encode(data, codes, scales, fmt.block_numel, field in SIGNED_FIELDS, tables.nearest)
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
    signed = field in SIGNED_FIELDS
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
    idx.bitwise_right_shift_(BUCKET_SHIFT).bitwise_and_(BUCKETS - 1)
    torch.index_select(int8_tables(map_kind(fmt, field)).nearest, 0, idx, out=codes)


def _encode_int8_sr(
    fmt: MomentFormat, field: str, src: Tensor, codes: Tensor, scales: Tensor, key: RoundingKey, offset: int
) -> None:
    """Stochastic rounding: the map value below ``y``, then up with probability = position in the gap."""
    signed = field in SIGNED_FIELDS
    tables = int8_tables(map_kind(fmt, field))
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
    check_field(field)
    numel = _check_buffers(fmt, src, out, "encode")
    _check_impl(impl)
    threads = check_threads(torch.get_num_threads() if threads is None else threads)
    if fmt.rounding == "stochastic" and key is None:
        raise ConfigError(f"format {fmt.name!r} rounds stochastically; pass key=RoundingKey(seed, step, offset)")
    if impl == "reference":
        from_numpy = reference_encode(fmt, field, src.numpy(), key)
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
    check_field(field)
    numel = _check_buffers(fmt, out, src, "decode")
    _check_impl(impl)
    threads = check_threads(torch.get_num_threads() if threads is None else threads)
    if impl == "reference":
        out.copy_(torch.from_numpy(reference_decode(fmt, field, src.numpy(), numel)))
        return
    codes, scales = split(fmt, src, numel)

    def work(_worker: int, chunk: tuple[int, int]) -> None:
        b, e = chunk
        decode_chunk(fmt, field, codes[b:e], _scales_of(fmt, scales, b, e), out[b:e], native=impl == "fast")

    run_each(_chunks(fmt, numel), work, threads=threads)

