"""The reference moment codecs: the plain NumPy oracle the fast codecs must match bit for bit.

Written for reading, not speed: one element or one block at a time, straight
from the rules of :mod:`tierstore._compute.formats` (nearest rounding by the
decision boundaries, stochastic rounding by
:func:`~tierstore._compute.formats.random_bits_reference`). The codecs run it
as ``impl="reference"`` (:func:`tierstore._compute.codecs.encode`), the tests
and :class:`~tierstore.testing.formats.FormatOracle` through them.

Example
-------
>>> import numpy as np
>>> from tierstore._compute.formats import moment_format
>>> fmt = moment_format("bfloat16")
>>> enc = reference_encode(fmt, "exp_avg", np.array([1.0, -2.5, 3.0e-3], np.float32), None)
>>> enc.size, reference_decode(fmt, "exp_avg", enc, 3).tolist()
(6, [1.0, -2.5, 0.0030059814453125])
"""

from __future__ import annotations

import numpy as np

from .formats import (
    NONFINITE_CODE,
    SIGNED_FIELDS,
    MomentFormat,
    RoundingKey,
    int8_tables,
    map_kind,
    nearest_codes,
    random_bits_reference,
)

__all__ = ["reference_decode", "reference_encode"]


def reference_encode(fmt: MomentFormat, field: str, x: np.ndarray, key: RoundingKey | None) -> np.ndarray:
    """The encoded bytes of ``x``: NumPy, block by block, written for reading, not speed."""
    n = x.size
    if fmt.exact:
        return x.astype(np.float32).view(np.uint8).copy()
    if fmt.code_itemsize == 2:
        bits = x.view(np.uint32).astype(np.uint64)
        if fmt.rounding == "nearest":  # round half to even on the upper 16 bits
            kept = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        else:
            noise = np.array([random_bits_reference(key, field, key.offset + i) & 0xFFFF for i in range(n)], np.uint64)
            kept = (bits + noise) >> 16
        kept = np.where(np.isnan(x), 0x7FC0, kept & 0xFFFF).astype(np.uint16)
        return kept.view(np.uint8).copy()
    signed = field in SIGNED_FIELDS
    tables = int8_tables(map_kind(fmt, field))
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
            out[lo:hi] = nearest_codes(signed, tables.boundaries, y)
            continue
        for i in range(hi - lo):  # stochastic: up with probability (y - lower value) / gap
            if not finite[i]:
                out[lo + i] = NONFINITE_CODE
                continue
            yi = y[i] if signed or y[i] >= 0 else np.float32(0)
            c = max(np.count_nonzero(tables.values <= yi) - 1, 0)
            frac = (yi - tables.values[c]) * (tables.inv_gap[c] if c < 254 else np.float32(0))
            u = np.float32(random_bits_reference(key, field, key.offset + lo + i) >> 8) * np.float32(2.0**-24)
            out[lo + i] = c + (u < frac)
    return out


def reference_decode(fmt: MomentFormat, field: str, enc: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` fp32 values the encoded bytes ``enc`` stand for: NumPy, element by element."""
    if fmt.code_itemsize == 4:
        return enc[: 4 * n].view(np.float32).copy()
    if fmt.code_itemsize == 2:
        return (enc[: 2 * n].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    values = np.append(int8_tables(map_kind(fmt, field)).values, np.float32(np.nan))
    scales = enc[fmt.scales_offset(n) : fmt.scales_offset(n) + 4 * fmt.num_blocks(n)].view(np.float32)
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = values[enc[i]] * scales[i // fmt.block_numel]
    return out
