"""Algorithm descriptions: AdamW's says exactly what the engine hard-wired before it existed."""

from __future__ import annotations

import re

import pytest
import torch

from tierstore._compute import kernel
from tierstore._compute.algorithms import ADAMW, ALGORITHMS, Algorithm, algorithm_named
from tierstore._compute.hyper import GroupHyper
from tierstore._layout import layout as layout_module
from tierstore._layout import torch_format
from tierstore.errors import ConfigError, ConfigTypeError

# What tierstore hard-wired for AdamW before algorithms were described (25da26a), written out.
BEFORE_FIELD_ORDER = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
BEFORE_STATE_KEYS = {
    "master": "master_param",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "max_exp_avg_sq": "max_exp_avg_sq",
}
BEFORE_MOMENT_FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
BEFORE_GROUP_DEFAULTS = {
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}
BEFORE_OWN_STATE_KEYS = frozenset({"step", "master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
# TieredAdamW's param-group keys in order (optimizer.py built them by hand).
BEFORE_GROUP_KEYS = ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                     "differentiable", "fused", "decoupled_weight_decay"]  # fmt: skip


def test_adamw_reproduces_the_constants_the_engine_had() -> None:
    assert ADAMW.name == "adamw" and ALGORITHMS["adamw"] is ADAMW and algorithm_named("adamw") is ADAMW
    assert ADAMW.front == "TieredAdamW" and ADAMW.torch_class == "torch.optim.AdamW"
    assert ("master", *ADAMW.field_names) == BEFORE_FIELD_ORDER == layout_module.FIELD_ORDER
    assert {f: f for f in ADAMW.field_names} | {"master": "master_param"} == BEFORE_STATE_KEYS
    assert BEFORE_STATE_KEYS == layout_module.STATE_KEY_OF_FIELD
    compressible = tuple(f.name for f in ADAMW.fields if f.compressible)
    assert compressible == BEFORE_MOMENT_FIELDS == layout_module.MOMENT_FIELDS
    assert dict(ADAMW.group_defaults) == BEFORE_GROUP_DEFAULTS == torch_format.GROUP_DEFAULTS
    assert list(ADAMW.group_defaults) == list(BEFORE_GROUP_DEFAULTS)  # torch's key order, as state dicts show it
    assert frozenset({*ADAMW.state_scalars, *ADAMW.field_names, "master_param"}) == BEFORE_OWN_STATE_KEYS
    assert BEFORE_OWN_STATE_KEYS == torch_format.OWN_STATE_KEYS
    assert all(f.init == 0.0 for f in ADAMW.fields)  # fresh moments are zero bytes, as _fresh wrote them
    assert ADAMW.compiled


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("master", [False, True])
def test_adamw_fields_are_what_fields_for_chose(amsgrad: bool, master: bool) -> None:
    options = ADAMW.options([{"amsgrad": False}, {"amsgrad": amsgrad}])
    assert options == ({"amsgrad"} if amsgrad else set())
    fields = ("master",) * master + ADAMW.fields_for(options)
    assert fields == layout_module.fields_for(amsgrad=amsgrad, master=master)


def test_adamw_defaults_are_the_groups_tiered_adamw_built() -> None:
    beta2 = torch.tensor([0.999])
    group = ADAMW.defaults(dict(lr=0.1, betas=(torch.tensor(0.9), beta2), eps=1e-8, weight_decay=0.0,
                                amsgrad=1, maximize=0))  # fmt: skip
    assert list(group) == BEFORE_GROUP_KEYS
    assert group["betas"][1].dim() == 0 and group["amsgrad"] is True and group["maximize"] is False


# (group, the message check_group must raise): torch.optim.AdamW's checks and order, with the fix.
BAD_GROUPS = [
    ({"lr": -1.0}, ConfigError, r"^Invalid learning rate: -1.0 in g; lr must be >= 0$"),
    ({"lr": torch.ones(2)}, ConfigError, "^Tensor lr must be 1-element in g"),
    ({"eps": -1.0}, ConfigError, "^Invalid epsilon value: -1.0 in g"),
    ({"betas": (1.0, 0.9)}, ConfigError, "^Invalid beta parameter at index 0: 1.0 in g"),
    ({"betas": 0.9}, ConfigError, r"^Invalid betas: 0.9 in g; pass a pair"),
    ({"betas": (0.9, torch.tensor(0.9))}, ConfigError, "^betas must be either both floats or both Tensors in g"),
    ({"weight_decay": -0.1}, ConfigError, "^Invalid weight_decay value: -0.1 in g"),
    ({"lr": "x"}, ConfigTypeError, "^lr='x' in g must be a number"),
    ({"lr": -1.0, "eps": -1.0}, ConfigError, "^Invalid learning rate"),  # torch's order: lr first
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_GROUPS)
def test_adamw_check_group_refuses_what_torch_refuses(change, error, message) -> None:
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **change}
    with pytest.raises(error, match=message):
        ADAMW.check_group(group, " in g")


def test_adamw_snapshot_is_group_hyper_and_refuses_amsgrad_without_its_field() -> None:
    group = ADAMW.defaults(dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5, amsgrad=True, maximize=True))
    assert ADAMW.snapshot(group, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")) == GroupHyper(
        lr=0.1, beta1=0.8, beta2=0.9, weight_decay=0.5, eps=1e-6, amsgrad=True, maximize=True
    )
    with pytest.raises(ConfigError, match="switched to amsgrad=True after construction"):
        ADAMW.snapshot(group, ("exp_avg", "exp_avg_sq"))
    assert ADAMW.advances(group) and ADAMW.bucket(1.0) is None


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_update_on_pieces_is_the_kernel_on_whole_tensors(amsgrad: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [1000, 70, 64 * 3]

    def tensors() -> list[torch.Tensor]:
        return [torch.randn(n, generator=gen) for n in sizes]

    params, grads, exp_avgs, exp_avg_sqs = tensors(), tensors(), tensors(), [t.abs() for t in tensors()]
    maxs = [t.abs() + 0.1 for t in tensors()] if amsgrad else []
    steps = [torch.tensor(3.0) for _ in sizes]
    hyper = GroupHyper(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad, maximize=False)
    whole = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, maxs)]
    kernel.adamw(whole[0], grads, whole[1], whole[2], whole[3], steps, **hyper.kernel_kwargs())

    # The same update, each tensor cut at multiples of 64 elements, through the description.
    cut = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, maxs)]

    def pieces(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t[i : i + 128] for t in ts for i in range(0, t.numel(), 128)]

    fields = {"exp_avg": pieces(cut[1]), "exp_avg_sq": pieces(cut[2])}
    if amsgrad:
        fields["max_exp_avg_sq"] = pieces(cut[3])
    piece_steps = [steps[k] for k, t in enumerate(params) for _ in range(0, t.numel(), 128)]
    ADAMW.update(pieces(cut[0]), pieces(grads), fields, piece_steps, hyper)
    for a, b in zip(whole, cut):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_an_unknown_algorithm_is_refused_with_the_known_ones() -> None:
    known = re.escape(str(sorted(ALGORITHMS)))
    with pytest.raises(ConfigError, match=rf"unknown optimizer algorithm 'lamb'; tierstore knows {known}"):
        algorithm_named("lamb")
    assert isinstance(ADAMW, Algorithm) and algorithm_named(ADAMW) is ADAMW


def test_adamw_probe_fails_where_torch_lacks_its_kernel(monkeypatch) -> None:
    ADAMW.probe()
    monkeypatch.delattr(torch, "_fused_adamw_")
    with pytest.raises(ConfigError, match="_fused_adamw_"):
        ADAMW.probe()
