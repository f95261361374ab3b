"""``from_deepspeed_config``: the DeepSpeed keys users have, mapped to TieredAdamW (and each optimizer type to its front), and the ones refused.

A table of configs with the keyword arguments each must map to, a table of
bad configs with the error each must raise, the ``ratio`` -> ``ram_budget``
arithmetic checked against the optimizer's own tier plan, and a run built
from a DeepSpeed config that is bitwise equal to ``torch.optim.AdamW``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierstore
from tierstore import ConfigError, TieredAdamW
from tierstore._compute.algorithms import ALGORITHMS
from tierstore._layout.layout import DEFAULT_SHARD_NUMEL
from tierstore.deepspeed_config import (
    deepspeed_kwargs,
    map_deepspeed_config,
    optimizer_arguments,
    ram_budget_for_ratio,
)
from tierstore.fronts.deepspeed import from_deepspeed_config as build_from_deepspeed_config

from_deepspeed_config = TieredAdamW.from_deepspeed_config
ACCEPTED = optimizer_arguments(TieredAdamW.__init__)


def zero(offload: dict[str, Any] | None = None, stage: int = 2, **more: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": stage, **more}
    if offload is not None:
        section["offload_optimizer"] = offload
    return {"zero_optimization": section}


def adam(kind: str = "AdamW", **params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": kind, "params": params}}


# config -> (TieredAdamW keyword arguments, offload ratio, keys accepted without effect)
MAPPINGS: list[tuple[str, dict[str, Any], dict[str, Any], float | None, tuple[str, ...]]] = [
    ("empty config: torch AdamW's defaults", {}, {}, None, ()),
    (
        "AdamW with every param",
        adam("AdamW", lr=3e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.1, amsgrad=True),
        {"lr": 3e-4, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True},
        None,
        (),
    ),
    ("type is case-insensitive", adam("adamw", lr=1e-3), {"lr": 1e-3, "weight_decay": 0.0}, None, ()),
    (
        "Adam: adam_w_mode defaults to true, so weight decay is decoupled (AdamW)",
        adam("Adam", lr=1e-3, weight_decay=0.01),
        {"lr": 1e-3, "weight_decay": 0.01},
        None,
        (),
    ),
    (
        "Adam in L2 mode is fine without weight decay (the same maths)",
        adam("Adam", lr=1e-3, adam_w_mode=False),
        {"lr": 1e-3, "weight_decay": 0.0},
        None,
        (),
    ),
    ("weight_decay absent: DeepSpeed's default 0", adam("AdamW", lr=1e-3), {"lr": 1e-3, "weight_decay": 0.0}, None, ()),
    (
        "torch_adam: torch AdamW's default weight decay",
        adam("AdamW", torch_adam=True),
        {"weight_decay": 0.01},
        None,
        (),
    ),
    (
        "AdamW ignores adam_w_mode, as DeepSpeed does",
        adam("AdamW", adam_w_mode=False, weight_decay=0.1, bias_correction=True, fp32_optimizer_states=True),
        {"weight_decay": 0.1},
        None,
        (),
    ),
    ("stage without offload: all state in RAM", zero(None, stage=3), {}, None, ()),
    ("device none", zero({"device": "none"}), {}, None, ()),
    (
        "device cpu: all in RAM; nvme_path has no use",
        zero({"device": "cpu", "pin_memory": True, "nvme_path": "/nvme"}),
        {"pin_memory": True},
        None,
        ("zero_optimization.offload_optimizer.nvme_path",),
    ),
    ("deprecated cpu_offload", zero(None, cpu_offload=True), {}, None, ()),
    (
        "device nvme: state_dir, prefetch, pin, shard size; ratio defaults to 1 (all offloaded)",
        zero({"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5, "pin_memory": False, "buffer_size": 1e6}),
        {"state_dir": "/nvme", "prefetch_depth": 5, "pin_memory": False, "shard_numel": 1_000_000},
        1.0,
        (),
    ),
    (
        "nvme_path a list: one directory per drive (issue 25)",
        zero({"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"]}),
        {"state_dir": ["/nvme0", "/nvme1"]},
        1.0,
        (),
    ),
    (
        "nvme with a ratio and speed-only knobs",
        zero(
            {"device": "nvme", "nvme_path": "/nvme", "ratio": 0.25, "fast_init": True, "pipeline_read": True,
             "pipeline_write": False},
            stage=3,
            overlap_comm=True,
            reduce_bucket_size=5e8,
        ),
        {"state_dir": "/nvme"},
        0.25,
        (
            "zero_optimization.overlap_comm",
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.offload_optimizer.pipeline_read",
            "zero_optimization.offload_optimizer.pipeline_write",
            "zero_optimization.offload_optimizer.fast_init",
        ),
    ),
    (
        "offload_param with device none is fine",
        {**adam(lr=1e-3), **zero({"device": "cpu"}, stage=3, offload_param={"device": "none"})},
        {"lr": 1e-3, "weight_decay": 0.0},
        None,
        (),
    ),
    (
        "top-level keys outside the optimizer's sections are not read",
        {"train_batch_size": 32, "bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR"}, "aio": {}},
        {},
        None,
        (),
    ),
]


@pytest.mark.parametrize(("name", "config", "kwargs", "ratio", "ignored"), MAPPINGS, ids=[m[0] for m in MAPPINGS])
def test_mapping_table(name: str, config: dict, kwargs: dict, ratio: float | None, ignored: tuple[str, ...]) -> None:
    mapping = map_deepspeed_config(config)
    assert mapping.kwargs == kwargs
    assert mapping.offload_ratio == ratio
    assert set(mapping.ignored) == set(ignored)


# (config, overrides, fragments the message must contain)
BAD: list[tuple[str, Any, dict[str, Any], tuple[str, ...]]] = [
    ("not a dict", 42, {}, ("config=42", "dict or the path")),
    ("missing file", "/nonexistent/ds.json", {}, ("cannot read", "/nonexistent/ds.json")),
    ("optimizer type", adam("Lamb"), {}, ("optimizer.type='Lamb'", "Adam/AdamW")),
    ("optimizer type OneBitAdam", adam("OneBitAdam"), {}, ("OneBitAdam",)),
    ("optimizer type not a string", {"optimizer": {"type": 3}}, {}, ("optimizer.type=3",)),
    ("unknown optimizer key", {"optimizer": {"type": "AdamW", "param": {}}}, {}, ("unknown keys", "'param'")),
    ("unknown optimizer param", adam(lr=1e-3, momentum=0.9), {}, ("momentum", "cannot honour")),
    ("params not an object", {"optimizer": {"type": "AdamW", "params": [1]}}, {}, ("optimizer.params=[1]", "JSON object")),
    ("L2 weight decay", adam("Adam", adam_w_mode=False, weight_decay=0.01), {}, ("adam_w_mode=false", "L2", "weight_decay=0.01")),
    ("L2 weight decay from an override", adam("Adam", adam_w_mode=False), {"weight_decay": 0.1}, ("L2",)),
    ("no bias correction", adam(bias_correction=False), {}, ("bias_correction=false", "Remove the key")),
    ("low-precision moments", adam(fp32_optimizer_states=False), {}, ("fp32_optimizer_states=false",)),
    ("lr auto", adam(lr="auto"), {}, ("lr='auto'", "Hugging Face", "lr=...")),
    ("lr a string", adam(lr="1e-3"), {}, ("lr='1e-3'", "must be a number")),
    ("betas single", adam(betas=[0.9]), {}, ("betas=[0.9]", "pair")),
    ("betas auto", adam(betas=["auto", 0.99]), {}, ("betas[0]='auto'",)),
    ("amsgrad not a bool", adam(amsgrad="yes"), {}, ("amsgrad='yes'", "true or false")),
    ("zero not an object", {"zero_optimization": 2}, {}, ("zero_optimization=2", "JSON object")),
    ("stage 4", zero(None, stage=4), {}, ("stage=4",)),
    ("stage negative", zero(None, stage=-1), {}, ("stage=-1", ">= 0")),
    ("offload under stage 0", zero({"device": "cpu"}, stage=0), {}, ("stage=0", "stage 1, 2 or 3")),
    ("offload params", zero({"device": "cpu"}, stage=3, offload_param={"device": "cpu"}), {}, ("offload_param", "optimizer state only")),
    ("deprecated param offload", zero(None, stage=3, cpu_offload_params=True), {}, ("offload_param",)),
    ("unknown offload key", zero({"device": "nvme", "nvme_path": "/x", "max_in_cpu": 1e9}), {}, ("max_in_cpu", "does not know")),
    ("device hpu", zero({"device": "hpu"}), {}, ("device='hpu'", "'nvme'")),
    ("nvme without a path", zero({"device": "nvme"}), {}, ("nvme_path", "None")),
    ("nvme_path an empty list", zero({"device": "nvme", "nvme_path": []}), {}, ("nvme_path", "one per drive", "[]")),
    ("nvme_path a list with a number", zero({"device": "nvme", "nvme_path": ["/a", 3]}), {}, ("nvme_path", "['/a', 3]")),
    ("ratio above 1", zero({"device": "nvme", "nvme_path": "/x", "ratio": 1.5}), {}, ("ratio=1.5", "[0, 1]")),
    ("ratio with cpu keeps state on the GPU", zero({"device": "cpu", "ratio": 0.3}, stage=3), {}, ("ratio=0.3", "on the GPU")),
    ("buffer_count 0", zero({"device": "nvme", "nvme_path": "/x", "buffer_count": 0}), {}, ("buffer_count=0", ">= 1")),
    ("buffer_size fractional", zero({"device": "nvme", "nvme_path": "/x", "buffer_size": 10.5}), {}, ("buffer_size=10.5",)),
    # Numbers JSON allows that int() cannot take (1e999 parses as inf): a ConfigError, never OverflowError.
    ("stage infinite", zero(None, stage=float("inf")), {}, ("stage=inf", "whole number")),
    ("stage NaN", zero(None, stage=float("nan")), {}, ("stage=nan", "whole number")),
    ("buffer_count infinite", zero({"device": "nvme", "nvme_path": "/x", "buffer_count": float("inf")}), {}, ("buffer_count=inf",)),
    ("buffer_size NaN", zero({"device": "nvme", "nvme_path": "/x", "buffer_size": float("nan")}), {}, ("buffer_size=nan",)),
    ("pin_memory a string", zero({"device": "cpu", "pin_memory": "true"}), {}, ("pin_memory='true'",)),
    ("unknown override", {}, {"learning_rate": 1e-3}, ("learning_rate", "not TieredAdamW arguments")),
    ("a bad value reaches TieredAdamW's own check", adam(lr=-1.0), {}, ("Invalid learning rate: -1.0",)),
]


@pytest.mark.parametrize(("name", "config", "overrides", "fragments"), BAD, ids=[b[0] for b in BAD])
def test_bad_configs_raise_config_error(name: str, config: Any, overrides: dict, fragments: tuple[str, ...]) -> None:
    w = nn.Parameter(torch.ones(4))
    with pytest.raises(ConfigError) as info:
        from_deepspeed_config([w], config, **overrides).close()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_bad_json_file(tmp_path: Path) -> None:
    broken = tmp_path / "ds.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        map_deepspeed_config(broken)
    broken.write_bytes(b"\xff\xfe{}")  # not UTF-8: UnicodeDecodeError is a ValueError, not a JSONDecodeError
    with pytest.raises(ConfigError, match="not valid JSON"):
        map_deepspeed_config(broken)
    broken.write_text("[" * 100_000)  # nested past the parser's recursion limit
    with pytest.raises(ConfigError, match="not valid JSON"):
        map_deepspeed_config(broken)
    broken.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list"):
        map_deepspeed_config(str(broken))


def test_json_file_and_overrides(tmp_path: Path) -> None:
    """A JSON path works like the dict; overrides win, and fill in Hugging Face's "auto" values."""
    config = {**adam("AdamW", lr="auto", weight_decay="auto", betas=[0.9, 0.95]), **zero({"device": "cpu"})}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    w = nn.Parameter(torch.ones(4))
    with from_deepspeed_config([w], path, lr=0.5, weight_decay=0.0, eps=1e-6) as opt:
        group = opt.param_groups[0]
        assert (group["lr"], group["weight_decay"], group["eps"], group["betas"]) == (0.5, 0.0, 1e-6, (0.9, 0.95))
        assert opt.state_dir is None and opt.disk_bytes == 0


def model_and_batches(seed: int = 0) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 16))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(4)]
    return model, batches


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.0])
def test_nvme_ratio_sets_the_share_on_disk(tmp_path: Path, ratio: float) -> None:
    """ratio = fraction of the state on disk (DeepSpeed's fraction offloaded); results stay bitwise equal."""
    model, batches = model_and_batches()
    ref_model, _ = model_and_batches()
    config = {
        **adam("Adam", lr=1e-2, betas=[0.9, 0.99], eps=1e-7, weight_decay=0.05),
        **zero({"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "ratio": ratio, "buffer_count": 1,
                "buffer_size": 1024}),
    }
    with from_deepspeed_config(model.parameters(), config) as opt:
        plan = opt.plan
        on_disk = plan.disk_nbytes / plan.state_nbytes
        shard = opt.layout.shard_nbytes(0)
        assert abs(on_disk - ratio) <= shard / plan.state_nbytes  # whole shards
        assert opt.state_dir is not None and opt.state_dir.startswith(str(tmp_path / "nvme"))
        assert plan.arena_slots in (0, 3)  # buffer_count 1 -> prefetch_depth 1 -> 3 slots
        train(model, opt, batches)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05, fused=True)
    train(ref_model, ref, batches)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_ram_budget_for_ratio_matches_the_optimizer_plan() -> None:
    """The layout it builds is the optimizer's (fields for bf16 masters and amsgrad, staging, arena)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(40 * 1024, dtype=torch.bfloat16))
    b = nn.Parameter(torch.randn(3000, dtype=torch.bfloat16))
    groups = [{"params": iter([w])}, {"params": b, "amsgrad": True}]  # a generator and a bare tensor
    budget = ram_budget_for_ratio(groups, 0.75, shard_numel=4096, prefetch_depth=2)
    groups = [{"params": [w]}, {"params": [b], "amsgrad": True}]
    with TieredAdamW(groups, ram_budget=budget, shard_numel=4096, prefetch_depth=2, amsgrad=True) as opt:
        plan = opt.plan
        assert set(opt.layout.fields) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"}
        assert plan.staging_nbytes > 0
        assert plan.ram_nbytes <= budget < plan.ram_nbytes + opt.layout.shard_nbytes(0)
        assert abs(plan.disk_nbytes / plan.state_nbytes - 0.75) <= opt.layout.shard_nbytes(0) / plan.state_nbytes


def test_default_shard_size_and_budget_override(tmp_path: Path) -> None:
    """nvme without buffer_size fixes the shard size the budget was computed for; ram_budget overrides win."""
    w = nn.Parameter(torch.zeros(8))
    config = zero({"device": "nvme", "nvme_path": str(tmp_path)})
    kwargs, mapping = deepspeed_kwargs([w], config, accepted=ACCEPTED)
    assert kwargs["shard_numel"] == DEFAULT_SHARD_NUMEL and isinstance(kwargs["ram_budget"], int)
    assert mapping.offload_ratio == 1.0
    kwargs, _ = deepspeed_kwargs([w], config, accepted=ACCEPTED, ram_budget="1GiB", resume=True)
    assert kwargs["ram_budget"] == "1GiB" and kwargs["resume"] is True and kwargs["state_dir"] == str(tmp_path)


@pytest.mark.parametrize("ratio", [-0.1, 1.1, True, "half"])
def test_ram_budget_for_ratio_rejects_bad_ratios(ratio: Any) -> None:
    with pytest.raises(ConfigError, match="ratio="):
        ram_budget_for_ratio([nn.Parameter(torch.zeros(4))], ratio)


# -- optimizer.type: each DeepSpeed optimizer maps to the front of its algorithm (issue 24) ------------
CPU_OFFLOAD = zero({"device": "cpu"})["zero_optimization"]


def typed(kind: str, **params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": kind, "params": params}, "zero_optimization": CPU_OFFLOAD}


# config -> (the algorithm it asks for, the front's keyword arguments)
TYPES: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = [
    ("AdamW", typed("AdamW", lr=1e-3), "adamw", {"lr": 1e-3, "weight_decay": 0.0}),
    ("Adam decoupled (adam_w_mode's default)", typed("Adam", weight_decay=0.1), "adamw", {"weight_decay": 0.1}),
    ("Adam in L2 mode: torch.optim.Adam", typed("Adam", adam_w_mode=False, weight_decay=0.1, amsgrad=True), "adam",
     {"weight_decay": 0.1, "amsgrad": True}),
    ("Adagrad: DeepSpeed's defaults are torch's", typed("Adagrad"), "adagrad", {}),
    ("Adagrad with torch's keys", typed("adagrad", lr=0.1, eps=1e-8, weight_decay=0.01, lr_decay=0.001,
                                        initial_accumulator_value=0.5, amsgrad=False, fp32_optimizer_states=True),
     "adagrad", {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01, "lr_decay": 0.001, "initial_accumulator_value": 0.5}),
    ("Lion: DeepSpeed's defaults, not lion-pytorch's", typed("Lion"), "lion",
     {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
    ("Lion given", typed("Lion", lr=1e-4, betas=[0.95, 0.98], weight_decay=0.1), "lion",
     {"lr": 1e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}),
    ("SGD: torch.optim's class, params as its arguments", typed("SGD", lr=0.1, momentum=0.9, nesterov=True), "sgd",
     {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("RMSprop", typed("RMSprop", lr=0.01, alpha=0.9, centered=True), "rmsprop", {"lr": 0.01, "alpha": 0.9, "centered": True}),
    ("RAdam's betas as a tuple", typed("RAdam", betas=[0.8, 0.9]), "radam", {"betas": (0.8, 0.9)}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "config", "algorithm", "kwargs"), TYPES, ids=[t[0] for t in TYPES])
def test_each_optimizer_type_maps_to_its_algorithm(name: str, config: dict, algorithm: str, kwargs: dict) -> None:
    mapping = map_deepspeed_config(config, algorithm=None)
    assert (mapping.algorithm, mapping.kwargs) == (algorithm, kwargs)


@pytest.mark.parametrize(("name", "config", "algorithm", "kwargs"), TYPES, ids=[t[0] for t in TYPES])
def test_from_deepspeed_config_builds_the_front_the_type_names(name: str, config: dict, algorithm: str, kwargs: dict) -> None:
    if algorithm not in ALGORITHMS or getattr(tierstore, ALGORITHMS[algorithm].front, None) is None:
        pytest.skip(f"this tierstore has no front for {algorithm} yet")
    front = getattr(tierstore, ALGORITHMS[algorithm].front)
    assert tierstore.from_deepspeed_config is build_from_deepspeed_config
    w = nn.Parameter(torch.ones(4))
    with build_from_deepspeed_config([w], config) as opt:
        assert type(opt) is front
        for key, value in kwargs.items():
            assert opt.param_groups[0][key] == value, key
        w.grad = torch.full((4,), 0.5)
        opt.step()


# (config, the front's from_deepspeed_config, fragments of the refusal)
TYPE_REFUSALS: list[tuple[str, dict[str, Any], Any, tuple[str, ...]]] = [
    ("OneBitAdam", typed("OneBitAdam"), None, ("optimizer.type='OneBitAdam'", "1-bit communication", "Use Adam")),
    ("ZeroOneAdam", typed("ZeroOneAdam"), None, ("ZeroOneAdam", "without ZeRO only")),
    ("OneBitLamb", typed("OneBitLamb"), None, ("OneBitLamb", "1-bit")),
    ("Lamb", typed("Lamb"), None, ("optimizer.type='Lamb'", "trust ratio", "not elementwise", "Adam/AdamW")),
    ("Muon", typed("Muon"), None, ("Muon", "orthogonalises", "not elementwise")),
    ("MuAdam", typed("MuAdam"), None, ("mup's", "width multiplier")),
    ("MuSGD", typed("MuSGD"), None, ("MuSGD", "mup's")),
    ("a torch class without a front", typed("LBFGS"), None, ("optimizer.type='LBFGS' is not supported", "SGD")),
    ("an empty type", typed(""), None, ("optimizer.type=''",)),
    ("Adagrad with amsgrad", typed("Adagrad", amsgrad=True), None, ("amsgrad=true: Adagrad has no amsgrad",)),
    ("Adagrad with Adam's key", typed("Adagrad", betas=[0.9, 0.99]), None, ("['betas']", "for type 'Adagrad'")),
    ("Adagrad with low-precision state", typed("Adagrad", fp32_optimizer_states=False), None,
     ("fp32_optimizer_states=false", "TieredAdagrad")),
    ("Lion with eps", typed("Lion", eps=1e-8), None, ("['eps']", "for type 'Lion'")),
    ("Lion betas single", typed("Lion", betas=[0.9]), None, ("betas=[0.9]", "pair")),
    ("Lion lr auto", typed("Lion", lr="auto"), None, ("lr='auto'", "Hugging Face")),
    ("SGD lr auto", typed("SGD", lr="auto"), None, ("lr='auto'", "Hugging Face")),
    ("SGD with Adam's betas", typed("SGD", lr=0.1, betas=[0.9, 0.99]), None, ("['betas']", "that TieredSGD does not take")),
    ("SGD into TieredAdamW", typed("SGD", lr=0.1), TieredAdamW.from_deepspeed_config,
     ("optimizer.type='SGD' asks for TieredSGD (sgd), not TieredAdamW", "tierstore.from_deepspeed_config")),
    ("Adam's L2 into TieredAdamW", typed("Adam", adam_w_mode=False, weight_decay=0.1), TieredAdamW.from_deepspeed_config,
     ("L2", "build TieredAdam")),
]  # fmt: skip


@pytest.mark.parametrize(("name", "config", "build", "fragments"), TYPE_REFUSALS, ids=[t[0] for t in TYPE_REFUSALS])
def test_optimizer_types_refused_with_the_reason(name: str, config: dict, build: Any, fragments: tuple[str, ...]) -> None:
    if "TieredSGD" in "".join(fragments) and "sgd" not in ALGORITHMS:
        pytest.skip("sgd is not registered in this tierstore yet")
    w = nn.Parameter(torch.ones(4))
    with pytest.raises(ConfigError) as info:
        (build or build_from_deepspeed_config)([w], config).close()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_a_front_this_tierstore_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierstore.fronts.deepspeed as builder

    monkeypatch.setattr(builder, "front_of", lambda name: None)
    assert map_deepspeed_config(typed("Lion"), algorithm=None).algorithm == "lion"
    with pytest.raises(ConfigError, match="asks for TieredLion, which this tierstore does not have"):
        build_from_deepspeed_config([nn.Parameter(torch.ones(4))], typed("Lion"))


def test_nvme_ratio_plans_the_fields_of_the_type(tmp_path: Path) -> None:
    """The ram_budget of a ratio counts the named algorithm's fields, with the options its arguments use."""
    if "rmsprop" not in ALGORITHMS:
        pytest.skip("rmsprop is not registered")
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5, "buffer_size": 4096}
    config = {"optimizer": {"type": "RMSprop", "params": {"momentum": 0.9}}, "zero_optimization": {"stage": 3, "offload_optimizer": offload}}
    params = [nn.Parameter(torch.zeros(64 * 1024))]
    kwargs, mapping = deepspeed_kwargs(params, config, algorithm=None)
    expected = ram_budget_for_ratio(params, 0.5, shard_numel=4096, algorithm="rmsprop", options={"momentum"})
    assert mapping.algorithm == "rmsprop" and kwargs["ram_budget"] == expected
    plain = ram_budget_for_ratio(params, 0.5, shard_numel=4096, algorithm="rmsprop")
    assert expected > plain  # momentum_buffer is a second field
    with build_from_deepspeed_config(params, config) as opt:
        assert opt.layout.fields == ("square_avg", "momentum_buffer") and opt.plan.disk_shards
