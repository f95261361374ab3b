"""The layout: every trainable element has exactly one place, a pure function of the parameters."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._layout.layout import FIELD_ORDER, PAGE_NUMEL, PARAM_ALIGN, STATE_ITEMSIZE, Layout
from tierstore.errors import ConfigError

FIELDS = ("exp_avg", "exp_avg_sq")


def tensors(specs: list[list[tuple[tuple[int, ...], torch.dtype, bool]]]) -> list[list[torch.Tensor]]:
    return [
        [torch.zeros(shape, dtype=dtype, requires_grad=trainable) for shape, dtype, trainable in group]
        for group in specs
    ]


param_specs = st.tuples(
    st.one_of(
        st.tuples(st.integers(0, 9000)),
        st.tuples(st.integers(0, 60), st.integers(0, 60)),
        st.just(()),
    ),
    st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    st.booleans(),
)
group_specs = st.lists(st.lists(param_specs, min_size=0, max_size=5), min_size=1, max_size=3)
field_sets = st.lists(st.sampled_from(FIELD_ORDER), min_size=1, max_size=4, unique=True)
# What an AdamW state can hold: both moments always, master and max_exp_avg_sq as chosen (from_dict refuses less).
adamw_field_sets = st.sets(st.sampled_from(("master", "max_exp_avg_sq"))).map(
    lambda extra: [f for f in FIELD_ORDER if f in {*extra, "exp_avg", "exp_avg_sq"}]
)


@settings(max_examples=150)
@given(specs=group_specs, shard_numel=st.integers(1, 20000), fields=field_sets)
def test_every_trainable_element_has_exactly_one_place(specs, shard_numel, fields) -> None:
    groups = tensors(specs)
    layout = Layout.build(groups, shard_numel=shard_numel, fields=fields)
    flat = [t for g in groups for t in g]

    # Parameters are numbered over all groups in order, frozen ones included.
    assert [p.index for p in layout.params] == list(range(len(flat)))
    assert [p.group for p in layout.params] == [gi for gi, g in enumerate(groups) for _ in g]
    # Fields come in the canonical order whatever order they were asked in.
    assert layout.fields == tuple(f for f in FIELD_ORDER if f in fields)
    # shard_numel is rounded up to whole pages.
    assert layout.shard_numel % PAGE_NUMEL == 0
    assert shard_numel <= layout.shard_numel < shard_numel + PAGE_NUMEL

    for entry, tensor in zip(layout.params, flat, strict=True):
        assert entry.shape == tuple(tensor.shape) and entry.numel == tensor.numel()
        if not entry.trainable:
            assert entry.start == -1 and layout.segments_of(entry.index) == []
            assert not tensor.requires_grad or tensor.numel() == 0
            continue
        assert entry.start % PARAM_ALIGN == 0  # pieces start at SIMD multiples
        covered = 0
        for shard_index, seg in layout.segments_of(entry.index):
            shard = layout.shards[shard_index]
            assert seg.param_offset == covered, "segments must tile the parameter in order"
            assert seg.param_offset % PARAM_ALIGN == 0
            assert seg.shard_offset >= 0 and seg.shard_offset + seg.length <= shard.capacity
            assert shard.start + seg.shard_offset == entry.start + seg.param_offset
            covered += seg.length
        assert covered == entry.numel

    # Shards tile the flat space; all but the last are full; segments never overlap.
    start = 0
    for i, shard in enumerate(layout.shards):
        assert shard.index == i and shard.start == start
        assert shard.capacity % PAGE_NUMEL == 0 and 0 < shard.capacity <= layout.shard_numel
        if i < len(layout.shards) - 1:
            assert shard.capacity == layout.shard_numel
        ends = sorted((s.shard_offset, s.shard_offset + s.length) for s in shard.segments)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
        start += shard.capacity
    assert layout.total_numel == start
    assert layout.trainable_numel == sum(t.numel() for t in flat if t.requires_grad)
    assert layout.total_numel >= layout.trainable_numel

    # Byte arithmetic.
    nfields = len(layout.fields)
    assert layout.state_nbytes == layout.total_numel * STATE_ITEMSIZE * nfields
    assert layout.slot_nbytes == layout.max_capacity * STATE_ITEMSIZE * nfields
    assert all(layout.shard_nbytes(s) % 4096 == 0 for s in layout.shards)
    assert all(layout.shard_nbytes(s.index) == layout.shard_nbytes(s) for s in layout.shards)


@settings(max_examples=60)
@given(specs=group_specs, shard_numel=st.integers(1, 20000), fields=adamw_field_sets)
def test_to_dict_round_trips_and_is_json(specs, shard_numel, fields) -> None:
    layout = Layout.build(tensors(specs), shard_numel=shard_numel, fields=fields)
    data = json.loads(json.dumps(layout.to_dict()))
    again = Layout.from_dict(data)
    assert again.params == layout.params
    assert again.shards == layout.shards
    assert again.fields == layout.fields and again.shard_numel == layout.shard_numel
    assert again.fingerprint == layout.fingerprint
    assert layout.describe_difference(again) == "no difference"


@settings(max_examples=40)
@given(specs=group_specs, shard_numel=st.integers(1, 20000))
def test_layout_is_a_pure_function_of_the_parameters(specs, shard_numel) -> None:
    a = Layout.build(tensors(specs), shard_numel=shard_numel, fields=FIELDS)
    b = Layout.build(tensors(specs), shard_numel=shard_numel, fields=FIELDS)
    assert a.fingerprint == b.fingerprint and a.shards == b.shards


def _layout(shapes=((3000,), (10,)), dtype=torch.float32, groups=None, frozen=(), shard_numel=2048, fields=FIELDS):
    params = [torch.zeros(s, dtype=dtype, requires_grad=i not in frozen) for i, s in enumerate(shapes)]
    grouped = [params] if groups is None else [[params[i] for i in g] for g in groups]
    return Layout.build(grouped, shard_numel=shard_numel, fields=fields)


@pytest.mark.parametrize(
    "other, says",
    [
        (dict(shapes=((3000,), (11,))), "parameter 1"),
        (dict(shapes=((3000,),)), "1 parameters instead of 2"),
        (dict(dtype=torch.bfloat16), "bfloat16"),
        (dict(groups=[[0], [1]]), "group 1"),
        (dict(frozen=(1,)), "frozen"),
        (dict(shard_numel=4096), "shard_numel 4096"),
        (dict(fields=("exp_avg", "exp_avg_sq", "max_exp_avg_sq")), "max_exp_avg_sq"),
    ],
    ids=["shape", "count", "dtype", "group", "frozen", "shard_numel", "fields"],
)
def test_fingerprint_changes_with_what_the_state_is(other, says) -> None:
    base = _layout()
    changed = _layout(**other)
    assert changed.fingerprint != base.fingerprint
    assert says in base.describe_difference(changed)


def test_shard_numel_rounding_is_not_identity_change() -> None:
    # 1500 and 2048 round to the same shard size: the same state.
    assert _layout(shard_numel=1500).fingerprint == _layout(shard_numel=2048).fingerprint


def test_documented_example() -> None:
    w, b = torch.zeros(3000, requires_grad=True), torch.zeros(10, requires_grad=True)
    layout = Layout.build([[w, b]], shard_numel=2048, fields=("exp_avg", "exp_avg_sq"))
    assert [s.capacity for s in layout.shards] == [2048, 1024]
    segs = [(g.param, g.param_offset, g.shard_offset, g.length) for g in layout.shards[1].segments]
    assert segs == [(0, 2048, 0, 952), (1, 0, 960, 10)]


def test_no_trainable_parameters_gives_no_shards() -> None:
    layout = Layout.build([[torch.zeros(5)]], shard_numel=1024, fields=FIELDS)
    assert layout.shards == () and layout.state_nbytes == 0 and layout.max_capacity == 0


@pytest.mark.parametrize("shard_numel", [0, -1024, 1.5, "4096", None, True])
def test_bad_shard_numel(shard_numel) -> None:
    with pytest.raises(ConfigError, match="shard_numel") as info:
        Layout.build([[torch.zeros(4, requires_grad=True)]], shard_numel=shard_numel, fields=FIELDS)
    assert repr(shard_numel) in str(info.value)


def test_unknown_field() -> None:
    with pytest.raises(ConfigError, match="momentum"):
        Layout.build([[torch.zeros(4, requires_grad=True)]], shard_numel=1024, fields=("momentum",))


def test_unknown_field_lookup_names_the_fields() -> None:
    with pytest.raises(KeyError, match="master"):
        _layout().field_index("master")


def test_from_dict_rejects_other_versions() -> None:
    data = _layout().to_dict()
    data["layout_version"] = 99
    with pytest.raises(ConfigError, match="99"):
        Layout.from_dict(data)
