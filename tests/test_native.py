"""The compiled int8 codec kernel (:mod:`tierstore.native`): same bytes as torch ops, optional, safe.

Each test decides afresh (the ``fresh`` fixture of ``tests/conftest.py``) and
leaves the process as it found it, so the other tests keep whatever this
machine can build.
"""

from __future__ import annotations

import shutil
import stat

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import codecs, native
from tierstore.errors import ConfigError

HAVE_CC = native._compiler() is not None


def _need_kernel() -> native.Kernel:
    k = codecs.native_kernel()
    if k is None:
        pytest.skip(f"no compiled kernel here: {native.status()}")
    return k


def _encode(field: str, x: torch.Tensor, impl: str) -> torch.Tensor:
    out = torch.zeros(codecs.moment_format("int8").encoded_nbytes(x.numel()), dtype=torch.uint8)
    codecs.encode("int8", field, x, out, threads=1, impl=impl)
    return out


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_builds_into_the_cache_directory_once(fresh):
    k = codecs.native_kernel()
    assert k is not None, native.status()
    assert k.path.parent == fresh / "cache"
    assert native.status() == f"compiled kernel {k.path} ({'AVX2+FMA' if k.fast else 'baseline'} variant)"
    mtime = k.path.stat().st_mtime_ns
    native.reset()
    assert codecs.native_kernel().path == k.path and k.path.stat().st_mtime_ns == mtime, "a cached build was rebuilt"


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5000), scale=st.sampled_from([1e-40, 1e-20, 1.0, 1e30]),
       field=st.sampled_from(["exp_avg", "exp_avg_sq"]))
@settings(max_examples=60, deadline=None)
def test_kernel_equals_torch_ops_and_reference(seed, n, scale, field):
    _need_kernel()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(8) * scale
    if field == "exp_avg_sq":
        x = x.abs()
    specials = torch.randint(0, n, (n // 97,), generator=gen)
    x[specials] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])[specials % 5]
    compiled = _encode(field, x, "fast")
    assert torch.equal(compiled, _encode(field, x, "torch"))
    assert torch.equal(compiled, _encode(field, x, "reference"))
    outs = []
    for impl in ("fast", "torch", "reference"):
        out = torch.empty(n)
        codecs.decode("int8", field, compiled, out, threads=1, impl=impl)
        outs.append(out.view(torch.int32))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_off_switch_uses_torch_ops(fresh, monkeypatch):
    monkeypatch.setenv("TIERSTORE_NATIVE", "0")
    assert codecs.native_kernel() is None
    assert native.status() == "torch ops (TIERSTORE_NATIVE=0)"
    x = torch.linspace(-1, 1, 1000)
    assert torch.equal(_encode("exp_avg", x, "fast"), _encode("exp_avg", x, "reference"))


def test_no_compiler_falls_back_and_require_raises(fresh, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert codecs.native_kernel() is None
    assert "no C compiler found" in native.status()
    native.reset()
    monkeypatch.setenv("TIERSTORE_NATIVE", "require")
    with pytest.raises(ConfigError, match="TIERSTORE_NATIVE=require.*no C compiler found"):
        codecs.native_kernel()


def test_a_failing_compiler_falls_back_with_its_message(fresh, monkeypatch):
    cc = fresh / "broken-cc"
    cc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'no luck' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("TIERSTORE_CC", str(cc))
    assert codecs.native_kernel() is None
    assert "building the compiled kernel failed" in native.status() and "no luck" in native.status()
    x = torch.rand(777)
    assert torch.equal(_encode("exp_avg_sq", x, "fast"), _encode("exp_avg_sq", x, "reference"))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize(
    "good, bad, what",
    [
        # Decode doubles every value.
        (b"out[i] = values[c[i]] * s;", b"out[i] = values[c[i]] * s * 2.0f;", "decode of exp_avg"),
        # The packed encode stores its eight codes in reverse order (a big-endian packing).
        (b"<< (8 * j);", b"<< (8 * (7 - j));", "encode of exp_avg"),
    ],
)
def test_a_kernel_that_computes_wrong_bytes_is_refused(fresh, monkeypatch, good, bad, what):
    # A deliberately broken build must fail the load-time self-check.
    source = native._source()
    broken = source.replace(good, bad)
    assert broken != source
    monkeypatch.setattr(native, "_source", lambda: broken)
    with pytest.warns(UserWarning, match=f"{what} differs"):
        assert codecs.native_kernel() is None
    assert "failed its self-check" in native.status()


def test_unknown_switch_value_is_a_config_error(fresh, monkeypatch):
    monkeypatch.setenv("TIERSTORE_NATIVE", "fastest")
    with pytest.raises(ConfigError, match="TIERSTORE_NATIVE='fastest' is unknown"):
        codecs.native_kernel()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")
def test_unusable_cache_directory_builds_in_a_temporary_one(fresh, monkeypatch):
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    k = codecs.native_kernel()
    try:
        assert k is not None, native.status()
        assert not str(k.path).startswith(str(blocker))
    finally:
        if k is not None:
            shutil.rmtree(k.path.parent, ignore_errors=True)
