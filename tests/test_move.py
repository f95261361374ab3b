"""``tierstore move SRC... --to DST...``: a state onto another set of drives, streamed within a RAM budget.

- one directory onto two (one on the second, faster drive), two onto one (a
  plain state directory again: no member record, no ``"drives"`` key), two
  onto three from the home alone: each moved state resumes and trains on
  bitwise equal to torch.optim.AdamW(fused=True), and the source is byte for
  byte what it was (and still resumes);
- the RAM it takes: the reader's buffer and the slots the budget holds; a
  budget below two of the largest shard is refused naming the least;
- refusals: a destination that is the source or inside it, one holding a
  committed state or another state's drive, a source held by an open
  optimizer, a damaged source (nothing committed in the destination);
- a move SIGKILLed mid-write, and after everything was written and synced
  but before its manifest was renamed: the kill landed there, the source is
  untouched and resumes bitwise, the destination holds no state, and the
  move run again into it succeeds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tierstore import (
    CorruptStateError,
    DriveSetError,
    StateDirInUseError,
    StateExistsError,
    TieredAdamW,
)
from tierstore._state.drive_record import MEMBER
from tierstore._state.move import move_slots, move_state
from tierstore.cli import main
from tierstore.errors import BudgetError
from tierstore.testing.drives import second_drive
from tierstore.testing.move_kill import run_move_child

SHAPES = ((300, 70), (10000,), (33,))
KW = dict(lr=1e-2, weight_decay=1e-2, shard_numel=2048, ram_budget="96KiB")


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    drive = second_drive(tmp_path_factory.mktemp("second-drive"), loop=os.environ.get("TIERSTORE_TEST_LOOP") == "1")
    print(drive.describe())
    yield drive
    drive.close()


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


class Run:
    """A TieredAdamW run beside torch's fused AdamW, fed the same gradients."""

    def __init__(self) -> None:
        self.params, self.ref_params = _params(), _params()
        self.ref = torch.optim.AdamW(self.ref_params, lr=KW["lr"], weight_decay=KW["weight_decay"], fused=True)
        self.step = 0

    def train(self, state_dir, steps: int, **kw) -> None:
        with TieredAdamW(self.params, state_dir=state_dir, **{**KW, **kw}) as opt:
            for _ in range(steps):
                for p, q, g in zip(self.params, self.ref_params, _grads(self.step)):
                    p.grad, q.grad = g.clone(), g.clone()
                opt.step()
                self.ref.step()
                self.step += 1
            mine, theirs = opt.state_dict()["state"], self.ref.state_dict()["state"]
        for p, q in zip(self.params, self.ref_params):
            assert torch.equal(p, q), f"step {self.step}: parameters differ from torch's"
        for i in theirs:
            for key, value in theirs[i].items():
                assert torch.equal(mine[i][key], value), f"step {self.step}: param {i} {key} differs"


def _snapshot(*dirs) -> dict[str, str]:
    """Every file of ``dirs`` with its bytes' hash: what "untouched" compares."""
    out = {}
    for d in dirs:
        for name in sorted(os.listdir(d)):
            out[f"{d}/{name}"] = hashlib.sha256(Path(d, name).read_bytes()).hexdigest()
    return out


def _move(src, dst, *extra) -> int:
    src = src if isinstance(src, list) else [src]
    return main(["move", *map(str, src), "--to", *map(str, dst), "--no-progress", *extra])


def test_one_directory_onto_two_then_back_onto_one_resumes_bitwise(tmp_path, fast, capsys):
    run = Run()
    src = str(tmp_path / "src")
    run.train(src, 3)
    before = _snapshot(src)
    two = [str(tmp_path / "a"), str(fast.path / "move-b")]
    assert _move(src, two, "--bandwidths", "1e9", "3e9") == 0
    out = capsys.readouterr().out
    assert "moved step 3" in out and "drive 1: " in out and "the source is untouched" in out, out
    assert _snapshot(src) == before, "the move changed the source"
    record = json.loads(Path(two[0], "manifest.json").read_text())["drives"]
    assert record["count"] == 2 and set(record["placement"]) == {0, 1} and record["bandwidths"] == [1e9, 3e9]
    assert main(["verify", two[0], "--no-progress"]) == 0
    capsys.readouterr()
    run.train(two, 2, resume=True)
    one = str(tmp_path / "one")
    assert _move(two, [one]) == 0  # the list as the source; one destination: a plain state directory
    assert sorted(os.listdir(one)) == ["manifest.json", "shards.0.bin", "shards.1.bin"]
    assert "drives" not in json.loads(Path(one, "manifest.json").read_text())
    run.train(one, 2, resume=True)
    shutil.rmtree(fast.path / "move-b")


def test_two_directories_onto_three_from_the_home_alone(tmp_path, fast):
    run = Run()
    src = [str(tmp_path / "s0"), str(fast.path / "move-s1")]
    os.environ["TIERSTORE_DRIVE_BANDWIDTHS"] = "1e9,1e9"
    try:
        run.train(src, 2)
    finally:
        del os.environ["TIERSTORE_DRIVE_BANDWIDTHS"]
    before = _snapshot(*src)
    three = [str(tmp_path / f"t{k}") for k in range(3)]
    moved = move_state(src[0], three, ram_budget=1 << 20, bandwidths=[1e9, 2e9, 1e9])
    assert moved.step_count == 2 and len(moved.drive_bytes) == 3 and all(b > 0 for b in moved.drive_bytes)
    assert _snapshot(*src) == before
    assert [json.loads(Path(d, MEMBER).read_text())["index"] for d in three] == [0, 1, 2]
    run.train(three, 2, resume=True)
    with TieredAdamW(_params(), state_dir=src, resume=True, **KW) as again:  # the source still resumes, at its step
        assert again.step_count == 2
    shutil.rmtree(fast.path / "move-s1")


def test_the_move_stays_within_its_ram_budget(tmp_path):
    Run().train(str(tmp_path / "src"), 1)
    slot = 2048 * 4 * 2  # a full shard's two fp32 moments
    moved = move_state(tmp_path / "src", [tmp_path / "d"], ram_budget=3 * slot, bandwidths=[1e9])
    assert moved.slots == 2 and (moved.slots + 1) * slot <= 3 * slot  # the reader's buffer and two slots
    with pytest.raises(BudgetError, match=f"give at least {2 * slot} bytes"):
        move_state(tmp_path / "src", [tmp_path / "e"], ram_budget=slot, bandwidths=[1e9])
    assert move_slots(1 << 30, slot) == 16  # a large budget: at most 16 writes in flight
    assert _move(tmp_path / "src", [tmp_path / "f"], "--ram-budget", "1KiB") == 2  # a usage error


def test_refusals_leave_source_and_destination_as_they_were(tmp_path, capsys):
    src = str(tmp_path / "src")
    Run().train(src, 1)
    before = _snapshot(src)
    assert _move(src, [src]) == 2
    assert "is the source directory" in capsys.readouterr().err
    assert _move(src, [f"{src}/inner"]) == 2
    assert "inside the source directory" in capsys.readouterr().err
    other = str(tmp_path / "other")
    Run().train(other, 1)
    with pytest.raises(StateExistsError, match="already holds a committed state"):
        move_state(src, [other], bandwidths=[1e9])
    two = [str(tmp_path / "x0"), str(tmp_path / "x1")]
    move_state(src, two, bandwidths=[1e9, 1e9])
    with pytest.raises(DriveSetError, match="is drive 1 of another state"):
        move_state(src, [str(tmp_path / "y0"), two[1]], bandwidths=[1e9, 1e9])
    assert not (tmp_path / "y0").exists()
    with TieredAdamW(_params(), state_dir=src, resume=True, **KW), pytest.raises(StateDirInUseError, match=src):
        move_state(src, [tmp_path / "z"], bandwidths=[1e9])
    assert _snapshot(src) == before


def test_a_damaged_source_is_refused_and_nothing_is_committed(tmp_path):
    src = tmp_path / "src"
    Run().train(str(src), 1)
    manifest = json.loads((src / "manifest.json").read_text())
    copy = manifest["shards"][3]["copy"]
    with open(src / f"shards.{copy}.bin", "r+b") as f:
        f.seek(3 * 2048 * 4 * 2 + 100)  # inside shard 3's committed extent (full shards before it)
        f.write(b"\xff" * 8)
    with pytest.raises(CorruptStateError, match="shard 3"):
        move_state(src, [tmp_path / "d"], bandwidths=[1e9])
    assert not (tmp_path / "d" / "manifest.json").exists()


@pytest.mark.parametrize("point, after", [("mid-write", 4), ("manifest-tmp", 1)])
def test_a_move_killed_midway_leaves_the_source_resumable_and_can_run_again(tmp_path, fast, point, after):
    run = Run()
    src = str(tmp_path / "src")
    run.train(src, 2)
    twin = copy.deepcopy(run)  # the same run, to go on from the source
    before = _snapshot(src)
    dst = [str(tmp_path / "d0"), str(fast.path / f"kill-{point}")]
    argv = ["move", src, "--to", *dst, "--no-progress", "--bandwidths", "1e9", "1e9"]
    child = run_move_child(argv, crash=(point, after))
    assert child.killed and child.landed_point == point, child
    assert _snapshot(src) == before, "a killed move changed the source"
    assert not Path(dst[0], "manifest.json").exists(), "a killed move left a committed destination"
    if point == "manifest-tmp":  # everything written and synced, the manifest durable only under its temporary name
        assert Path(dst[0], ".manifest.json.tmp").exists() and Path(dst[1], "shards.0.bin").exists()
    with pytest.raises(StateExistsError):  # no state there: nothing to resume, and files refuse a fresh start
        TieredAdamW(_params(), state_dir=dst, **KW)
    assert _move(src, dst, "--bandwidths", "1e9", "1e9") == 0  # again, over what the killed move left
    run.train(dst, 1, resume=True)
    twin.train(src, 1, resume=True)  # and the source still resumes bitwise
    shutil.rmtree(dst[1])
