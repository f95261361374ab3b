"""The fused compressed update (:mod:`tierstore._compute.fused_update`): the torch path's bytes, or not used at all.

The kernel runs decode -> AdamW -> encode per block in C; every test here
holds it to decode -> ``torch._fused_adamw_`` -> encode, bit for bit, or
checks that a kernel which differs is refused and the torch path runs.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import TieredAdamW
from tierstore._compute import codecs, formats, fused_update, native
from tierstore._compute.hyper import GroupHyper
from tierstore._platform import torch_private
from tierstore.errors import ParamsChangedError
from tierstore.testing.formats import FormatOracle

HAVE_CC = native._compiler() is not None


def _need_fused():
    k = fused_update.kernel()
    if k is None:
        pytest.skip(f"no fused kernel here: {fused_update.status()}")
    return k


hypers = st.builds(
    GroupHyper,
    lr=st.sampled_from([0.0, 1e-4, 1e-3, 0.1, 1.0]),
    beta1=st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99]),
    beta2=st.sampled_from([0.0, 0.5, 0.95, 0.999]),
    weight_decay=st.sampled_from([0.0, 1e-2, 0.5]),
    eps=st.sampled_from([0.0, 1e-8, 1e-3]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
)


@given(
    fmt=st.sampled_from(["bfloat16", "int8"]),
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    gaps=st.lists(st.sampled_from([0, 64, 256, 300]), min_size=6, max_size=6),
    hyper=st.lists(hypers, min_size=6, max_size=6),
    steps=st.lists(st.integers(1, 20000), min_size=6, max_size=6),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    bf16_grads=st.lists(st.booleans(), min_size=6, max_size=6),
    bf16_params=st.lists(st.booleans(), min_size=6, max_size=6),
)
@settings(max_examples=80, deadline=None)
def test_the_kernel_equals_decode_torch_fused_adamw_encode(fmt, lengths, gaps, hyper, steps, rounds, seed, bf16_grads,
                                                            bf16_params):
    """fp32 or bfloat16 gradients and parameters per piece: the torch path widens bfloat16 gradients
    into fp32 and gives a bfloat16 parameter ``param.copy_(master)``."""
    k = _need_fused()
    fmt = formats.FORMATS[fmt]
    layout, at = [], 0
    for numel, gap in zip(lengths, gaps):
        at += gap
        layout.append((at, numel))
        at += numel
    n = at + 37  # a partial last block, never touched
    gen = torch.Generator().manual_seed(seed)
    stored = [formats.split(fmt, torch.zeros(fmt.encoded_nbytes(n), dtype=torch.uint8), n) for _ in formats.FIELDS]
    reference = [(c.clone(), None if s is None else s.clone()) for c, s in stored]
    target = torch.randn(n, generator=gen)
    expected = target.clone()
    for r in range(rounds):
        grads = [torch.randn(numel, generator=gen) * 10.0 ** float(-((i + r) % 6)) for i, (_, numel) in enumerate(layout)]
        grads = [g.to(torch.bfloat16) if half else g for g, half in zip(grads, bf16_grads)]
        hs = hyper[: len(layout)]
        st_ = [torch.tensor(float(s + r)) for s in steps[: len(layout)]]
        out, out16 = torch.full((n,), 7.0), torch.full((n,), 7.0, dtype=torch.bfloat16)
        pieces = []
        for (start, numel), g, h, s, half in zip(layout, grads, hs, st_, bf16_params):
            half = half and fused_update.bf16_param_flags() is not None
            dtypes = (fused_update.GRAD_BF16 if g.dtype == torch.bfloat16 else 0) | (
                fused_update.bf16_param_flags() if half else 0)
            dest = out16.data_ptr() + 2 * start if half else out.data_ptr() + 4 * start
            pieces.append(fused_update.Piece(start, numel, target.data_ptr() + 4 * start, g.data_ptr(), dest,
                                             fused_update.constants(h, float(s)), dtypes))  # fmt: skip
        fused_update.update_chunk(k, fmt, stored, 0, n, pieces)
        fused_update._reference(fmt, reference, n, layout, hs, st_, [g.float() for g in grads],
                                [expected[s : s + c] for s, c in layout])  # fmt: skip
        assert torch.equal(target.view(torch.int32), expected.view(torch.int32)), f"round {r}: masters differ"
        # The whole output buffers: each piece's values, and nothing written between or past them.
        want, want16 = torch.full((n,), 7.0), torch.full((n,), 7.0, dtype=torch.bfloat16)
        for (start, numel), half in zip(layout, bf16_params):
            new = target[start : start + numel]
            if half and fused_update.bf16_param_flags() is not None:
                want16[start : start + numel] = new.to(torch.bfloat16)
            else:
                want[start : start + numel] = new
        assert torch.equal(out16.view(torch.int16), want16.view(torch.int16)), "bf16 param_out"
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), "fp32 param_out"
        for (c, s), (rc, rs) in zip(stored, reference):
            assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)), f"round {r}: codes differ"
            assert s is None or torch.equal(s.view(torch.int32), rs.view(torch.int32)), f"round {r}: scales differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_tiered_adamw_runs_the_fused_kernel_and_equals_the_oracle(fmt, dtype, monkeypatch):
    _need_fused()
    calls = []
    real = fused_update.update_chunk
    monkeypatch.setattr(fused_update, "update_chunk", lambda *a: (calls.append(a[5]), real(*a)))
    gen = torch.Generator().manual_seed(11)
    shapes = [(300, 70), (1001,), (5,), (64, 64)]
    mine = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05, "betas": (0.4, 0.9), "maximize": True}]  # noqa: E731
    with TieredAdamW(groups(mine), lr=1e-2, weight_decay=0.1, amsgrad=True, moment_dtype=fmt) as opt:
        oracle = FormatOracle(groups(ref), lr=1e-2, weight_decay=0.1, amsgrad=True, moment_dtype=fmt)
        for _ in range(4):
            for a, b in zip(mine, ref):
                g = torch.randn(a.shape, generator=gen).to(dtype)
                a.grad, b.grad = g.clone(), g.clone()
            opt.step()
            oracle.step()
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(mine, ref))
    assert calls, "the step did not go through the fused kernel"
    if dtype == torch.bfloat16:  # the kernel read the bfloat16 gradients and wrote the parameters itself
        want = fused_update.GRAD_BF16 | (fused_update.bf16_param_flags() or 0)
        assert all(p.dtypes == want for pieces in calls for p in pieces)


def test_inside_suspended_the_torch_path_runs():
    with native.suspended():
        assert fused_update.kernel() is None
        assert fused_update.status().startswith("torch path")


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_the_self_check_passes_on_this_torch_build(fresh):
    if native.library() is None:
        pytest.skip(native.status())
    assert fused_update.kernel() is not None, fused_update.status()
    assert fused_update.status() == "fused kernel"
    assert fused_update.kernel("int8").recipe.name == torch_private.cpu_capability()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_a_mismatch_in_one_format_disables_that_format_only(fresh, monkeypatch, caplog):
    # The fused update's int8 decode reads every scale doubled: int8 must fall back, bfloat16 not.
    good = b"decode_block((const uint8_t *)f->codes + b, f->scales[k], len, f->values, out);"
    broken = native._source().replace(good, good.replace(b"f->scales[k]", b"f->scales[k] * 2.0f"))
    assert broken != native._source()
    monkeypatch.setattr(native, "_source", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="tierstore._compute.fused_update"):
        assert fused_update.kernel("int8") is None
        assert fused_update.kernel("bfloat16") is not None
        assert fused_update.kernel() is None  # not every format
    assert fused_update.status("bfloat16") == "fused kernel"
    assert fused_update.status("int8").startswith("torch path (the fused update failed its self-check: int8:")
    warned = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(warned) == 1 and "int8" in warned[0], warned
    fused_update.kernel("int8")  # asked again: decided once, said once
    assert len([r for r in caplog.records if "is not used" in r.getMessage()]) == 1
    assert codecs.native_kernel() is not None, "the int8 codec itself is still good and used"


def test_status_without_deciding_builds_nothing(fresh):
    assert fused_update.status(decide=False) == "undecided"
    assert native.status() == "undecided"
    assert not (fresh / "cache").exists() or not any((fresh / "cache").glob("*.so"))


def test_the_bf16_probe_accepts_this_builds_copy_and_refuses_another_rounding():
    """Writes bfloat16 parameters only where torch's conversion is the kernel's, bit for bit."""
    flags = fused_update.bf16_param_flags()
    assert flags in (None, fused_update.OUT_BF16, fused_update.OUT_BF16 | fused_update._OUT_NAN_ONES)
    if flags is not None:  # the probed pattern is what copy_ writes for NaN here
        out = torch.empty(64, dtype=torch.bfloat16)
        out.copy_(torch.full((64,), float("nan")))
        assert set(out.view(torch.int16).tolist()) == ({-1} if flags & fused_update._OUT_NAN_ONES else {0x7FC0})

    def truncating(out, src):  # round toward zero: differs on every tie and above-half value
        out.view(torch.int16).copy_((src.view(torch.int32) >> 16).to(torch.int16))

    def round_half_up(out, src):  # differs from nearest-even on ties with an even upper half only
        bits = src.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        out.view(torch.int16).copy_(((bits + 0x8000) >> 16).to(torch.int32).to(torch.int16))

    assert fused_update._bf16_flags_for(truncating) is None
    assert fused_update._bf16_flags_for(round_half_up) is None

    def nearest_even(nan):  # the kernel's own rounding, with one NaN pattern
        def convert(out, src):
            bits = src.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, nan, rounded)
            out.view(torch.int16).copy_(rounded.to(torch.int32).to(torch.int16))

        return convert

    def nan_by_length(out, src):  # 0xFFFF from whole vectors, 0x7FC0 from scalar tails
        nearest_even(0xFFFF)(out, src)
        n = out.numel()
        tail = out[n - n % 8 :]
        nearest_even(0x7FC0)(tail, src[n - n % 8 :])

    assert fused_update._bf16_flags_for(nearest_even(0x7FC0)) == fused_update.OUT_BF16
    assert fused_update._bf16_flags_for(nearest_even(0xFFFF)) == fused_update.OUT_BF16 | fused_update._OUT_NAN_ONES
    assert fused_update._bf16_flags_for(nan_by_length) is None


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize(
    "good, bad",
    [
        # The scalar tail without torch's FMA: differs in the last numel % vec elements only.
        (b": madd(fused, v[i], b2, (c2 * gi) * gi)", b": v[i] * b2 + (c2 * gi) * gi"),
        # A body that forgets weight decay.
        (b"if (wd) pi = pi * wdf;\n        const float mi", b"const float mi"),
        # bfloat16 parameters given the wrong values (the gradient's, not the new master's).
        (b"bf16_encode(q->target + o, hi - lo,", b"bf16_encode(g, hi - lo,"),
        # bfloat16 parameters given the other build's NaN pattern.
        (b"PIECE_OUT_NAN_ONES) ? 0xFFFFu : 0x7FC0u", b"PIECE_OUT_NAN_ONES) ? 0x7FC0u : 0xFFFFu"),
        # bfloat16 gradients read as if they were the upper half of nothing (no widening).
        (b"bf16_decode((const uint16_t *)q->grad + o, hi - lo, widened);",
         b"for (int64_t i = 0; i < hi - lo; ++i) widened[i] = (float)((const uint16_t *)q->grad + o)[i];"),
    ],
)
def test_a_fused_kernel_that_differs_from_torch_is_refused(fresh, monkeypatch, caplog, good, bad):
    if (b"bf16_encode" in good or b"NAN_ONES" in good) and fused_update.bf16_param_flags() is None:
        pytest.skip("this torch build's bfloat16 copy_ is not the kernel's: bf16 parameters take torch copies")
    source = native._source()
    broken = source.replace(good, bad, 1)
    assert broken != source
    monkeypatch.setattr(native, "_source", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="tierstore._compute.fused_update"):
        assert fused_update.kernel("int8") is None
    assert "failed its self-check" in fused_update.status("int8")
    assert any("fused update is not used" in r.getMessage() for r in caplog.records)
    assert codecs.native_kernel() is not None, "the codec part of the kernel is still good and used"
    # The step takes the torch path and stays exact.
    gen = torch.Generator().manual_seed(2)
    mine = [torch.nn.Parameter(torch.randn(1003, generator=gen))]
    ref = [torch.nn.Parameter(mine[0].detach().clone())]
    with TieredAdamW(mine, lr=1e-2, weight_decay=0.1, moment_dtype="int8") as opt:
        oracle = FormatOracle(ref, lr=1e-2, weight_decay=0.1, moment_dtype="int8")
        for _ in range(3):
            g = torch.randn(1003, generator=gen)
            mine[0].grad, ref[0].grad = g.clone(), g.clone()
            opt.step()
            oracle.step()
        assert torch.equal(mine[0], ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_strided_gradient_is_not_read_as_dense(dtype, fmt):
    """A gradient that flattens to a strided view (a step slice, an expand) gives the oracle's
    result, the same as its dense copy."""
    gen = torch.Generator().manual_seed(5)
    mine = [torch.nn.Parameter(torch.randn(3000, generator=gen).to(dtype)), torch.nn.Parameter(torch.randn(4, 50)),
            torch.nn.Parameter(torch.randn(700))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    with TieredAdamW(mine, lr=1e-2, moment_dtype=fmt) as opt:
        oracle = FormatOracle(ref, lr=1e-2, moment_dtype=fmt)
        for _ in range(2):
            big = torch.randn(6000, generator=gen).to(dtype)
            row = torch.randn(1, 50, generator=gen)
            mine[0].grad, ref[0].grad = big[::2], big[::2].clone()
            mine[1].grad, ref[1].grad = row.expand(4, 50), row.expand(4, 50).clone()
            one = torch.randn(1, generator=gen)
            mine[2].grad, ref[2].grad = one.expand(700), one.expand(700).clone()  # 1-D, stride 0
            opt.step()
            oracle.step()
        for a, b in zip(mine, ref):
            assert torch.equal(a.detach().view(-1).view(torch.int16), b.detach().view(-1).view(torch.int16))


def test_a_parameter_made_strided_after_construction_is_refused_before_anything_changes():
    p = torch.nn.Parameter(torch.randn(64))
    with TieredAdamW([p], lr=1e-2) as opt:
        p.grad = torch.randn(64)
        opt.step()
        p.data = torch.randn(128)[::2]  # same shape, now strided
        values = p.detach().clone()
        p.grad = torch.randn(64)
        with pytest.raises(ParamsChangedError, match="parameter 0 .* is no longer contiguous"):
            opt.step()
        assert torch.equal(p.detach(), values)
        assert int(opt.state_dict()["state"][0]["step"]) == 1
