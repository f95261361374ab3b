"""``tierstore plan``: the arithmetic against hand-computed cases, the CLI, bad inputs.

The hand-computed numbers are written out as arithmetic on purpose: each can
be checked with a pocket calculator (B/param x params, shard counts, what a
budget holds after the arena).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import BudgetError, ConfigError, TieredAdamW
from tierstore._layout.budget import OVERHEAD_BYTES
from tierstore.cli import main
from tierstore.planner import Bandwidth, format_plan, load_model, parse_count, plan_memory, traffic

GiB = 1 << 30
MiB = 1 << 20
HOST = 512 * GiB
DEFAULT_BUDGET = int(HOST * 0.9)  # 494_780_232_499
P7 = 7_000_000_000
P7_PADDED = 7_000_000_512  # one tensor; the flat space is rounded up to 1024 elements
P70 = 70_000_000_000  # a multiple of 1024: no padding


# -- factories for --model (built on the meta device) ------------------------------
SEEN_DEVICES: list[str] = []


def tiny_factory() -> torch.nn.Module:
    """No device kwarg: the planner builds it under ``with torch.device('meta')``."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 10))
    model[0].bias.requires_grad_(False)  # 200 frozen
    SEEN_DEVICES.append(model[0].weight.device.type)
    return model


def tiny_factory_with_device(device: torch.device | str = "cpu") -> torch.nn.Module:
    SEEN_DEVICES.append(torch.device(device).type)
    return torch.nn.Linear(64, 32, device=device, dtype=torch.bfloat16)


def not_a_module() -> int:
    return 3


def broken_factory() -> torch.nn.Module:
    raise RuntimeError("boom")


# -- the arithmetic ----------------------------------------------------------------
def test_7b_fp32_cpu() -> None:
    plan = plan_memory(P7, host_ram=HOST)
    assert plan.fields == ("exp_avg", "exp_avg_sq")
    assert plan.state_bytes_per_param == 8  # two fp32 moments, no master
    assert plan.state == P7_PADDED * 8
    assert plan.host.model == P7 * 4 + P7 * 4  # weights and grads live on the host
    assert plan.host.budget_given == DEFAULT_BUDGET - P7 * 8  # the default: 90% of RAM minus the model
    # ... is more than the state takes: the plan caps it there, and proposes keeping everything in RAM.
    assert plan.host.budget == plan.host.all_resident == plan.state  # fp32 on the CPU: no staging, no scratch
    assert plan.host.proposed_budget is None
    assert plan.host.staging == 0 and plan.host.arena == 0
    assert plan.host.resident == plan.state
    assert plan.gpu.used is False and plan.gpu.total == 0
    assert plan.traffic.pcie_down == plan.traffic.pcie_up == 0
    assert plan.traffic.disk_read == plan.traffic.disk_write == 0
    # plain torch AdamW in fp32: 4 weights + 4 grads + 8 moments = 16 B/param
    assert (plan.torch.weights, plan.torch.grads, plan.torch.optimizer) == (P7 * 4, P7 * 4, P7 * 8)
    assert plan.torch.total == 16 * P7 == 112_000_000_000
    assert plan.torch.where == "host RAM"
    assert plan.verdict == "fits in host RAM"
    assert plan.step_time.lower_bound == pytest.approx(7.0)  # 7e9 params at 1 Gparam/s


def test_7b_bf16_gpu() -> None:
    plan = plan_memory(P7, precision="bf16", host_ram=HOST, gpu_memory=80 * 10**9)
    assert plan.fields == ("master", "exp_avg", "exp_avg_sq")
    assert plan.state_bytes_per_param == 12  # 8 B moments + 4 B fp32 master
    assert plan.state == P7_PADDED * 12  # ~84 GB
    assert (plan.gpu.weights, plan.gpu.grads, plan.gpu.total) == (P7 * 2, P7 * 2, P7 * 4)
    assert plan.gpu.fits is True
    assert plan.host.model == 0
    assert plan.host.budget_given == DEFAULT_BUDGET
    assert plan.shard_numel == 1 << 22
    assert plan.host.staging == 4 * (1 << 22) * 4  # 4 fp32 staging buffers with CUDA
    assert plan.host.budget == plan.host.all_resident == plan.state + plan.host.staging  # capped at the whole state
    assert plan.host.proposed_budget is None  # and it fits the host: TieredAdamW(ram_budget=None)
    assert plan.host.resident == plan.state and plan.verdict == "fits in host RAM"
    assert plan.traffic.pcie_down == plan.traffic.pcie_up == P7 * 2
    # mixed precision: 2 + 2 weights/grads + 8 moments + 4 master = 16 B/param
    assert plan.torch.optimizer == 12 * P7 == 84_000_000_000
    assert plan.torch.total == 16 * P7
    assert plan.torch.fits is False  # 112 GB > 80 GB


def test_fp32_on_gpu_keeps_a_master_like_tieredadamw() -> None:
    plan = plan_memory(P7, precision="fp32", host_ram=HOST, gpu=True)
    assert plan.state_bytes_per_param == 12
    assert plan.torch.optimizer == 8 * P7  # torch keeps no master in fp32
    assert any("master" in note for note in plan.notes)


SHARD = 1 << 25  # 70B tests use big shards to stay fast; the arithmetic is the same
SHARDS70 = 2087  # ceil(70e9 / 2**25); the last holds 5_454_848 elements


@pytest.mark.parametrize(
    ("amsgrad", "durable", "bpp"),
    [(False, False, 12), (False, True, 12), (True, False, 16), (True, True, 16)],
)
def test_70b_bf16(amsgrad: bool, durable: bool, bpp: int) -> None:
    plan = plan_memory(
        P70, precision="bf16", amsgrad=amsgrad, durable=durable, host_ram=HOST,
        gpu_memory=80 * 10**9, shard_numel=SHARD,
    )
    state = P70 * bpp
    slot = SHARD * bpp
    arena = 4 * slot  # prefetch_depth 2 + 2
    staging = 4 * SHARD * 4
    resident_shards = (DEFAULT_BUDGET - arena - staging) // slot
    assert resident_shards == (1223 if bpp == 12 else 916)
    resident = resident_shards * slot
    on_disk = state - resident
    assert plan.state == state and plan.shards == SHARDS70
    assert (plan.host.arena, plan.host.staging, plan.host.resident) == (arena, staging, resident)
    assert plan.host.ram_nbytes == arena + staging + resident <= DEFAULT_BUDGET
    assert plan.host.tierstore_total == plan.host.ram_nbytes + OVERHEAD_BYTES
    assert plan.host.pinned == plan.host.ram_nbytes + 2 * (4 << 20)  # the budget's buffers and the gradient buckets
    # The host side streams; one 80 GB GPU cannot hold 280 GB of bf16 weights and grads.
    assert plan.verdict == "does not fit" and [f.resource for f in plan.shortfalls] == ["GPU memory"]
    assert plan.host.fits and plan.shortfalls[0].need == P70 * 4 and "4 or more GPUs" in plan.shortfalls[0].fix  # 280 GB / 80 GB
    assert plan.traffic.disk_read == on_disk
    if durable:
        assert plan.disk.total == 2 * state  # a second copy of every shard
        manifest = 1024 + 192 * SHARDS70 + 128 * 1  # the manifest's estimate: per shard and per parameter tensor
        assert (plan.traffic.resident_write, plan.traffic.manifest_write) == (resident, manifest)
        # 'auto' is assumed to commit every step: each step writes the streamed and the resident shards
        assert plan.traffic.disk_write == on_disk + resident + manifest == state + manifest
    else:
        assert plan.disk.total == on_disk
        assert plan.traffic.disk_write == on_disk
    assert plan.gpu.total == P70 * 4 and plan.gpu.fits is False  # 280 GB of bf16 weights+grads
    assert plan.torch.optimizer == P70 * (12 + (4 if amsgrad else 0))
    assert plan.torch.total == P70 * (16 + (4 if amsgrad else 0))


def test_budget_split_by_hand() -> None:
    numel = 10 * MiB  # 10 shards of 1 Mi elements, 8 MiB each (two moments)
    common = dict(host_ram=64 * GiB, shard_numel=1 << 20)
    plan = plan_memory(numel, ram_budget=40 * MiB + 1, **common)
    assert (plan.host.arena, plan.host.resident_shards, plan.disk.disk_shards) == (32 * MiB, 1, 9)
    assert plan.disk.total == plan.traffic.disk_read == plan.traffic.disk_write == 72 * MiB
    everything = plan_memory(numel, ram_budget=80 * MiB, **common)
    assert everything.host.resident == 80 * MiB and everything.host.arena == 0
    deeper = plan_memory(numel, ram_budget=56 * MiB, prefetch_depth=4, **common)
    assert deeper.host.arena == 48 * MiB and deeper.host.resident_shards == 1
    short = plan_memory(numel, ram_budget=31 * MiB, **common)  # below the arena: a plan, shown at its minimum
    assert short.verdict == "does not fit" and short.host.budget == short.host.min_budget == 32 * MiB
    assert [(f.resource, f.need, f.have) for f in short.shortfalls] == [("ram_budget", 32 * MiB, 31 * MiB)]
    assert "raise it to at least 32.00 MiB" in short.shortfalls[0].fix


def test_does_not_fit_on_the_drive() -> None:
    plan = plan_memory(P70, precision="bf16", host_ram=HOST, gpu=True, shard_numel=SHARD, disk_free=100 * 10**9)
    assert plan.disk.fits is False and plan.verdict == "does not fit" and not plan.fits
    [short] = plan.shortfalls
    assert (short.resource, short.need, short.have) == ("drive space", plan.disk.total, 100 * 10**9)
    durable_only = plan_memory(P7, host_ram=HOST, durable=True, disk_free=10 * 10**9)
    assert durable_only.verdict == "does not fit"
    assert "durable=False" in durable_only.shortfalls[0].fix  # RAM holds it all: one copy needs no drive


# -- the planner always answers ------------------------------------------------------
GB24 = 24 * GiB


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_7b_on_a_24_gib_host_without_a_gpu_does_not_fit_and_says_why(precision) -> None:
    plan = plan_memory(P7, precision=precision, host_ram=GB24)
    pbytes = 2 if precision == "bf16" else 4
    assert plan.verdict == "does not fit" and not plan.fits and not plan.host.fits
    assert plan.host.model == 2 * P7 * pbytes and plan.host.budget_given == 0  # the weights and grads alone exceed 90%
    assert plan.host.budget == plan.host.min_budget == plan.host.ram_nbytes  # shown at the smallest budget that streams
    [short] = plan.shortfalls
    assert short.resource == "host RAM" and short.have == GB24
    # the default budget must leave 10% of RAM: (weights + grads + the minimum budget) / 0.9
    assert short.need == -(-(plan.host.model + plan.host.min_budget) * 10 // 9)
    assert "add" in short.fix and "train on a GPU" in short.fix


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_7b_on_a_24_gib_host_with_an_80_gb_gpu_streams(precision) -> None:
    plan = plan_memory(P7, precision=precision, host_ram=GB24, gpu_memory=80 * 10**9)
    assert plan.verdict == "needs the disk tier" and plan.fits and plan.shortfalls == ()
    assert plan.host.total == plan.host.tierstore_total <= GB24
    assert plan.host.pinned == plan.host.ram_nbytes + plan.host.grad_buckets


def test_every_shortfall_at_once() -> None:
    plan = plan_memory(P7, precision="bf16", host_ram=GB24, gpu_memory=16 * 10**9, ram_budget=100 * GiB,
                       durable=True, disk_free=10 * 10**9)
    assert plan.verdict == "does not fit"
    by = {f.resource: f for f in plan.shortfalls}
    assert sorted(by) == ["GPU memory", "drive space", "host RAM"]
    assert by["GPU memory"].need == 4 * P7 and "2 or more GPUs" in by["GPU memory"].fix
    assert "lower" not in by["host RAM"].fix and "give ram_budget at most" in by["host RAM"].fix
    assert by["drive space"].need == 2 * plan.state


def test_ram_budget_above_host_ram_is_a_plan() -> None:
    plan = plan_memory(P7, host_ram=GB24, gpu=True, ram_budget=GiB * 100, shard_numel=1 << 22)
    assert plan.verdict == "does not fit" and [f.resource for f in plan.shortfalls] == ["host RAM"]
    assert plan.host.resident == plan.state  # all resident at that budget
    # 100 GiB is more than the whole state takes (78 GiB + staging): the arithmetic uses what it takes ...
    assert plan.host.budget_given == 100 * GiB and plan.host.budget == plan.host.all_resident < 100 * GiB
    assert plan.host.ram_nbytes == plan.host.budget == plan.state + plan.host.staging
    assert any("more than the whole state takes" in note for note in plan.notes)
    # ... and proposes it, in bytes: everything in RAM does not fit this host.
    assert plan.host.proposed_budget == plan.host.budget
    assert "give ram_budget at most" in plan.shortfalls[0].fix


def test_step_time_and_endurance_by_hand() -> None:
    bw = Bandwidth(read_gbps=4.0, write_gbps=2.0, pcie_gbps=20.0, memory_gbps=100.0, update_gparams=50.0)
    plan = plan_memory(10 * MiB, host_ram=64 * GiB, ram_budget=64 * MiB, shard_numel=1 << 20,
                       gpu=True, bandwidth=bw, drive_tbw=600)
    # 12 B/param (a GPU keeps the master), shards of 12 MiB: the 4-slot arena (48 MiB) and
    # 4 staging buffers (16 MiB) take the whole budget, so all 10 shards are on disk.
    assert plan.traffic.disk_read == plan.traffic.disk_write == 120 * MiB
    t = plan.traffic
    assert plan.step_time.disk == pytest.approx(t.disk_read / 4e9 + t.disk_write / 2e9)
    assert plan.step_time.pcie == pytest.approx(10 * MiB * 4 / 20e9)
    assert plan.step_time.update == pytest.approx(10 * MiB / 50e9)
    assert plan.step_time.memory == pytest.approx(plan.state / 100e9)
    assert plan.step_time.lower_bound == max(plan.step_time.disk, plan.step_time.pcie, plan.step_time.update,
                                             plan.step_time.memory, plan.step_time.fixed)
    e = plan.endurance
    assert e.writes_per_1000_steps == 1000 * t.disk_write
    assert e.steps_to_exhaust == pytest.approx(600e12 / t.disk_write)
    assert e.endurance_days == pytest.approx(e.steps_to_exhaust * plan.step_time.lower_bound / 86400)


# -- tiny to huge: every number makes sense for the model's size -------------------------
def linear_10x10() -> torch.nn.Module:
    return torch.nn.Linear(10, 10)  # 110 parameters


def mlp_1m() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1000, 500), torch.nn.ReLU(), torch.nn.Linear(500, 1000))  # 1,001,500


def test_a_tiny_state_explains_its_padding_and_that_it_never_streams() -> None:
    plan = plan_memory(load_model(f"{__name__}:linear_10x10"), host_ram=GiB)
    # 8 B/param x 110 params = 880 B, but a shard holds whole 1,024-element pages: 8 KiB (4 KiB per moment).
    assert plan.trainable_params == 110 and plan.state == 1024 * 8 and plan.padded_numel == 1024
    text = format_plan(plan)
    assert "x 110 params = 880 B unpadded, stored as 8.00 KiB: 1,024 elements per field" in text
    assert "starts at a multiple of 64 elements" in text
    assert "the whole state is no larger than a 4-slot streaming arena of its shards, so it never streams" in text
    assert plan.host.stream_floor is None


def test_a_budget_below_a_tiny_state_says_the_state_is_smaller_than_the_arena(tmp_path) -> None:
    plan = plan_memory(load_model(f"{__name__}:linear_10x10"), host_ram=GiB, ram_budget=100)
    [short] = plan.shortfalls
    assert (short.resource, short.need, short.have) == ("ram_budget", 8192, 100)
    whole = "the whole state (8.00 KiB, one 1,024-element shard) is smaller than the streaming arena (4 slots x 8.00 KiB)"
    assert whole in short.fix and "give at least 8.00 KiB (8192 bytes) so it stays in RAM" in short.fix
    assert "0 slots" not in short.fix and "+ 0 B" not in short.fix
    # TieredAdamW says the same, and the minimum it names works.
    w = torch.nn.Parameter(torch.zeros(110))
    with pytest.raises(BudgetError) as refused:
        TieredAdamW([w], ram_budget=100, state_dir=tmp_path / "a")
    assert whole in str(refused.value) and "at least 8192 bytes" in str(refused.value)
    assert "= 8.00 KiB" not in str(refused.value)  # not "4 slots x 8.00 KiB = 8.00 KiB"
    with TieredAdamW([w], ram_budget=8192, state_dir=tmp_path / "b") as opt:
        assert opt.plan.disk_shards == () and opt.ram_bytes == 8192


@pytest.mark.parametrize("what", ["linear_10x10", "mlp_1m", "70B"])
def test_plans_from_tiny_to_huge_read_right(capsys, what: str) -> None:
    argv = ["--params", what] if what == "70B" else ["--model", f"{__name__}:{what}"]
    rc, out, _ = _run(capsys, *argv, "--host-ram", "64GiB", "--state-dir", "/tmp", "--drive-tbw", "600")
    assert rc == 0
    assert "(0.00 GB)" not in out and "(0.0" not in out  # below a GB the decimal unit is MB
    assert "0 slots" not in out
    numbers = json.loads(_run(capsys, *argv, "--host-ram", "64GiB", "--json")[1])
    bpp, n = numbers["state_bytes_per_param"], numbers["trainable_params"]
    assert n * bpp <= numbers["state"] <= n * bpp + numbers["shards"] * 1024 * bpp + 64 * 8  # padding: < a page per shard
    host = numbers["host"]
    assert host["tierstore_total"] == host["ram_nbytes"] + host["overhead"] and host["budget"] <= host["all_resident"]
    if what == "70B":  # it streams: the default budget leaves nothing beside 560 GB of weights and grads
        assert numbers["verdict"] == "does not fit" and host["stream_floor"] == host["min_budget"] == host["budget"]
    else:  # a small model: everything in RAM, no arena, no drive writes
        assert numbers["verdict"] == "fits in host RAM" and host["arena"] == 0 and numbers["traffic"]["disk_write"] == 0


# -- drive wear under the commit policy, by hand ---------------------------------------
TB = 10**12
MONTH_S = 365.25 / 12 * 86_400  # a month is 365.25 / 12 days


def wear_plan(commit_every, **kw):
    """10 Mi fp32 parameters on the CPU, all resident in 10 shards of 8 MiB, durable, 1 s a step, a 1 TBW drive."""
    bw = Bandwidth(update_gparams=10 * MiB / 1e9)  # 10 Mi params at this rate: a step takes 1 s
    return plan_memory(10 * MiB, host_ram=64 * GiB, shard_numel=1 << 20, durable=True, commit_every=commit_every,
                       drive_tbw=1, bandwidth=bw, **kw)  # fmt: skip


def test_wear_verdict_by_hand() -> None:
    plan = wear_plan(10)
    step_s = plan.step_time.lower_bound
    assert step_s == pytest.approx(1.0) and plan.disk.disk_shards == 0  # nothing streams: commits are all the writes
    # Each commit writes every resident shard (each has a gradient, so each changed) and the manifest:
    # 80 MiB + (1 KiB + 192 B per shard x 10 shards + 128 B per parameter tensor x 1) = 83,889,152 B.
    commit = 10 * 8 * MiB + (1024 + 192 * 10 + 128 * 1)
    assert commit == 83_889_152 and plan.traffic.commit_write == commit
    # commit_every=10: a tenth of a commit a step, 8,388,915.2 B; the 1 TBW rating lasts 119,205 steps = 1.38 days.
    per_step = commit / 10
    assert plan.endurance.steps_to_exhaust == pytest.approx(TB / per_step) == pytest.approx(119_204.9, abs=0.1)
    assert plan.endurance.endurance_days == pytest.approx(TB / per_step * step_s / 86_400) == pytest.approx(1.3797, abs=1e-4)
    assert plan.endurance.lasts is False
    assert plan.wear == "the drive WEARS OUT: its 1 TBW last 1.4 days at commit_every=10, short of the 36-month lifetime"
    # 36 months of 1 s steps is 94,672,800 steps; the rating affords 1e12 / 94,672,800 = 10,562.7 B a step, so a
    # commit may come once every ceil(83,889,152 / 10,562.7) = 7,943 steps, and no more often.
    steps = 36 * MONTH_S / step_s
    assert steps == pytest.approx(94_672_800)
    proposed = math.ceil(commit / (TB / steps))
    assert proposed == 7943 == plan.endurance.commit_every_for_lifetime
    assert traffic.lifetime_commit_every(streamed=0, commit=commit, affordable=TB / steps) == proposed
    assert "commit_every=7943" in plan.endurance.fix


def test_the_proposed_commit_every_makes_the_drive_last_the_stated_lifetime() -> None:
    proposed = wear_plan(10).endurance.commit_every_for_lifetime
    lasts, short = wear_plan(proposed), wear_plan(proposed - 1)
    assert lasts.endurance.lasts is True and lasts.endurance.endurance_days >= 36 * MONTH_S / 86_400
    assert short.endurance.lasts is False and short.endurance.endurance_days < 36 * MONTH_S / 86_400
    # 1e12 B / (83,889,152 B / 7,943 steps) = 94,684,700 steps of 1 s = 1,095.9 days, just over 36 months (1,095.75).
    assert lasts.wear.startswith("the drive's 1 TBW last 1,095.9 days (3.0 years) at commit_every=7943, beyond")
    # A shorter lifetime needs a smaller commit_every, in proportion: 12 months, a third of 7,943 steps rounded up.
    year = wear_plan(10, lifetime_months=12)
    assert year.endurance.commit_every_for_lifetime == math.ceil(7943 / 3) == 2648
    assert wear_plan(2648, lifetime_months=12).endurance.lasts and not wear_plan(2647, lifetime_months=12).endurance.lasts


@pytest.mark.parametrize(
    ("streamed", "commit", "affordable", "every"),
    [
        (0, 1000, 10.0, 100),  # 1000 B a commit, 10 B a step: every 100 steps
        (4, 1000, 10.0, 167),  # streamed shards take 4 B a step: 1000 / 6 = 166.7 -> 167
        (10, 1000, 10.0, None),  # the streamed shards alone use what the drive affords: no commit_every helps
        (0, 5, 10.0, 1),  # a commit every step is affordable
    ],
)
def test_lifetime_commit_every_by_hand(streamed: int, commit: int, affordable: float, every: int | None) -> None:
    assert traffic.lifetime_commit_every(streamed=streamed, commit=commit, affordable=affordable) == every
    if every is not None:
        assert streamed + commit / every <= affordable
        assert every == 1 or streamed + commit / (every - 1) > affordable


def test_unknown_bandwidth_leaves_the_term_out() -> None:
    plan = plan_memory(10 * MiB, host_ram=64 * GiB, ram_budget=40 * MiB + 1, shard_numel=1 << 20)
    assert plan.step_time.disk is None and plan.step_time.memory is None
    assert plan.step_time.bound_by == "update"


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 1 << 24),
    shard_log=st.integers(10, 22),
    budget_mib=st.integers(1, 256),
    precision=st.sampled_from(["fp32", "bf16", "fp16"]),
    amsgrad=st.booleans(),
    durable=st.booleans(),
    gpu=st.booleans(),
)
def test_invariants(numel, shard_log, budget_mib, precision, amsgrad, durable, gpu) -> None:
    plan = plan_memory(numel, host_ram=64 * GiB, ram_budget=budget_mib * MiB, shard_numel=1 << shard_log,
                       precision=precision, amsgrad=amsgrad, durable=durable, gpu=gpu)
    assert (plan.verdict == "does not fit") == (budget_mib * MiB < plan.host.min_budget) == (not plan.fits)
    # at least the minimum that streams, at most what the whole state takes in RAM
    assert plan.host.budget == min(max(budget_mib * MiB, plan.host.min_budget), plan.host.all_resident)
    assert plan.host.all_resident == plan.state + plan.host.staging + plan.host.scratch
    bpp = 8 + 4 * amsgrad + 4 * (precision != "fp32" or gpu)
    assert plan.state_bytes_per_param == bpp
    assert plan.state >= numel * bpp and plan.state - numel * bpp < 1024 * bpp  # padding < one page
    assert plan.host.ram_nbytes <= plan.host.budget
    assert plan.host.tierstore_total == plan.host.ram_nbytes + OVERHEAD_BYTES
    assert plan.host.resident + plan.traffic.disk_read == plan.state
    assert plan.disk.total == (2 * plan.state if durable else plan.traffic.disk_read)
    # 'auto' is assumed to commit every step: streamed + resident shards + the manifest
    assert plan.traffic.disk_write == (plan.state + plan.traffic.manifest_write if durable else plan.traffic.disk_read)
    if plan.fits:
        assert (plan.verdict == "fits in host RAM") == (plan.traffic.disk_read == 0)
    assert plan.torch.total == numel * (16 + 4 * amsgrad)


@pytest.mark.parametrize(
    ("dtype", "budget", "shard_numel", "durable"),
    [
        (torch.float32, 256 << 10, 4096, True),
        (torch.float32, 256 << 10, 4096, False),
        (torch.bfloat16, 2 << 20, None, True),
        (torch.float32, None, None, True),
    ],
)
def test_agrees_with_tieredadamw(tmp_path, dtype, budget, shard_numel, durable) -> None:
    """The planner's numbers are the ones TieredAdamW allocates."""
    model = torch.nn.Sequential(torch.nn.Linear(400, 600), torch.nn.Linear(600, 33)).to(dtype)
    model[1].bias.requires_grad_(False)
    with TieredAdamW(model.parameters(), ram_budget=budget, shard_numel=shard_numel, state_dir=str(tmp_path),
                     durable=durable) as opt:
        ours = plan_memory(model, host_ram=64 * GiB, ram_budget=budget or 64 * GiB, shard_numel=shard_numel,
                           durable=durable)
        # The planner's automatic shard is never larger than the flat space: one shard, the same bytes.
        assert ours.shard_numel == min(opt.layout.shard_numel, opt.layout.total_numel)
        assert (ours.shards, ours.host.slot) == (len(opt.layout.shards), opt.layout.slot_nbytes)
        assert ours.fields == opt.layout.fields
        assert ours.state == opt.plan.state_nbytes
        assert ours.host.ram_nbytes == opt.ram_bytes
        assert (ours.host.arena, ours.host.staging) == (opt.plan.arena_nbytes, opt.plan.staging_nbytes)
        assert ours.host.resident_shards == len(opt.plan.resident)
        assert ours.traffic.disk_read == opt.plan.disk_nbytes
        assert ours.disk.total == opt.disk_bytes
    assert (ours.disk.disk_shards > 0) == (budget is not None)  # the disk tier is exercised
    assert ours.frozen_params == 33 and ours.trainable_params == 400 * 600 + 600 + 600 * 33


def test_layout_builds_on_meta_tensors() -> None:
    plan = plan_memory([torch.empty(3000, device="meta", requires_grad=True)], host_ram=GiB)
    assert plan.trainable_params == 3000 and plan.state == 3072 * 8


# -- parsing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "count"),
    [("7e9", P7), ("7B", P7), ("70B", P70), ("125M", 125_000_000), ("1.5b", 1_500_000_000), ("350k", 350_000),
     ("7000000000", P7), (7e9, P7), (123, 123)],
)
def test_parse_count(text, count) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("bad", ["seven", "-7B", "0", "7X", "", "7 billion", True, None, float("inf"), 0.2])
def test_parse_count_rejects(bad) -> None:
    with pytest.raises(ConfigError, match="params"):
        parse_count(bad)


# -- the CLI -----------------------------------------------------------------------
def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json(capsys) -> None:
    rc, out, _ = _run(capsys, "--params", "7B", "--precision", "bf16", "--host-ram", "512GiB",
                      "--gpu-memory", "80GB", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["state"] == P7_PADDED * 12 and data["state_bytes_per_param"] == 12
    assert data["torch"]["total"] == 16 * P7 and data["verdict"] == "fits in host RAM"
    assert data["gpu"]["weights"] == 2 * P7 and data["traffic"]["pcie_down"] == 2 * P7


@pytest.mark.parametrize("gpu", [[], ["--gpu-memory", "80GB"]], ids=["cpu", "gpu"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cli_always_answers_and_fails_only_when_asked(capsys, precision, gpu) -> None:
    argv = ["--params", "7e9", "--precision", precision, "--host-ram", "24GiB", *gpu]
    rc, out, err = _run(capsys, *argv, "--json")
    data = json.loads(out)
    assert rc == 0 and err == ""
    fits = bool(gpu)
    assert data["fits"] is fits and data["verdict"] == ("needs the disk tier" if fits else "does not fit")
    for key in ("budget", "min_budget", "ram_nbytes", "overhead", "pinned", "tierstore_total", "model", "total"):
        assert isinstance(data["host"][key], int), key
    assert [s["resource"] for s in data["shortfalls"]] == ([] if fits else ["host RAM"])
    rc, out, _ = _run(capsys, *argv, "--fail-if-not-fit")
    assert rc == (0 if fits else 3) and out.rstrip().splitlines()[-3 if not fits else -1].startswith("verdict:")
    if not fits:
        assert "fix: " in out and "DOES NOT FIT" in out


def test_cli_human_output(capsys, tmp_path) -> None:
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"summary": {"best_read_GBps": 6.0, "best_write_GBps": 3.0}}))
    rc, out, _ = _run(capsys, "--params", "70B", "--precision", "bf16", "--host-ram", "512GiB", "--gpu-memory",
                      "80GB", "--shard-numel", str(SHARD), "--io-json", str(io), "--pcie-gbps", "25",
                      "--drive-tbw", "600", "--state-dir", str(tmp_path / "new" / "dir"), "--durable")
    assert rc == 0
    for line in ("optimizer state: 12 B/param", "GPU:", "host RAM:", "arena", "resident state", "disk:",
                 "durability copy", "PCIe", "step time >=", "read/6 GB/s + write/3 GB/s", "rated 600 TBW",
                 "plain torch.optim.AdamW (GPU)", "(16 B/param)", "TieredAdamW(", "verdict:"):
        assert line in out, line


def test_cli_flags_override_io_json(capsys, tmp_path) -> None:
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"summary": {"best_read_GBps": 6.0, "memory_GBps": 50}, "other": 1}))
    rc, out, _ = _run(capsys, "--params", "1B", "--host-ram", "4GiB", "--ram-budget", "1GiB", "--io-json",
                      str(io), "--read-gbps", "2", "--write-gbps", "1", "--json")
    bw = json.loads(out)["bandwidth"]
    assert rc == 0 and (bw["read_gbps"], bw["write_gbps"], bw["memory_gbps"]) == (2.0, 1.0, 50.0)


@pytest.mark.parametrize("spec", [f"{__name__}:tiny_factory", f"{__file__}:tiny_factory"])
def test_cli_model(capsys, spec) -> None:
    SEEN_DEVICES.clear()
    rc, out, _ = _run(capsys, "--model", spec, "--host-ram", "1GiB", "--json")
    data = json.loads(out)
    expected = ["meta"] if spec.startswith(__name__) else []  # a file path loads a fresh copy of this module
    assert rc == 0
    assert expected == SEEN_DEVICES
    assert (data["trainable_params"], data["frozen_params"]) == (100 * 200 + 200 * 10 + 10, 200)


def test_model_factory_with_device_kwarg() -> None:
    SEEN_DEVICES.clear()
    model = load_model(f"{__name__}:tiny_factory_with_device")
    assert SEEN_DEVICES == ["meta"]
    plan = plan_memory(model, host_ram=GiB)
    assert plan.precision == "bf16" and plan.state_bytes_per_param == 12


BAD_CLI = [
    (["--params", "seven"], "is not a parameter count"),
    (["--params=-7B"], "negative"),
    (["--params", "7B", "--gpu-memory=-80GB"], "negative"),
    (["--params", "7B", "--host-ram", "0"], "zero"),
    (["--params", "7B", "--host-ram", "lots"], "is not a size"),
    (["--params", "7B", "--io-json", "/nonexistent/io.json"], "does not exist"),
    (["--params", "7B", "--read-gbps", "0"], "> 0"),
    (["--params", "7B", "--drive-tbw", "many"], "not a number"),
    (["--params", "7B", "--shard-numel", "0"], "--shard-numel=0 must be an int >= 1"),
    (["--params", "7B", "--prefetch-depth", "0"], "--prefetch-depth=0 must be an int >= 1"),
    (["--params", "7B", "--shard-numel", "1024"], "shards"),
    (["--model", "no_colon_here"], "module:factory"),
    (["--model", "tierstore_no_such_module:f"], "cannot import"),
    (["--model", f"{__name__}:missing"], "no attribute"),
    (["--model", f"{__name__}:not_a_module"], "not a torch.nn.Module"),
    (["--model", f"{__name__}:broken_factory"], "boom"),
    (["--model", "/nonexistent/models.py:f"], "no file"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_CLI)
def test_cli_bad_inputs(capsys, argv, message) -> None:
    rc, out, err = _run(capsys, "--host-ram", "512GiB", *argv) if "--host-ram" not in argv else _run(capsys, *argv)
    assert rc == 2 and out == ""  # a value or --model that cannot be used: a usage error (cli.EXIT_USAGE)
    assert err.startswith("tierstore: error:") and message in err, err


@pytest.mark.parametrize(
    ("knob", "value", "flag"),
    [("prefetch_depth", 0, "--prefetch-depth"), ("shard_numel", 0, "--shard-numel"), ("ram_budget", "-1GiB", "--ram-budget")],
)
def test_cli_knob_flags_say_what_the_api_says(capsys, tmp_path, knob: str, value: object, flag: str) -> None:
    """A knob's flag is checked by the knob's registry check: the API's message, naming the flag."""
    w = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ConfigError) as api:
        TieredAdamW([w], state_dir=tmp_path / "state", **{knob: value})
    rc, _, err = _run(capsys, "--params", "7B", "--host-ram", "512GiB", f"{flag}={value}")
    assert rc == 2
    assert err.strip() == f"tierstore: error: {str(api.value).replace(knob, flag, 1)}"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not json", "is not JSON"),
        (b"\xff\xfe{}", "is not JSON"),  # not UTF-8: a UnicodeDecodeError, not a JSONDecodeError
        (b"[" * 100_000, "is not JSON"),  # nested past the recursion limit
        (b'{"summary": {"best_read_GBps": true}}', "is not a number"),  # a bool is not a speed
        (b'{"summary": {"best_read_GBps": 1' + b"0" * 400 + b"}}", "is not a number"),  # float() overflows
    ],
    ids=["not-json", "not-utf8", "too-deep", "bool", "huge-int"],
)
def test_cli_bad_io_json(capsys, tmp_path, content: bytes, message: str) -> None:
    io = tmp_path / "io.json"
    io.write_bytes(content)
    rc, _, err = _run(capsys, "--params", "7B", "--host-ram", "512GiB", "--io-json", str(io))
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_needs_params_or_model(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--host-ram", "1GiB"])
    assert exc.value.code == 2
