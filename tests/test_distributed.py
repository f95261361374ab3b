"""torch.distributed (issue 5, point 3): FSDP2, ZeRO, durability across ranks, DCP checkpoints.

Multi-rank tests run 2 gloo ranks on the CPU from a warm fork server
(:mod:`tierstore.testing.distributed`). Every rank trains on the same
batches, so results are compared bitwise with torch's fused AdamW kernel run
on the same pieces of every tensor (FSDP2 with 2 ranks updates each
parameter as 2 dim-0 pieces, and torch's fused CPU kernel rounds the last
elements of every piece differently from the middle ones, so the piece
count is part of the reference).
"""

from __future__ import annotations

import json
import math
import random
import threading
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tierstore import ConfigError, TieredAdamW
from tierstore._platform import faults
from tierstore._storage.dcp_memory import (
    BLOCK_NBYTES,
    TORCH_COPY_AHEAD,
    BlockRing,
    copy_ahead_of_caller,
)
from tierstore.dcp import TieredSavePlanner, TieredStateful, _session, _stateful
from tierstore.dcp._parts import boxes
from tierstore.testing.crash import CrashJob, step_windows
from tierstore.testing.distributed import (
    DistJob,
    agree_rank,
    compare,
    job_phases,
    reference,
    replace,
    run_ranks,
    torch_state_dict_rank,
    train_rank,
)

# DCP warns that it assumes a single process whenever no process group exists.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

STEPS = 5


@pytest.fixture(scope="module")
def two_piece_reference() -> dict:
    """FSDP2 with 2 ranks, uninterrupted (the default job, which every crash test runs)."""
    return reference(DistJob(state_dir="", out_dir="", steps=STEPS), 2)


def _ok(results) -> None:
    assert [r.exitcode for r in results] == [0] * len(results), results


# -- FSDP2 and ZeRO: bitwise equal to torch's AdamW --------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        dict(keep_master=False, ram_budget="48KiB"),  # fp32 updated in place, 9 of 11 shards on disk
        dict(keep_master=True, amsgrad=True, ram_budget="96KiB"),  # masters written back to the shards
    ],
    ids=["in-place", "masters-amsgrad"],
)
def test_fsdp2_matches_torch_adamw_bitwise(tmp_path, variant):
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=3, **variant)
    _ok(run_ranks(train_rank, world_size=2, args=(replace(job, optimizer="torch"), "torch")))
    _ok(run_ranks(train_rank, world_size=2, args=(job, "tiered")))
    # Local shards of every parameter and state, and a forward pass after the last step
    # (FSDP2 all-gathers the sharded storage: the updates reached the model).
    assert compare(job, "tiered", world_size=2, against="torch") == []
    assert compare(job, "tiered", world_size=2, against=reference(job, 2)) == []


def test_attached_durable_training_under_two_ranks_is_bitwise(tmp_path):
    """attach + durable commits under FSDP2: the ranks' votes and barriers run on the training
    loop's thread, in step with FSDP's collectives (on the worker thread they interleaved with
    them and gloo aborted). ZeroRedundancyOptimizer is left out on purpose: it broadcasts the
    parameters right after the local step returns, before an attached step has written them
    (docs/integrations.md says so)."""
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=3, wrap="fsdp2", attach=True)
    _ok(run_ranks(train_rank, world_size=2, args=(replace(job, optimizer="torch", attach=False), "torch")))
    _ok(run_ranks(train_rank, world_size=2, args=(job, "tiered")))
    assert compare(job, "tiered", world_size=2, against="torch") == []


def test_zero_redundancy_optimizer_matches_torch_adamw_bitwise(tmp_path):
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=3, wrap="zero")
    _ok(run_ranks(train_rank, world_size=2, args=(replace(job, optimizer="torch"), "torch")))
    _ok(run_ranks(train_rank, world_size=2, args=(job, "tiered")))
    assert compare(job, "tiered", world_size=2, against="torch") == []
    assert compare(job, "tiered", world_size=2, against=reference(job, 1)) == []
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["rank0", "rank1"]


# -- a crash of one rank: both resume at one step, bitwise ------------------------------


def _last_commits(job: DistJob) -> list[int | None]:
    out = []
    for rank in range(2):
        path = Path(job.state_dir) / f"rank{rank}" / "manifest.json"
        out.append(json.loads(path.read_text())["step_count"] if path.exists() else None)
    return out


def _resume_and_check(job: DistJob, reference_result: dict) -> None:
    commits = _last_commits(job)
    known = [c for c in commits if c is not None]
    # A rank cannot finish step N+2 before every rank finished step N+1.
    assert not known or max(known) - min(known) <= 1, commits
    _ok(run_ranks(train_rank, world_size=2, args=(job, "resumed")))
    resumed = [torch.load(Path(job.out_dir) / f"resumed-rank{r}.pt", weights_only=True)["resumed_at"] for r in range(2)]
    common = min((c if c is not None else 0) for c in commits) if known else 0
    assert resumed == [common, common], (commits, resumed)
    assert compare(job, "resumed", world_size=2, against=reference_result) == []


def _window(name: str) -> list[str]:
    return ["construct"] if name == "construction" else step_windows(CrashJob(state_dir="", steps=STEPS))[name]


# A step's commit finishes on a background thread while the rank is already past the step:
# its points land in the step or in what follows it (the next forward, or export and close).
COMMIT_POINTS = ("before-sync", "manifest-tmp", "manifest-renamed", "after-commit")


def _window_for(point: str, name: str) -> list[str]:
    phases = _window(name)
    if point not in COMMIT_POINTS or name == "construction":
        return phases
    more = []
    for phase in phases:
        k = int(phase.split()[1])
        more += [f"forward {k + 1}"] if k + 1 < STEPS else ["export", "close"]
    return phases + [p for p in more if p not in phases]


def _assert_victim(results, victim: int, phases: list[str], point: str | None, commits: list[int | None]) -> None:
    """The victim died by the planned kill, where it was meant to, holding the step it saw committed (or the next)."""
    got = results[victim]
    assert got.crashed, f"rank {victim} was not killed as planned: {results}"
    assert got.phase in phases, f"rank {victim}'s kill landed in {got.phase!r}, meant for {phases}: {results}"
    if point is not None:
        assert got.landed_point == point, results
    # It reports committed_step; commits finish in the background, so one more may have landed
    # (two inside a step, whose own commit may finish before it returns).
    allowed = {None, 0} if got.completed < 0 else {got.completed, got.completed + 1, got.completed + 2}
    if not got.phase.startswith(("step", "construct")) and got.completed >= 0:
        allowed = {got.completed, got.completed + 1}
    assert commits[victim] in allowed, (commits, results)


MANY_HITS = ("after-read", "mid-update", "mid-write")  # reached once per shard; the others once per commit
STEP_ONLY = ("after-read", "mid-update")  # never reached while a fresh optimizer is built


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("point", faults.POINTS)
def test_kill_one_rank_at_named_point_then_both_resume_bitwise(tmp_path, two_piece_reference, point, victim):
    rng = random.Random(f"{point}-{victim}")
    windows = ("early", "middle", "late") if point in STEP_ONLY else ("construction", "early", "middle", "late")
    if point == "inflight-marker":  # made durable once per open, while the optimizer is built
        windows = ("construction",)
    phases = _window_for(point, windows[(faults.POINTS.index(point) + victim) % len(windows)])
    # A commit's points land on a background thread: the forward stand-in lets each commit finish
    # before the next step, so no step's commit is deferred out of the window under load.
    forward = 0.02 if point in COMMIT_POINTS else 0.0
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=STEPS, forward_seconds=forward)
    # Counted only in the phases under test; the other rank may run on a little (finishing
    # its step) before it is killed too.
    crash = (victim, point, rng.choice([1, 3]) if point in MANY_HITS else 1, phases)
    results = run_ranks(
        train_rank, world_size=2, args=(job, "crashed"), phases=job_phases(job), crash=crash, kill_grace=rng.uniform(0, 0.2)
    )
    _assert_victim(results, victim, phases, point, _last_commits(job))
    _resume_and_check(job, two_piece_reference)


@pytest.mark.parametrize("window", ["construction", "early", "middle", "late"])
def test_kill_one_rank_at_random_instant_then_both_resume_bitwise(tmp_path, two_piece_reference, window):
    rng = random.Random(window)
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=STEPS)
    victim = rng.choice([0, 1])
    phase = rng.choice(_window(window) + ([f"forward {k}" for k in range(1, STEPS)] if window == "middle" else []))
    # The victim holds at the end of its phase until killed: the kill cannot miss it.
    kill = (victim, phase, rng.uniform(0.0, 0.03))
    results = run_ranks(
        train_rank, world_size=2, args=(job, "crashed"), phases=job_phases(job), kill_in=kill, kill_grace=rng.uniform(0, 0.1)
    )
    _assert_victim(results, victim, [phase], None, _last_commits(job))
    _resume_and_check(job, two_piece_reference)


def test_agree_on_step_meets_at_the_lowest_commit_or_refuses_on_every_rank(tmp_path):
    cases = [
        [[3, 2], [3, 2]],
        [[4, 3], [3, 2]],  # rank 0 one ahead: rolls back
        [None, [0]],  # rank 0 killed before its first commit
        [None, None],  # nothing anywhere: fresh
        [[7, 6], [3, 2]],  # more than one step apart: other runs' directories
        [None, [5, 4]],  # a rank without its directory
    ]
    _ok(run_ranks(agree_rank, world_size=2, args=(cases, str(tmp_path))))
    for rank in range(2):
        got = torch.load(tmp_path / f"agree-rank{rank}.pt", weights_only=True)
        assert got[:4] == [3, 3, 0, None]
        assert all(str(g).startswith("CorruptStateError: the ranks cannot resume at a common step") for g in got[4:])
        assert "state_dir/rank{N}" in got[4] and "start all ranks fresh" in got[5]


# -- DCP: 2 ranks -> 1 -> 2, torch's layout ---------------------------------------------


@pytest.mark.parametrize(
    "first, then",
    [
        (("fsdp2", 2), ("none", 1)),
        (("none", 1), ("fsdp2", 2)),
        (("zero", 2), ("fsdp2", 1)),
    ],
    ids=["fsdp2x2-to-1", "1-to-fsdp2x2", "zero2-to-fsdp2x1"],
)
def test_dcp_checkpoint_loads_on_another_world_size_and_continues_bitwise(tmp_path, first, then):
    (wrap1, world1), (wrap2, world2) = first, then
    saved = DistJob(
        state_dir=str(tmp_path / "first"),
        out_dir=str(tmp_path),
        steps=3,
        save_at=3,
        wrap=wrap1,
        dcp_dir=str(tmp_path / "ckpt"),
        single_file_per_rank=world1 == 1,
    )
    _ok(run_ranks(train_rank, world_size=world1, args=(saved, "first")))
    loaded = replace(saved, state_dir=str(tmp_path / "then"), steps=STEPS, save_at=None, load=True, wrap=wrap2)
    _ok(run_ranks(train_rank, world_size=world2, args=(loaded, "then")))
    for rank in range(world2):
        got = torch.load(tmp_path / f"then-rank{rank}.pt", weights_only=True)
        assert got["first_step"] == 3  # step_count came back with the state
    pieces = [(3, world1 if wrap1 == "fsdp2" else 1), (STEPS, world2 if wrap2 == "fsdp2" else 1)]
    assert compare(loaded, "then", world_size=world2, against=reference(loaded, pieces)) == []


@pytest.mark.parametrize("writer, reader", [("tiered", "torch"), ("torch", "tiered")])
def test_dcp_checkpoints_interchange_with_torch_adamw_under_fsdp2(tmp_path, writer, reader):
    saved = DistJob(
        state_dir=str(tmp_path / "first"),
        out_dir=str(tmp_path),
        steps=3,
        save_at=3,
        optimizer=writer,
        dcp_dir=str(tmp_path / "ckpt"),
    )
    _ok(run_ranks(train_rank, world_size=2, args=(saved, "first")))
    loaded = replace(saved, state_dir=str(tmp_path / "then"), steps=STEPS, save_at=None, load=True, optimizer=reader)
    _ok(run_ranks(train_rank, world_size=2, args=(loaded, "then")))
    assert compare(loaded, "then", world_size=2, against=reference(loaded, 2)) == []


def test_state_dict_round_trips_through_get_set_optimizer_state_dict_under_fsdp2(tmp_path):
    job = DistJob(state_dir=str(tmp_path / "state"), out_dir=str(tmp_path), steps=2, keep_master=False)
    _ok(run_ranks(torch_state_dict_rank, world_size=2, args=(job, "sd")))
    assert all(torch.load(tmp_path / f"sd-rank{r}.pt", weights_only=True)["equal"] for r in range(2))


# -- DCP in one process: layout, streaming, errors ------------------------------------------


def _trained(shapes, *, steps=2, seed=0, **options) -> tuple[list[torch.nn.Parameter], TieredAdamW]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = TieredAdamW(params, lr=1e-2, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _torch_layout(opt: TieredAdamW) -> dict:
    """Empty tensors in torch AdamW's layout for every state entry, to load a checkpoint into."""
    sd = opt.state_dict()
    return {str(i): {k: torch.full_like(v, float("nan")) for k, v in e.items()} for i, e in sd["state"].items()}


shapes_strategy = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 3000)),
        st.tuples(st.integers(1, 40), st.integers(1, 300)),
        st.tuples(st.integers(1, 3), st.integers(1, 7), st.integers(1, 500)),  # rows wider than a shard
        st.just(()),
    ),
    min_size=1,
    max_size=4,
)


def _budget(shard_numel: int, fields: int) -> int:
    """An arena (prefetch 2: 4 slots) and one resident shard: larger states go to disk."""
    return 5 * shard_numel * fields * 4


@settings(max_examples=12)
@given(
    shapes=shapes_strategy,
    shard_numel=st.sampled_from([1024, 2048]),
    on_disk=st.booleans(),
    keep_master=st.booleans(),
    amsgrad=st.booleans(),
    use_planner=st.booleans(),
    block_numel=st.sampled_from([None, 300]),  # None: 2 MiB blocks; 300 elements cut rows and shards into boxes
)
def test_dcp_save_matches_state_dict_and_loads_back(
    tmp_path_factory, shapes, shard_numel, on_disk, keep_master, amsgrad, use_planner, block_numel
):
    path = str(tmp_path_factory.mktemp("ckpt"))
    fields = 2 + keep_master + amsgrad
    budget = _budget(shard_numel, fields) if on_disk else None
    params, opt = _trained(shapes, shard_numel=shard_numel, ram_budget=budget, keep_master=keep_master, amsgrad=amsgrad)
    block_nbytes = 4 * block_numel if block_numel else BLOCK_NBYTES  # the blocks cut, and the buffers they go through
    with opt, mock.patch.object(_stateful, "BLOCK_NBYTES", block_nbytes), mock.patch.object(_session, "BLOCK_NBYTES", block_nbytes):
        planner = TieredSavePlanner() if use_planner else None
        dcp.save({"optim": TieredStateful(opt)}, checkpoint_id=path, planner=planner, no_dist=True)
        want = opt.state_dict()
        # Plain tensors in torch's layout read it back (DCP reassembles the blocks).
        plain = {"optim": {"state": _torch_layout(opt)}}
        dcp.load(plain, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        for i, entry in want["state"].items():
            for key, value in entry.items():
                assert torch.equal(plain["optim"]["state"][str(i)][key], value), (i, key)
        steps = opt.step_count
    # A fresh optimizer with another shard size, on disk, loads it through the staging map.
    fresh_params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    with TieredAdamW(
        fresh_params,
        lr=0.5,
        shard_numel=4096,
        ram_budget=_budget(4096, fields),
        state_dir=str(tmp_path_factory.mktemp("fresh")),
        keep_master=keep_master,
        amsgrad=amsgrad,
    ) as fresh:
        dcp.load({"optim": TieredStateful(fresh)}, checkpoint_id=path, no_dist=True)
        got = fresh.state_dict()
        assert fresh.step_count == steps and fresh.param_groups[0]["lr"] == 1e-2
        for i, entry in want["state"].items():
            for key, value in entry.items():
                assert torch.equal(got["state"][i][key], value), (i, key)
        if keep_master:  # masters came back into the parameters
            assert all(torch.equal(a, b) for a, b in zip(fresh_params, params))
        assert [p.name for p in Path(fresh.state_dir).iterdir() if "staging" in p.name] == []


@settings(max_examples=200)
@given(
    shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    cap=st.integers(1, 40),
)
def test_boxes_are_contiguous_and_cover_the_range(shape, cut, cap):
    numel = math.prod(shape)
    lo, hi = sorted(int(c * numel) for c in cut)
    if not shape:
        lo, hi = 0, 1
    flat = torch.arange(numel).reshape(shape)
    pos = lo
    for offsets, sizes, a, b in boxes(shape, lo, hi, cap):
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else flat
        assert a == pos and b - a == box.numel() <= max(cap, 1) and box.numel() > 0
        assert box.reshape(-1).tolist() == list(range(a, b))  # contiguous, in order
        pos = b
    assert pos == hi or lo == hi


def test_block_ring_reuses_a_buffer_once_the_thread_asks_again():
    ring = BlockRing(1 << 20)
    a = ring.take(100)
    assert ring.take(200).data_ptr() == a.data_ptr() and ring.buffer_nbytes == 1 << 20
    others = []
    thread = threading.Thread(target=lambda: others.append(ring.take(10)))
    thread.start()
    thread.join()
    assert others[0].data_ptr() != a.data_ptr() and ring.buffer_nbytes == 2 << 20  # one buffer per thread
    # A writer that resolves ahead: blocks within ``keep`` bytes stay untouched.
    ahead = [ring.take(1 << 18, keep=3 << 20) for _ in range(4)]  # 1 MiB each, 3 MiB kept behind
    assert len({t.data_ptr() for t in ahead}) == 4
    assert ring.take(1 << 18, keep=3 << 20).data_ptr() == ahead[0].data_ptr()
    with pytest.raises(ValueError, match="does not fit"):
        ring.take((1 << 18) + 1)


def test_staging_tensor_writes_what_dcp_copies_into_the_file(tmp_path):
    """DCP narrows a staging tensor to the piece it read and copies into it: a box along any dimension."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    from tierstore._storage.dcp_memory import StagingFile
    from tierstore.dcp._staging import Staged

    file = StagingFile(3 + 24, str(tmp_path))
    want = torch.zeros(4, 6)
    target = Staged(file, 3, (4, 6), (0, 0), (4, 6))
    for offsets, sizes in [((1, 2), (2, 3)), ((3, 0), (1, 6)), ((0, 5), (4, 1))]:
        piece = torch.randn(sizes)
        narrow_tensor_by_index(target.detach(), offsets, sizes).copy_(piece)
        want[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]] = piece
    got = torch.empty(24)
    Staged(file, 3, (24,), (0,), (24,)).read_into(got)
    assert torch.equal(got.view(4, 6), want)
    with pytest.raises(RuntimeError, match="staging tensor"):
        target + 1
    assert list(tmp_path.iterdir()) == []  # unlinked at once
    file.close()


class _OverlappingCpuLoader:  # named as torch's: copy_ahead_of_caller finds it among the callers
    inflight_threshhold = 5_000

    def resolve(self) -> int:
        return copy_ahead_of_caller(False)


def test_copy_ahead_of_the_calling_writer_is_found():
    assert _OverlappingCpuLoader().resolve() == 10_000  # resolved ahead, and as much again while draining
    assert copy_ahead_of_caller(False) == 0  # no writer among the callers: serial
    assert copy_ahead_of_caller(True) == 2 * TORCH_COPY_AHEAD  # on a GPU host: torch's default, to be safe


def test_save_planner_reads_every_shard_once_and_threaded_writers_work(tmp_path):
    params, opt = _trained([(64, 512), (3000,)], shard_numel=1024, ram_budget="64KiB")
    with opt:
        on_disk, slots = len(opt.plan.disk_shards), opt.plan.arena_slots
        reads, buffers = {}, {}
        for name, planner, threads in [("default", None, 1), ("tiered", TieredSavePlanner(), 1), ("threads", None, 2)]:
            stateful = TieredStateful(opt)
            writer = dcp.FileSystemWriter(str(tmp_path / name), thread_count=threads)
            dcp.save({"optim": stateful}, storage_writer=writer, planner=planner, no_dist=True)
            reads[name], buffers[name] = stateful.stats.shard_reads, stateful.stats.buffer_bytes
        want = opt.state_dict()["state"]
    assert on_disk > 20
    # Shards still in arena slots from the step or the previous save are not read again.
    assert on_disk - slots <= reads["tiered"] <= on_disk  # blocks in shard order: one read each at most
    assert 2 * (on_disk - slots) <= reads["default"] <= 2 * on_disk  # field after field: once per field
    # One block buffer per writer thread (it writes a block before it asks for the next).
    assert buffers == {"default": BLOCK_NBYTES, "tiered": BLOCK_NBYTES, "threads": 2 * BLOCK_NBYTES}
    with TieredAdamW([torch.nn.Parameter(torch.zeros_like(p)) for p in params], lr=1.0) as fresh:
        dcp.load({"optim": TieredStateful(fresh)}, checkpoint_id=str(tmp_path / "threads"), no_dist=True)
        got = fresh.state_dict()["state"]
    assert all(torch.equal(got[i][k], v) for i, e in want.items() for k, v in e.items())


def test_loads_a_torch_adamw_state_dict_and_continues_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 70), torch.nn.Linear(70, 5))
    mirror = torch.nn.Sequential(torch.nn.Linear(30, 70), torch.nn.Linear(70, 5))
    mirror.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(8, 30)
    for _ in range(2):
        model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    mirror.load_state_dict(model.state_dict())
    with TieredAdamW(mirror.parameters(), lr=0.5, ram_budget="64KiB", shard_numel=1024) as opt:
        TieredStateful(opt, mirror).load_state_dict(get_optimizer_state_dict(model, ref))
        assert opt.step_count == 2 and opt.param_groups[0]["lr"] == 1e-2
        for m, o in ((model, ref), (mirror, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), mirror.parameters()))


def test_placeholders_refuse_tensor_operations_and_serve_one_direction(tmp_path):
    _, opt = _trained([(10, 10)])
    with opt:
        sd = TieredStateful(opt).state_dict()
        placeholder = sd["state"]["0"]["exp_avg"]
        assert "TieredState(0.exp_avg" in repr(placeholder) and placeholder.shape == (10, 10)
        with pytest.raises(RuntimeError, match="optimizer.state_dict"):
            placeholder + 1
        dcp.save({"optim": sd}, checkpoint_id=str(tmp_path), no_dist=True)
        with pytest.raises(dcp.api.CheckpointException) as info:
            dcp.load({"optim": sd}, checkpoint_id=str(tmp_path), no_dist=True)
        assert "serves one dcp.save or one dcp.load" in str(info.value.failures)


class _Stranger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda opt, p: TieredStateful(torch.optim.AdamW([p])), ConfigError, "needs a tiered optimizer such as TieredAdamW"),
        (lambda opt, p: TieredStateful(opt, _Stranger()), ConfigError, "not parameters of the given model"),
        (lambda opt, p: TieredStateful(opt, cache_bytes=-1), ConfigError, "cache_bytes=-1"),
        (lambda opt, p: TieredStateful(opt, cache_bytes="1MiB"), ConfigError, "cache_bytes='1MiB'"),
        (
            lambda opt, p: TieredStateful(opt).load_state_dict({"state": {}, "param_groups": []}),
            ValueError,
            "0 param groups, this optimizer has 1",
        ),
        (
            lambda opt, p: TieredStateful(opt).load_state_dict(
                {"state": {"0": {"exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 0.1}]}
            ),
            ValueError,
            r"0.exp_avg has local shape \(4,\), this rank's part of the parameter is \(3,\)",
        ),
    ],
    ids=["torch-optimizer", "foreign-model", "negative-cache", "string-cache", "groups", "shape"],
)
def test_bad_inputs_raise_errors_that_name_the_fix(make, error, match):
    p = torch.nn.Parameter(torch.zeros(3))
    with TieredAdamW([p], lr=0.1) as opt, warnings.catch_warnings(), pytest.raises(error, match=match):
        make(opt, p)
