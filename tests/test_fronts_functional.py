"""TieredRMSprop, TieredAdamax, TieredNAdam, TieredRAdam and TieredAdadelta are bitwise their torch classes.

For fp32 parameters every parameter and every state tensor (NAdam's
``mu_product`` included) equals the torch class's after every step, with
``foreach=False`` and ``foreach=True``, for random shapes, shard sizes, all
state in RAM or streamed from disk through the arena alone, a private or a
durable state directory, every option of the class, two param groups with
their own values, parameters without a gradient on some steps and the lr
changed between steps; bf16 parameters keep an fp32 master equal to the
torch class run on fp32 copies. State dicts cross both ways (torch ->
tiered -> torch) through ``torch.save``; a closed state directory resumes (NAdam's
``mu_product`` recorded beside each step: tests/test_param_scalars.py takes it
through checkpoints, DCP and crafted files); the compressed formats run (and centered RMSprop
refuses them); every error says torch's message and the fix. PyTorch's own
``OptimizerInfo`` database drives each front with its class's inputs and
error inputs.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import (
    ConfigError,
    ConfigTypeError,
    TieredAdadelta,
    TieredAdamax,
    TieredNAdam,
    TieredRAdam,
    TieredRMSprop,
)
from tierstore._compute.algorithms import ADADELTA, ADAMAX, NADAM, RADAM, RMSPROP
from tierstore._compute.formats import CODED_FIELDS, SIGNED_FIELDS

FRONTS = {
    "rmsprop": (TieredRMSprop, torch.optim.RMSprop),
    "adamax": (TieredAdamax, torch.optim.Adamax),
    "nadam": (TieredNAdam, torch.optim.NAdam),
    "radam": (TieredRAdam, torch.optim.RAdam),
    "adadelta": (TieredAdadelta, torch.optim.Adadelta),
}
ALGORITHMS = {"rmsprop": RMSPROP, "adamax": ADAMAX, "nadam": NADAM, "radam": RADAM, "adadelta": ADADELTA}
BETAS = st.tuples(st.sampled_from((0.9, 0.0, 0.5)), st.sampled_from((0.999, 0.9, 0.5)))
OPTIONS = {
    "rmsprop": dict(lr=(1e-2, 1e-3, 0.0), alpha=(0.99, 0.5, 0.0), eps=(1e-8, 1e-3), weight_decay=(0.0, 0.1),
                    momentum=(0.0, 0.9), centered=(False, True), maximize=(False, True)),
    "adamax": dict(lr=(2e-3, 0.1, 0.0), betas=BETAS, eps=(1e-8, 1e-3), weight_decay=(0.0, 0.1), maximize=(False, True)),
    "nadam": dict(lr=(2e-3, 0.1), betas=BETAS, eps=(1e-8, 1e-3), weight_decay=(0.0, 0.1),
                  momentum_decay=(4e-3, 0.0, 0.5), decoupled_weight_decay=(False, True), maximize=(False, True)),
    # beta2 = 0.9 reaches RAdam's rectified branch (rho_t > 5) by step 6; 0.5 never does
    "radam": dict(lr=(1e-3, 0.1), betas=st.tuples(st.sampled_from((0.9, 0.0)), st.sampled_from((0.9, 0.5, 0.999))),
                  eps=(1e-8, 1e-3), weight_decay=(0.0, 0.1), decoupled_weight_decay=(False, True),
                  maximize=(False, True)),
    "adadelta": dict(lr=(1.0, 0.3, 0.0), rho=(0.9, 0.0, 1.0), eps=(1e-6, 1e-3), weight_decay=(0.0, 0.1),
                     maximize=(False, True)),
}  # fmt: skip


def options(name: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {k: v if isinstance(v, st.SearchStrategy) else st.sampled_from(v) for k, v in OPTIONS[name].items()}
    )


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(st.tuples(st.integers(1, 5000)), st.tuples(st.integers(1, 60), st.integers(1, 60)), st.just(()))


@dataclass(frozen=True)
class Case:
    name: str
    groups: tuple[tuple[tuple[tuple[int, ...], ...], dict[str, Any]], ...]  # (shapes, options) per group
    foreach: bool
    shard_numel: int
    streamed: bool  # the budget holds the arena only: every shard streams from disk
    storage: str  # "private" (state_dir=None) or "durable" (a state_dir)
    steps: int
    seed: int


def cases(name: str) -> st.SearchStrategy[Case]:
    group = st.tuples(st.lists(shapes(), min_size=1, max_size=3).map(tuple), options(name))
    return st.builds(
        Case,
        name=st.just(name),
        groups=st.lists(group, min_size=1, max_size=2).map(tuple),
        foreach=st.booleans(),
        shard_numel=st.sampled_from((1024, 2048)) | st.integers(1024, 4096),
        streamed=st.booleans(),
        storage=st.sampled_from(("private", "durable")),
        steps=st.integers(2, 7),
        seed=st.integers(0, 2**31 - 1),
    )


# -- running both ----------------------------------------------------------------


def make_params(case: Case, gen: torch.Generator) -> list[list[torch.nn.Parameter]]:
    out = [[torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes] for shapes, _ in case.groups]
    if case.streamed:  # a state larger than the arena (4 slots), so shards really stream from disk
        shard = -(-case.shard_numel // 1024) * 1024  # shard sizes round up to 1024 elements
        out[0].append(torch.nn.Parameter(torch.randn(5 * shard + 100, generator=gen)))
    return out


def group_dicts(case: Case, params: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    return [dict(params=ps, **opts) for (_, opts), ps in zip(case.groups, params)]


def clone_params(params: list[list[torch.nn.Parameter]]) -> list[list[torch.nn.Parameter]]:
    return [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in params]


def roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def random_grads(flat: list, ref_flat: list, gen: torch.Generator) -> None:
    for p, r in zip(flat, ref_flat):
        if torch.rand((), generator=gen) < 0.2:  # no gradient this step: its state must not move
            p.grad = r.grad = None
            continue
        g = torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-3, 2, (), generator=gen))
        p.grad, r.grad = g, g.clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.detach().reshape(-1)


def check_equal(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, flat: list, ref_flat: list) -> None:
    for i, (p, r) in enumerate(zip(flat, ref_flat)):
        assert torch.equal(bits(p), bits(r)), f"parameter {i} differs from {type(ref).__name__}"
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"]), "state for different parameters"
    for i, theirs in rsd["state"].items():
        mine = sd["state"][i]
        assert list(mine) == list(theirs), f"parameter {i}: keys {list(mine)} in torch's order {list(theirs)}"
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype and torch.equal(bits(mine[key]), bits(value)), f"parameter {i}: {key}"
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    assert groups == rsd["param_groups"]


def run_case(case: Case) -> None:
    front, torch_cls = FRONTS[case.name]
    gen = torch.Generator().manual_seed(case.seed)
    params = make_params(case, gen)
    ref_params = clone_params(params)
    flat, ref_flat = [p for ps in params for p in ps], [p for ps in ref_params for p in ps]
    ref = torch_cls(group_dicts(case, ref_params), foreach=case.foreach)
    kw = dict(foreach=case.foreach, shard_numel=case.shard_numel)
    budget = None
    if case.streamed:
        with front(group_dicts(case, params), **kw) as probe:
            budget = 4 * probe.plan.slot_nbytes + probe.plan.staging_nbytes  # the arena alone
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = None if case.storage == "private" else f"{tmp}/state"
        with front(group_dicts(case, params), ram_budget=budget, state_dir=state_dir, **kw) as opt:
            if case.streamed:
                assert opt.plan.resident == () and opt.disk_bytes > 0
            for step in range(case.steps):
                if step == 2:  # an LR schedule's change between steps
                    for g, rg in zip(opt.param_groups, ref.param_groups):
                        g["lr"] = rg["lr"] = rg["lr"] * 0.5 + 1e-3
                random_grads(flat, ref_flat, gen)
                opt.step()
                ref.step()
            check_equal(opt, ref, flat, ref_flat)


@pytest.mark.parametrize("name", list(FRONTS))
@settings(max_examples=10)
@given(data=st.data())
def test_bitwise_equal_to_the_torch_class(name: str, data: st.DataObject) -> None:
    run_case(data.draw(cases(name)))


# -- state dicts both ways, resume ---------------------------------------------------


def small_model(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((40, 30), (3000,), (7,), ())]


FULL = {  # every option that adds a field or a scalar on
    "rmsprop": dict(momentum=0.9, centered=True, weight_decay=0.1),
    "adamax": dict(weight_decay=0.1, maximize=True),
    "nadam": dict(weight_decay=0.1, momentum_decay=0.01, decoupled_weight_decay=True),
    "radam": dict(betas=(0.9, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
    "adadelta": dict(rho=0.8, weight_decay=0.1),
}


def arena_budget(front: type, params: list, **kw: Any) -> int:
    """A budget that holds the streaming arena alone (4 slots): every shard streams from disk."""
    with front(params, **kw) as probe:
        return 4 * probe.plan.slot_nbytes + probe.plan.staging_nbytes + probe.plan.scratch_nbytes


def train(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, a: list, b: list, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        random_grads(a, b, gen)
        opt.step()
        ref.step()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(FRONTS))
def test_state_dicts_cross_both_ways(name: str, foreach: bool) -> None:
    front, torch_cls = FRONTS[name]
    kw = dict(FULL[name], foreach=foreach)
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(1)
    ref = torch_cls(b, **kw)
    with front(a, shard_numel=1024, **kw) as opt:
        train(opt, ref, a, b, gen, 3)
        saved = roundtrip(ref.state_dict())  # torch -> tiered
    with front(a, shard_numel=2048, **kw) as opt:
        opt.load_state_dict(saved)
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)
        ref = torch_cls(b, **kw)  # tiered -> torch
        ref.load_state_dict(roundtrip(opt.state_dict()))
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)


@pytest.mark.parametrize("name", list(FRONTS))
def test_a_closed_state_dir_resumes_bitwise(name: str, tmp_path) -> None:
    front, torch_cls = FRONTS[name]
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(2)
    ref = torch_cls(b, **FULL[name])
    budget = arena_budget(front, a, shard_numel=1024, **FULL[name])
    with front(a, state_dir=str(tmp_path), shard_numel=1024, ram_budget=budget, **FULL[name]) as opt:
        assert opt.disk_bytes > 0
        train(opt, ref, a, b, gen, 3)
    with front(a, state_dir=str(tmp_path), resume=True, **FULL[name]) as opt:
        assert opt.step_count == 3
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)


def test_nadam_keeps_mu_product_per_parameter_and_refuses_a_state_dict_without_it() -> None:
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(3)
    ref = torch.optim.NAdam(b, momentum_decay=0.05)
    with TieredNAdam(a, momentum_decay=0.05, shard_numel=1024) as opt:
        a[0].grad, b[0].grad = torch.ones(40, 30), torch.ones(40, 30)  # one parameter steps alone first
        opt.step()
        ref.step()
        train(opt, ref, a, b, gen, 2)
        check_equal(opt, ref, a, b)
        mu = opt.state_dict()["state"]
        assert float(mu[0]["mu_product"]) != float(mu[1]["mu_product"])  # each parameter its own product
        assert opt.param_scalars() == {"mu_product": [float(e["mu_product"]) for e in mu.values()]}  # what adapters record
        broken = opt.state_dict()
        del broken["state"][1]["mu_product"]
        with pytest.raises(ConfigError, match=r"loaded state of parameter 1 has a step but no mu_product"):
            opt.load_state_dict(broken)


# -- compressed formats ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("name", list(FRONTS))
def test_compressed_formats_run_and_stay_close(name: str, fmt: str) -> None:
    front, torch_cls = FRONTS[name]
    kw = dict(FULL[name])
    if name == "rmsprop":
        kw["centered"] = False  # centered keeps float32 moments (test_centered_rmsprop_refuses...)
    a, b = small_model(), small_model()
    gen = torch.Generator().manual_seed(4)
    ref = torch_cls(b, **kw)
    budget = arena_budget(front, a, moment_dtype=fmt, shard_numel=1024, **kw)
    with front(a, moment_dtype=fmt, shard_numel=1024, ram_budget=budget, **kw) as opt:
        assert opt.disk_bytes > 0  # streamed too
        algorithm = ALGORITHMS[name]
        fields = [f for f in opt.layout.field_order if f != "master"]
        assert opt.layout.encoded_fields == tuple(f for f in fields if algorithm.field(f).compressible)
        train(opt, ref, a, b, gen, 4)
        for p, r in zip(a, b):
            assert torch.isfinite(p).all()
            assert torch.allclose(p, r, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_centered_rmsprop_refuses_compressed_formats(fmt: str) -> None:
    with pytest.raises(ConfigError, match=rf"moment_dtype='{fmt}' with centered=True: .* use moment_dtype='float32'"):
        TieredRMSprop(small_model(), centered=True, moment_dtype=fmt)
    TieredRMSprop(small_model(), centered=False, moment_dtype=fmt).close()


def test_fields_say_which_formats_may_store_them_and_their_sign() -> None:
    """RMSprop's grad_avg and Adamax's exp_inf stay float32 (a difference that must stay >= 0, a divisor);
    every other field is an average a format may round."""
    never = {("rmsprop", "grad_avg"), ("adamax", "exp_inf")}
    signed = {"exp_avg", "momentum_buffer", "grad_avg"}
    for name, algorithm in ALGORITHMS.items():
        for f in algorithm.fields:
            assert f.compressible == ((name, f.name) not in never), (name, f.name)
            assert f.signed == (f.name in signed) == (f.name in SIGNED_FIELDS), (name, f.name)
            assert not f.compressible or f.name in CODED_FIELDS
    assert NADAM.scalar_inits == {"mu_product": 1.0} and NADAM.state_scalars == ("step", "mu_product")


# -- errors ---------------------------------------------------------------------------


def test_flags_without_cpu_meaning_are_refused() -> None:
    for front, _ in FRONTS.values():
        for flag in ("capturable", "differentiable"):
            with pytest.raises(ConfigError, match=rf"{flag}=True is not supported by {front.__name__}: .* pass {flag}=False"):
                front(small_model(), **{flag: True})
            with pytest.raises(ConfigError, match=rf"{flag}=True in param group 1 is not supported"):
                front([{"params": small_model()[:1]}, {"params": small_model()[1:], flag: True}])


@pytest.mark.parametrize("name", list(FRONTS))
def test_values_that_are_not_numbers_are_type_errors(name: str) -> None:
    front, _ = FRONTS[name]
    with pytest.raises(ConfigTypeError, match=r"lr='fast' must be a number"):
        front(small_model(), lr="fast")
    with pytest.raises(ConfigTypeError, match=r"eps=None must be a number"):
        front(small_model(), eps=None)


def test_betas_that_are_not_a_pair_are_type_errors() -> None:
    with pytest.raises(ConfigTypeError, match=r"betas=0.9 must be a pair of numbers, e.g. betas=\(0.9, 0.999\)"):
        TieredAdamax(small_model(), betas=0.9)


def test_an_option_a_group_takes_up_later_needs_its_field() -> None:
    a = small_model()
    with TieredRMSprop(a) as opt:
        opt.param_groups[0]["momentum"] = 0.9
        for p in a:
            p.grad = torch.ones_like(p)
        with pytest.raises(ConfigError, match=r"uses momentum > 0 but the state has no momentum_buffer .* build "
                                              r"TieredRMSprop with momentum > 0 from the start"):  # fmt: skip
            opt.step()
    with TieredNAdam(small_model()) as opt:
        opt.param_groups[0]["capturable"] = True
        with pytest.raises(ConfigError, match=r"a param group now has capturable=True, which TieredNAdam does not"):
            opt.step()


def test_a_loaded_group_torch_would_refuse_is_refused() -> None:
    a = small_model()
    with TieredAdadelta(a) as opt:
        sd = opt.state_dict()
        sd["param_groups"][0]["rho"] = 1.5
        with pytest.raises(ConfigError, match=r"Invalid rho value: 1.5 in loaded group 0; rho must be in \[0, 1\]"):
            opt.load_state_dict(sd)


# -- PyTorch's OptimizerInfo database -----------------------------------------------------

# Read in a child process: importing the database imports torch._dynamo (about 100 MiB of RSS),
# which this process must not carry into the RAM tests that may run after it on the same worker.
_EXTRACT = r"""
import sys
import torch
from torch.testing._internal.common_optimizers import optim_db

out = {}
for info in optim_db:
    name = info.optim_cls.__name__
    if name not in sys.argv[2:]:
        continue
    errors = []
    for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        i = e.optimizer_error_input
        errors.append((i.desc, i.params, i.kwargs, e.error_type.__name__, e.error_regex, e.error_on.name))
    out[name] = {"inputs": [(i.desc, i.params, i.kwargs) for i in info.optim_inputs_func(device="cpu")],
                 "errors": errors, "impls": list(info.supported_impls)}
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def optim_db(tmp_path_factory) -> dict[str, Any]:
    """torch's OptimizerInfo entries of these classes: CPU inputs and error inputs (the import needs expecttest)."""
    pytest.importorskip("expecttest", reason="torch's OptimizerInfo database needs expecttest (the test extra)")
    path = tmp_path_factory.mktemp("optim_db") / "inputs.pt"
    names = [torch_cls.__name__ for _, torch_cls in FRONTS.values()]
    done = subprocess.run([sys.executable, "-c", _EXTRACT, str(path), *names], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, f"reading torch's optim_db failed:\n{done.stderr[-3000:]}"
    db = torch.load(path, weights_only=False)  # written just now, by the child above
    return {name: db[torch_cls.__name__] for name, (_, torch_cls) in FRONTS.items()}


def skip_reason(kwargs: dict[str, Any]) -> str | None:
    """Why a torch input does not apply here. None of the CPU inputs is skipped: capturable (CUDA graphs),
    differentiable (autograd through the step) and sparse gradients are not CPU inputs of these classes;
    tierstore refuses the first two with a ConfigError (tested above)."""
    for flag in ("capturable", "differentiable"):
        if kwargs.get(flag):
            return f"{flag}=True: refused with a ConfigError (test_flags_without_cpu_meaning_are_refused)"
    return None


def db_model() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(5)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((10, 5), (5,), (2500,))]
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", list(FRONTS))
def test_optim_db_inputs_are_bitwise_torchs(optim_db, name: str, foreach: bool) -> None:
    db = optim_db[name]
    assert "foreach" in db["impls"]
    torch_cls = FRONTS[name][1]
    ran, skipped = 0, []
    for desc, params, kwargs in db["inputs"]:
        kwargs = dict(kwargs)
        reason = skip_reason(kwargs) or (None if params is None else "its own params")
        if reason is not None:
            skipped.append(f"{desc}: {reason}")
            continue
        kwargs["foreach"] = foreach
        a, b = db_model()
        ref = torch_cls(b, **kwargs)
        with FRONTS[name][0](a, shard_numel=1024, **kwargs) as opt:
            train(opt, ref, a, b, torch.Generator().manual_seed(6), 3)
            check_equal(opt, ref, a, b)
        ran += 1
    assert ran >= 5 and not skipped, f"{ran} of torch's inputs ran; skipped: {skipped}"


@pytest.mark.parametrize("name", list(FRONTS))
def test_optim_db_error_inputs_raise_torchs_errors(optim_db, name: str) -> None:
    front = FRONTS[name][0]
    errors = optim_db[name]["errors"]
    assert len(errors) >= 5, f"optim_db has only {len(errors)} CPU error inputs for {name}"
    for desc, params, kwargs, error_name, regex, error_on in errors:
        assert error_on == "CONSTRUCTION_ERROR", f"{name} {desc}: a step error input: check it here"
        error = getattr(builtins, error_name)
        params = params if params is not None else [torch.nn.Parameter(torch.randn(2, 3))]
        if issubclass(error, Warning):
            # tierstore may refuse what torch only warns about; the warning came first
            with pytest.warns(error, match=regex), contextlib.suppress(ValueError, TypeError):
                front(params, **kwargs).close()
        else:
            with pytest.raises(error, match=regex):
                front(params, **kwargs)


def test_messages_are_torchs_with_the_fix() -> None:
    """Each refusal starts with torch's own message (the OptimizerInfo regexes check the same) and says the fix."""
    cases = [
        (TieredRMSprop, dict(alpha=-1.0), "Invalid alpha value: -1.0; alpha must be >= 0"),
        (TieredRMSprop, dict(momentum=-0.1), "Invalid momentum value: -0.1; momentum must be >= 0"),
        (TieredAdamax, dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0; betas[1] must be in [0, 1)"),
        (TieredNAdam, dict(momentum_decay=-1.0), "Invalid momentum_decay value: -1.0; momentum_decay must be >= 0"),
        (TieredRAdam, dict(eps=-1.0), "Invalid epsilon value: -1.0; eps must be >= 0"),
        (TieredAdadelta, dict(rho=1.1), "Invalid rho value: 1.1; rho must be in [0, 1]"),
        (TieredAdadelta, dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element; pass a float or a 1-element tensor"),
    ]
    for front, kwargs, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            front(small_model(), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TieredAdadelta(small_model(), rho=1.0).close()  # the bounds torch allows are allowed


@pytest.mark.parametrize("name", list(FRONTS))
def test_bf16_parameters_keep_a_master_equal_to_torch_on_fp32_copies(name: str) -> None:
    front, torch_cls = FRONTS[name]
    gen = torch.Generator().manual_seed(7)
    a = [torch.nn.Parameter(torch.randn(3000, generator=gen).bfloat16())]
    b = [torch.nn.Parameter(a[0].detach().float())]
    ref = torch_cls(b, **FULL[name])
    with front(a, shard_numel=1024, **FULL[name]) as opt:
        for _ in range(3):
            g = torch.randn(3000, generator=gen).bfloat16()
            a[0].grad, b[0].grad = g, g.float()
            opt.step()
            ref.step()
        master = opt.state_dict()["state"][0]["master_param"]
        assert torch.equal(bits(master), bits(b[0])) and torch.equal(a[0].detach(), master.bfloat16())
