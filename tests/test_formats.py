"""Compressed moments in TieredAdamW (issue 10): one math, every format, everything else keeps working.

- The fast path (chunks decoded, updated by the fused kernel and encoded on
  worker threads, shard by shard, streamed or resident) equals the oracle
  (:class:`~tierstore.testing.formats.FormatOracle`: reference codecs around
  the fused kernel, per tensor) bit for bit, for every shard size, budget,
  backend, chunk size and thread count, param groups, frozen parameters,
  parameters without a gradient, bf16 parameters with masters, amsgrad.
- ``float32`` runs no codec at all and stays bitwise ``torch.optim.AdamW(fused=True)``.
- The format is the state's identity: fingerprint, manifest, resume checks.
- Budgets: a compressed format keeps more shards resident; its decode
  scratch is counted.
- state_dict / load_state_dict, zarr checkpoints in every format pair,
  export / to-torch / verify / inspect, DCP, durability and resume.
- Bad values raise errors that name the fix.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import ConfigError, LayoutMismatchError, TieredAdamW
from tierstore._compute import codecs, formats
from tierstore._layout.budget import plan_tiers
from tierstore._layout.layout import Layout
from tierstore._state.reader import StateReader
from tierstore.checkpoint import (
    checkpoint_to_state_dict,
    export_statedir,
    statedir_to_state_dict,
    verify_checkpoint,
)
from tierstore.cli import main as cli_main
from tierstore.errors import BudgetError, CorruptStateError
from tierstore.sizes import parse_size
from tierstore.testing.formats import FormatOracle

COMPRESSED = ("bfloat16", "int8")
FORMATS = ("float32", *COMPRESSED)
BACKENDS = ("direct", "buffered", "mmap")


def state_equal(a: dict, b: dict, *, keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")) -> list[str]:
    problems = []
    for i, entry in a["state"].items():
        other = b["state"].get(i)
        if other is None:
            problems.append(f"param {i}: no state")
            continue
        for k in keys:
            if k in entry and not torch.equal(entry[k], other[k]):
                problems.append(f"param {i} {k} differs")
    return problems


# -- one math: the fast path equals the oracle, bit for bit ---------------------------------------


@dataclass(frozen=True)
class Case:
    fmt: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    frozen: tuple[bool, ...]
    groups: int
    amsgrad: bool
    maximize: bool
    shard_numel: int
    budget: str  # "none", "partial", "arena"
    backend: str
    chunk: int
    threads: int
    steps: int
    seed: int


@st.composite
def cases(draw, fmt: str) -> Case:
    n = draw(st.integers(1, 5))
    shapes = tuple(
        draw(st.one_of(st.tuples(st.integers(1, 9000)), st.tuples(st.integers(1, 90), st.integers(1, 90)), st.just(())))
        for _ in range(n)
    )
    return Case(
        fmt=fmt,
        shapes=shapes,
        dtypes=tuple(draw(st.sampled_from(["float32", "float32", "bfloat16"])) for _ in range(n)),
        frozen=tuple(draw(st.booleans()) and i > 0 for i in range(n)),
        groups=draw(st.integers(1, 2)),
        amsgrad=draw(st.booleans()),
        maximize=draw(st.booleans()),
        shard_numel=draw(st.sampled_from([1024, 2048, 4096, 1 << 14])),
        budget=draw(st.sampled_from(["none", "partial", "arena"])),
        backend=draw(st.sampled_from(BACKENDS)),
        chunk=draw(st.sampled_from([256, 1024, codecs.CHUNK_NUMEL])),
        threads=draw(st.integers(1, 3)),
        steps=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**31)),
    )


def _params(case: Case) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(case.seed)
    out = []
    for shape, dtype, frozen in zip(case.shapes, case.dtypes, case.frozen):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(getattr(torch, dtype)), requires_grad=not frozen)
        out.append(p)
    return out


def _groups(params: list[torch.Tensor], case: Case) -> list[dict]:
    if case.groups == 1:
        return [{"params": params}]
    half = max(1, len(params) // 2)
    return [{"params": params[:half]}, {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def _budget(case: Case, params: list[torch.Tensor]) -> str | int | None:
    if case.budget == "none":
        return None
    probe = TieredAdamW(_groups(params, case), moment_dtype=case.fmt, shard_numel=case.shard_numel, amsgrad=case.amsgrad)
    plan, layout = probe.plan, probe.layout
    probe.close()
    fixed = 4 * layout.slot_nbytes + plan.staging_nbytes + layout.scratch_nbytes(case.threads)
    return fixed + (layout.state_nbytes // 3 if case.budget == "partial" else 0)


def _grads(case: Case, params: list[torch.Tensor], step: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(case.seed + 7919 * (step + 1))
    out = []
    for k, p in enumerate(params):
        g = (torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-5, 1, (), generator=gen))).to(p.dtype)
        out.append(None if (not p.requires_grad or (step + k) % 3 == 2) else g)
    return out


def _run_case(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "CHUNK_NUMEL", case.chunk)
    mine, ref = _params(case), _params(case)
    budget = _budget(case, mine)
    opt = TieredAdamW(
        _groups(mine, case), lr=1e-2, amsgrad=case.amsgrad, maximize=case.maximize, moment_dtype=case.fmt,
        shard_numel=case.shard_numel, ram_budget=budget, backend=case.backend, update_threads=case.threads,
        state_dir=str(tmp_path / "state") if budget is not None else None,
    )
    oracle = FormatOracle(_groups(ref, case), lr=1e-2, amsgrad=case.amsgrad, maximize=case.maximize, moment_dtype=case.fmt)
    try:
        for step in range(case.steps):
            for a, b, g in zip(mine, ref, _grads(case, mine, step)):
                a.grad = None if g is None else g.clone()
                b.grad = None if g is None else g.clone()
            opt.step()
            oracle.step()
            for i, (a, b) in enumerate(zip(mine, ref)):
                assert torch.equal(a, b), f"step {step}: param {i} differs"
        assert state_equal(oracle.state_dict(), opt.state_dict()) == []
    finally:
        opt.close()


@pytest.mark.parametrize("fmt", COMPRESSED)
@given(data=st.data())
@settings(max_examples=14)
def test_fast_path_equals_the_oracle_bitwise(fmt, data):
    """Shards, budgets, backends, chunks and threads never change a bit: the result is the per-tensor
    decode (reference codecs) -> fused AdamW -> encode."""
    case = data.draw(cases(fmt))
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        _run_case(case, Path(tmp), mp)


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_oracle_with_the_reference_kernel_stays_within_the_codec_bound(fmt):
    """decode -> reference (textbook) AdamW -> encode agrees with the fused path to the codec's precision."""
    gen = torch.Generator().manual_seed(3)
    w = [torch.nn.Parameter(torch.randn(3000, generator=gen))]
    v = [torch.nn.Parameter(w[0].detach().clone())]
    fused = TieredAdamW(w, lr=1e-3, moment_dtype=fmt)
    textbook = FormatOracle(v, lr=1e-3, moment_dtype=fmt, kernel="reference")
    for _step in range(5):
        g = torch.randn(3000, generator=gen) * 1e-2
        w[0].grad, v[0].grad = g.clone(), g.clone()
        fused.step()
        textbook.step()
    torch.testing.assert_close(w[0], v[0], rtol=1e-4, atol=1e-5)
    a, b = fused.state_dict()["state"][0], textbook.state_dict()["state"][0]
    tol = {"bfloat16": 2**-6, "int8": 0.03}[fmt]
    for key in ("exp_avg", "exp_avg_sq"):
        scale = a[key].abs().max()
        assert float((a[key] - b[key]).abs().max()) <= tol * float(scale)
    fused.close()


def test_chunks_and_threads_never_change_a_bit(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(s, generator=gen) for s in [(700, 300), (5000,), (3,)]]
    grads = [[torch.randn(b.shape, generator=gen) for b in base] for _ in range(3)]
    results = []
    for chunk, threads in ((1 << 18, 1), (256, 3), (1024, 2)):
        monkeypatch.setattr(codecs, "CHUNK_NUMEL", chunk)
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        with TieredAdamW(ps, lr=1e-2, moment_dtype="int8", update_threads=threads, shard_numel=1 << 17) as opt:
            for gs in grads:
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                opt.step()
            results.append(([p.detach().clone() for p in ps], opt.state_dict()))
    for params, sd in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], params))
        assert state_equal(results[0][1], sd) == []


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_a_parameter_without_a_gradient_keeps_its_moments_bit_for_bit(fmt):
    """Blocks of a parameter that took no step are neither decoded nor encoded: no drift."""
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (300, 700, 5)]  # small ones share shards
    with TieredAdamW(ps, lr=1e-2, moment_dtype=fmt) as opt:
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-30  # tiny moments: subnormal products if re-encoded
        opt.step()
        before = opt.state_dict()
        for _step in range(3):
            ps[0].grad = torch.randn(300, generator=gen)
            ps[1].grad = None
            ps[2].grad = torch.randn(5, generator=gen)
            opt.step()
        after = opt.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(before["state"][1][key], after["state"][1][key])


def test_float32_runs_no_codec_and_equals_torch_adamw(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("float32 must not run a codec")

    for name in ("encode", "decode", "encode_chunk", "decode_chunk"):
        monkeypatch.setattr(codecs, name, refuse)
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(s, generator=gen) for s in [(64, 33), (5000,)]]
    mine = [torch.nn.Parameter(b.clone()) for b in base]
    ref = [torch.nn.Parameter(b.clone()) for b in base]
    opt = TieredAdamW(mine, lr=1e-2, moment_dtype="float32", ram_budget="64KiB", shard_numel=1024)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    assert opt.describe() == opt.describe().replace("moments", "")  # no format note for the default
    for _ in range(3):
        for a, b in zip(mine, ref):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    assert state_equal(torch_opt.state_dict(), opt.state_dict()) == []
    opt.close()


# -- identity: layout, fingerprint, manifest ----------------------------------------------------------


def test_the_format_is_part_of_the_layout_and_its_fingerprint():
    w = torch.zeros(3000, requires_grad=True)
    layouts = {f: Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"), moment_dtype=f) for f in FORMATS}
    assert len({lay.fingerprint for lay in layouts.values()}) == 3
    assert "moment_dtype" not in layouts["float32"].to_dict()  # float32 layouts hash as before formats existed
    for f, lay in layouts.items():
        again = Layout.from_dict(json.loads(json.dumps(lay.to_dict())))
        assert again.fingerprint == lay.fingerprint and again.format.name == f
    assert layouts["int8"].param_align == 256 and layouts["float32"].param_align == 64
    # bytes per field and per shard follow the format (fields page aligned)
    assert [layouts[f].shard_nbytes(0) for f in FORMATS] == [8192, 8192, 8192]  # 1024 elements: one page each
    big = {f: Layout.build([[torch.zeros(1 << 20, requires_grad=True)]], shard_numel=1 << 20,
                           fields=("master", "exp_avg", "exp_avg_sq"), moment_dtype=f) for f in FORMATS}
    assert [big[f].shard_nbytes(0) for f in FORMATS] == [12 << 20, 8 << 20, (4 << 20) + 2 * ((1 << 20) + (16 << 10))]
    assert [big[f].bytes_per_element for f in FORMATS] == [12, 8, 4 + 2 * 1.015625]


@pytest.mark.parametrize("saved, mine", [("int8", "float32"), ("float32", "bfloat16"), ("bfloat16", "int8")])
def test_resuming_with_another_moment_dtype_names_the_fix(tmp_path, saved, mine):
    w = torch.nn.Parameter(torch.ones(2000))
    with TieredAdamW([w], state_dir=tmp_path, moment_dtype=saved) as opt:
        w.grad = torch.ones(2000)
        opt.step()
    with pytest.raises(LayoutMismatchError, match=rf"moment_dtype='{saved}'.*Pass moment_dtype='{saved}'.*load_checkpoint"):
        TieredAdamW([w], state_dir=tmp_path, resume=True, moment_dtype=mine)
    with TieredAdamW([w], state_dir=tmp_path, resume=True, moment_dtype=saved) as opt:
        assert opt.step_count == 1 and opt.moment_dtype == saved
        assert json.loads((tmp_path / "manifest.json").read_text())["layout"].get("moment_dtype", "float32") == saved


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("fp8", ConfigError, r"moment_dtype='fp8' is unknown; use one of \['bfloat16', 'float32', 'int8'\]"),
        (torch.float16, ConfigError, r"float16 moments are not offered .*use 'bfloat16'"),
        ("fp16", ConfigError, r"moment_dtype='fp16': float16 moments are not offered"),
        (None, ConfigError, "moment_dtype=None is unknown"),
        (8, ConfigError, "moment_dtype=8 is unknown"),
        (formats.MomentFormat("int8-stochastic", 1, 256, rounding="stochastic", sqrt_second=True), ConfigError,
         "is a codec variant, not a state format"),
    ],
)
def test_a_bad_moment_dtype_is_refused_naming_the_choices(value, error, match, tmp_path):
    with pytest.raises(error, match=match):
        TieredAdamW([torch.nn.Parameter(torch.ones(3))], moment_dtype=value, state_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


@pytest.mark.parametrize(
    "alias, name", [(torch.bfloat16, "bfloat16"), ("bf16", "bfloat16"), (torch.int8, "int8"), (torch.float32, "float32"),
                    ("fp32", "float32")],
)
def test_torch_dtypes_and_short_names_are_the_same_format(alias, name, tmp_path):
    p = [torch.nn.Parameter(torch.ones(300))]
    p[0].grad = torch.ones(300)
    with TieredAdamW(p, moment_dtype=alias, state_dir=tmp_path / "a") as opt:
        opt.step()
        assert opt.moment_dtype == name
    with TieredAdamW(p, moment_dtype=name, state_dir=tmp_path / "a", resume=True) as opt:  # same identity
        assert opt.step_count == 1


# -- budgets: more shards resident, scratch counted ------------------------------------------------------


def test_the_same_budget_keeps_more_shards_resident_and_counts_the_scratch():
    ps = [torch.zeros(1 << 20, requires_grad=True)]
    budget = (12 << 20) // 3
    plans = {}
    for f in FORMATS:
        with TieredAdamW(ps, moment_dtype=f, keep_master=True, ram_budget=budget, shard_numel=1 << 16) as opt:
            plans[f] = opt.plan
            assert opt.ram_bytes == opt.plan.arena_nbytes + opt.plan.staging_nbytes + opt.plan.scratch_nbytes + opt.plan.resident_nbytes
            assert opt.ram_bytes <= budget
            if f != "float32":
                assert "decode scratch" in opt.describe() and f"{f} moments" in opt.describe()
    resident = [len(plans[f].resident) for f in FORMATS]
    assert resident[0] < resident[1] < resident[2], resident
    assert plans["float32"].scratch_nbytes == 0 and plans["int8"].scratch_nbytes > 0


def test_a_budget_without_room_for_the_scratch_says_so():
    ps = [torch.zeros(1 << 16, requires_grad=True)]
    with pytest.raises(BudgetError, match="int8 decode scratch"):
        TieredAdamW(ps, moment_dtype="int8", ram_budget=100 << 10, shard_numel=1 << 14)


# -- state dicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_state_dict_is_torch_format_fp32_and_round_trips_through_torch_adamw(fmt):
    gen = torch.Generator().manual_seed(8)
    w = torch.nn.Parameter(torch.randn(40, 50, generator=gen))
    with TieredAdamW([w], lr=1e-2, moment_dtype=fmt) as opt:
        w.grad = torch.randn(40, 50, generator=gen)
        opt.step()
        sd = opt.state_dict()
        assert sd["state"][0]["exp_avg"].dtype == torch.float32 and sd["state"][0]["exp_avg"].shape == (40, 50)
        torch_opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
        torch_opt.load_state_dict(sd)  # torch takes it as its own
        back = torch_opt.state_dict()
        opt.load_state_dict(back)  # and back: the values were encoded already, encoding again changes nothing
        assert state_equal(sd, opt.state_dict()) == []


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_load_state_dict_encodes_torch_moments(fmt):
    gen = torch.Generator().manual_seed(9)
    w = torch.nn.Parameter(torch.randn(3000, generator=gen))
    torch_opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
    w.grad = torch.randn(3000, generator=gen)
    torch_opt.step()
    sd = torch_opt.state_dict()
    with TieredAdamW([w], lr=1e-2, moment_dtype=fmt) as opt:
        opt.load_state_dict(sd)
        got = opt.state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        want = sd["state"][0][key]
        enc = torch.zeros(formats.moment_format(fmt).encoded_nbytes(3000), dtype=torch.uint8)
        codecs.encode(fmt, key, want, enc, impl="reference")
        expected = torch.empty(3000)
        codecs.decode(fmt, key, enc, expected, impl="reference")
        assert torch.equal(got[key], expected)


# -- checkpoints: every format pair, plain zarr, export, to-torch, verify ---------------------------------


def _trained(fmt: str, tmp_path: Path, *, keep_master: bool = True, **kwargs) -> tuple[list, TieredAdamW]:
    gen = torch.Generator().manual_seed(11)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(70, 33), (5000,), (300,), ()]]
    opt = TieredAdamW(ps, lr=1e-2, moment_dtype=fmt, keep_master=keep_master, amsgrad=True,
                      state_dir=str(tmp_path / f"state-{fmt}"), ram_budget="320KiB", shard_numel=2048, **kwargs)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return ps, opt


def _fresh(fmt: str, **kwargs) -> tuple[list, TieredAdamW]:
    gen = torch.Generator().manual_seed(12)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(70, 33), (5000,), (300,), ()]]
    kwargs.setdefault("shard_numel", 4096)
    return ps, TieredAdamW(ps, lr=0.5, moment_dtype=fmt, keep_master=True, amsgrad=True, **kwargs)


def _converted(values: torch.Tensor, key: str, fmt: str) -> torch.Tensor:
    """What storing ``values`` in ``fmt`` gives back."""
    flat = values.reshape(-1).contiguous()
    enc = torch.zeros(formats.moment_format(fmt).encoded_nbytes(flat.numel()), dtype=torch.uint8)
    codecs.encode(fmt, key, flat, enc, impl="reference")
    out = torch.empty(flat.numel())
    codecs.decode(fmt, key, enc, out, impl="reference")
    return out.view(values.shape)


@pytest.mark.parametrize("source", FORMATS)
@pytest.mark.parametrize("target", FORMATS)
def test_a_checkpoint_of_any_format_loads_into_an_optimizer_of_any_format(tmp_path, source, target):
    ps, opt = _trained(source, tmp_path)
    want = opt.state_dict()
    opt.save_checkpoint(str(tmp_path / "ck.zarr"))
    opt.close()
    qs, fresh = _fresh(target)
    fresh.load_checkpoint(str(tmp_path / "ck.zarr"))
    got = fresh.state_dict()
    assert fresh.step_count == 3
    for i, entry in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            expected = entry[key] if target in (source, "float32") else _converted(entry[key], key, target)
            assert torch.equal(got["state"][i][key], expected), (i, key)
        assert torch.equal(got["state"][i]["master_param"], entry["master_param"])
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))  # masters went into the parameters
    fresh.close()


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_same_format_checkpoint_loads_the_stored_bytes_without_decoding(tmp_path, fmt, monkeypatch):
    ps, opt = _trained(fmt, tmp_path, durable=True)
    want = opt.state_dict()
    opt.save_checkpoint(str(tmp_path / "ck.zarr"))
    opt.close()
    qs, fresh = _fresh(fmt, state_dir=str(tmp_path / "copy"), ram_budget="320KiB")

    def refuse(*args, **kwargs):
        raise AssertionError("a same-format load must copy codes, not encode them")

    monkeypatch.setattr(codecs, "encode", refuse)
    monkeypatch.setattr(codecs, "encode_chunk", refuse)
    fresh.load_checkpoint(str(tmp_path / "ck.zarr"))  # another shard size: still the same flat space
    monkeypatch.undo()
    assert state_equal(want, fresh.state_dict(), keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")) == []
    fresh.close()


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_a_checkpoint_is_readable_with_plain_zarr(tmp_path, fmt):
    ps, opt = _trained(fmt, tmp_path)
    sd = opt.state_dict()
    opt.save_checkpoint(str(tmp_path / "ck.zarr"))
    opt.close()
    g = zarr.open_group(str(tmp_path / "ck.zarr"), mode="r")
    assert g.attrs["moment_dtype"] == fmt and g.attrs["format_version"] == 2
    for i, p in enumerate(g.attrs["params"]):
        if not p["numel"]:
            continue
        lo, hi = p["start"], p["start"] + p["numel"]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            codes = g[key][lo:hi]
            if fmt == "bfloat16":
                assert codes.dtype == np.uint16
                values = (codes.astype("uint32") << 16).view("float32")
            else:
                assert codes.dtype == np.uint8
                arr = g[key]
                values_map = np.append(arr.attrs["map"], np.nan).astype("float32")
                scales = g[arr.attrs["scales"]][:]
                values = values_map[codes] * scales[np.arange(lo, hi) // arr.attrs["block_numel"]]
            np.testing.assert_array_equal(values, sd["state"][i][key].reshape(-1).numpy())


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_export_to_torch_and_verify_work_on_a_compressed_state_dir(tmp_path, fmt):
    ps, opt = _trained(fmt, tmp_path, durable=True)
    sd = opt.state_dict()
    opt.close()
    state = tmp_path / f"state-{fmt}"
    assert state_equal(sd, statedir_to_state_dict(state), keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")) == []
    export_statedir(state, tmp_path / "exp.zarr")
    assert verify_checkpoint(tmp_path / "exp.zarr") == []
    assert state_equal(sd, checkpoint_to_state_dict(tmp_path / "exp.zarr")) == []
    with StateReader(state) as reader:
        assert reader.verify() == []
    # a flipped scale (int8) or code byte is found by verify
    scales = tmp_path / "exp.zarr" / ("exp_avg_scales" if fmt == "int8" else "exp_avg") / "c" / "0"
    raw = bytearray(scales.read_bytes())
    raw[5] ^= 0x10
    scales.write_bytes(bytes(raw))
    assert len(verify_checkpoint(tmp_path / "exp.zarr")) == 1
    with pytest.raises(CorruptStateError, match="fails its checksum"):
        checkpoint_to_state_dict(tmp_path / "exp.zarr")


def test_cli_inspect_verify_export_to_torch_and_plan(tmp_path, capsys):
    ps, opt = _trained("int8", tmp_path, durable=True)
    opt.close()
    state = str(tmp_path / "state-int8")

    def cli(*args: str) -> subprocess.CompletedProcess:
        # In this process (a fresh one per command cost 2.5 s of imports each; the installed
        # command's own process is tested in tests/test_cli_exit_codes.py).
        capsys.readouterr()
        code = cli_main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    out = cli("inspect", state)
    assert out.returncode == 0 and "moments in int8, 7.05 B/param" in out.stdout, out.stdout + out.stderr
    info = json.loads(cli("inspect", state, "--json").stdout)
    assert info["layout"]["moment_dtype"] == info["moment_dtype"] == "int8"
    assert cli("verify", state, "--no-progress").returncode == 0
    assert cli("export", state, str(tmp_path / "e.zarr"), "--no-progress").returncode == 0
    checked = cli("verify", str(tmp_path / "e.zarr"), "--no-progress")
    # master, exp_avg, exp_avg_sq, max_exp_avg_sq and the three moments' scales
    assert checked.returncode == 0 and "every chunk of 7 arrays" in checked.stdout, checked.stdout
    assert cli("to-torch", state, str(tmp_path / "sd.pt")).returncode == 0
    sd = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    plan = cli("plan", "--params", "1e9", "--moment-dtype", "int8", "--host-ram", "64GiB", "--ram-budget", "8GiB")
    assert plan.returncode == 0 and "2.03 B/param" in plan.stdout and "moment_dtype='int8'" in plan.stdout, plan.stdout


# -- converting a state directory between formats -----------------------------------------------------


@pytest.mark.parametrize("source, target", [("float32", "int8"), ("int8", "bfloat16"), ("bfloat16", "float32")])
def test_converting_a_state_directory_between_formats(tmp_path, source, target):
    """The documented path: resume with its format, save_checkpoint, load_checkpoint into a new
    optimizer (new state_dir) with the other format; then resume that one and keep training."""
    ps, opt = _trained(source, tmp_path, durable=True)
    want = opt.state_dict()
    opt.close()
    qs, old = _fresh(source, state_dir=str(tmp_path / f"state-{source}"), ram_budget="320KiB", resume=True, shard_numel=None)
    old.save_checkpoint(str(tmp_path / "convert.zarr"))
    old.close()
    rs, new = _fresh(target, state_dir=str(tmp_path / "converted"), ram_budget="320KiB")
    new.load_checkpoint(str(tmp_path / "convert.zarr"))
    new.close()
    rs2, resumed = _fresh(target, state_dir=str(tmp_path / "converted"), ram_budget="320KiB", resume=True)
    got = resumed.state_dict()
    assert resumed.step_count == 3 and resumed.moment_dtype == target
    for i, entry in want["state"].items():
        expected = entry["exp_avg"] if target == "float32" else _converted(entry["exp_avg"], "exp_avg", target)
        assert torch.equal(got["state"][i]["exp_avg"], expected)
    for p in rs2:
        p.grad = torch.ones_like(p)
    resumed.step()
    assert resumed.step_count == 4
    resumed.close()


# -- DCP ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source, target", [("int8", "float32"), ("float32", "bfloat16"), ("bfloat16", "int8")])
def test_dcp_save_and_load_across_formats(tmp_path, source, target):
    import torch.distributed.checkpoint as dcp

    from tierstore.dcp import TieredStateful

    ps, opt = _trained(source, tmp_path)
    want = opt.state_dict()
    dcp.save({"optim": TieredStateful(opt)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    opt.close()
    qs, fresh = _fresh(target)
    dcp.load({"optim": TieredStateful(fresh)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    got = fresh.state_dict()
    assert fresh.step_count == 3
    for i, entry in want["state"].items():
        expected = entry["exp_avg"] if target == "float32" else _converted(entry["exp_avg"], "exp_avg", target)
        if target == source:
            expected = entry["exp_avg"]
        assert torch.equal(got["state"][i]["exp_avg"], expected)
    fresh.close()


# -- durability and resume -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", COMPRESSED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_and_resume_continues_bitwise(tmp_path, fmt, backend):
    gen = torch.Generator().manual_seed(13)
    base = [torch.randn(s, generator=gen) for s in [(70, 33), (5000,), (300,)]]
    grads = [[torch.randn(b.shape, generator=gen) for b in base] for _ in range(4)]
    straight = [torch.nn.Parameter(b.clone()) for b in base]
    with TieredAdamW(straight, lr=1e-2, moment_dtype=fmt, ram_budget="96KiB", shard_numel=2048, backend=backend) as a:
        for gs in grads:
            for p, g in zip(straight, gs):
                p.grad = g.clone()
            a.step()
        want = a.state_dict()
    split = [torch.nn.Parameter(b.clone()) for b in base]
    kwargs = dict(lr=1e-2, moment_dtype=fmt, ram_budget="96KiB", shard_numel=2048, backend=backend,
                  state_dir=str(tmp_path), keep_master=True)
    with TieredAdamW(split, **kwargs) as b:
        for gs in grads[:2]:
            for p, g in zip(split, gs):
                p.grad = g.clone()
            b.step()
    for p in split:  # the masters restore the parameters
        p.data.zero_()
    with TieredAdamW(split, resume=True, **{**kwargs, "ram_budget": "160KiB"}) as b:
        for gs in grads[2:]:
            for p, g in zip(split, gs):
                p.grad = g.clone()
            b.step()
        assert state_equal(want, b.state_dict()) == []
    assert all(torch.equal(p, q) for p, q in zip(straight, split))


CRASH_CASES = [
    pytest.param("int8", "direct", "112KiB", ("mid-write", 2), id="int8-direct-mid-write"),
    pytest.param("int8", "mmap", None, ("before-sync", 2), id="int8-mmap-resident-before-sync"),
    pytest.param("bfloat16", "buffered", "112KiB", ("after-read", 2), id="bf16-buffered-after-read"),
    pytest.param("bfloat16", "direct", "200KiB", ("mid-update", 3), id="bf16-direct-mid-update"),
]


@pytest.mark.parametrize("fmt, backend, budget, crash", CRASH_CASES)
def test_kill_then_resume_is_bitwise_the_oracle(ram_tmp_path, fmt, backend, budget, crash):
    """SIGKILL at a crash point, resume, finish: bitwise the format's oracle run uninterrupted."""
    from tierstore.testing.crash import CrashJob, compare, killed_state_problems, run_child

    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=5, backend=backend, ram_budget=budget,
                   amsgrad=True, extra={"moment_dtype": fmt})
    point, after = crash
    result = run_child(job, crash=(point, after, None))
    assert result.killed and result.landed_point == point, result
    assert killed_state_problems(job, result) == []
    out = ram_tmp_path / "final.pt"
    finished = run_child(job, out=str(out))
    assert finished.exitcode == 0 and finished.completed == job.steps, finished
    assert compare(job, out) == []


@pytest.mark.parametrize("fmt", COMPRESSED)
def test_every_power_cut_image_resumes_at_a_committed_step(ram_tmp_path, fmt):
    from tierstore.testing.crash import CrashJob
    from tierstore.testing.powercut import run_powercuts

    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=3, backend="direct", ram_budget="112KiB",
                   forward_seconds=0.01, extra={"moment_dtype": fmt})
    result = run_powercuts(job, images=12, seed=3, workdir=ram_tmp_path)
    assert result.violations == []
    assert result.outcomes["resumed"] == 12


def test_the_crash_harness_tells_formats_apart(ram_tmp_path):
    """Premise of the two tests above: the int8 oracle's trajectory is not torch AdamW's."""
    from tierstore.testing.crash import CrashJob, trajectory

    plain = CrashJob(state_dir="", steps=2)
    int8 = CrashJob(state_dir="", steps=2, extra={"moment_dtype": "int8"})
    a, b = trajectory(plain)[-1], trajectory(int8)[-1]
    assert not torch.equal(a.state_dict["state"][0]["exp_avg"], b.state_dict["state"][0]["exp_avg"])


# -- the planner -----------------------------------------------------------------------------------------


def test_the_planner_counts_bytes_per_param_by_format():
    from tierstore.planner import plan_memory

    plans = {f: plan_memory(10**8, host_ram=64 << 30, ram_budget=1 << 30, moment_dtype=f, precision="bf16") for f in FORMATS}
    assert [plans[f].state_bytes_per_param for f in FORMATS] == [12, 8, 4 + 2 * 1.015625]
    assert plans["float32"].host.scratch == 0 < plans["int8"].host.scratch
    assert plans["float32"].host.resident_shards < plans["int8"].host.resident_shards
    w = torch.zeros(10**6, device="meta", requires_grad=True)
    layout = Layout.build([[w]], shard_numel=1 << 16, fields=plans["int8"].fields, moment_dtype="int8")
    tiers = plan_tiers(layout, ram_budget=None, arena_slots=4)
    assert tiers.state_nbytes == layout.state_nbytes


def test_the_planner_cli_takes_format_aliases(capsys):
    from tierstore.cli import main

    assert main(["plan", "--params", "1e8", "--moment-dtype", "bf16", "--host-ram", "64GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state_bytes_per_param"] == 4


@pytest.mark.parametrize("budget", [None, "64KiB", "1MiB"])
def test_a_compressed_format_needs_less_ram_than_float32(budget):
    """The decode scratch and page padding stay small where everything is resident: the automatic
    shard size counts them. A tiny model (page padding is most of its state) still fits the budget."""
    tiny, model = torch.nn.Linear(64, 64), torch.nn.Sequential(*[torch.nn.Linear(512, 640) for _ in range(3)])
    for m in (tiny, model):
        ram = {}
        for fmt in FORMATS:
            with TieredAdamW(m.parameters(), moment_dtype=fmt, ram_budget=budget) as opt:
                ram[fmt] = opt.plan.ram_nbytes
                assert budget is None or ram[fmt] <= parse_size(budget)
        if m is model and budget is None:
            assert ram["int8"] < ram["bfloat16"] < ram["float32"], ram


def test_a_large_resident_compressed_state_keeps_a_chunk_per_worker():
    """A shard's chunks are what a compressed update runs in parallel: where the scratch costs little
    (a large state), resident shards hold at least one chunk per worker."""
    from tierstore._layout.spec import decide

    for fmt in COMPRESSED:
        spec = decide(numel=2 * 10**7, dtypes=[torch.float32], cuda=False, amsgrad=False, keep_master=True,
                      arena_slots=4, ram_budget=None, shard_numel=None, moment_dtype=fmt, workers=2)  # fmt: skip
        assert spec.shard_numel >= 2 * codecs.CHUNK_NUMEL, (fmt, spec.shard_numel)
        small = decide(numel=10**6, dtypes=[torch.float32], cuda=False, amsgrad=False, keep_master=True,
                       arena_slots=4, ram_budget=None, shard_numel=None, moment_dtype=fmt, workers=2)  # fmt: skip
        assert small.shard_numel < 2 * codecs.CHUNK_NUMEL  # small: the RAM matters more than the threads


# -- behind the training loop ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", COMPRESSED)
@pytest.mark.parametrize("budget", [None, "64KiB"])
def test_the_step_behind_the_loop_equals_the_synchronous_step(tmp_path, fmt, budget):
    """attach(model): the compressed update runs on the attachment's thread (its chunks on the workers),
    in first-use order, and gives the same bits as the synchronous step."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 40))
    results = []
    for attached in (False, True):
        model = __import__("copy").deepcopy(base)
        opt = TieredAdamW(model.parameters(), lr=1e-2, moment_dtype=fmt, ram_budget=budget, shard_numel=1024,
                          state_dir=str(tmp_path / f"s{attached}") if budget else None)
        if attached:
            opt.attach(model, overlap=True)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            loss = model(torch.randn(8, 40, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        results.append((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()))
        opt.close()
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert state_equal(results[0][2], results[1][2]) == []
