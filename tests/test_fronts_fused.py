"""TieredAdam, TieredSGD and TieredAdagrad are bitwise torch's Adam, SGD and Adagrad with ``fused=True``.

For fp32 parameters, every parameter and every state tensor equals the torch
class's after every step, for random shapes, shard sizes, budgets (all in
RAM; streamed from disk through the arena alone), a private or a durable
state directory, every option of the class, two param groups with their own
values, parameters without a gradient on some steps and the lr changed
between steps; state dicts cross both ways (tiered -> torch -> tiered); a
closed state directory resumes; the compressed formats run and stay close
(Adagrad's ``sum`` is never compressed, so Adagrad stays bitwise); every
error says the torch class's message and the fix. PyTorch's own
``OptimizerInfo`` inputs are in ``tests/test_fronts_optim_db.py``.
"""

from __future__ import annotations

import io
import math
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import ConfigError, ConfigTypeError, TieredAdagrad, TieredAdam, TieredSGD
from tierstore._compute.algorithms import ADAGRAD, ADAM, SGD
from tierstore._compute.formats import CODED_FIELDS, SIGNED_FIELDS

FRONTS = {"adam": (TieredAdam, torch.optim.Adam), "sgd": (TieredSGD, torch.optim.SGD),
          "adagrad": (TieredAdagrad, torch.optim.Adagrad)}  # fmt: skip


# -- a case ---------------------------------------------------------------------


def adam_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "lr": st.sampled_from((1e-3, 0.05, 0.0)),
            "betas": st.tuples(st.sampled_from((0.9, 0.0)), st.sampled_from((0.999, 0.5))),
            "eps": st.sampled_from((1e-8, 1e-3)),
            "weight_decay": st.sampled_from((0.0, 0.1)),
            "amsgrad": st.booleans(),
            "maximize": st.booleans(),
            "decoupled_weight_decay": st.booleans(),
        }
    )


def sgd_options() -> st.SearchStrategy[dict[str, Any]]:
    def valid(o: dict[str, Any]) -> dict[str, Any]:
        if o["nesterov"] and (o["momentum"] == 0 or o["dampening"] != 0):
            o["nesterov"] = False  # torch refuses it (tested with the errors)
        return o

    return st.fixed_dictionaries(
        {
            "lr": st.sampled_from((1e-2, 0.3, 0.0)),
            "momentum": st.sampled_from((0.0, 0.9, 0.5)),
            "dampening": st.sampled_from((0.0, 0.3)),
            "weight_decay": st.sampled_from((0.0, 0.1)),
            "nesterov": st.booleans(),
            "maximize": st.booleans(),
        }
    ).map(valid)


def adagrad_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "lr": st.sampled_from((1e-2, 0.3, 0.0)),
            "lr_decay": st.sampled_from((0.0, 0.05)),
            "weight_decay": st.sampled_from((0.0, 0.1)),
            # a group's own value: torch ignores it (the constructor's is every sum's start)
            "initial_accumulator_value": st.sampled_from((0.0, 0.1, 2.0)),
            "eps": st.sampled_from((1e-10, 1e-3)),
            "maximize": st.booleans(),
        }
    )


OPTIONS = {"adam": adam_options, "sgd": sgd_options, "adagrad": adagrad_options}


@dataclass(frozen=True)
class Case:
    front: str
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per group
    options: tuple[dict[str, Any], ...]  # the constructor's, then each later group's own
    shard_numel: int
    tier: str  # "ram", "stream" (the arena alone, a private directory), "durable" (the arena, a state_dir)
    steps: int
    seed: int


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(
        st.tuples(st.integers(1, 5000)),
        st.tuples(st.integers(1, 70), st.integers(1, 70)),
        st.just(()),
    )


def cases(front: str) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        front=st.just(front),
        shapes=st.lists(st.lists(shapes(), min_size=1, max_size=3).map(tuple), min_size=1, max_size=2).map(tuple),
        options=st.lists(OPTIONS[front](), min_size=2, max_size=2).map(tuple),
        shard_numel=st.sampled_from((1024, 2048, 4096)),
        tier=st.sampled_from(("ram", "stream", "durable")),
        steps=st.integers(2, 4),
        seed=st.integers(0, 2**31 - 1),
    )


def groups_of(case: Case, tensors: list[list[torch.Tensor]]) -> tuple[list[dict], dict]:
    """Param groups (the first with the constructor's values, later ones with their own) and the constructor's."""
    constructor = dict(case.options[0])
    out = [{"params": tensors[0]}]
    for ps in tensors[1:]:
        out.append({"params": ps, **case.options[1]})
    return out, constructor


def fields_of(case: Case) -> int:
    opts = case.options[: len(case.shapes)]
    if case.front == "adam":
        return 3 if any(o["amsgrad"] for o in opts) else 2
    if case.front == "sgd":
        return int(any(o["momentum"] != 0 for o in opts))
    return 1


# -- running both ----------------------------------------------------------------


def clone_params(params: list[list[torch.nn.Parameter]]) -> list[list[torch.nn.Parameter]]:
    return [[torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in ps] for ps in params]


def set_grads(flat: list, ref_flat: list, gen: torch.Generator, *, all_of_them: bool) -> None:
    for p, r in zip(flat, ref_flat, strict=True):
        # Some parameters get no gradient on some steps (never on the first: torch's fused SGD
        # raises when a group mixes first and later steps, see test_sgd_first_steps_per_parameter).
        if not all_of_them and torch.rand((), generator=gen) < 0.25:
            p.grad = r.grad = None
            continue
        g = torch.randn(p.shape, generator=gen)
        p.grad, r.grad = g.clone(), g.clone()


def roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, flat: list, ref_flat: list) -> None:
    """Parameters and state dicts bitwise equal (the state dicts' groups equal, key for key)."""
    for i, (p, r) in enumerate(zip(flat, ref_flat, strict=True)):
        assert torch.equal(p.detach(), r.detach()), f"parameter {i} differs from torch's"
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"]), "state for different parameters"
    for i, theirs in rsd["state"].items():
        mine = sd["state"][i]
        assert list(mine) == list(theirs), f"parameter {i}: state keys {list(mine)} vs torch's {list(theirs)}"
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), f"parameter {i}: {key} differs"
    assert sd["param_groups"] == rsd["param_groups"]


def run_case(case: Case) -> None:
    tiered_cls, torch_cls = FRONTS[case.front]
    gen = torch.Generator().manual_seed(case.seed)
    shapes = case.shapes
    if case.tier != "ram":  # the state outgrows the arena, so shards really stream from disk
        shapes = ((*shapes[0], (5 * case.shard_numel + 100,)), *shapes[1:])
    params = [[torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ps] for ps in shapes]
    ref_params = clone_params(params)
    flat = [p for ps in params for p in ps]
    ref_flat = [p for ps in ref_params for p in ps]
    groups, constructor = groups_of(case, params)
    ref_groups, _ = groups_of(case, ref_params)
    ref = torch_cls(ref_groups, fused=True, **constructor)
    # The streaming arena alone: 4 slots of a shard's fields (fp32).
    budget = None if case.tier == "ram" else 4 * case.shard_numel * 4 * max(1, fields_of(case))
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = f"{tmp}/state" if case.tier == "durable" else None
        opt = tiered_cls(groups, ram_budget=budget, shard_numel=case.shard_numel, state_dir=state_dir,
                         **constructor)  # fmt: skip
        try:
            if case.tier != "ram" and fields_of(case):
                assert opt.plan.disk_shards, "the case meant to stream from disk"
            for step in range(case.steps):
                if step:
                    for g, rg in zip(opt.param_groups, ref.param_groups, strict=True):
                        g["lr"] = rg["lr"] = rg["lr"] * 0.5 + 1e-3  # lr changed between steps
                set_grads(flat, ref_flat, gen, all_of_them=step == 0)
                opt.step()
                ref.step()
                for i, (p, r) in enumerate(zip(flat, ref_flat, strict=True)):
                    assert torch.equal(p.detach(), r.detach()), f"step {step}: parameter {i} differs"
            assert_same(opt, ref, flat, ref_flat)
        finally:
            opt.close()


@settings(max_examples=12)
@given(case=cases("adam"))
def test_adam_bitwise_equal_to_fused_adam(case: Case) -> None:
    run_case(case)


@settings(max_examples=12)
@given(case=cases("sgd"))
def test_sgd_bitwise_equal_to_fused_sgd(case: Case) -> None:
    run_case(case)


@settings(max_examples=12)
@given(case=cases("adagrad"))
def test_adagrad_bitwise_equal_to_fused_adagrad(case: Case) -> None:
    run_case(case)


# -- state dicts both ways, resume -----------------------------------------------

SETTINGS = {
    "adam": dict(lr=0.01, weight_decay=0.1, amsgrad=True),
    "sgd": dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
    "adagrad": dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.3),
}


def two_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(20000, generator=gen)), torch.nn.Parameter(torch.randn(17, 5, generator=gen))]


def train(opt: torch.optim.Optimizer, params: list, gen: torch.Generator, steps: int, twins: list | None = None,
          twin: torch.optim.Optimizer | None = None) -> None:  # fmt: skip
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen)
            if twins is not None:
                twins[i].grad = p.grad.clone()
        opt.step()
        if twin is not None:
            twin.step()


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_state_dicts_cross_both_ways(front: str) -> None:
    tiered_cls, torch_cls = FRONTS[front]
    kwargs = SETTINGS[front]
    # torch -> tiered: a tiered optimizer loads torch's state and continues exactly as torch does.
    gen = torch.Generator().manual_seed(1)
    ps, qs = two_params(), two_params()
    ref = torch_cls(qs, fused=True, **kwargs)
    train(ref, qs, gen, 2)
    for p, q in zip(ps, qs, strict=True):
        p.data.copy_(q.data)
    with tiered_cls(ps, ram_budget=None, shard_numel=1024, **kwargs) as opt:
        opt.load_state_dict(roundtrip(ref.state_dict()))
        assert_same(opt, ref, ps, qs)
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)
        # tiered -> torch: a fresh torch optimizer loads the tiered state and continues alike.
        saved = roundtrip(opt.state_dict())
        again = torch_cls(qs, fused=True, **kwargs)
        again.load_state_dict(saved)
        train(opt, ps, gen, 2, qs, again)
        assert_same(opt, again, ps, qs)


@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("moment_dtype", ["float32", "int8"])
def test_a_closed_state_dir_resumes(tmp_path, front: str, moment_dtype: str) -> None:
    tiered_cls, torch_cls = FRONTS[front]
    kwargs = SETTINGS[front]
    gen = torch.Generator().manual_seed(2)
    ps, qs = two_params(), two_params()
    tiers = dict(state_dir=str(tmp_path / "s"), ram_budget=72 << 10, shard_numel=1024, moment_dtype=moment_dtype)
    opt = tiered_cls(ps, **tiers, **kwargs)
    ref = torch_cls(qs, fused=True, **kwargs)
    train(opt, ps, gen, 2, qs, ref)
    before = {k: {f: v.clone() for f, v in e.items()} for k, e in opt.state_dict()["state"].items()}
    opt.close()
    with tiered_cls(ps, resume=True, **tiers, **kwargs) as opt:
        assert opt.step_count == 2 and opt.plan.disk_shards
        after = opt.state_dict()["state"]
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[k][f], v) for k, e in before.items() for f, v in e.items())
        train(opt, ps, gen, 2, qs, ref)
        if moment_dtype == "float32" or front == "adagrad":  # Adagrad's sum is fp32 in every format
            assert_same(opt, ref, ps, qs)


# -- compressed formats -----------------------------------------------------------


@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("moment_dtype", ["bfloat16", "int8"])
def test_compressed_formats_run_and_stay_close(front: str, moment_dtype: str) -> None:
    tiered_cls, torch_cls = FRONTS[front]
    kwargs = SETTINGS[front]
    gen = torch.Generator().manual_seed(3)
    ps, qs = two_params(), two_params()
    with tiered_cls(ps, ram_budget=72 << 10, shard_numel=1024, moment_dtype=moment_dtype, **kwargs) as opt:
        ref = torch_cls(qs, fused=True, **kwargs)
        train(opt, ps, gen, 5, qs, ref)
        assert opt.plan.disk_shards and opt.moment_dtype == moment_dtype
        if front == "adagrad":
            # No format stores sum (it only grows: rounding would stall it), so Adagrad stays exact.
            assert opt.layout.encoded_fields == ()
            assert_same(opt, ref, ps, qs)
            return
        assert opt.layout.encoded_fields == opt.layout.fields  # every field compressed
        for p, q in zip(ps, qs, strict=True):
            assert not torch.equal(p, q)  # really rounded
            assert float((p - q).detach().abs().max()) < 0.02 * float(q.detach().abs().max())
        sd, rsd = opt.state_dict()["state"], ref.state_dict()["state"]
        for i, theirs in rsd.items():
            for key, value in theirs.items():
                if key != "step":
                    assert float((sd[i][key] - value).abs().max()) <= 0.05 * float(value.abs().max()), key


def test_which_fields_a_format_may_store() -> None:
    """Adam's moments and SGD's momentum are moving averages (rounding errors fade); Adagrad's sum only grows."""
    assert all(f.compressible for f in ADAM.fields) and ADAM.field("exp_avg").signed
    buf = SGD.field("momentum_buffer")
    assert buf.compressible and buf.signed and buf.lazy and buf.option == "momentum"
    total = ADAGRAD.field("sum")
    assert not total.compressible and total.init == "initial_accumulator_value"
    for algorithm in (ADAM, SGD, ADAGRAD):
        for f in algorithm.fields:
            assert (f.name in SIGNED_FIELDS) == f.signed
            if f.compressible:
                assert f.name in CODED_FIELDS


# -- semantics torch has and tierstore keeps -------------------------------------


def test_adagrad_has_state_from_construction_and_sums_start_at_the_constructors_value() -> None:
    ps, qs = two_params(), two_params()
    groups = lambda xs: [{"params": [xs[0]]}, {"params": [xs[1]], "initial_accumulator_value": 5.0}]  # noqa: E731
    with TieredAdagrad(groups(ps), lr=0.1, initial_accumulator_value=0.25) as opt:
        ref = torch.optim.Adagrad(groups(qs), lr=0.1, initial_accumulator_value=0.25, fused=True)
        assert_same(opt, ref, ps, qs)  # step 0 and sum 0.25 everywhere, as torch has them
        assert float(opt.state_dict()["state"][1]["sum"][0, 0]) == 0.25
        train(opt, ps, torch.Generator().manual_seed(4), 2, qs, ref)
        assert_same(opt, ref, ps, qs)


def test_adagrad_parameters_a_state_dict_leaves_out_start_over() -> None:
    gen = torch.Generator().manual_seed(5)
    ps, qs = two_params(), two_params()
    with TieredAdagrad(ps, lr=0.1, initial_accumulator_value=0.5) as opt:
        ref = torch.optim.Adagrad(qs, lr=0.1, initial_accumulator_value=0.5, fused=True)
        train(opt, ps, gen, 2, qs, ref)
        sd = ref.state_dict()
        del sd["state"][1]  # as torch does, the second parameter starts over: sum 0.5 at its next step
        ref.load_state_dict(sd)
        opt.load_state_dict(sd)
        assert sorted(opt.state_dict()["state"]) == [0]
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)


def test_adagrad_frozen_parameters_hold_no_state() -> None:
    """Note: torch's Adagrad lists a frozen parameter (step 0, its initial sum); tierstore keeps no state for it."""
    w, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with TieredAdagrad([w, frozen], lr=0.1) as opt:
        assert sorted(opt.state_dict()["state"]) == [0]
    assert sorted(torch.optim.Adagrad([w, frozen], lr=0.1, fused=True).state_dict()["state"]) == [0, 1]


def test_adagrad_added_groups_start_when_they_first_step() -> None:
    gen = torch.Generator().manual_seed(6)
    ps, qs = two_params(), two_params()
    with TieredAdagrad([ps[0]], lr=0.1, initial_accumulator_value=0.1) as opt:
        ref = torch.optim.Adagrad([qs[0]], lr=0.1, initial_accumulator_value=0.1, fused=True)
        train(opt, ps[:1], gen, 1, qs[:1], ref)
        opt.add_param_group({"params": [ps[1]], "lr": 0.2})
        ref.add_param_group({"params": [qs[1]], "lr": 0.2})
        assert_same(opt, ref, ps, qs)  # torch gives an added parameter no state until its first step
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)


def test_sgd_keeps_no_step_and_no_state_without_momentum(tmp_path) -> None:
    ps, qs = two_params(), two_params()
    with TieredSGD(ps, lr=0.1, weight_decay=0.1, state_dir=str(tmp_path / "s")) as opt:
        ref = torch.optim.SGD(qs, lr=0.1, weight_decay=0.1, fused=True)
        train(opt, ps, torch.Generator().manual_seed(7), 3, qs, ref)
        assert opt.layout.fields == () and opt.state_dict()["state"] == {} and opt.disk_bytes == 0
        assert_same(opt, ref, ps, qs)
    with TieredSGD(ps, lr=0.1, weight_decay=0.1, state_dir=str(tmp_path / "s"), resume=True) as opt:
        assert opt.step_count == 3


def test_sgd_momentum_turned_on_later_starts_its_buffer_then() -> None:
    """A group whose momentum is switched on takes its first momentum step then (dampening not applied),
    and one switched off and on again keeps its buffer, as torch's fused SGD does."""
    gen = torch.Generator().manual_seed(8)
    ps, qs = two_params(), two_params()
    groups = lambda xs: [{"params": [xs[0]], "momentum": 0.0}, {"params": [xs[1]]}]  # noqa: E731
    with TieredSGD(groups(ps), lr=0.1, momentum=0.9, dampening=0.5) as opt:
        ref = torch.optim.SGD(groups(qs), lr=0.1, momentum=0.9, dampening=0.5, fused=True)
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)
        for g in (opt.param_groups[0], ref.param_groups[0]):
            g["momentum"] = 0.8
        for g in (opt.param_groups[1], ref.param_groups[1]):
            g["momentum"] = 0.0
        train(opt, ps, gen, 2, qs, ref)
        for g in (opt.param_groups[1], ref.param_groups[1]):
            g["momentum"] = 0.9
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)


def test_sgd_first_steps_per_parameter() -> None:
    """A parameter whose first gradient comes later takes its own first step.

    torch's fused SGD raises there (TypeError: some buffers of the group are None); each
    parameter's update is its own, so the oracle is one torch optimizer per parameter.
    """
    gen = torch.Generator().manual_seed(9)
    ps, qs = two_params(), two_params()
    kwargs = dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1)
    with TieredSGD(ps, **kwargs) as opt:
        refs = [torch.optim.SGD([q], fused=True, **kwargs) for q in qs]
        for step in range(3):
            for i, (p, q) in enumerate(zip(ps, qs, strict=True)):
                p.grad = q.grad = None if (i == 1 and step == 0) else torch.randn(p.shape, generator=gen)
                if p.grad is not None:
                    q.grad = p.grad.clone()
            opt.step()
            for r in refs:
                r.step()
        for i, (p, q) in enumerate(zip(ps, qs, strict=True)):
            assert torch.equal(p, q)
            assert torch.equal(opt.state_dict()["state"][i]["momentum_buffer"], refs[i].state_dict()["state"][0]["momentum_buffer"])
        plain = torch.optim.SGD(two_params(), fused=True, **kwargs)
        for p in plain.param_groups[0]["params"][:1]:
            p.grad = torch.ones_like(p)
        plain.step()
        plain.param_groups[0]["params"][1].grad = torch.ones(17, 5)
        with pytest.raises(TypeError):  # what torch's fused SGD does with the same order of gradients
            plain.step()


def test_adam_groups_choose_their_kernel() -> None:
    """decoupled_weight_decay per group: torch's _fused_adamw_ for those, _fused_adam_ for the others;
    a state dict saved by torch's AdamW makes the groups decoupled, as torch.optim.Adam loads it."""
    gen = torch.Generator().manual_seed(10)
    ps, qs = two_params(), two_params()
    groups = lambda xs: [{"params": [xs[0]]}, {"params": [xs[1]], "decoupled_weight_decay": True}]  # noqa: E731
    with TieredAdam(groups(ps), lr=0.01, weight_decay=0.5) as opt:
        ref = torch.optim.Adam(groups(qs), lr=0.01, weight_decay=0.5, fused=True)
        train(opt, ps, gen, 3, qs, ref)
        assert_same(opt, ref, ps, qs)
        adamw = torch.optim.AdamW(two_params(), lr=0.01, weight_decay=0.5, fused=True)
        sd = adamw.state_dict()
        sd["param_groups"] = [sd["param_groups"][0], dict(sd["param_groups"][0], params=[])]
        sd["param_groups"][0]["params"], sd["param_groups"][1]["params"] = [0], [1]
        opt.load_state_dict(sd)
        ref.load_state_dict(sd)
        assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [True, True]
        train(opt, ps, gen, 2, qs, ref)
        assert_same(opt, ref, ps, qs)


# -- errors -----------------------------------------------------------------------

P = [torch.nn.Parameter(torch.ones(2))]
T = torch.tensor

# front, kwargs, error type, tierstore's message (regex), torch's own message where torch makes the check
ERRORS = [
    ("adam", dict(lr=-1.0), ConfigError, r"Invalid learning rate: -1.0; lr must be >= 0", "Invalid learning rate: -1.0"),
    ("adam", dict(lr=T([0.1, 0.1])), ConfigError, r"Tensor lr must be 1-element; pass", "Tensor lr must be 1-element"),
    ("adam", dict(lr="x"), ConfigTypeError, r"lr='x' must be a number", None),
    ("adam", dict(eps=-1.0), ConfigError, r"Invalid epsilon value: -1.0; eps must be >= 0", "Invalid epsilon value: -1.0"),
    ("adam", dict(betas=(1.0, 0.9)), ConfigError, r"Invalid beta parameter at index 0: 1.0; it must be in \[0, 1\)",
     "Invalid beta parameter at index 0: 1.0"),
    ("adam", dict(betas=(0.9, -0.1)), ConfigError, r"Invalid beta parameter at index 1: -0.1",
     "Invalid beta parameter at index 1: -0.1"),
    ("adam", dict(weight_decay=-1), ConfigError, r"Invalid weight_decay value: -1; it must be >= 0", "Invalid weight_decay value: -1"),
    ("adam", dict(betas=(0.9, T(0.99))), ConfigError, r"betas must be either both floats or both Tensors; pass",
     "betas must be either both floats or both Tensors"),
    ("adam", dict(lr=T(0.01), foreach=True), ConfigError,
     r"lr as a Tensor is not supported for capturable=False and foreach=True; pass a float lr",
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
    ("adam", dict(betas=(T(0.9), T(0.99)), foreach=True), ConfigError,
     r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True; pass",
     r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True"),
    ("adam", dict(capturable=True), ConfigError, r"capturable=True: CUDA graph capture has no meaning for TieredAdam", None),
    ("adam", dict(differentiable=True), ConfigError,
     r"`fused` does not support `differentiable`: .* pass differentiable=False", "`fused` does not support `differentiable`"),
    ("adam", dict(foreach=True), ConfigError, r"`fused` and `foreach` cannot be `True` together: .* pass foreach=None",
     "`fused` and `foreach` cannot be `True` together"),
    ("adam", dict(fused=False), ConfigError, r"fused=False: TieredAdam always runs torch's fused CPU kernel", None),
    ("sgd", dict(lr=-0.1), ConfigError, r"Invalid learning rate: -0.1; lr must be >= 0", "Invalid learning rate: -0.1"),
    ("sgd", dict(lr=T([0.1, 0.1])), ConfigError, r"Tensor lr must be 1-element", "Tensor lr must be 1-element"),
    ("sgd", dict(lr="x"), ConfigTypeError, r"lr='x' must be a number", None),
    ("sgd", dict(momentum=-0.5), ConfigError, r"Invalid momentum value: -0.5; momentum must be >= 0", "Invalid momentum value: -0.5"),
    ("sgd", dict(weight_decay=-1.0), ConfigError, r"Invalid weight_decay value: -1.0", "Invalid weight_decay value: -1.0"),
    ("sgd", dict(nesterov=True), ConfigError,
     r"Nesterov momentum requires a momentum and zero dampening \(momentum=0, dampening=0\); pass momentum > 0",
     "Nesterov momentum requires a momentum and zero dampening"),
    ("sgd", dict(nesterov=True, momentum=0.9, dampening=0.1), ConfigError,
     r"Nesterov momentum requires a momentum and zero dampening", "Nesterov momentum requires a momentum and zero dampening"),
    ("sgd", dict(differentiable=True), ConfigError, r"`fused` does not support `differentiable`.*TieredSGD",
     "`fused` does not support `differentiable`"),
    ("sgd", dict(foreach=True), ConfigError, r"`fused` and `foreach` cannot be `True` together: TieredSGD",
     "`fused` and `foreach` cannot be `True` together"),
    ("sgd", dict(fused=False), ConfigError, r"fused=False: TieredSGD .* pass fused=None or fused=True", None),
    ("adagrad", dict(lr=-1.0), ConfigError, r"Invalid learning rate: -1.0; lr must be >= 0", "Invalid learning rate: -1.0"),
    ("adagrad", dict(lr=T([0.1, 0.1])), ConfigError, r"Tensor lr must be 1-element", "Tensor lr must be 1-element"),
    ("adagrad", dict(lr_decay=-0.5), ConfigError, r"Invalid lr_decay value: -0.5; lr_decay must be >= 0", "Invalid lr_decay value: -0.5"),
    ("adagrad", dict(weight_decay=-1.0), ConfigError, r"Invalid weight_decay value: -1.0", "Invalid weight_decay value: -1.0"),
    ("adagrad", dict(initial_accumulator_value=-1.0), ConfigError, r"Invalid initial_accumulator_value value: -1.0; .* >= 0",
     "Invalid initial_accumulator_value value: -1.0"),
    ("adagrad", dict(eps=-1.0), ConfigError, r"Invalid epsilon value: -1.0; eps must be >= 0", "Invalid epsilon value: -1.0"),
    ("adagrad", dict(lr_decay="x"), ConfigTypeError, r"lr_decay='x' must be a number", None),
    ("adagrad", dict(differentiable=True), ConfigError, r"`fused` does not support `differentiable`.*TieredAdagrad",
     "`fused` does not support `differentiable`"),
    ("adagrad", dict(foreach=True), ConfigError, r"`fused` and `foreach` cannot be `True` together",
     "`fused` and `foreach` cannot be `True` together"),
    ("adagrad", dict(fused=False), ConfigError, r"fused=False: TieredAdagrad", None),
]  # fmt: skip


@pytest.mark.parametrize(("front", "kwargs", "error", "message", "torch_message"), ERRORS)
def test_construction_errors_say_torchs_message_and_the_fix(front, kwargs, error, message, torch_message) -> None:
    tiered_cls, torch_cls = FRONTS[front]
    with pytest.raises(error, match=message):
        tiered_cls(P, **kwargs)
    if torch_message is not None:  # torch refuses it too, with the message ours starts with
        with pytest.raises((ValueError, RuntimeError), match=torch_message):
            torch_cls(P, **{"fused": True, **kwargs})


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_a_param_groups_values_are_checked_too(front: str) -> None:
    tiered_cls, _ = FRONTS[front]
    with pytest.raises(ConfigError, match=r"Invalid learning rate: -1 in param group 1; lr must be >= 0"):
        tiered_cls([{"params": P}, {"params": [torch.nn.Parameter(torch.ones(1))], "lr": -1}])
    with pytest.raises(ConfigError, match=r"`fused` does not support `differentiable` in param group 0"):
        tiered_cls([{"params": P, "differentiable": True}])
    with pytest.raises(TypeError, match="ram_budgett"):
        tiered_cls(P, ram_budgett=1 << 20)


def test_adam_capturable_in_a_loaded_group_is_refused() -> None:
    with TieredAdam(P) as opt:
        sd = opt.state_dict()
        sd["param_groups"][0]["capturable"] = True
        with pytest.raises(ConfigError, match=r"capturable=True in loaded group 0: .* pass capturable=False"):
            opt.load_state_dict(sd)


def test_a_group_switching_to_an_option_the_state_lacks_is_refused_at_its_step() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    with TieredAdam([w]) as opt:
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ConfigError, match=r"switched to amsgrad=True after construction.*Build TieredAdam with amsgrad=True"):
            opt.step()
    with TieredSGD([w], lr=0.1) as opt:
        opt.param_groups[0]["momentum"] = 0.9
        with pytest.raises(ConfigError, match=r"switched to momentum=0.9 after construction.*Build TieredSGD with momentum > 0"):
            opt.step()


def test_loading_a_state_that_uses_an_option_the_state_lacks_is_refused() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    momentum = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
    momentum.step()
    with TieredSGD([w], lr=0.1) as opt, pytest.raises(
        ConfigError, match=r"loaded parameter group 0 uses momentum .* build TieredSGD with momentum > 0 \(e.g. momentum=0.9\)"
    ):
        opt.load_state_dict(momentum.state_dict())
    amsgrad = torch.optim.Adam([w], amsgrad=True, fused=True)
    amsgrad.step()
    with TieredAdam([w]) as opt, pytest.raises(ConfigError, match=r"uses amsgrad .* build TieredAdam with amsgrad=True"):
        opt.load_state_dict(amsgrad.state_dict())


def test_sgd_takes_a_nan_lr_as_torch_does() -> None:
    """torch.optim.SGD tests ``lr < 0.0``, which a NaN passes (Adam's ``0.0 <= lr`` does not)."""
    with TieredSGD(P, lr=math.nan) as opt:
        assert math.isnan(opt.param_groups[0]["lr"])
    torch.optim.SGD(P, lr=math.nan, fused=True)
    with pytest.raises(ConfigError, match="Invalid learning rate: nan"):
        TieredAdam(P, lr=math.nan)


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_sparse_gradients_are_refused_naming_the_front(front: str) -> None:
    """torch's fused kernels take no sparse gradient either (Adagrad's sparse path is its for-loop one)."""
    tiered_cls, _ = FRONTS[front]
    w = torch.nn.Parameter(torch.ones(3))
    with tiered_cls([w]) as opt:
        w.grad = torch.ones(3).to_sparse()
        with pytest.raises(RuntimeError, match=rf"{tiered_cls.__name__} does not support sparse gradients"):
            opt.step()
