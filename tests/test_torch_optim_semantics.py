"""The semantics of torch's own optimizer tests (``test/test_optim.py``), in our words (issue 21).

``bench/torch_optim_tests.py`` runs torch's file itself against ``TieredAdamW``;
the suite cannot download it, so what that run found is pinned here, each
against ``torch.optim.AdamW`` doing the same thing: state dicts saved by
``torch.optim.Adam``/``AdamW`` load as torch's AdamW loads them, extra entries
of ``optimizer.state`` travel through state dicts, param groups are packed as
torch packs them (or refused clearly), and the design limits (non-contiguous
parameters, ``copy.deepcopy``) are refused with an error that names the fix;
``add_param_group`` lays the state out again (refused, with the fix, on a ``state_dir``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tierstore import ConfigError, ParamsChangedError, TieredAdamW


def _pair(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8))]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _train(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        _grads(params, step)
        opt.step()


def test_a_state_dict_saved_by_torch_adam_loads_as_torch_adamw_loads_it() -> None:
    """torch's AdamW makes every loaded group decoupled (an Adam state dict says False); so does TieredAdamW."""
    source, _ = _pair()
    adam = torch.optim.Adam(source, lr=1e-2, weight_decay=0.1)
    _train(adam, source, range(3))
    saved = adam.state_dict()
    assert saved["param_groups"][0]["decoupled_weight_decay"] is False
    ours, theirs = _pair(1)
    opt = TieredAdamW(ours, lr=1e-3)
    ref = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    opt.load_state_dict(copy.deepcopy(saved))
    ref.load_state_dict(copy.deepcopy(saved))
    assert opt.param_groups[0]["decoupled_weight_decay"] is ref.param_groups[0]["decoupled_weight_decay"] is True
    assert opt.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True
    _train(opt, ours, range(3, 6))
    _train(ref, theirs, range(3, 6))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)  # the weight decay is AdamW's, with Adam's lr and weight_decay
    opt.close()


def test_loaded_groups_become_the_saved_ones_as_in_torch() -> None:
    """A saved group without a flag (an older state dict) gets torch's default, not the optimizer's value."""
    ours, theirs = _pair()
    opt = TieredAdamW(ours, maximize=True)
    ref = torch.optim.AdamW(theirs, maximize=True, fused=True)
    saved = ref.state_dict()
    for group in saved["param_groups"]:
        del group["maximize"]
        group["initial_lr"] = 0.5  # a scheduler's key travels too
    opt.load_state_dict(copy.deepcopy(saved))
    ref.load_state_dict(copy.deepcopy(saved))
    assert opt.param_groups[0]["maximize"] is ref.param_groups[0]["maximize"] is False
    assert opt.param_groups[0]["initial_lr"] == ref.param_groups[0]["initial_lr"] == 0.5
    opt.close()


def test_extra_state_entries_travel_through_state_dicts_as_in_torch() -> None:
    """Keys a user or a scheduler keeps in optimizer.state: a parameter's own, and keys that are not parameters."""
    ours, theirs = _pair()
    opt, ref = TieredAdamW(ours), torch.optim.AdamW(theirs, fused=True)
    for o, params in ((opt, ours), (ref, theirs)):
        _train(o, params, range(2))
        o.state[params[0]]["ema"] = torch.full((2,), 3.0)
        o.state[params[1]]["note"] = "kept"
        o.state["run"] = {"epoch": 7}
    sd, torch_sd = opt.state_dict(), ref.state_dict()
    assert sd["state"]["run"] == torch_sd["state"]["run"] == {"epoch": 7}
    assert torch.equal(sd["state"][0]["ema"], torch_sd["state"][0]["ema"])
    assert sd["state"][1]["note"] == torch_sd["state"][1]["note"] == "kept"
    # Loading keeps them (torch's AdamW's dict and ours alike); tensors take the parameter's dtype.
    for saved in (sd, torch_sd):
        params = [torch.nn.Parameter(p.detach().clone().to(torch.bfloat16)) for p in ours]
        again = TieredAdamW(params)
        again.state["stale"] = 1  # replaced, as torch replaces the whole state
        again.load_state_dict(copy.deepcopy(saved))
        assert again.state[params[0]]["ema"].dtype == torch.bfloat16
        assert again.state[params[1]]["note"] == "kept" and again.state["run"] == {"epoch": 7}
        assert "stale" not in again.state
        assert again.state_dict()["state"]["run"] == {"epoch": 7}
        _train(again, params, range(2, 3))  # extra keys do not disturb the step
        again.close()
    opt.close()


def test_state_ids_no_group_lists_are_kept_not_refused() -> None:
    ours, theirs = _pair()
    ref = torch.optim.AdamW(theirs, fused=True)
    _train(ref, theirs, range(1))
    saved = ref.state_dict()
    saved["state"][99] = {"orphan": 1}
    opt = TieredAdamW(ours)
    opt.load_state_dict(saved)
    assert opt.state[99] == {"orphan": 1} and opt.state_dict()["state"][99] == {"orphan": 1}
    opt.close()


def test_a_state_dict_pre_hook_entry_appears_in_the_state_dict() -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    assert opt.state_dict()["state"]["test"] == 1
    opt.close()


def test_param_groups_appended_again_are_packed_as_torch_packs_them() -> None:
    ours, theirs = _pair()
    opt = TieredAdamW([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 0.1}])
    ref = torch.optim.AdamW([{"params": [theirs[0]]}, {"params": [theirs[1]], "lr": 0.1}], fused=True)
    for o, params in ((opt, ours), (ref, theirs)):
        _train(o, params, range(2))
        o.param_groups.extend(o.param_groups)
    ours_sd, torch_sd = opt.state_dict(), ref.state_dict()
    assert [g["params"] for g in ours_sd["param_groups"]] == [g["params"] for g in torch_sd["param_groups"]]
    assert [g["params"] for g in ours_sd["param_groups"]] == [[0], [1], [0], [1]]
    assert sorted(ours_sd["state"]) == sorted(torch_sd["state"]) == [0, 1]
    with pytest.raises(ParamsChangedError, match="changed since construction"):
        _train(opt, ours, range(2, 3))  # a step would update the parameters twice: refused
    opt.close()


def test_hyperparameter_edits_are_in_the_state_dict() -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours, lr=1e-3)
    opt.param_groups[0]["lr"] = 0.25
    opt.param_groups[0]["my_key"] = "x"
    group = opt.state_dict()["param_groups"][0]
    assert group["lr"] == 0.25 and group["my_key"] == "x" and group["params"] == [0, 1]
    opt.close()


def test_a_tensor_put_into_param_groups_is_refused_not_saved_as_an_empty_group() -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours)
    opt.param_groups.append({**opt.param_groups[0], "params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ParamsChangedError, match=r"param group 1 holds a tensor of shape \(3,\).*build a new"):
        opt.state_dict()
    opt.param_groups.pop()
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:1]
    with pytest.raises(ParamsChangedError, match=r"parameters \[1\] were removed from param_groups"):
        opt.state_dict()
    opt.close()


@pytest.mark.parametrize("where", [dict(), dict(ram_budget="56KiB", shard_numel=1024)], ids=["ram", "streamed"])
@pytest.mark.parametrize("added", [dict(lr=3e-2), dict(amsgrad=True, weight_decay=0.0)], ids=["lr", "amsgrad"])
def test_add_param_group_mid_training_steps_as_torch_adamw(where, added) -> None:
    """A group added after some steps shows in state_dict() and steps exactly as in torch.optim.AdamW."""
    torch.manual_seed(3)
    first = [torch.nn.Parameter(torch.randn(40, 70)), torch.nn.Parameter(torch.randn(70))]
    later = [torch.nn.Parameter(torch.randn(6000)), torch.nn.Parameter(torch.randn(9, 11))]
    twin_first = [torch.nn.Parameter(p.detach().clone()) for p in first]
    twin_later = [torch.nn.Parameter(p.detach().clone()) for p in later]
    opt = TieredAdamW(first, lr=1e-2, weight_decay=0.1, **where)
    ref = torch.optim.AdamW(twin_first, lr=1e-2, weight_decay=0.1, fused=True)
    _train(opt, first, range(2))
    _train(ref, twin_first, range(2))
    opt.add_param_group({"params": later, **added})
    ref.add_param_group({"params": twin_later, **added})
    if where:  # the state outgrew the budget: it now streams through a private directory
        assert "0 streamed" not in opt.describe(), opt.describe()
    ours_sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert ours_sd["param_groups"] == ref_sd["param_groups"]
    assert sorted(ours_sd["state"]) == sorted(ref_sd["state"]) == [0, 1]  # the new ones have no state yet
    assert opt.step_count == 2
    _train(opt, first + later, range(2, 5))
    _train(ref, twin_first + twin_later, range(2, 5))
    for a, b in zip(first + later, twin_first + twin_later):
        assert torch.equal(a, b)
    ours_sd, ref_sd = opt.state_dict(), ref.state_dict()
    for i, entry in ref_sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours_sd["state"][i][key], value), (i, key)
    assert opt.step_count == 5
    opt.close()


def test_add_param_group_is_refused_with_a_state_dir_and_changes_nothing(tmp_path) -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours[:1], state_dir=tmp_path / "s")
    with pytest.raises(ParamsChangedError, match=r"add_param_group.*every group.*TieredAdamW\(\[group1, group2\]"):
        opt.add_param_group({"params": [ours[1]]})
    assert len(opt.param_groups) == 1 and len(opt.state_dict()["param_groups"]) == 1
    opt.close()


def test_add_param_group_refuses_what_torch_refuses_and_keeps_the_old_state() -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours[:1], lr=1e-2)
    _train(opt, ours[:1], range(1))
    before = opt.state_dict()
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [ours[0]]})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [ours[1]], "lr": -1.0})
    assert len(opt.param_groups) == 1
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())
    _train(opt, ours[:1], range(1, 2))  # still usable
    opt.close()


def test_non_contiguous_parameters_are_refused_with_the_fix() -> None:
    """torch 2.13's own fused CPU AdamW updates a non-contiguous parameter wrongly; TieredAdamW refuses it."""
    weight = torch.nn.Parameter(torch.randn(10, 5, 2)[..., 0])
    assert not weight.is_contiguous()
    with pytest.raises(ConfigError, match=r"is not contiguous; make it contiguous \(param.data = param.data.contiguous"):
        TieredAdamW([weight])


def test_deepcopy_is_refused_with_the_fix() -> None:
    ours, _ = _pair()
    opt = TieredAdamW(ours)
    with pytest.raises(TypeError, match=r"cannot be deep-copied.*state_dict\(\).*new TieredAdamW"):
        copy.deepcopy(opt)
    twin = copy.copy(opt)  # a shallow copy shares the running state (wrappers rely on it)
    assert twin.step_count == opt.step_count
    opt.close()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(lambda e: e.pop("exp_avg"), "has a step but no exp_avg;", id="missing-exp_avg"),
        pytest.param(lambda e: e.pop("exp_avg_sq"), "has a step but no exp_avg_sq;", id="missing-exp_avg_sq"),
        pytest.param(lambda e: e.update(exp_avg=None), "exp_avg of parameter 0 is NoneType, expected a tensor", id="none"),
        pytest.param(lambda e: e.update(exp_avg_sq=[1.0, 2.0]), "exp_avg_sq of parameter 0 is list", id="list"),
    ],
)
def test_a_state_dict_missing_or_mistyped_moment_is_refused_not_zero_filled(edit, match) -> None:
    """torch.optim.AdamW fails at its next step on such a state; TieredAdamW refuses it and keeps its own."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = TieredAdamW([w], lr=0.1)
    w.grad = torch.ones(4)
    opt.step()
    before = opt.state_dict()
    bad = copy.deepcopy(before)
    edit(bad["state"][0])
    with pytest.raises(ConfigError, match=match):
        opt.load_state_dict(bad)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], before["state"][0][k]) for k in ("exp_avg", "exp_avg_sq"))
    opt.close()


@pytest.mark.parametrize(
    ("loaded", "match"),
    [
        ({"tierstore_snapshot": {"step_count": 3}}, "is a reference .* resume through the same integration"),
        ({"state": {}}, r"has \['state'\]; expected a dict with 'state' and 'param_groups'"),
        ([1, 2], "has list; expected a dict"),
    ],
    ids=["trainer-reference", "no-groups", "not-a-dict"],
)
def test_a_state_dict_that_is_not_one_is_refused_naming_what_it_is(loaded, match) -> None:
    """A trainer checkpoint's reference loaded without its integration raised KeyError('param_groups')."""
    w = torch.nn.Parameter(torch.ones(4))
    with TieredAdamW([w], lr=0.1) as opt, pytest.raises(ConfigError, match=match):
        opt.load_state_dict(loaded)
