"""How a RAM budget splits into arena, staging and resident shards; byte-size parsing."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import TieredAdamW
from tierstore._layout.budget import MIN_ARENA_SLOTS, plan_tiers, staging_nbytes
from tierstore._layout.layout import Layout
from tierstore.errors import BudgetError, ConfigError
from tierstore.sizes import format_size, parse_size


def layout_of(sizes: list[int], shard_numel: int, nfields: int) -> Layout:
    fields = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:nfields]
    return Layout.build(
        [[torch.zeros(n, requires_grad=True) for n in sizes]], shard_numel=shard_numel, fields=fields
    )


layouts = st.builds(
    layout_of,
    sizes=st.lists(st.integers(1, 20000), min_size=1, max_size=6),
    shard_numel=st.integers(1024, 8192),
    nfields=st.integers(1, 4),
)


@settings(max_examples=200)
@given(
    layout=layouts,
    slots=st.integers(MIN_ARENA_SLOTS, 6),
    staging=st.integers(0, 4),
    budget=st.none() | st.integers(0, 2_000_000),
)
def test_plan_respects_the_budget(layout: Layout, slots: int, staging: int, budget: int | None) -> None:
    state = layout.state_nbytes
    stage = staging_nbytes(layout, staging)
    arena = slots * layout.slot_nbytes
    everything = tuple(range(len(layout.shards)))
    if budget is not None and state + stage > budget and arena + stage > budget:
        with pytest.raises(BudgetError) as info:
            plan_tiers(layout, ram_budget=budget, arena_slots=slots, staging_buffers=staging)
        message = str(info.value)
        assert f"ram_budget={format_size(budget)}" in message
        assert f"at least {min(arena, state) + stage} bytes" in message  # names the smallest budget that works
        return
    plan = plan_tiers(layout, ram_budget=budget, arena_slots=slots, staging_buffers=staging)
    assert plan.state_nbytes == state and plan.staging_nbytes == stage
    assert sorted(plan.resident + plan.disk_shards) == list(everything)
    assert not set(plan.resident) & set(plan.disk_shards)
    assert plan.resident == everything[: len(plan.resident)], "resident shards are a prefix"
    assert plan.resident_nbytes == sum(layout.shard_nbytes(i) for i in plan.resident)
    assert plan.disk_nbytes == state - plan.resident_nbytes
    if budget is None or state + stage <= budget:
        # Everything resident: no arena, no file.
        assert plan.resident == everything and plan.arena_slots == 0 and plan.arena_nbytes == 0
        assert plan.ram_nbytes == state + stage
    else:
        assert plan.arena_slots == slots and plan.arena_nbytes == arena
        assert plan.disk_shards, "a budget below the state must put shards on disk"
        # Greedy: the next shard would not have fitted.
        next_shard = len(plan.resident)
        assert plan.ram_nbytes + layout.shard_nbytes(next_shard) > budget
    if budget is not None:
        assert plan.ram_nbytes <= budget


@settings(max_examples=100)
@given(layout=layouts, a=st.integers(0, 2_000_000), b=st.integers(0, 2_000_000))
def test_more_budget_never_means_fewer_resident_shards(layout: Layout, a: int, b: int) -> None:
    low, high = sorted((a, b))
    try:
        small = plan_tiers(layout, ram_budget=low, arena_slots=3)
    except BudgetError:
        return
    large = plan_tiers(layout, ram_budget=high, arena_slots=3)
    assert set(small.resident) <= set(large.resident)


def test_documented_example() -> None:
    w = torch.zeros(10 * 1024, requires_grad=True)
    layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
    plan = plan_tiers(layout, ram_budget=40 << 10, arena_slots=3)  # 40 KiB
    assert (plan.arena_slots, plan.resident, plan.disk_shards) == (3, (0, 1), (2, 3, 4, 5, 6, 7, 8, 9))


def test_budget_exactly_the_arena_streams_one_shard_at_a_time() -> None:
    layout = layout_of([50_000], 1024, 2)
    plan = plan_tiers(layout, ram_budget=2 * layout.slot_nbytes, arena_slots=2)
    assert plan.resident == () and len(plan.disk_shards) == len(layout.shards)
    with pytest.raises(BudgetError):
        plan_tiers(layout, ram_budget=2 * layout.slot_nbytes - 1, arena_slots=2)


@pytest.mark.parametrize("slots", [0, 1, -3, 2.0, True, "3"])
def test_bad_arena_slots(slots) -> None:
    with pytest.raises(ConfigError, match="arena_slots"):
        plan_tiers(layout_of([100], 1024, 2), ram_budget=None, arena_slots=slots)


def test_budget_error_minimum_is_the_real_minimum_for_the_optimizer() -> None:
    """The minimum the message names is accepted; one byte less is not."""
    params = [torch.nn.Parameter(torch.zeros(40_000))]
    with pytest.raises(BudgetError) as info:
        TieredAdamW(params, ram_budget="1KiB", shard_numel=2048, backend="buffered")
    match = re.search(r"at least (\d+) bytes", str(info.value))
    assert match, str(info.value)
    minimum = int(match.group(1))
    with pytest.raises(BudgetError):
        TieredAdamW(params, ram_budget=minimum - 1, shard_numel=2048, backend="buffered")
    with TieredAdamW(params, ram_budget=minimum, shard_numel=2048, backend="buffered") as opt:
        assert opt.plan.resident == () and opt.ram_bytes <= minimum
        assert opt.disk_bytes == opt.plan.state_nbytes


@pytest.mark.parametrize("budget", [None, "2MiB", "200KiB", 170_000])
def test_optimizer_reports_its_split(budget) -> None:
    params = [torch.nn.Parameter(torch.zeros(30_000)), torch.nn.Parameter(torch.zeros(7, 9))]
    with TieredAdamW(params, ram_budget=budget, shard_numel=4096, backend="buffered") as opt:
        plan = opt.plan
        assert opt.ram_bytes == plan.ram_nbytes
        assert opt.disk_bytes == plan.disk_nbytes
        assert plan.state_nbytes == opt.layout.state_nbytes
        if budget is not None:
            assert opt.ram_bytes <= parse_size(budget)
        assert (opt.backend is None) == (not plan.disk_shards)
        assert (opt.state_dir is None) == (not plan.disk_shards)
        text = opt.describe()
        assert f"{len(plan.resident)} resident" in text and f"{len(plan.disk_shards)} streamed from disk" in text


# -- byte sizes ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 << 20),
        ("2GB", 2_000_000_000),
        ("1.5 GiB", 3 << 29),
        ("4096", 4096),
        (" 1kb ", 1000),
        ("1KiB", 1024),
        ("3TiB", 3 << 40),
        ("7b", 7),
        (123, 123),
        (0, 0),
        (2.0, 2),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "value, says",
    [
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("lots", "not a size"),
        ("", "not a size"),
        ("-1MiB", "not a size"),
        (-1, "negative"),
        (True, "bool"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ([512], "type list"),
    ],
)
def test_parse_size_rejects(value, says) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, name="ram_budget")
    message = str(info.value)
    assert message.startswith("ram_budget=") and says in message


@settings(max_examples=100)
@given(st.integers(0, 1 << 50))
def test_format_size_round_trips_roughly(n: int) -> None:
    assert abs(parse_size(format_size(n)) - n) <= max(1, n * 0.01)
