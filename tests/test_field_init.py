"""The engine gives each field its initial value (FieldSpec.init), in every moment format.

A fresh state holds each field at its start (Adagrad's ``sum`` at
``initial_accumulator_value``; here a test algorithm whose compressible field
starts at 0.25, so the start goes through each format's encoder), a loaded
state dict that gives a parameter no value for a field starts it there, an
eager algorithm lists every parameter from construction, and a saved layout
holds the fields its algorithm always has (and may hold none).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tierstore import ConfigError
from tierstore._compute.algorithms import ADAMW, FieldSpec
from tierstore._compute.algorithms.sgd import StochasticGradientDescent
from tierstore._layout.layout import Layout
from tierstore.tiered_optimizer import TieredOptimizer


class Started(StochasticGradientDescent):
    """SGD's hyperparameters over a field that always exists, starts at ``start`` and may be compressed."""

    name = "test_started"
    front = "Started"
    fields = (FieldSpec("momentum_buffer", init="start", signed=True),)
    state_scalars = ("step",)
    eager = True

    def defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        return {**super().defaults(values), "start": values["start"]}

    def advances(self, group: dict[str, Any]) -> bool:
        return True


class TieredStarted(TieredOptimizer):
    algorithm = Started()

    def __init__(self, params: Any, start: float, **tiers: Any) -> None:
        hyper = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, start=start)
        super().__init__(params, hyper, **tiers)


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16", "int8"])
def test_a_fresh_state_holds_each_fields_start_in_every_format(moment_dtype: str) -> None:
    params = [torch.nn.Parameter(torch.ones(30000)), torch.nn.Parameter(torch.ones(3, 7))]
    with TieredStarted(params, 0.25, moment_dtype=moment_dtype, ram_budget=64 << 10, shard_numel=1024) as opt:
        assert opt.plan.disk_shards and opt.layout.encoded == (moment_dtype != "float32")
        state = opt.state_dict()["state"]
        assert sorted(state) == [0, 1]  # eager: listed before any step, with step 0
        for entry in state.values():
            assert float(entry["step"]) == 0.0
            assert torch.equal(entry["momentum_buffer"], torch.full_like(entry["momentum_buffer"], 0.25))


def test_a_parameter_a_loaded_state_leaves_out_starts_over() -> None:
    params = [torch.nn.Parameter(torch.ones(100)), torch.nn.Parameter(torch.ones(10))]
    with TieredStarted(params, 0.5) as opt:
        sd = opt.state_dict()
        sd["state"][0]["momentum_buffer"] = torch.full((100,), 3.0)
        del sd["state"][1]
        opt.load_state_dict(sd)
        state = opt.state_dict()["state"]
        assert sorted(state) == [0]
        assert float(state[0]["momentum_buffer"][0]) == 3.0
        # The second parameter took no step since (no entry), and holds the start again.
        out = {1: {"momentum_buffer": torch.empty(10)}}
        opt.visit_shards(lambda shard, flat: opt.layout.copy_out(shard, flat, out))
        assert torch.equal(out[1]["momentum_buffer"], torch.full((10,), 0.5))


def test_copy_in_starts_what_no_source_covers() -> None:
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    layout = Layout.build([[a, b]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
    shard = layout.shards[0]
    flat = torch.full((2 * 1024,), 9.0)
    layout.copy_in(shard, flat, {0: {"exp_avg": torch.ones(3)}}, init={"exp_avg": 0.0, "exp_avg_sq": 0.5})
    views = layout.field_views(flat, shard)
    start_b = layout.params[1].start - shard.start
    assert views["exp_avg"][:3].tolist() == [1.0, 1.0, 1.0] and views["exp_avg"][start_b : start_b + 2].tolist() == [0.0, 0.0]
    assert views["exp_avg_sq"][:3].tolist() == [0.5] * 3 and views["exp_avg_sq"][start_b : start_b + 2].tolist() == [0.5] * 2
    assert float(views["exp_avg_sq"][3]) == 0.0  # padding stays zero


def test_a_saved_layout_holds_the_fields_its_algorithm_always_has() -> None:
    w = torch.zeros(3, requires_grad=True)
    data = json.loads(json.dumps(Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq")).to_dict()))
    with pytest.raises(ConfigError, match=r"layout fields=\['master'\] lack \['exp_avg', 'exp_avg_sq'\]"):
        Layout.from_dict({**data, "fields": ["master"]})
    assert ADAMW.fields_for(()) == ("exp_avg", "exp_avg_sq")
    # SGD without momentum (and without masters) holds no field at all.
    from tierstore._compute.algorithms import SGD

    empty = Layout.build([[w]], shard_numel=1024, fields=(), algorithm=SGD)
    assert Layout.from_dict(json.loads(json.dumps(empty.to_dict()))).fields == ()
