"""The convergence benchmark's pieces: the CodecAdamW stand-in and the throughput/convergence runners.

The stand-in does the one math the integration into TieredAdamW will do
(decode -> fused AdamW -> encode per shard of the layout's flat space), so
its properties are the integration's targets: ``float32`` is bitwise
``torch.optim.AdamW(fused=True)``, and for every format the shard size
(a tuning knob) never changes a bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.cli.bench import codec_speed, convergence
from tierstore.cli.bench.codec_adamw import CodecAdamW


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 9))


def _train(model, opt, seed, steps=4):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 40, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@given(seed=st.integers(0, 1000), shard_pages=st.integers(1, 20))
@settings(max_examples=8)
def test_float32_stand_in_equals_torch_adamw_fused_bitwise(seed, shard_pages):
    a, b = _model(seed), _model(seed)
    ref = _train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=True), seed)
    ours = _train(b, CodecAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, shard_numel=shard_pages * 1024), seed)
    assert all(torch.equal(x, y) for x, y in zip(ref, ours))


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "convergence:int8-stochastic", "convergence:bfloat16-nearest"])
@given(seed=st.integers(0, 1000), shard_pages=st.integers(1, 20))
@settings(max_examples=4)
def test_shard_size_never_changes_results(fmt, seed, shard_pages):
    fmt = convergence.our_format("ours-" + fmt.split(":")[1]) if ":" in fmt else fmt
    a, b = _model(seed), _model(seed)
    one = _train(a, CodecAdamW(a.parameters(), lr=1e-2, moment_dtype=fmt, shard_numel=shard_pages * 1024), seed)
    two = _train(b, CodecAdamW(b.parameters(), lr=1e-2, moment_dtype=fmt, shard_numel=1 << 20), seed)
    assert all(torch.equal(x, y) for x, y in zip(one, two))


def test_compressed_formats_stay_close_to_fp32():
    models = {name: _model(0) for name in ("float32", "bfloat16", "int8")}
    params = {n: _train(m, CodecAdamW(m.parameters(), lr=1e-3, moment_dtype=n), 0, steps=10) for n, m in models.items()}
    for name in ("bfloat16", "int8"):
        for x, y in zip(params["float32"], params[name]):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-3)  # 10 steps of lr 1e-3: moves up to 1e-2


def test_convergence_runner_small(tmp_path):
    out = convergence.run_model(
        "demo", ["torch-adamw-fp32", "ours-float32", "ours-int8-stochastic"], steps=3, eval_every=2,
        batch_size=2, context=16, eval_windows=2, small=True,
    )
    rec = out["contenders"]
    assert rec["ours-float32"]["train_loss"] == rec["torch-adamw-fp32"]["train_loss"]  # bitwise, so equal floats
    assert [s for s, _ in rec["ours-int8-stochastic"]["eval"]] == [2, 3]
    assert rec["torch-adamw-fp32"]["final_vs_fp32"] == 0
    convergence.plot({"models": {"demo": out}}, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 0


def test_convergence_reports_an_unknown_contender():
    with pytest.raises(ValueError, match="ours-int8-fancy"):
        convergence.our_format("ours-int8-fancy")


def test_codec_speed_small():
    result = codec_speed.measure(numel=1 << 14, rounds=1, formats=["float32", "int8-stochastic"], threads=1)
    assert set(result["summary"]) == {"float32", "int8-stochastic"}
    assert result["summary"]["int8-stochastic"]["bytes_per_param"] == 4 + 2 * (1 + 4 / 256)
    assert all(v > 0 for v in result["params_per_s"].values())


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_the_stand_in_equals_tiered_adamw_bit_for_bit_on_the_demo_model(fmt):
    """The convergence figures the stand-in measured (codec variants) and TieredAdamW's (formats)
    come from the same math: on a few demo-model steps, with the benchmark's schedule and
    clipping, both give the same losses and weights bit for bit."""
    from tierstore import TieredAdamW

    runs = []
    for make in (
        lambda ps: CodecAdamW(ps, lr=3e-3, weight_decay=0.1, moment_dtype=fmt),
        lambda ps: TieredAdamW(ps, lr=3e-3, weight_decay=0.1, moment_dtype=fmt),
    ):
        model = convergence.build_model("demo", context=16, small=True)
        params = list(model.parameters())
        opt = make(params)
        stream = convergence.BatchStream(convergence.load_corpus(), context=16, batch_size=2, seed=0)
        losses = []
        for step in range(6):
            x, y = stream.batch(step)
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, convergence.CLIP_NORM)
            convergence._set_lr(opt, convergence.lr_at(step, 6, 3e-3))
            opt.step()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in params]))
        if hasattr(opt, "close"):
            opt.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
