"""TieredLion is bitwise lion-pytorch's ``Lion``, and its compiled kernel is lion-pytorch's torch ops.

For fp32 parameters every parameter and ``exp_avg`` equal lion-pytorch's
after every step, for random shapes, shard sizes, all state in RAM or
streamed from disk through the arena alone, a private or durable state
directory, one or two param groups (lr, betas with 0 and 1, weight decay),
lion-pytorch's decoupled weight decay, parameters without a gradient on some
steps and the lr changed between steps, through the compiled kernel and
through the torch ops it falls back to. State dicts cross both ways; a
closed state directory resumes; compressed formats run; the kernel's
multiply-adds round as torch's ``add(..., alpha=)`` does on each CPU
capability (FMA or not); every refusal names the value and the fix.
lion-pytorch is an optional test dependency: the comparisons skip without it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import ConfigError, ConfigTypeError, TieredLion
from tierstore._compute import lion_kernel, native
from tierstore._compute.algorithms import LION
from tierstore._compute.lion_kernel import LionHyper

lion_pytorch = pytest.importorskip("lion_pytorch", reason="lion-pytorch is not installed (pip install lion-pytorch)")
Lion = lion_pytorch.Lion


@dataclass(frozen=True)
class Case:
    groups: tuple[tuple[tuple[tuple[int, ...], ...], float, tuple[float, float], float], ...]  # shapes, lr, betas, wd
    decoupled: bool
    shard_numel: int
    streamed: bool
    durable: bool
    compiled: bool
    steps: int
    seed: int


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(st.tuples(st.integers(1, 5000)), st.tuples(st.integers(1, 60), st.integers(1, 60)), st.just(()))


def cases() -> st.SearchStrategy[Case]:
    group = st.tuples(
        st.lists(shapes(), min_size=1, max_size=3).map(tuple),
        st.sampled_from((1e-4, 3e-3, 0.5)),
        st.tuples(st.sampled_from((0.9, 0.0, 1.0)), st.sampled_from((0.99, 0.0, 1.0))),
        st.sampled_from((0.0, 0.1, 1.0)),
    )
    return st.builds(
        Case,
        groups=st.lists(group, min_size=1, max_size=2).map(tuple),
        decoupled=st.booleans(),
        shard_numel=st.sampled_from((1024, 2048)) | st.integers(1024, 4096),
        streamed=st.booleans(),
        durable=st.booleans(),
        compiled=st.booleans(),
        steps=st.integers(2, 5),
        seed=st.integers(0, 2**31 - 1),
    )


def group_dicts(case: Case, params: list[list[torch.Tensor]]) -> list[dict]:
    return [dict(params=ps, lr=lr, betas=betas, weight_decay=wd) for (_, lr, betas, wd), ps in zip(case.groups, params)]


def random_grads(flat: list, ref_flat: list, gen: torch.Generator) -> None:
    for p, r in zip(flat, ref_flat):
        if torch.rand((), generator=gen) < 0.2:
            p.grad = r.grad = None
            continue
        g = torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-3, 2, (), generator=gen))
        p.grad, r.grad = g, g.clone()


def check_equal(opt: TieredLion, ref: Lion, flat: list, ref_flat: list) -> None:
    for i, (p, r) in enumerate(zip(flat, ref_flat)):
        assert torch.equal(p.detach().view(torch.int32), r.detach().view(torch.int32)), f"parameter {i} differs"
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"])
    for i, theirs in rsd["state"].items():
        assert list(sd["state"][i]) == list(theirs) == ["exp_avg"], f"parameter {i}: {list(sd['state'][i])}"
        assert torch.equal(sd["state"][i]["exp_avg"].view(torch.int32), theirs["exp_avg"].view(torch.int32))
    assert sd["param_groups"] == rsd["param_groups"]


def run_case(case: Case) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    params = [[torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes] for shapes, *_ in case.groups]
    if case.streamed:
        shard = -(-case.shard_numel // 1024) * 1024
        params[0].append(torch.nn.Parameter(torch.randn(5 * shard + 100, generator=gen)))
    ref_params = [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in params]
    flat, ref_flat = [p for ps in params for p in ps], [p for ps in ref_params for p in ps]
    first_lr = case.groups[0][1]
    ref = Lion(group_dicts(case, ref_params), lr=first_lr, decoupled_weight_decay=case.decoupled)
    kw = dict(lr=first_lr, decoupled_weight_decay=case.decoupled, shard_numel=case.shard_numel)
    budget = None
    if case.streamed:
        with TieredLion(group_dicts(case, params), **kw) as probe:
            budget = 4 * probe.plan.slot_nbytes + probe.plan.staging_nbytes
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = f"{tmp}/state" if case.durable else None
        with TieredLion(group_dicts(case, params), ram_budget=budget, state_dir=state_dir, **kw) as opt:
            for step in range(case.steps):
                if step == 2:
                    for g, rg in zip(opt.param_groups, ref.param_groups):
                        g["lr"] = rg["lr"] = rg["lr"] * 0.5 + 1e-4
                random_grads(flat, ref_flat, gen)
                if case.compiled:
                    opt.step()
                else:
                    with native.suspended():  # the torch ops the kernel falls back to
                        opt.step()
                ref.step()
            check_equal(opt, ref, flat, ref_flat)


@settings(max_examples=25)
@given(case=cases())
def test_bitwise_equal_to_lion_pytorch(case: Case) -> None:
    run_case(case)


def test_the_compiled_kernel_is_used_where_it_builds() -> None:
    if native.library() is None:
        pytest.skip(f"no compiled kernel here: {native.status()}")
    assert lion_kernel.kernel() is not None, native.part_status("lion update")
    assert native.part_status("lion update") == ""


def test_the_kernel_rounds_multiply_adds_as_this_torch_does() -> None:
    """The recipe matters: with the other rounding (FMA or two roundings) the bits differ, so the self-check
    that picks it is not vacuous; with the chosen one they agree, on one thread and on several."""
    k = lion_kernel.kernel()
    if k is None:
        pytest.skip(f"no compiled kernel here: {native.status()}")
    chosen = lion_kernel._FLAGS["flags"]
    gen = torch.Generator().manual_seed(8)
    hyper = LionHyper(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    base = [torch.randn(300_001, generator=gen) for _ in range(3)]
    ref = [t.clone() for t in base]
    lion_kernel.torch_update([ref[0]], [ref[1]], [ref[2]], hyper)
    for flags, threads in ((chosen, 1), (chosen, 3)):
        mine = [t.clone() for t in base]
        lion_kernel.compiled_update(k, flags, [mine[0]], [mine[1]], [mine[2]], hyper, threads=threads)
        assert torch.equal(mine[0], ref[0]) and torch.equal(mine[2], ref[2])
    other = [t.clone() for t in base]
    lion_kernel.compiled_update(k, lion_kernel.UNFUSED - chosen, [other[0]], [other[1]], [other[2]], hyper)
    assert not torch.equal(other[2], ref[2]), "FMA or not should change some exp_avg bits"


@pytest.mark.skipif(native.library() is None, reason="no compiled kernel here")
def test_on_the_default_capability_the_kernel_rounds_twice() -> None:
    """torch's DEFAULT build (no FMA): a process with ATEN_CPU_CAPABILITY=default picks the two-rounding recipe
    and TieredLion stays bitwise lion-pytorch's."""
    code = """
import torch
from lion_pytorch import Lion
from tierstore import TieredLion
from tierstore._compute import lion_kernel
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
a = torch.nn.Parameter(torch.randn(100_003)); b = torch.nn.Parameter(a.detach().clone())
opt, ref = TieredLion([a], lr=1e-3, weight_decay=0.1), Lion([b], lr=1e-3, weight_decay=0.1)
for _ in range(3):
    g = torch.randn(100_003); a.grad, b.grad = g, g.clone(); opt.step(); ref.step()
print(lion_kernel.kernel() is not None, lion_kernel._FLAGS.get("flags"), torch.equal(a, b))
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", str(lion_kernel.UNFUSED), "True"]


def roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def small_model() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((40, 30), (9000,), (7,), ())]


def train(opt, ref, a, b, gen, steps) -> None:  # noqa: ANN001
    for _ in range(steps):
        random_grads(a, b, gen)
        opt.step()
        ref.step()


def test_state_dicts_cross_both_ways() -> None:
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(1)
    ref = Lion(b, lr=1e-3, weight_decay=0.1)
    with TieredLion(a, lr=1e-3, weight_decay=0.1, shard_numel=1024) as opt:
        train(opt, ref, a, b, gen, 3)
    with TieredLion(a, lr=1e-3, weight_decay=0.1, shard_numel=2048) as opt:
        opt.load_state_dict(roundtrip(ref.state_dict()))  # lion-pytorch -> tiered (no step: one is counted)
        assert opt.step_count == 1
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)
        ref = Lion(b, lr=1e-3, weight_decay=0.1)  # tiered -> lion-pytorch
        ref.load_state_dict(roundtrip(opt.state_dict()))
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)


def test_a_closed_state_dir_resumes_bitwise(tmp_path) -> None:
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(2)
    ref = Lion(b, lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1, decoupled_weight_decay=True)
    kw = dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=0.1, decoupled_weight_decay=True)
    with TieredLion(a, shard_numel=1024) as probe:
        budget = 4 * probe.plan.slot_nbytes + probe.plan.staging_nbytes
    with TieredLion(a, state_dir=str(tmp_path), shard_numel=1024, ram_budget=budget, **kw) as opt:
        assert opt.disk_bytes > 0
        train(opt, ref, a, b, gen, 3)
    with TieredLion(a, state_dir=str(tmp_path), resume=True, **kw) as opt:
        assert opt.step_count == 3
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_compressed_formats_run_and_stay_close(fmt: str) -> None:
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(3)
    ref = Lion(b, lr=1e-3)
    with TieredLion(a, moment_dtype=fmt, shard_numel=1024) as probe:
        budget = 4 * probe.plan.slot_nbytes + probe.plan.staging_nbytes + probe.plan.scratch_nbytes
    with TieredLion(a, lr=1e-3, moment_dtype=fmt, shard_numel=1024, ram_budget=budget) as opt:
        assert opt.disk_bytes > 0 and opt.layout.encoded_fields == ("exp_avg",)
        train(opt, ref, a, b, gen, 4)
        for p, r in zip(a, b):  # each step moves a parameter by lr at most: a flipped sign costs 2 lr
            assert torch.isfinite(p).all() and (p - r).abs().max() <= 8e-3 + 1e-6


def test_lion_is_described_as_lion_pytorch_keeps_it() -> None:
    assert LION.field_names == ("exp_avg",) and LION.field("exp_avg").signed and LION.field("exp_avg").compressible
    assert LION.state_scalars == () and LION.defaults(dict(lr=1, betas=(0.9, 0.99), weight_decay=0)) == {
        "lr": 1, "betas": (0.9, 0.99), "weight_decay": 0}  # fmt: skip
    assert LION.loaded_step({"exp_avg": torch.zeros(1)}) == 1.0 and LION.loaded_step({}) is None


# -- errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(lr=0.0), ConfigError, r"Invalid learning rate: 0.0; lion-pytorch's Lion needs lr > 0"),
        (dict(lr=-1e-3), ConfigError, r"Invalid learning rate: -0.001; lion-pytorch's Lion needs lr > 0"),
        (dict(betas=(0.9, 1.5)), ConfigError, r"Invalid beta parameter at index 1: 1.5; it must be in \[0, 1\]"),
        (dict(betas=(-0.1, 0.99)), ConfigError, r"Invalid beta parameter at index 0: -0.1; it must be in \[0, 1\]"),
        (dict(betas=0.9), ConfigTypeError, r"betas=0.9 must be a pair of numbers, e.g. betas=\(0.9, 0.99\)"),
        (dict(lr="1e-4"), ConfigTypeError, r"lr='1e-4' must be a number"),
        (dict(lr=torch.tensor(1e-4)), ConfigTypeError, r"lr=tensor\(.*\) must be a number"),
        (dict(weight_decay=None), ConfigTypeError, r"weight_decay=None must be a number"),
        (dict(use_triton=True), ConfigError, r"use_triton=True runs lion-pytorch's Triton kernel on a GPU; .* "
                                             r"pass use_triton=False"),
    ],
)
def test_what_lion_pytorch_asserts_is_refused_with_the_fix(kwargs, error, message) -> None:  # noqa: ANN001
    with pytest.raises(error, match=message):
        TieredLion(small_model(), **kwargs)


def test_lion_pytorch_refuses_the_same_values() -> None:
    """What TieredLion refuses as a ConfigError, lion-pytorch refuses with a bare assert."""
    for kwargs in (dict(lr=0.0), dict(betas=(0.9, 1.5)), dict(betas=(-0.1, 0.99))):
        with pytest.raises(AssertionError):
            Lion(small_model(), **kwargs)


def test_a_param_group_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"Invalid learning rate: 0 in param group 1; lion-pytorch's Lion needs lr > 0"):
        TieredLion([{"params": small_model()[:1]}, {"params": small_model()[1:], "lr": 0}])


def test_bf16_parameters_keep_a_master_equal_to_lion_on_fp32_copies() -> None:
    gen = torch.Generator().manual_seed(9)
    a = [torch.nn.Parameter(torch.randn(3000, generator=gen).bfloat16())]
    b = [torch.nn.Parameter(a[0].detach().float())]
    ref = Lion(b, lr=1e-3, weight_decay=0.1)
    with TieredLion(a, lr=1e-3, weight_decay=0.1, shard_numel=1024) as opt:
        for _ in range(3):
            g = torch.randn(3000, generator=gen).bfloat16()
            a[0].grad, b[0].grad = g, g.float()
            opt.step()
            ref.step()
        master = opt.state_dict()["state"][0]["master_param"]
        assert torch.equal(master, b[0].detach()) and torch.equal(a[0].detach(), master.bfloat16())
