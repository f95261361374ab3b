"""TieredAdamW works wherever a ``torch.optim.AdamW`` does (issue 2, points 2 and 5).

state_dict structure and cross-loading, LR schedulers, ``clip_grad_norm_``,
``GradScaler``, closures, ``zero_grad``, hooks, the context manager and
``close()``. Every comparison is bitwise against ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import ClosedError, StateExistsError, TieredAdamW

# Budgets: everything in RAM, and a tight one that streams most shards from disk.
BUDGETS = ("ram", "disk")
SHARD = 1024


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 64), nn.Tanh(), nn.Linear(64, 1))
    return model.to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 32, generator=gen).to(dtype), torch.randn(16, 1, generator=gen).to(dtype)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step, next(model.parameters()).dtype)
    return (model(x) - y).float().square().mean()


def tiered(params, budget: str = "ram", **kwargs) -> TieredAdamW:
    """A TieredAdamW with all state in RAM, or with the arena and one resident shard."""
    params = list(params)
    kwargs.setdefault("shard_numel", SHARD)
    kwargs.setdefault("backend", "buffered")
    ram_budget = None
    if budget == "disk":
        probe_kwargs = {k: v for k, v in kwargs.items() if k not in ("state_dir", "durable", "resume")}
        with TieredAdamW(params, **probe_kwargs) as probe:
            plan = probe.plan
        ram_budget = 5 * plan.slot_nbytes + plan.staging_nbytes  # 4 arena slots + 1 resident
    opt = TieredAdamW(params, ram_budget=ram_budget, **kwargs)
    assert (budget == "disk") == bool(opt.plan.disk_shards)
    return opt


def two_models(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    model = make_model(dtype=dtype)
    return model, copy.deepcopy(model)


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs"


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, before_step: Callable | None = None):
    for step in steps:
        opt.zero_grad()
        loss_of(model, step).backward()
        if before_step is not None:
            before_step(model, step)
        opt.step()


def roundtrip(sd: dict) -> dict:
    """Through torch.save/torch.load (weights_only), as a checkpoint would go."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# -- state_dict structure ----------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_has_the_structure_of_torch_adamw(budget: str, amsgrad: bool) -> None:
    model, ref_model = two_models()
    groups = lambda m: [  # noqa: E731
        {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
        {"params": [m[0].bias, m[2].bias, m[4].weight, m[4].bias], "weight_decay": 0.0, "lr": 3e-3},
    ]
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-3, amsgrad=amsgrad, fused=True)
    with tiered(groups(model), budget, lr=1e-3, amsgrad=amsgrad) as opt:
        # Before any step: no per-parameter state, as in torch.
        assert opt.state_dict()["state"] == {} and ref.state_dict()["state"] == {}
        model[4].bias.requires_grad_(False)  # one parameter never gets a gradient
        ref_model[4].bias.requires_grad_(False)
        train(model, opt, range(3))
        train(ref_model, ref, range(3))
        mine, theirs = opt.state_dict(), ref.state_dict()

    assert set(mine) == set(theirs) == {"state", "param_groups"}
    assert len(mine["param_groups"]) == len(theirs["param_groups"])
    for g_mine, g_theirs in zip(mine["param_groups"], theirs["param_groups"]):
        assert set(g_theirs) <= set(g_mine), f"missing group keys {set(g_theirs) - set(g_mine)}"
        for key, value in g_theirs.items():
            assert g_mine[key] == value, f"group key {key}: {g_mine[key]!r} != {value!r}"
    assert sorted(mine["state"]) == sorted(theirs["state"]) == [0, 1, 2, 3, 4]
    for i, entry in theirs["state"].items():
        assert set(entry) <= set(mine["state"][i])
        for key, value in entry.items():
            got = mine["state"][i][key]
            assert got.dtype == value.dtype and got.shape == value.shape and got.device == value.device, key
            assert torch.equal(got, value), f"param {i} {key}"
    assert_same_params(model, ref_model)


def test_state_dict_tensors_are_copies() -> None:
    """Mutating a returned state dict must not change the optimizer's state."""
    model, ref_model = two_models()
    with tiered(model.parameters(), "disk") as opt:
        ref = torch.optim.AdamW(ref_model.parameters(), fused=True)
        train(model, opt, range(2))
        train(ref_model, ref, range(2))
        sd = opt.state_dict()
        for entry in sd["state"].values():
            entry["exp_avg"].fill_(7.0)
            entry["step"].fill_(99.0)
        sd["param_groups"][0]["lr"] = 123.0
        train(model, opt, range(2, 4))
        train(ref_model, ref, range(2, 4))
    assert_same_params(model, ref_model)


# -- loading either way ------------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_state_dict_loads_into_tiered_and_training_continues(budget: str, amsgrad: bool) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=2e-3, weight_decay=0.05, amsgrad=amsgrad, fused=True)
    train(ref_model, ref, range(3))
    saved = roundtrip(ref.state_dict())
    model.load_state_dict(ref_model.state_dict())
    with tiered(model.parameters(), budget, amsgrad=amsgrad) as opt:  # other hyperparameters: loaded
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[0]["weight_decay"] == 0.05
        train(model, opt, range(3, 6))
        train(ref_model, ref, range(3, 6))
        assert_same_params(model, ref_model)
        mine, theirs = opt.state_dict(), ref.state_dict()
    for i, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(mine["state"][i][key], value), f"param {i} {key}"


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("keep_master", [None, True])
def test_tiered_state_dict_loads_into_torch_and_training_continues(budget: str, keep_master) -> None:
    model, ref_model = two_models()
    with tiered(model.parameters(), budget, lr=2e-3, amsgrad=True, keep_master=keep_master) as opt:
        train(model, opt, range(3))
        saved = roundtrip(opt.state_dict())
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1.0, fused=True)
    ref.load_state_dict(saved)
    assert ref.param_groups[0]["lr"] == 2e-3 and ref.param_groups[0]["amsgrad"] is True
    # Training continues identically in torch and in a TieredAdamW loaded from the same dict.
    again = make_model(seed=5)
    again.load_state_dict(model.state_dict())
    with tiered(again.parameters(), budget, amsgrad=True, keep_master=keep_master) as opt2:
        opt2.load_state_dict(saved)
        train(again, opt2, range(3, 6))
    train(ref_model, ref, range(3, 6))
    assert_same_params(again, ref_model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_bf16_state_dict_round_trip_restores_master_weights(budget: str) -> None:
    """Loading a bf16 run's state dict gives the parameters their saved master, cast to bf16."""
    model, twin = two_models(torch.bfloat16)
    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        train(model, opt, range(3))
        saved = roundtrip(opt.state_dict())
        train(model, opt, range(3, 6))
        final = opt.state_dict()
    for entry in saved["state"].values():
        assert entry["master_param"].dtype == torch.float32
    other = make_model(seed=9, dtype=torch.bfloat16)  # different weights: the master must win
    with tiered(other.parameters(), budget) as opt2:
        opt2.load_state_dict(saved)
        for i, p in enumerate(other.parameters()):
            assert torch.equal(p, saved["state"][i]["master_param"].to(torch.bfloat16))
        train(other, opt2, range(3, 6))
        resumed = opt2.state_dict()
    assert_same_params(other, model)
    for i, entry in final["state"].items():
        for key, value in entry.items():
            assert torch.equal(resumed["state"][i][key], value), f"param {i} {key}"


# -- the usual training-loop companions ---------------------------------------


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    "Sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)],
        milestones=[3],
    ),
}


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_lr_schedulers_give_the_same_params_as_with_torch_adamw(name: str, budget: str) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref)
        for step in range(8):
            train(model, opt, [step])
            train(ref_model, ref, [step])
            sched.step()
            ref_sched.step()
            assert sched.get_last_lr() == ref_sched.get_last_lr()
            assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
        assert_same_params(model, ref_model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_reduce_lr_on_plateau(budget: str) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(ref, patience=0, factor=0.5)
        for step in range(6):
            train(model, opt, [step])
            train(ref_model, ref, [step])
            sched.step(1.0)  # never improves: lr halves
            ref_sched.step(1.0)
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < 1e-2
        assert_same_params(model, ref_model)


@pytest.mark.parametrize("budget", BUDGETS)
def test_clip_grad_norm_before_step(budget: str) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)

    def clip(m, step):
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)

    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        train(model, opt, range(4), before_step=clip)
    train(ref_model, ref, range(4), before_step=clip)
    assert_same_params(model, ref_model)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("unscale_and_clip", [False, True])
def test_grad_scaler_around_step(budget: str, unscale_and_clip: bool) -> None:
    """GradScaler on the CPU, including a step whose gradients overflow (it must be skipped)."""
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        for m, o in ((model, opt), (ref_model, ref)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            for step in range(5):
                o.zero_grad()
                scaler.scale(loss_of(m, step)).backward()
                if step == 2:
                    m[0].weight.grad[0, 0] = float("inf")  # overflow: the step is skipped
                if unscale_and_clip:
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.5)
                scaler.step(o)
                scaler.update()
            assert scaler.get_scale() < 2.0**10  # the overflow lowered the scale
        assert_same_params(model, ref_model)
        mine, theirs = opt.state_dict(), ref.state_dict()
    for i, entry in theirs["state"].items():
        assert float(mine["state"][i]["step"]) == float(entry["step"]) == 4.0
        assert torch.equal(mine["state"][i]["exp_avg_sq"], entry["exp_avg_sq"])


@pytest.mark.parametrize("budget", BUDGETS)
def test_step_with_closure(budget: str) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    calls = []

    def closure_for(m, o, step):
        def closure():
            calls.append(torch.is_grad_enabled())
            o.zero_grad()
            loss = loss_of(m, step)
            loss.backward()
            return loss

        return closure

    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        for step in range(3):
            with torch.no_grad():  # step() must still enable grad for the closure
                got = opt.step(closure_for(model, opt, step))
            want = ref.step(closure_for(ref_model, ref, step))
            assert torch.equal(got, want)
    assert calls == [True] * 6
    assert_same_params(model, ref_model)


def test_step_without_closure_returns_none() -> None:
    w = nn.Parameter(torch.ones(3))
    with tiered([w]) as opt:
        w.grad = torch.ones(3)
        assert opt.step() is None
        assert opt.step_count == 1


@pytest.mark.parametrize("budget", BUDGETS)
def test_zero_grad(budget: str) -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with tiered(model.parameters(), budget, lr=1e-2) as opt:
        loss_of(model, 0).backward()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        loss_of(model, 0).backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        # A step on zero gradients still decays weights and advances the moments, as in torch.
        opt.step()
        loss_of(ref_model, 0).backward()
        ref.zero_grad(set_to_none=False)
        ref.step()
        assert_same_params(model, ref_model)


def test_is_a_torch_optimizer_with_working_hooks() -> None:
    w = nn.Parameter(torch.ones(4))
    seen = []
    with tiered([w]) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
        opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
        opt.register_state_dict_post_hook(lambda o, sd: seen.append("sd"))
        w.grad = torch.ones(4)
        opt.step()
        opt.state_dict()
    assert seen == ["pre", "post", "sd"]


def test_tensor_lr_like_torch() -> None:
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=torch.tensor(1e-2), fused=True)
    with tiered(model.parameters(), "disk", lr=torch.tensor(1e-2)) as opt:
        train(model, opt, range(3))
    train(ref_model, ref, range(3))
    assert_same_params(model, ref_model)


# -- lifecycle -------------------------------------------------------------------


@pytest.mark.parametrize("budget", BUDGETS)
def test_context_manager_closes_and_removes_its_private_directory(budget: str) -> None:
    w = nn.Parameter(torch.randn(50_000))
    with tiered([w], budget) as opt:
        private = opt.state_dir
        assert (private is not None) == (budget == "disk")
        if private:
            assert Path(private).is_dir()
        w.grad = torch.ones_like(w)
        opt.step()
    assert private is None or not Path(private).exists(), "close() left the private state_dir"
    with pytest.raises(ClosedError):
        opt.step()
    opt.close()
    opt.close()


def test_context_manager_closes_when_the_body_raises() -> None:
    w = nn.Parameter(torch.randn(50_000))
    with pytest.raises(KeyError), tiered([w], "disk") as opt:
        private = opt.state_dir
        raise KeyError("boom")
    assert not Path(private).exists()
    with pytest.raises(ClosedError):
        opt.state_dict()


@pytest.mark.parametrize("budget", BUDGETS)
def test_close_twice_and_use_after_close(budget: str, tmp_path: Path) -> None:
    w = nn.Parameter(torch.randn(50_000))
    opt = tiered([w], budget, state_dir=tmp_path / "state")
    w.grad = torch.ones_like(w)
    opt.step()
    opt.close()
    opt.close()
    for use in (opt.step, opt.state_dict, lambda: opt.load_state_dict({"state": {}, "param_groups": []})):
        with pytest.raises(ClosedError, match="closed"):
            use()
    # The directory's lock is released: a new optimizer is refused for the state it
    # holds (StateExistsError), not because the directory is in use.
    with pytest.raises(StateExistsError):
        tiered([nn.Parameter(torch.randn(50_000))], budget, state_dir=tmp_path / "state")


@pytest.mark.parametrize("budget", [None, "64MiB"])
def test_nondurable_state_dir_all_resident_closes(tmp_path: Path, budget) -> None:
    w = nn.Parameter(torch.randn(1000))
    opt = TieredAdamW([w], state_dir=tmp_path / "state", durable=False, ram_budget=budget)
    w.grad = torch.ones_like(w)
    opt.step()
    opt.close()
    with TieredAdamW([nn.Parameter(torch.zeros(1000))], state_dir=tmp_path / "state", resume=True) as again:
        assert again.step_count == 1


def test_zero_element_parameter_has_state_like_torch() -> None:
    w, empty = nn.Parameter(torch.randn(5)), nn.Parameter(torch.zeros(0, 3))
    rw, rempty = nn.Parameter(w.detach().clone()), nn.Parameter(empty.detach().clone())
    ref = torch.optim.AdamW([rw, rempty], fused=True)
    with tiered([w, empty]) as opt:
        for p in (w, empty, rw, rempty):
            p.grad = torch.ones_like(p)
        opt.step()
        ref.step()
        assert sorted(opt.state_dict()["state"]) == sorted(ref.state_dict()["state"])


@pytest.mark.parametrize("budget", BUDGETS)
def test_non_contiguous_gradient_is_used_by_value(budget: str) -> None:
    """A transposed (non-contiguous) gradient counts by its values.

    Note: torch 2.13's fused CPU AdamW reads such a gradient in memory order
    (it updates with ``grad.t()``), so the reference here gets ``.contiguous()``.
    """
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128))
    r = nn.Parameter(w.detach().clone())
    ref = torch.optim.AdamW([r], lr=1e-2, fused=True)
    with tiered([w], budget, lr=1e-2) as opt:
        for _ in range(3):
            g = torch.randn(128, 128).t()
            assert not g.is_contiguous()
            w.grad, r.grad = g, g.contiguous()
            opt.step()
            ref.step()
    assert torch.equal(w, r)


@pytest.mark.parametrize("pin_memory", [None, False, True])
def test_pinning_falls_back_cleanly_without_cuda(pin_memory, caplog: pytest.LogCaptureFixture) -> None:
    """These machines have no CUDA: asking to pin must not break anything (a warning at most)."""
    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with caplog.at_level("WARNING", logger="tierstore"), tiered(
        model.parameters(), "disk", lr=1e-2, pin_memory=pin_memory
    ) as opt:
        train(model, opt, range(3))
    train(ref_model, ref, range(3))
    assert_same_params(model, ref_model)
    if not torch.cuda.is_available() and pin_memory is None:
        assert not [r for r in caplog.records if r.name.startswith("tierstore")], "pinning was attempted"


@pytest.mark.parametrize(
    "backend, durable",
    [
        ("direct", True),
        ("direct", False),
        ("buffered", False),
        ("mmap", True),
        ("mmap", False),
    ],
)
def test_no_trainable_parameters(backend: str, durable: bool, tmp_path: Path) -> None:
    """Everything frozen: steps do nothing, the state dict is empty, as with torch AdamW."""
    w = nn.Parameter(torch.randn(10), requires_grad=False)
    ref = torch.optim.AdamW([nn.Parameter(w.detach().clone(), requires_grad=False)], fused=True)
    before = w.detach().clone()
    with TieredAdamW([w], state_dir=tmp_path / "state", durable=durable, backend=backend) as opt:
        opt.step()
        ref.step()
        assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}
    assert torch.equal(w, before)


@pytest.mark.parametrize("update_threads", [None, 1, 2])
def test_update_threads_never_change_results(update_threads) -> None:
    """A tuning knob: any thread count gives torch's bits, and torch's own setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, ref_model = two_models()
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
        with tiered(model.parameters(), "disk", lr=1e-2, update_threads=update_threads) as opt:
            train(model, opt, range(3))
            assert torch.get_num_threads() == 2
        train(ref_model, ref, range(3))
        assert_same_params(model, ref_model)
    finally:
        torch.set_num_threads(threads)


def test_a_copy_going_away_closes_nothing(tmp_path: Path) -> None:
    """Wrappers that copy the optimizer's ``__dict__`` into an object of a derived class
    (Lightning's ``LightningOptimizer`` does) must not close it when they are collected."""
    import gc

    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = tiered(model.parameters(), "disk", lr=1e-2, state_dir=tmp_path / "s")

    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
            self.__class__ = type("Wrapped" + type(optimizer).__name__, (Wrapper, type(optimizer)), {})

    train(model, opt, range(2))
    wrapper = Wrapper(opt)
    assert isinstance(wrapper, TieredAdamW)
    del wrapper
    gc.collect()
    train(model, opt, range(2, 4))  # still open: the store was not closed by the wrapper
    train(ref_model, ref, range(4))
    assert_same_params(model, ref_model)
    opt.close()
    with pytest.raises(ClosedError):
        opt.step()


def test_an_unclosed_optimizer_is_closed_when_collected(tmp_path: Path) -> None:
    """Without close(), the last reference going away releases the lock and commits a
    non-durable directory cleanly, so it resumes."""
    import gc

    w = nn.Parameter(torch.randn(5000))
    opt = TieredAdamW([w], lr=1e-2, state_dir=tmp_path / "s", durable=False, ram_budget="48KiB", shard_numel=1024)
    w.grad = torch.ones_like(w)
    opt.step()
    del opt
    gc.collect()
    with TieredAdamW([w], lr=1e-2, state_dir=tmp_path / "s", durable=False, ram_budget="48KiB", shard_numel=1024, resume=True) as again:
        assert again.step_count == 1


def test_copy_shares_the_state_and_deepcopy_or_pickle_name_the_way_to_save(tmp_path: Path) -> None:
    """copy.copy (wrappers do it) shares the one open state; a deep copy or a pickle of files
    on a drive cannot be made, and the error says what to use instead."""
    import copy
    import pickle

    model, ref_model = two_models()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = tiered(model.parameters(), "disk", lr=1e-2)
    train(model, opt, range(2))
    shallow = copy.copy(opt)
    train(model, shallow, range(2, 4))  # the same optimizer, two names
    assert opt.step_count == 4
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    train(ref_model, ref, range(4))
    assert_same_params(model, ref_model)
    del shallow
    opt.close()
