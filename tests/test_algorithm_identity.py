"""Everything that knows the state knows its algorithm (issue 24, item 4).

A state directory, a zarr checkpoint, a torch state dict and a DCP checkpoint
of one optimizer algorithm are refused by an optimizer of another, naming
both; ``inspect``, ``verify`` and ``to-torch`` say whose state it is. The
algorithms here are test-only (an AdamW under another name, an SGD-like
momentum algorithm), registered for the test, so these tests hold whatever
fronts exist; the real fronts' cases run where they are importable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
import zarr

import tierstore._compute.algorithms as registry
from tierstore import (
    ConfigError,
    CorruptStateError,
    FormatVersionError,
    LayoutMismatchError,
    TieredAdamW,
)
from tierstore._compute.algorithms import ADAMW, FLAG, NUMBER, Algorithm, FieldSpec
from tierstore._compute.algorithms.adamw import AdamW
from tierstore._compute.formats import FORMATS
from tierstore._layout import layout as layout_module
from tierstore._state import manifest as manifest_module
from tierstore._state.statedir import MANIFEST
from tierstore.checkpoint import (
    FORMAT_VERSION,
    checkpoint_to_state_dict,
    load_checkpoint,
    save_checkpoint,
    state_dict_to_checkpoint,
)
from tierstore.cli import main


class AdamLike(AdamW):
    """AdamW's update under another name: a second algorithm whose front runs."""

    name = "adamlike"
    front = "TieredAdamLike"
    torch_class = "torch.optim.AdamLike"


class TieredAdamLike(TieredAdamW):
    algorithm = AdamLike()


class Momentum(Algorithm):
    """SGD's state and groups, enough for the state-dict checks (no front runs it)."""

    name = "momentum"
    front = "TieredMomentum"
    torch_class = "torch.optim.SGD"
    fields = (FieldSpec("momentum_buffer", option="momentum", signed=True, lazy=True, enable="momentum=0.9"),)
    state_scalars = ()
    group_kinds = MappingProxyType({"lr": NUMBER, "momentum": NUMBER, "dampening": NUMBER, "nesterov": FLAG})

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        return option == "momentum" and group.get("momentum", 0) != 0

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        if not group["lr"] >= 0:
            raise ConfigError(f"Invalid learning rate: {group['lr']}{where}")


ADAMLIKE, MOMENTUM = TieredAdamLike.algorithm, Momentum()


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the test algorithms beside AdamW (and nothing else: the real fronts may or may not exist)."""
    algorithms = MappingProxyType({a.name: a for a in (ADAMW, ADAMLIKE, MOMENTUM)})
    for module in (registry, layout_module, manifest_module):
        monkeypatch.setattr(module, "ALGORITHMS", algorithms)


def _model(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(40, 30, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]


def _trained(front: type, params: list[torch.nn.Parameter], **kwargs: Any) -> TieredAdamW:
    opt = front(params, lr=0.01, **kwargs)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


# -- resuming a state directory -----------------------------------------------------------


@pytest.mark.parametrize(("saved", "mine"), [(TieredAdamW, TieredAdamLike), (TieredAdamLike, TieredAdamW)])
def test_resuming_another_algorithms_state_dir_names_both(tmp_path: Path, registered, saved, mine) -> None:
    _trained(saved, _model(), state_dir=tmp_path).close()
    with pytest.raises(LayoutMismatchError) as caught:
        mine(_model(), state_dir=tmp_path, resume=True)
    s, m = saved.algorithm, mine.algorithm
    assert str(caught.value) == (
        f"state_dir={str(tmp_path)!r} holds {s.front} ({s.name}) state; this is {m.front} ({m.name}): resume it "
        f"with a {s.front}, or give {m.front} another state_dir (an optimizer resumes only the state of its own "
        "algorithm)"
    )
    with saved(_model(), state_dir=tmp_path, resume=True) as again:  # untouched: its own front resumes it
        assert again.step_count == 1


def test_an_adamw_manifest_records_no_algorithm(tmp_path: Path, registered) -> None:
    _trained(TieredAdamW, _model(), state_dir=tmp_path / "a").close()
    _trained(TieredAdamLike, _model(), state_dir=tmp_path / "b").close()
    a = json.loads((tmp_path / "a" / MANIFEST).read_text())
    b = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert "algorithm" not in a["layout"] and b["layout"]["algorithm"] == "adamlike"
    assert a["param_groups"] == b["param_groups"]  # the same hyperparameters, checked by each algorithm


def test_a_state_of_an_algorithm_this_tierstore_does_not_know_is_a_newer_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registered
) -> None:
    _trained(TieredAdamLike, _model(), state_dir=tmp_path).close()
    monkeypatch.setattr(layout_module, "ALGORITHMS", MappingProxyType({"adamw": ADAMW}))
    monkeypatch.setattr(manifest_module, "ALGORITHMS", MappingProxyType({"adamw": ADAMW}))
    with pytest.raises(FormatVersionError, match="belongs to the optimizer algorithm 'adamlike', which this tierstore"):
        TieredAdamW(_model(), state_dir=tmp_path, resume=True)
    assert main(["inspect", str(tmp_path)]) == 1


def test_a_manifests_groups_are_checked_by_its_algorithm(tmp_path: Path, registered) -> None:
    from tierstore._state.manifest import validate

    _trained(TieredAdamW, _model(), state_dir=tmp_path).close()
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    validate(manifest, "m")
    manifest["param_groups"][0]["betas"] = [0.9, 1.5]
    with pytest.raises(CorruptStateError, match="holds hyperparameters torch.optim.AdamW refuses: Invalid beta"):
        validate(manifest, "m")
    manifest["param_groups"][0]["betas"] = [0.9]
    with pytest.raises(CorruptStateError, match=r"param_groups\[0\].betas=\[0.9\], expected a pair of numbers"):
        validate(manifest, "m")
    del manifest["param_groups"][0]["betas"]
    with pytest.raises(CorruptStateError, match=r"has no 'param_groups\[0\].betas'"):
        validate(manifest, "m")


def test_groups_of_an_algorithm_whose_check_fails_on_a_crafted_value_are_corrupt(registered) -> None:
    from tierstore._state.manifest import _group

    _group({"lr": 0.1, "momentum": 0.9, "dampening": 0.0}, "g", "m", MOMENTUM)
    with pytest.raises(CorruptStateError, match="holds hyperparameters torch.optim.SGD refuses: Invalid learning"):
        _group({"lr": -1.0, "momentum": 0.9, "dampening": 0.0}, "g", "m", MOMENTUM)
    with pytest.raises(CorruptStateError, match=r"g.nesterov='no', expected true or false"):
        _group({"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": "no"}, "g", "m", MOMENTUM)


# -- torch state dicts --------------------------------------------------------------------


def _sgd_state_dict() -> dict:
    w = torch.nn.Parameter(torch.ones(3))
    ref = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(3)
    ref.step()
    return ref.state_dict()


def test_loading_an_sgd_state_dict_into_adamw_names_both(registered) -> None:
    sd = _sgd_state_dict()
    with TieredAdamW([torch.nn.Parameter(torch.ones(3))]) as opt:
        with pytest.raises(ConfigError, match=r"^loaded group 0 \(hyperparameters \[.*'momentum'.*\]\) is torch.optim.SGD "
                           r"state, as TieredMomentum \(momentum\) keeps it; this is TieredAdamW \(adamw\): load it into "
                           r"a TieredMomentum \(or torch.optim.SGD\)"):  # fmt: skip
            opt.load_state_dict(sd)
        # AdamW's groups with SGD's state: the entry's key names it.
        adamw_sd = opt.state_dict()
        adamw_sd["state"] = {0: {"step": torch.tensor(1.0), **sd["state"][0]}}
        with pytest.raises(ConfigError, match=r"the loaded state of parameter 0 \(\['momentum_buffer', 'step'\]\) is "
                           r"torch.optim.SGD state"):  # fmt: skip
            opt.load_state_dict(adamw_sd)
        assert opt.step_count == 0


def test_a_group_without_a_hyperparameter_of_its_algorithm_is_refused_by_name(registered) -> None:
    with TieredAdamW([torch.nn.Parameter(torch.ones(3))]) as opt:
        sd = opt.state_dict()
        del sd["param_groups"][0]["betas"]
        with pytest.raises(ConfigError, match=r"loaded group 0 has no \['betas'\], which every param group of "
                           "torch.optim.AdamW holds"):  # fmt: skip
            opt.load_state_dict(sd)


def test_an_adam_state_dict_still_loads_into_adamw(registered) -> None:
    """Adam's keys are AdamW's: torch's AdamW loads them, and so does TieredAdamW."""
    w = torch.nn.Parameter(torch.ones(3))
    ref = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(3)
    ref.step()
    with TieredAdamW([torch.nn.Parameter(torch.ones(3))]) as opt:
        opt.load_state_dict(ref.state_dict())
        assert opt.param_groups[0]["decoupled_weight_decay"] is True


def test_state_dict_to_checkpoint_converts_the_algorithm_it_is_told(tmp_path: Path, registered) -> None:
    sd = _sgd_state_dict()
    with pytest.raises(ConfigError, match=r"the state of parameter 0 \(\['momentum_buffer'\]\) is torch.optim.SGD state.*"
                       "this is TieredAdamW \\(adamw\\): pass algorithm='momentum' to convert it"):  # fmt: skip
        state_dict_to_checkpoint(sd, tmp_path / "a.zarr")
    state_dict_to_checkpoint(sd, tmp_path / "m.zarr", algorithm="momentum")
    attrs = zarr.open_group(str(tmp_path / "m.zarr"), mode="r").attrs.asdict()
    assert (attrs["algorithm"], attrs["torch_class"], attrs["format_version"]) == ("momentum", "torch.optim.SGD", 3)
    assert attrs["arrays"] == ["momentum_buffer"] and attrs["layout"]["algorithm"] == "momentum"
    back = checkpoint_to_state_dict(tmp_path / "m.zarr")
    assert list(back["state"][0]) == ["momentum_buffer"]  # no step: torch's SGD keeps none
    assert torch.equal(back["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])
    assert back["param_groups"][0]["momentum"] == 0.9
    with pytest.raises(ConfigError, match="unknown optimizer algorithm 'lamb'"):
        state_dict_to_checkpoint(sd, tmp_path / "l.zarr", algorithm="lamb")


def test_state_dict_to_checkpoint_needs_the_fields_its_algorithm_keeps(tmp_path: Path, registered) -> None:
    sd = _sgd_state_dict()
    sd["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ConfigError, match="Invalid learning rate: -1.0 in param group 0"):
        state_dict_to_checkpoint(sd, tmp_path / "m.zarr", algorithm="momentum")
    sd = _sgd_state_dict()
    sd["state"][0] = {"note": 1}
    with pytest.raises(ConfigError, match=r"holds no tensor \(\['note'\]\), so its shape is unknown; pass params="):
        state_dict_to_checkpoint(sd, tmp_path / "m.zarr", algorithm="momentum")
    assert not (tmp_path / "m.zarr").exists()


# -- zarr checkpoints ---------------------------------------------------------------------


def test_a_checkpoint_records_its_algorithm_and_load_refuses_another(tmp_path: Path, registered) -> None:
    with _trained(TieredAdamLike, _model()) as opt:
        save_checkpoint(opt, tmp_path / "like.zarr")
    with _trained(TieredAdamW, _model()) as opt:
        save_checkpoint(opt, tmp_path / "adamw.zarr")
    like = zarr.open_group(str(tmp_path / "like.zarr"), mode="r").attrs.asdict()
    adamw = zarr.open_group(str(tmp_path / "adamw.zarr"), mode="r").attrs.asdict()
    assert (like["algorithm"], like["torch_class"], like["format_version"]) == ("adamlike", "torch.optim.AdamLike", 3)
    assert "algorithm" not in adamw and "torch_class" not in adamw and adamw["format_version"] == 1
    assert FORMAT_VERSION == 3
    for path, front, saved in (("like.zarr", TieredAdamW, ADAMLIKE), ("adamw.zarr", TieredAdamLike, ADAMW)):
        with front(_model()) as opt, pytest.raises(LayoutMismatchError) as caught:
            load_checkpoint(opt, tmp_path / path)
        mine = front.algorithm
        assert str(caught.value).startswith(
            f"checkpoint {tmp_path / path} holds {saved.label} state; this is {mine.label}: load it into a "
            f"{saved.front}, or load into this {mine.front} a checkpoint of its own algorithm"
        )
    with TieredAdamLike(_model()) as opt:
        load_checkpoint(opt, tmp_path / "like.zarr")
        assert opt.step_count == 1


def _edit_attrs(path: Path, **changes: Any) -> None:
    meta = json.loads((path / "zarr.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta["attributes"].pop(key, None)
        else:
            meta["attributes"][key] = value
    (path / "zarr.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("source", "changes", "message"),
    [
        ("like", {"algorithm": "adamw"}, "has algorithm attributes .*'adamw'.*its layout holds TieredAdamLike"),
        ("like", {"algorithm": None, "torch_class": None}, r"has algorithm attributes \{\}; its layout holds TieredAdamLike"),
        ("like", {"format_version": 2}, "holds TieredAdamLike \\(adamlike\\) state but says format_version 2"),
        ("adamw", {"algorithm": "adamlike"}, "has algorithm attributes .*its layout holds TieredAdamW \\(adamw\\) state"),
    ],
    ids=["name-differs", "names-dropped", "old-version", "adamw-claims-another"],
)
def test_a_checkpoints_algorithm_attributes_must_match_its_layout(tmp_path: Path, registered, source, changes, message) -> None:
    front = TieredAdamLike if source == "like" else TieredAdamW
    with _trained(front, _model()) as opt:
        save_checkpoint(opt, tmp_path / "c.zarr")
    _edit_attrs(tmp_path / "c.zarr", **changes)
    with front(_model()) as opt, pytest.raises(CorruptStateError, match=message):
        load_checkpoint(opt, tmp_path / "c.zarr")


# -- inspect, verify, to-torch -------------------------------------------------------------


@pytest.mark.parametrize("front", [TieredAdamW, TieredAdamLike])
def test_inspect_verify_and_to_torch_name_the_algorithm(tmp_path: Path, registered, capsys, front) -> None:
    _trained(front, _model(), state_dir=tmp_path / "s").close()
    a = front.algorithm
    assert main(["inspect", "--json", str(tmp_path / "s")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["algorithm"] == {"name": a.name, "front": a.front, "torch_class": a.torch_class,
                                 "fields": ["exp_avg", "exp_avg_sq"]}  # fmt: skip
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert f"  optimizer: {a.front} ({a.name}), the state of {a.torch_class}: exp_avg, exp_avg_sq\n" in out
    assert "parameters with state, step 1" in out
    assert main(["verify", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.startswith(f"ok: step 1 of {a.label} state, ")
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "c.zarr")]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(tmp_path / "c.zarr")]) == 0
    assert json.loads(capsys.readouterr().out)["algorithm"]["name"] == a.name
    assert main(["verify", str(tmp_path / "c.zarr")]) == 0
    assert f"ok: step 1 of {a.label} state (exp_avg, exp_avg_sq), every chunk" in capsys.readouterr().out
    for src, flags in ((tmp_path / "s", []), (tmp_path / "c.zarr", ["--from-zarr"])):
        out_pt = tmp_path / f"{src.name}.pt"
        assert main(["to-torch", *flags, str(src), str(out_pt)]) == 0
        assert f"wrote {out_pt}: a {a.torch_class} state dict, 2 parameter states" in capsys.readouterr().out


# -- DCP -------------------------------------------------------------------------------------


class AdamLikeToo(AdamW):
    name = "adamlike2"
    front = "TieredAdamLikeToo"
    torch_class = "torch.optim.AdamLikeToo"


class TieredAdamLikeToo(TieredAdamW):
    algorithm = AdamLikeToo()


@pytest.fixture
def dcp_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    algorithms = MappingProxyType({a.name: a for a in (ADAMW, ADAMLIKE, MOMENTUM, TieredAdamLikeToo.algorithm)})
    for module in (registry, layout_module, manifest_module):
        monkeypatch.setattr(module, "ALGORITHMS", algorithms)


def test_a_dcp_checkpoint_of_another_algorithm_is_refused_naming_both(tmp_path: Path, dcp_registered) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tierstore.dcp import ALGORITHM_KEY, TieredStateful

    with _trained(TieredAdamLike, _model()) as opt:
        stateful = TieredStateful(opt)
        assert stateful.state_dict()[ALGORITHM_KEY] == "adamlike"
        dcp.save({"optim": stateful}, checkpoint_id=tmp_path / "like", no_dist=True)
    with _trained(TieredAdamW, _model()) as opt:
        assert ALGORITHM_KEY not in TieredStateful(opt).state_dict()  # AdamW's DCP keys are what they were
        dcp.save({"optim": TieredStateful(opt)}, checkpoint_id=tmp_path / "adamw", no_dist=True)
    with TieredAdamLike(_model()) as opt:  # its own algorithm's: loads
        dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=tmp_path / "like", no_dist=True)
        assert opt.step_count == 1
    with TieredAdamLikeToo(_model()) as opt, pytest.raises(LayoutMismatchError) as caught:
        dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=tmp_path / "like", no_dist=True)
    assert str(caught.value).startswith(
        "the loaded DCP state holds TieredAdamLike (adamlike) state; this is TieredAdamLikeToo (adamlike2): load it "
        "into a TieredAdamLike"
    )
    # A checkpoint without the key (AdamW's): DCP itself refuses what the loading side lists and it lacks.
    with TieredAdamLike(_model()) as opt, pytest.raises(CheckpointException, match=f"Missing key .*{ALGORITHM_KEY}"):
        dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=tmp_path / "adamw", no_dist=True)


def test_real_tensors_of_another_algorithm_are_refused_by_the_dcp_stateful(dcp_registered) -> None:
    from tierstore.dcp import ALGORITHM_KEY, TieredStateful

    model = torch.nn.Linear(3, 2)
    with TieredAdamW(model.parameters()) as opt:
        stateful = TieredStateful(opt, model)
        sgd = {"state": {"weight": {"momentum_buffer": torch.zeros(2, 3)}},
               "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": ["weight", "bias"]}]}  # fmt: skip
        with pytest.raises(LayoutMismatchError, match=r"the loaded state of weight \(\['momentum_buffer'\]\) is "
                           r"torch.optim.SGD state, as TieredMomentum \(momentum\) keeps it; this is TieredAdamW"):  # fmt: skip
            stateful.load_state_dict(sgd)
        with pytest.raises(LayoutMismatchError, match=r"holds TieredAdamLike \(adamlike\) state; this is TieredAdamW"):
            stateful.load_state_dict({**stateful.state_dict(), ALGORITHM_KEY: "adamlike"})
        with pytest.raises(LayoutMismatchError, match="holds 'lamb' state; this is TieredAdamW"):
            stateful.load_state_dict({**stateful.state_dict(), ALGORITHM_KEY: "lamb"})
        assert opt.step_count == 0


def test_dcp_lists_an_algorithm_s_scalars_besides_step(monkeypatch: pytest.MonkeyPatch, dcp_registered) -> None:
    """Per-parameter scalars besides step (NAdam's mu_product) are DCP entries beside it, named as torch names them
    (tests/test_param_scalars.py saves and loads NAdam's through DCP)."""
    from tierstore.dcp import TieredStateful

    w = torch.nn.Parameter(torch.ones(3))
    with TieredAdamLike([w]) as opt:
        w.grad = torch.ones(3)
        opt.step()
        monkeypatch.setattr(AdamLike, "scalar_inits", MappingProxyType({"mu_product": 1.0}), raising=False)
        assert list(TieredStateful(opt).state_dict()["state"]["0"]) == ["step", "mu_product", "exp_avg", "exp_avg_sq"]


# -- plan: bytes per parameter from the algorithm's fields -----------------------------------


def _planned(name: str, options: tuple[str, ...] = (), **kwargs: Any):
    from tierstore.planner import plan_memory

    return plan_memory(1_000_000, host_ram=64 << 30, optimizer=name, options=options, **kwargs)


def _every_registered() -> list[tuple[str, tuple[str, ...]]]:
    """Each registered algorithm with all its field-adding options, and with none where it then keeps a field."""
    cases = []
    for algorithm in registry.ALGORITHMS.values():
        every = tuple(sorted({f.option for f in algorithm.fields if f.option is not None}))
        cases.append((algorithm.name, every))
        if every and algorithm.fields_for(()):
            cases.append((algorithm.name, ()))
    return cases


@pytest.mark.parametrize(("name", "options"), _every_registered())
def test_plan_counts_each_registered_algorithms_bytes_per_parameter(name: str, options: tuple[str, ...]) -> None:
    algorithm = registry.ALGORITHMS[name]
    fields = algorithm.fields_for(options)
    plan = _planned(name, options)
    assert plan.optimizer == name and plan.options == options and plan.fields == fields
    assert plan.state_bytes_per_param == 4 * len(fields)  # fp32 fields, no master for fp32 CPU training
    assert plan.torch.optimizer == 4 * len(fields) * 1_000_000
    mixed = _planned(name, options, precision="bf16")  # an fp32 master joins the fields
    assert mixed.fields == ("master", *fields) and mixed.state_bytes_per_param == 4 * (len(fields) + 1)
    # A compressed format stores only the fields the algorithm lets it store (where it takes one at all).
    try:
        getattr(algorithm, "check_format", lambda *a: None)(frozenset(options), "int8")
    except ConfigError as refused:
        with pytest.raises(ConfigError, match=re.escape(str(refused)[:40])):
            _planned(name, options, moment_dtype="int8")
        return
    int8 = _planned(name, options, moment_dtype="int8")
    compressed = [f for f in fields if algorithm.field(f).compressible]
    code = FORMATS["int8"].bytes_per_element  # 1 B and a 4 B scale per 256 elements
    assert int8.state_bytes_per_param == pytest.approx(4 * (len(fields) - len(compressed)) + code * len(compressed))


@pytest.mark.parametrize(
    ("name", "options", "nbytes"),
    [("sgd", ("momentum",), 4), ("adagrad", (), 4), ("adam", (), 8), ("adam", ("amsgrad",), 12), ("adamw", (), 8),
     ("adamw", ("amsgrad",), 12)],
)  # fmt: skip
def test_plan_bytes_per_parameter_of_torchs_fronts(name: str, options: tuple[str, ...], nbytes: int) -> None:
    """The issue's figures: SGD with momentum one field, Adagrad one, Adam two, amsgrad three."""
    if name not in registry.ALGORITHMS:
        pytest.skip(f"{name} is not registered in this tierstore yet")
    assert _planned(name, options).state_bytes_per_param == nbytes


def test_plan_refuses_an_unknown_optimizer_an_option_it_lacks_and_a_stateless_state(registered) -> None:
    with pytest.raises(ConfigError, match=r"unknown optimizer algorithm 'lamb'; tierstore knows \['adamlike', 'adamw', "):
        _planned("lamb")
    with pytest.raises(ConfigError, match=r"optimizer 'adamw' \(torch.optim.AdamW\) has no option 'momentum' that adds "
                       r"a state field; its options are \['amsgrad'\]"):  # fmt: skip
        _planned("adamw", ("momentum",))
    with pytest.raises(ConfigError, match=r"optimizer 'momentum' \(torch.optim.SGD\) has no option 'amsgrad'"):
        _planned("momentum", amsgrad=True)
    with pytest.raises(ConfigError, match=r"torch.optim.SGD keeps no per-element state on fp32 parameters .* pass "
                       r"options=\['momentum'\] \(plan --option momentum\) for its momentum_buffer \(momentum=0.9\)"):  # fmt: skip
        _planned("momentum")
    assert _planned("momentum", precision="bf16").fields == ("master",)  # the master alone is state to plan


def test_plan_cli_takes_the_optimizer_and_its_options(registered, capsys) -> None:
    argv = ["plan", "--params", "1M", "--host-ram", "64GiB"]
    assert main([*argv, "--optimizer", "momentum", "--option", "momentum", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["optimizer"], plan["options"], plan["fields"]) == ("momentum", ["momentum"], ["momentum_buffer"])
    assert plan["state_bytes_per_param"] == 4 and plan["amsgrad"] is False
    assert main([*argv, "--optimizer", "momentum", "--option", "momentum"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "tierstore plan: 1M trainable params (0 frozen), fp32, SGD momentum"
    assert "optimizer state: 4 B/param (momentum_buffer 4)" in text
    assert "plain torch.optim.SGD (host RAM): " in text and "TieredMomentum(..., ram_budget=" in text
    assert main([*argv, "--amsgrad"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("fp32, AdamW amsgrad")
    assert main([*argv, "--optimizer", "lamb"]) == 2
    assert "unknown optimizer algorithm 'lamb'" in capsys.readouterr().err
    assert main([*argv, "--optimizer", "momentum"]) == 2
    assert "keeps no per-element state" in capsys.readouterr().err


# -- diagnose: the advice is about the measured optimizer's algorithm ---------------------------


def test_diagnose_measures_a_registered_algorithm_by_name_and_advises_its_front() -> None:
    from tierstore.diagnose import diagnose

    if "rmsprop" not in registry.ALGORITHMS:
        pytest.skip("rmsprop is not registered in this tierstore")
    model = torch.nn.Linear(256, 256)
    report = diagnose(model, torch.randn(4, 256), lambda m, b: m(b).square().mean(), optimizer="rmsprop")
    assert report.optimizer == "torch.optim.RMSprop(lr=0)"
    params = sum(p.numel() for p in model.parameters())
    assert report.optimizer_state_bytes >= 4 * params  # square_avg: one fp32 field
    assert report.dominant == "optimizer_state"
    names = [f.name for f in report.figures]
    assert "TieredRMSprop's host RAM" in names and "peak drop with TieredRMSprop" in names
    assert "TieredRMSprop" in report.advice and "TieredAdamW" not in report.advice


def test_diagnose_knows_the_algorithm_of_the_optimizer_a_factory_builds(registered) -> None:
    from tierstore.diagnose.measure import _measured_algorithm

    w = [torch.nn.Parameter(torch.ones(3))]
    assert _measured_algorithm(torch.optim.SGD(w, lr=0.1, momentum=0.9)) == (MOMENTUM, frozenset({"momentum"}))
    assert _measured_algorithm(torch.optim.AdamW(w, amsgrad=True)) == (ADAMW, frozenset({"amsgrad"}))
    assert _measured_algorithm(torch.optim.Rprop(w)) == (ADAMW, frozenset())  # a class tierstore does not know
    with TieredAdamLike(w) as opt:
        assert _measured_algorithm(opt) == (ADAMLIKE, frozenset())


def test_diagnose_refuses_an_unknown_optimizer_name(registered) -> None:
    from tierstore.diagnose import diagnose

    with pytest.raises(ConfigError, match="unknown optimizer algorithm 'lamb'; .* or pass a factory as MODULE:FACTORY"):
        diagnose(torch.nn.Linear(2, 2), torch.ones(1, 2), optimizer="lamb")
    with pytest.raises(ConfigError, match="measures torch.optim.AdamLike, which cannot be imported here"):
        diagnose(torch.nn.Linear(2, 2), torch.ones(1, 2), optimizer="adamlike")


# -- the real fronts ---------------------------------------------------------------------------


def _front(name: str) -> type:
    import tierstore

    front = getattr(tierstore, registry.ALGORITHMS[name].front, None) if name in registry.ALGORITHMS else None
    if front is None:
        pytest.skip(f"this tierstore has no {name} front")
    return front


# A front's construction arguments that give its state a field (SGD and RMSprop keep none without momentum).
_ARGS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "rmsprop": {"lr": 0.01, "momentum": 0.9}, "adagrad": {"lr": 0.1}}


def _real(name: str, params: list[torch.nn.Parameter], **kwargs: Any):
    opt = _front(name)(params, **{"lr": 0.01, **_ARGS.get(name, {}), **kwargs})
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize(("saved", "mine"), [("adamw", "sgd"), ("sgd", "adagrad"), ("adam", "adamw"), ("rmsprop", "adam")])
def test_real_fronts_refuse_each_others_state_dirs(tmp_path: Path, saved: str, mine: str) -> None:
    _real(saved, _model(), state_dir=tmp_path).close()
    s, m = registry.ALGORITHMS[saved], registry.ALGORITHMS[mine]
    with pytest.raises(LayoutMismatchError, match=re.escape(f"holds {s.label} state; this is {m.label}: resume it with a {s.front}")):
        _front(mine)(_model(), **{"lr": 0.01, **_ARGS.get(mine, {})}, state_dir=tmp_path, resume=True)


@pytest.mark.parametrize(
    ("torch_class", "kwargs", "mine", "named"),
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "adamw", "TieredSGD (sgd)"),
     (torch.optim.Adagrad, {"lr": 0.1}, "sgd", "TieredAdagrad (adagrad)"),
     (torch.optim.RMSprop, {"lr": 0.1}, "adagrad", "TieredRMSprop (rmsprop)"),
     (torch.optim.AdamW, {"lr": 0.1}, "adagrad", "TieredAdamW (adamw)")],
)  # fmt: skip
def test_each_front_refuses_another_torch_classs_state_dict(torch_class, kwargs: dict, mine: str, named: str) -> None:
    w = torch.nn.Parameter(torch.ones(5))
    ref = torch_class([w], **kwargs)
    w.grad = torch.ones(5)
    ref.step()
    front = _front(mine)
    with front([torch.nn.Parameter(torch.ones(5))], **_ARGS.get(mine, {})) as opt, pytest.raises(ConfigError, match=re.escape(named)):
        opt.load_state_dict(ref.state_dict())


def test_a_real_fronts_checkpoint_loads_only_into_its_front(tmp_path: Path) -> None:
    sgd = _front("sgd")
    with _real("sgd", _model()) as opt:
        save_checkpoint(opt, tmp_path / "sgd.zarr")
        expected = opt.state_dict()
    attrs = zarr.open_group(str(tmp_path / "sgd.zarr"), mode="r").attrs.asdict()
    assert (attrs["algorithm"], attrs["torch_class"], attrs["arrays"]) == ("sgd", "torch.optim.SGD", ["momentum_buffer"])
    with TieredAdamW(_model()) as opt, pytest.raises(LayoutMismatchError, match=r"holds TieredSGD \(sgd\) state; this is"):
        load_checkpoint(opt, tmp_path / "sgd.zarr")
    with sgd(_model(), lr=0.1, momentum=0.9) as opt:
        load_checkpoint(opt, tmp_path / "sgd.zarr")
        loaded = opt.state_dict()
    for i, entry in expected["state"].items():
        assert torch.equal(loaded["state"][i]["momentum_buffer"], entry["momentum_buffer"])


def test_a_torch_sgd_state_dict_converts_and_loads_bitwise(tmp_path: Path) -> None:
    sgd = _front("sgd")
    params = _model()
    ref = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    ref.step()
    state_dict_to_checkpoint(ref.state_dict(), tmp_path / "c.zarr", algorithm="sgd")
    back = checkpoint_to_state_dict(tmp_path / "c.zarr")
    for i, entry in ref.state_dict()["state"].items():
        assert list(back["state"][i]) == ["momentum_buffer"]
        assert torch.equal(back["state"][i]["momentum_buffer"], entry["momentum_buffer"])
    with sgd(_model(), lr=0.1, momentum=0.9) as opt:
        load_checkpoint(opt, tmp_path / "c.zarr")
        assert all(torch.equal(opt.state_dict()["state"][i]["momentum_buffer"], e["momentum_buffer"])
                   for i, e in ref.state_dict()["state"].items())  # fmt: skip


def test_a_real_fronts_dcp_state_names_its_algorithm_and_keeps_torchs_keys(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tierstore.dcp import ALGORITHM_KEY, TieredStateful

    sgd = _front("sgd")
    model = torch.nn.Linear(6, 4)
    with _real("sgd", list(model.parameters())) as opt:
        state = TieredStateful(opt, model).state_dict()
        assert state[ALGORITHM_KEY] == "sgd" and list(state["state"]["weight"]) == ["momentum_buffer"]  # no step
        dcp.save({"optim": TieredStateful(opt, model)}, checkpoint_id=tmp_path, no_dist=True)
        expected = opt.state_dict()
    with sgd(model.parameters(), lr=0.1, momentum=0.9) as opt:
        dcp.load({"optim": TieredStateful(opt, model)}, checkpoint_id=tmp_path, no_dist=True)
        assert opt.step_count == 1
        for i, entry in expected["state"].items():
            assert torch.equal(opt.state_dict()["state"][i]["momentum_buffer"], entry["momentum_buffer"])
    with TieredAdamW(model.parameters()) as opt, pytest.raises(BaseException, match="Missing key in checkpoint"):
        dcp.load({"optim": TieredStateful(opt, model)}, checkpoint_id=tmp_path, no_dist=True)  # DCP: keys it lacks
