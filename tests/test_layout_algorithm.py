"""A layout records its algorithm; every AdamW layout keeps the bytes and fingerprint it had before."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tierstore._compute.algorithms import ADAMW, FieldSpec
from tierstore._compute.algorithms.adamw import AdamW
from tierstore._layout import layout as layout_module
from tierstore._layout.layout import Layout, fields_for, state_fields
from tierstore.errors import ConfigError


class Adam(AdamW):
    """Adam's state has AdamW's field names: only the algorithm tells the two apart."""

    name = "adam"
    front = "TieredAdam"
    torch_class = "torch.optim.Adam"


class Momentum(AdamW):
    """A one-field algorithm whose field no moment format may store."""

    name = "momentum"
    fields = (FieldSpec("momentum_buffer", option="momentum", compressible=False),)

    def uses(self, group, option) -> bool:
        return option == "momentum" and group.get("momentum", 0) != 0


ADAM, MOMENTUM = Adam(), Momentum()


def _groups() -> list[list[torch.Tensor]]:
    g1 = [torch.zeros(3000, requires_grad=True), torch.zeros(10, dtype=torch.bfloat16, requires_grad=True),
          torch.zeros(5)]  # fmt: skip
    return [g1, [torch.zeros(7, 9, requires_grad=True)]]


_PARAMS = (
    '[{"dtype":"float32","group":0,"index":0,"numel":3000,"shape":[3000],"start":0,"trainable":true},'
    '{"dtype":"bfloat16","group":0,"index":1,"numel":10,"shape":[10],"start":%d,"trainable":true},'
    '{"dtype":"float32","group":0,"index":2,"numel":5,"shape":[5],"start":-1,"trainable":false},'
    '{"dtype":"float32","group":1,"index":3,"numel":63,"shape":[7,9],"start":%d,"trainable":true}]'
)
# Written by 25da26a, before layouts recorded an algorithm (json.dumps(to_dict(), sort_keys=True), the fingerprint).
BEFORE = [
    (
        dict(shard_numel=2048, fields=fields_for(amsgrad=False, master=False)),
        '{"fields":["exp_avg","exp_avg_sq"],"layout_version":1,"params":' + _PARAMS % (3008, 3072)
        + ',"shard_numel":2048}',
        "61105006a868473bcae103867db32ae5",
    ),
    (
        dict(shard_numel=4096, fields=fields_for(amsgrad=True, master=True), moment_dtype="int8"),
        '{"fields":["master","exp_avg","exp_avg_sq","max_exp_avg_sq"],"layout_version":1,"moment_dtype":"int8",'
        '"params":' + _PARAMS % (3072, 3328) + ',"shard_numel":4096}',
        "f875ec079ace755e217256d538f9c793",
    ),
]


@pytest.mark.parametrize(("build", "data", "fingerprint"), BEFORE, ids=["float32", "int8-amsgrad-master"])
def test_an_adamw_layout_is_byte_for_byte_what_it_was_before_algorithms(build, data, fingerprint) -> None:
    layout = Layout.build(_groups(), **build)
    assert layout.algorithm is ADAMW and "algorithm" not in layout.to_dict()
    assert json.dumps(layout.to_dict(), sort_keys=True, separators=(",", ":")) == data
    # The unsorted order too: a manifest or checkpoint writes the dict as it comes.
    assert list(layout.to_dict())[:4] == ["layout_version", "shard_numel", "fields", "params"]
    assert layout.fingerprint == fingerprint
    assert Layout.from_dict(json.loads(data)).fingerprint == fingerprint
    assert Layout.build(_groups(), **build, algorithm="adamw").fingerprint == fingerprint


def test_an_algorithm_with_adamws_fields_is_another_state() -> None:
    adamw = Layout.build(_groups(), shard_numel=2048, fields=("exp_avg", "exp_avg_sq"))
    adam = Layout.build(_groups(), shard_numel=2048, fields=("exp_avg", "exp_avg_sq"), algorithm=ADAM)
    assert adam.to_dict() == {**adamw.to_dict(), "algorithm": "adam"}
    assert adam.fingerprint != adamw.fingerprint
    assert adamw.describe_difference(adam) == "algorithm 'adam' instead of 'adamw'"
    assert adam.describe_difference(adamw) == "algorithm 'adamw' instead of 'adam'"


def test_a_layout_of_another_algorithm_reads_back_where_it_is_registered(monkeypatch) -> None:
    layout = Layout.build(_groups(), shard_numel=2048, fields=("master", "momentum_buffer"), algorithm=MOMENTUM)
    data = json.loads(json.dumps(layout.to_dict()))
    assert data["algorithm"] == "momentum" and data["fields"] == ["master", "momentum_buffer"]
    known = re.escape(str(sorted(layout_module.ALGORITHMS)))
    with pytest.raises(ConfigError, match=rf"layout algorithm='momentum' is not one of {known}"):
        Layout.from_dict(data)
    monkeypatch.setattr(layout_module, "ALGORITHMS", {"adamw": ADAMW, "momentum": MOMENTUM})
    again = Layout.from_dict(data)
    assert again.algorithm is MOMENTUM and again.fingerprint == layout.fingerprint
    assert layout.describe_difference(again) == "no difference"
    # The fields are checked against the recorded algorithm's, in its order.
    with pytest.raises(ConfigError, match=r"fields=\['exp_avg'\] must be distinct names from \('master', 'momentum_"):
        Layout.from_dict({**data, "fields": ["exp_avg"]})
    with pytest.raises(ConfigError, match=r"must be distinct names from \('master', 'momentum_buffer'\), in that"):
        Layout.from_dict({**data, "fields": ["momentum_buffer", "master"]})


@pytest.mark.parametrize("name", [None, 3, "", "lamb"])
def test_a_recorded_algorithm_that_is_not_registered_is_refused(name) -> None:
    data = {**Layout.build(_groups(), shard_numel=2048, fields=("exp_avg",)).to_dict(), "algorithm": name}
    with pytest.raises(ConfigError, match=f"layout algorithm={name!r} is not one of"):
        Layout.from_dict(data)


def test_fields_are_those_of_the_layouts_algorithm() -> None:
    with pytest.raises(ConfigError, match=r"unknown state fields \['exp_avg'\]; known fields are \('master', 'mom"):
        Layout.build(_groups(), shard_numel=1024, fields=("exp_avg",), algorithm=MOMENTUM)
    with pytest.raises(ConfigError, match="unknown optimizer algorithm 'sgdw'"):
        Layout.build(_groups(), shard_numel=1024, fields=(), algorithm="sgdw")
    layout = Layout.build(_groups(), shard_numel=1024, fields=("momentum_buffer", "master"), algorithm=MOMENTUM)
    assert layout.fields == layout.field_order == ("master", "momentum_buffer")
    assert [layout.state_key(f) for f in layout.fields] == ["master_param", "momentum_buffer"]
    assert [layout.field_of_key(k) for k in ("master_param", "momentum_buffer", "exp_avg")] == [
        "master", "momentum_buffer", None]  # fmt: skip
    with pytest.raises(KeyError, match="momentum has no state field 'exp_avg'"):
        layout.state_key("exp_avg")
    assert state_fields(MOMENTUM, {"momentum"}, master=False) == ("momentum_buffer",)
    assert state_fields(MOMENTUM, (), master=True) == ("master",)


def test_only_compressible_fields_take_the_moment_format() -> None:
    int8 = Layout.build(_groups(), shard_numel=4096, fields=("master", "momentum_buffer"), moment_dtype="int8",
                        algorithm=MOMENTUM)  # fmt: skip
    assert int8.encoded_fields == ()
    assert int8.bytes_per_element == 8 and int8.field_nbytes("momentum_buffer", 4096) == 4096 * 4
    adamw = Layout.build(_groups(), shard_numel=4096, fields=fields_for(amsgrad=True, master=True),
                         moment_dtype="int8")  # fmt: skip
    assert adamw.encoded_fields == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert adamw.field_nbytes("exp_avg", 4096) < adamw.field_nbytes("master", 4096) == 4096 * 4


def test_decide_chooses_the_algorithms_fields() -> None:
    from tierstore._layout.spec import decide

    kw = dict(numel=10_000, dtypes=[torch.float32], cuda=False, keep_master=None, arena_slots=4, ram_budget=None,
              shard_numel=None)  # fmt: skip
    assert decide(**kw, amsgrad=True) == decide(**kw, options={"amsgrad"})
    assert decide(**kw, amsgrad=True).fields == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    spec = decide(**kw, algorithm=MOMENTUM, options=MOMENTUM.options([{"amsgrad": True, "momentum": 0.9}]))
    assert spec.fields == ("momentum_buffer",) and spec.options == {"momentum"} and not spec.amsgrad
    # A resumed state keeps the optional fields it was saved with.
    saved = Layout.build(_groups(), shard_numel=1024, fields=("momentum_buffer",), algorithm=MOMENTUM)
    assert decide(**kw, algorithm=MOMENTUM, options=(), saved=saved).fields == ("momentum_buffer",)
    assert decide(**kw, algorithm=MOMENTUM, options=()).fields == ()
    # Only compressible fields take the moment format's bytes.
    int8 = dict(kw, keep_master=True, moment_dtype="int8")
    assert decide(**int8, algorithm=MOMENTUM, options={"momentum"}).stored_bytes_per_element == 8
    assert decide(**int8).stored_bytes_per_element < 8


def test_torch_state_dicts_use_the_layouts_keys() -> None:
    from tierstore._layout.torch_format import empty_state_dict, flat_sources

    w = torch.zeros(3, requires_grad=True)
    layout = Layout.build([[w]], shard_numel=1024, fields=("master", "momentum_buffer"), algorithm=MOMENTUM)
    sd, flats = empty_state_dict(layout, [1.0], [{"lr": 0.1, "momentum": 0.9}])
    assert list(sd["state"][0]) == ["step", "momentum_buffer", "master_param"] and list(flats[0]) == list(layout.fields)
    sd, flats = empty_state_dict(layout, [1.0], [{"lr": 0.1, "momentum": 0.0}])  # a group that does not use it
    assert list(sd["state"][0]) == ["step", "master_param"] and list(flats[0]) == ["master"]
    sources = flat_sources({0: {"momentum_buffer": torch.ones(3), "exp_avg": torch.ones(3)}}, layout)
    assert list(sources[0]) == ["momentum_buffer"]
