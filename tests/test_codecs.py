"""Property tests of the moment codecs (:mod:`tierstore._compute.codecs`).

What each format promises, checked here:

- ``float32``: exact, bit for bit (NaN payloads too).
- ``bfloat16``: nearest: |err| <= 2**-8 |x| for normal x, <= 2**-134 for subnormal x;
  stochastic: the result is one of the two bf16 neighbours, |err| < 2**-7 |x|
  (2**-133 subnormal), and unbiased.
- ``int8`` (blockwise, scale s = the block's largest finite magnitude):
  nearest: each element decodes to the map value nearest to x/s, up to the decision
  boundaries' rounding to the 12-bit bucket grid (a boundary moves by <= 2**-11 of
  itself), so |err| <= s * (the largest distance from a map value to a boundary next
  to it) = 0.00723 s for ``exp_avg`` and 0.00711 s for ``exp_avg_sq`` (whose map is the
  square of the unsigned map: the square root is what is quantized); stochastic: one
  of the two map values around x/s, unbiased.
- Non-finite values: float32/bfloat16 keep them; int8 decodes them as NaN, and
  neither their block's finite elements nor any other block change.
- The fast path equals the NumPy reference bitwise, for any thread count, chunking
  and (stochastic rounding) any cut of the flat index space.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._compute import codecs, formats
from tierstore._compute.formats import RoundingKey
from tierstore._compute.kernel import adamw
from tierstore.errors import ConfigError

FORMATS = ["float32", "bfloat16", "int8"]
FIELDS = ["exp_avg", "exp_avg_sq"]


def variant(name: str, rounding: str | None = None) -> formats.MomentFormat:
    fmt = formats.moment_format(name)
    if rounding and not fmt.exact:
        fmt = dataclasses.replace(fmt, name=f"{name}-{rounding}", rounding=rounding)
    return fmt


ALL_VARIANTS = [variant("float32")] + [variant(n, r) for n in ("bfloat16", "int8") for r in ("nearest", "stochastic")]
VARIANT_IDS = [f.name for f in ALL_VARIANTS]


def sample(seed: int, n: int, field: str, *, specials: bool = False, subnormal: bool = False) -> torch.Tensor:
    """Moment-like data: per-block magnitudes over many decades, zero blocks, optional specials."""
    rng = np.random.default_rng(seed)
    block_mag = 10.0 ** rng.uniform(-30, 10, size=-(-n // 256)).repeat(256)[:n]
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2) * block_mag
    if field != "exp_avg":
        x = np.abs(x)
    if n > 600:
        x[256:512] = 0.0  # a zero block
    if subnormal:
        x[: min(n, 300)] *= 1e-40 / np.maximum(np.abs(x[: min(n, 300)]).max(), 1e-300)
    x = x.astype(np.float32)
    if specials:
        idx = rng.choice(n, size=max(1, n // 100), replace=False)
        x[idx] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0], np.float32), size=idx.size)
    return torch.from_numpy(x)


def enc(fmt, field, x, *, key=None, threads=1, impl="fast"):
    out = torch.zeros(fmt.encoded_nbytes(x.numel()), dtype=torch.uint8)
    codecs.encode(fmt, field, x, out, key=key, threads=threads, impl=impl)
    return out


def dec(fmt, field, encoded, n, *, threads=1, impl="fast"):
    out = torch.empty(n)
    codecs.decode(fmt, field, encoded, out, threads=threads, impl=impl)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


KEY = RoundingKey(seed=7, step=3, offset=4096)


# -- sizes and alignment ----------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@given(pages=st.integers(1, 5000))
@settings(max_examples=40)
def test_field_nbytes_is_page_aligned_and_holds_the_encoding(name, pages):
    fmt = formats.moment_format(name)
    capacity = pages * formats.CAPACITY_MULTIPLE
    nbytes = fmt.field_nbytes(capacity)
    assert nbytes % formats.FIELD_ALIGN == 0
    assert fmt.encoded_nbytes(capacity) <= nbytes < fmt.encoded_nbytes(capacity) + formats.FIELD_ALIGN
    assert fmt.encoded_nbytes(capacity) == capacity * fmt.bytes_per_element
    codes, scales = formats.split(fmt, torch.zeros(nbytes, dtype=torch.uint8), capacity)
    assert codes.numel() == capacity
    if scales is not None:
        assert scales.numel() == capacity // formats.BLOCK_NUMEL
        assert (scales.data_ptr() - codes.data_ptr()) % 64 == 0


def test_bytes_per_element_of_each_format():
    assert [formats.moment_format(n).bytes_per_element for n in FORMATS] == [4, 2, 1 + 4 / 256]


@pytest.mark.parametrize("capacity", [0, 1000, 1025, -1024, 1024.0, True])
def test_field_nbytes_rejects_capacities_that_are_not_page_multiples(capacity):
    with pytest.raises(ConfigError, match="multiple of 1024"):
        formats.moment_format("int8").field_nbytes(capacity)


# -- fast path == reference, bitwise ------------------------------------------------------


@pytest.mark.parametrize("impl", ["fast", "torch"])  # fast: the compiled int8 kernel where it builds
@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("field", FIELDS)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000), specials=st.booleans(), subnormal=st.booleans(),
       threads=st.integers(1, 3), offset=st.sampled_from([0, 256, 10**6, 2**32 - 300, 2**40]))
@settings(max_examples=12)
def test_fast_path_equals_reference_bitwise(impl, fmt, field, seed, n, specials, subnormal, threads, offset):
    x = sample(seed, n, field, specials=specials, subnormal=subnormal)
    key = RoundingKey(seed=seed, step=seed % 1000, offset=offset)
    fast = enc(fmt, field, x, key=key, threads=threads, impl=impl)
    assert torch.equal(fast, enc(fmt, field, x, key=key, impl="reference"))
    decoded = dec(fmt, field, fast, n, threads=threads, impl=impl)
    assert torch.equal(bits(decoded), bits(dec(fmt, field, fast, n, impl="reference")))
    assert torch.equal(bits(x), bits(sample(seed, n, field, specials=specials, subnormal=subnormal))), "encode changed its input"


@pytest.mark.parametrize("fmt", ALL_VARIANTS[1:], ids=VARIANT_IDS[1:])
def test_fast_path_equals_reference_across_chunks_and_threads(fmt, monkeypatch):
    monkeypatch.setattr(codecs, "CHUNK_NUMEL", 4096)  # the reference is slow; the cut is what matters
    n = 2 * codecs.CHUNK_NUMEL + 1000  # several chunks and a partial last block
    x = sample(1, n, "exp_avg", specials=True)
    one = enc(fmt, "exp_avg", x, key=KEY, threads=1)
    assert torch.equal(one, enc(fmt, "exp_avg", x, key=KEY, threads=3))
    assert torch.equal(one, enc(fmt, "exp_avg", x, key=KEY, threads=2, impl="torch"))
    assert torch.equal(one, enc(fmt, "exp_avg", x, key=KEY, impl="reference"))


@pytest.mark.parametrize("fmt", [f for f in ALL_VARIANTS if f.rounding == "stochastic"], ids=lambda f: f.name)
@given(seed=st.integers(0, 2**31), cut_blocks=st.integers(1, 7))
@settings(max_examples=10)
def test_stochastic_rounding_does_not_depend_on_how_the_field_is_cut(fmt, seed, cut_blocks):
    """Shard size is a tuning knob: encoding two pieces at their offsets gives the whole's bytes."""
    x = sample(seed, 2048, "exp_avg_sq")
    cut = cut_blocks * 256
    whole = enc(fmt, "exp_avg_sq", x, key=RoundingKey(seed, 5, 1 << 20))
    a = enc(fmt, "exp_avg_sq", x[:cut].clone(), key=RoundingKey(seed, 5, 1 << 20))
    b = enc(fmt, "exp_avg_sq", x[cut:].clone(), key=RoundingKey(seed, 5, (1 << 20) + cut))
    for part, lo, hi in ((a, 0, cut), (b, cut, 2048)):
        codes, scales = formats.split(fmt, part, hi - lo)
        whole_codes, whole_scales = formats.split(fmt, whole, 2048)
        assert torch.equal(codes.view(torch.uint8), whole_codes[lo:hi].view(torch.uint8))
        if scales is not None:
            assert torch.equal(scales, whole_scales[lo // 256 : hi // 256])


@pytest.mark.parametrize("fmt", [f for f in ALL_VARIANTS if f.rounding == "stochastic"], ids=lambda f: f.name)
def test_stochastic_rounding_changes_with_step_seed_and_field(fmt):
    x = sample(3, 4096, "exp_avg_sq")
    base = enc(fmt, "exp_avg_sq", x, key=RoundingKey(1, 1, 0))
    assert torch.equal(base, enc(fmt, "exp_avg_sq", x, key=RoundingKey(1, 1, 0)))
    for other in (RoundingKey(2, 1, 0), RoundingKey(1, 2, 0), RoundingKey(1, 1, 256)):
        assert not torch.equal(base, enc(fmt, "exp_avg_sq", x, key=other))
    assert not torch.equal(base, enc(fmt, "max_exp_avg_sq", x, key=RoundingKey(1, 1, 0)))


# -- error bounds ----------------------------------------------------------------------------


def _block_scales(x: torch.Tensor, field: str) -> torch.Tensor:
    xb = torch.nn.functional.pad(x, (0, -x.numel() % 256)).view(-1, 256)
    return (xb.abs() if field == "exp_avg" else xb.clamp(min=0)).amax(1).repeat_interleave(256)[: x.numel()]


def _nearest_bound(fmt, field) -> float:
    """The largest distance from a positive map value to a decision boundary next to it."""
    values = formats.int8_map(fmt, field).astype(np.float64)
    positive = values[values >= 0]
    b = formats.int8_boundaries(fmt, field).astype(np.float64)
    return float(max((b - positive[:-1]).max(), (positive[1:] - b).max()))


def test_int8_nearest_bounds_are_those_the_docs_state():
    assert _nearest_bound("int8", "exp_avg") == pytest.approx(0.00723, abs=1e-5)
    assert _nearest_bound("int8", "exp_avg_sq") == pytest.approx(0.00711, abs=1e-5)
    for field in FIELDS:  # the boundaries sit on the bucket grid, within 2**-11 of the midpoints
        b = formats.int8_boundaries("int8", field)
        assert not bool(np.any(b.view(np.uint32) & 0xFFF))


@pytest.mark.parametrize("field", FIELDS)
def test_int8_nearest_table_agrees_with_the_rule_inside_every_bucket(field):
    """The fast path looks codes up by the upper 20 bits of x / s: every fp32 pattern of a
    bucket must get the code the reference rule gives it. Checked at the first, a middle and
    the last pattern of every one of the 2**20 buckets, each in a block whose scale is 1."""
    fmt = formats.moment_format("int8")
    first = np.arange(1 << 20, dtype=np.uint32) << 12
    boundaries = formats.int8_boundaries(fmt, field)
    for low in (0, 0x7FF, 0xFFF):
        y = (first | low).view(np.float32)
        with np.errstate(invalid="ignore"):
            y = np.where(np.abs(y) > 1, np.float32(0.5), y)  # x / s never exceeds 1 in magnitude
        y = np.concatenate([y, np.zeros(-y.size % 255, np.float32)]).reshape(-1, 255)
        x = torch.from_numpy(np.concatenate([y, np.ones((y.shape[0], 1), np.float32)], axis=1).reshape(-1))
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        scales = torch.empty(x.numel() // 256)
        codecs.encode_chunk(fmt, field, x, codes, scales)
        assert bool((scales == 1).all())
        ref = formats.nearest_codes(field == "exp_avg", boundaries, x.numpy())
        assert torch.equal(codes, torch.from_numpy(ref))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("field", FIELDS)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000), subnormal=st.booleans())
@settings(max_examples=15)
def test_int8_round_trip_error_per_block(rounding, field, seed, n, subnormal):
    fmt = variant("int8", rounding)
    x = sample(seed, n, field, subnormal=subnormal)
    e = enc(fmt, field, x, key=KEY)
    y = dec(fmt, field, e, n)
    values = formats.int8_map(fmt, field).astype(np.float64)
    gap = float(np.diff(values).max())
    s = _block_scales(x, field).double()
    err = (y.double() - x.double()).abs()
    bound = s * (_nearest_bound(fmt, field) if rounding == "nearest" else gap) * (1 + 2**-20) + 2**-148
    assert bool((err <= bound).all()), float((err - bound).max())
    # the code is the map value nearest to x/s (nearest) or one of the two around it (stochastic)
    codes, scales = formats.split(fmt, e, n)
    stored = scales.repeat_interleave(256)[:n]
    assert torch.equal(stored, _block_scales(x, field))
    ratio = (x / torch.where(stored > 0, stored, 1)).double().numpy()
    # exp_avg_sq: the map is the square of the unsigned map; "nearest" is measured on sqrt(v)
    near = np.sqrt if field != "exp_avg" and fmt.sqrt_second else (lambda a: a)
    distance = np.abs(near(np.maximum(ratio, 0) if field != "exp_avg" else ratio)[:, None] - near(values)[None, :])
    chosen = distance[np.arange(n), codes.long().numpy()]
    if rounding == "nearest":  # a boundary moved by <= 2**-11 of itself: the choice by at most twice that
        assert np.all(chosen <= distance.min(1) * (1 + 1e-6) + 2**-10 * np.abs(near(np.abs(ratio))) + 1e-12)
    else:
        lower = np.maximum((values[None, :] <= ratio[:, None]).sum(1) - 1, 0)
        c = codes.long().numpy()
        assert np.all((c == lower) | (c == lower + 1))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@given(seed=st.integers(0, 2**32 - 1), subnormal=st.booleans())
@settings(max_examples=15)
def test_bfloat16_round_trip_error(rounding, seed, subnormal):
    fmt = variant("bfloat16", rounding)
    x = sample(seed, 1500, "exp_avg", subnormal=subnormal)
    x = x.clamp(-3e38, 3e38)  # above that nearest rounding overflows to inf, as it should
    y = dec(fmt, "exp_avg", enc(fmt, "exp_avg", x, key=KEY), x.numel())
    err = (y.double() - x.double()).abs()
    rel, floor = (2**-8, 2**-134) if rounding == "nearest" else (2**-7, 2**-133)
    assert bool((err <= torch.maximum(x.double().abs() * rel, torch.full_like(err, floor))).all())
    if rounding == "stochastic":  # one of the two bf16 neighbours: truncation, or truncation + 1 ulp
        down = (bits(x) & ~0xFFFF).view(torch.float32)
        up = (bits(down) + 0x10000).view(torch.float32)
        assert bool(((y == down) | (y == up)).all())


@pytest.mark.parametrize("fmt", [f for f in ALL_VARIANTS if f.rounding == "stochastic"], ids=lambda f: f.name)
@pytest.mark.parametrize("field", FIELDS)
def test_stochastic_rounding_is_unbiased(fmt, field):
    x = sample(11, 2048, field).clamp(-1e30, 1e30)
    x[0] = 1.0 if field == "exp_avg" else 1.0  # a known scale, and values between map points
    x[1:256] = torch.linspace(0.001, 0.999, 255) * (1 if field != "exp_avg" else -1)
    total = torch.zeros(2048, dtype=torch.float64)
    trials = 400
    for step in range(trials):
        total += dec(fmt, field, enc(fmt, field, x, key=RoundingKey(5, step, 0)), 2048).double()
    mean = total / trials
    s = _block_scales(x, field).double()
    # the rounding error of one draw is at most one gap (<= 0.0141 s); its mean over 400 draws
    # shrinks like 1/sqrt(400): 6 standard errors of a two-point variable
    tolerance = (0.0141 if fmt.code_itemsize == 1 else 2**-7) * 6 / trials**0.5
    scale = s if fmt.code_itemsize == 1 else x.double().abs()
    assert bool(((mean - x.double()).abs() <= tolerance * scale + 1e-300).all())


# -- zeros, denormals, non-finite values ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("field", FIELDS)
def test_zeros_round_trip_and_zero_filled_bytes_decode_to_zeros(fmt, field):
    """A fresh, zero-filled field is a valid encoding of zero moments in every format."""
    x = torch.zeros(3000)
    e = enc(fmt, field, x, key=KEY)
    assert torch.equal(bits(dec(fmt, field, e, 3000)), bits(x))
    if fmt.code_itemsize == 1:
        assert not bool(formats.split(fmt, e, 3000)[1].any()), "zero blocks have zero scales"
    else:
        assert not bool(e.any())
    from_zero_bytes = dec(fmt, field, torch.zeros_like(e), 3000)
    assert bool((from_zero_bytes == 0).all())  # int8 exp_avg: code 0 is -1, times scale 0: -0.0


@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
def test_negative_zero(fmt):
    x = torch.full((512,), -0.0)
    e = enc(fmt, "exp_avg", x, key=KEY)
    assert torch.equal(e, enc(fmt, "exp_avg", x, key=KEY, impl="reference"))
    y = dec(fmt, "exp_avg", e, 512)
    assert bool((y == 0).all())
    # float32 and bfloat16 keep the sign; int8 has one zero code (+0.0)
    assert bool(torch.signbit(y).all()) == (fmt.code_itemsize > 1)


@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("field", FIELDS)
def test_denormal_blocks_keep_their_scale(fmt, field):
    x = sample(4, 1024, field, subnormal=True)[:256].clone()
    assert bool((x.abs() < 1.2e-38).all()) and bool((x != 0).any())
    y = dec(fmt, field, enc(fmt, field, x, key=KEY), 256)
    if fmt.code_itemsize == 1:
        assert float(y.abs().max()) == float(x.abs().max())  # the block scale is exact
    else:
        assert bool(((y - x).abs() <= 2**-133).all())


@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("field", FIELDS)
@given(seed=st.integers(0, 2**32 - 1), special=st.sampled_from([np.nan, np.inf, -np.inf]),
       block=st.integers(0, 7), pos=st.integers(0, 255))
@settings(max_examples=8)
def test_non_finite_value_never_touches_another_block(fmt, field, seed, special, block, pos):
    n = 2048
    x = sample(seed, n, field)
    i = block * 256 + pos
    bad = x.clone()
    bad[i] = float(special)
    clean, dirty = enc(fmt, field, x, key=KEY), enc(fmt, field, bad, key=KEY)
    yc, yd = dec(fmt, field, clean, n), dec(fmt, field, dirty, n)
    others = torch.ones(n, dtype=torch.bool)
    others[block * 256 : (block + 1) * 256] = False
    assert torch.equal(bits(yc)[others], bits(yd)[others])
    if fmt.code_itemsize > 1:  # float32 and bfloat16 keep the value
        assert bool(yd[i].isnan()) if np.isnan(special) else float(yd[i]) == special
    else:
        assert bool(yd[i].isnan())  # int8: NaN, the block's finite values stay within the bound
        mine = torch.zeros(n, dtype=torch.bool)
        mine[block * 256 : (block + 1) * 256] = True
        mine[i] = False
        finite = x[mine]
        s = float((finite.abs() if field == "exp_avg" else finite.clamp(min=0)).max())
        assert bool(((yd[mine] - finite).abs() <= s * 0.0141 + 2**-148).all())


# -- idempotence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [f for f in ALL_VARIANTS if f.name != "int8-stochastic"], ids=lambda f: f.name)
@pytest.mark.parametrize("field", FIELDS)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2000))
@settings(max_examples=12)
def test_decode_encode_is_idempotent(fmt, field, seed, n):
    """decode(encode(decode(encode(x)))) == decode(encode(x)): a state written, read and written
    again does not drift. (int8 with stochastic rounding may move an element by one code with
    probability ~1e-7: x/s of a decoded value is a map value only up to one fp32 rounding.)"""
    x = sample(seed, n, field, specials=True)
    once = dec(fmt, field, enc(fmt, field, x, key=KEY), n)
    twice = dec(fmt, field, enc(fmt, field, once, key=RoundingKey(1, 99, 0)), n)
    assert torch.equal(bits(once), bits(twice))


# -- one math: decode -> AdamW -> encode ------------------------------------------------------------


def _one_step(fmt, encoded_m, encoded_v, param, grad, *, codec_impl, kernel_impl, key):
    n = param.numel()
    m, v = dec(fmt, "exp_avg", encoded_m, n, impl=codec_impl), dec(fmt, "exp_avg_sq", encoded_v, n, impl=codec_impl)
    p = param.clone()
    adamw([p], [grad], [m], [v], [], [torch.tensor(4.0)], lr=1e-3, beta1=0.9, beta2=0.999,
          weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, impl=kernel_impl)
    return p, enc(fmt, "exp_avg", m, key=key, impl=codec_impl), enc(fmt, "exp_avg_sq", v, key=key, impl=codec_impl)


@pytest.mark.parametrize("fmt", ALL_VARIANTS, ids=VARIANT_IDS)
@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=6)
def test_one_math_fast_codecs_equal_reference_codecs_around_the_fused_kernel(fmt, seed):
    """Same encoded state and gradient: fast codecs + fused kernel give the same parameter and
    encoded bytes as reference codecs + fused kernel, bit for bit; with the reference kernel
    (whose rounding differs from the fused one) they agree within the codec's bound."""
    n = 1500
    gen = torch.Generator().manual_seed(seed)
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m0 = torch.randn(n, generator=gen) * 1e-3
    v0 = torch.rand(n, generator=gen) * 1e-5
    em, ev = enc(fmt, "exp_avg", m0, key=KEY), enc(fmt, "exp_avg_sq", v0, key=KEY)
    key = RoundingKey(seed, 5, 0)
    fast = _one_step(fmt, em, ev, param, grad, codec_impl="fast", kernel_impl="fused", key=key)
    ref = _one_step(fmt, em, ev, param, grad, codec_impl="reference", kernel_impl="fused", key=key)
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    oracle = _one_step(fmt, em, ev, param, grad, codec_impl="reference", kernel_impl="reference", key=key)
    torch.testing.assert_close(fast[0], oracle[0], rtol=1e-6, atol=1e-6)
    for field, a, b in (("exp_avg", fast[1], oracle[1]), ("exp_avg_sq", fast[2], oracle[2])):
        ya, yb = dec(fmt, field, a, n), dec(fmt, field, b, n)
        s = _block_scales(ya, field)
        tol = {4: 1e-6 * ya.abs(), 2: 2**-7 * ya.abs(), 1: 0.0141 * s}[fmt.code_itemsize] + 1e-30
        assert bool(((ya - yb).abs() <= tol).all())


# -- argument errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: formats.moment_format("fp8"), "moment_dtype='fp8' is unknown"),
        (lambda: codecs.encode("int8", "master", torch.zeros(4), torch.zeros(64, dtype=torch.uint8)), "not a moment field"),
        (lambda: codecs.encode("int8", "exp_avg", torch.zeros(4, dtype=torch.float64), torch.zeros(64, dtype=torch.uint8)), "float32"),
        (lambda: codecs.encode("int8", "exp_avg", torch.zeros(1024), torch.zeros(1024, dtype=torch.uint8)), "at least 1040 bytes"),
        (lambda: codecs.encode(variant("bfloat16", "stochastic"), "exp_avg", torch.zeros(4), torch.zeros(8, dtype=torch.uint8)), "key=RoundingKey"),
        (lambda: codecs.encode("float32", "exp_avg", torch.zeros(4), torch.zeros(16, dtype=torch.uint8), impl="slow"), "impl='slow'"),
        (lambda: codecs.decode("int8", "exp_avg", torch.zeros(128, dtype=torch.uint8), torch.zeros(4), threads=0), "threads=0"),
    ],
)
def test_bad_arguments_raise_config_error(call, match):
    with pytest.raises(ConfigError, match=match):
        call()
