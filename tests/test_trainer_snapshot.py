"""The optimizer's part of a trainer checkpoint (``tierstore.integrations.snapshot``) and its safety rules.

No trainer here (tests/test_hf_checkpoints.py runs Hugging Face ``Trainer``):
a snapshot stays valid while the state directory keeps committing, costs the
state's bytes once, is freed with its folder, and ``tierstore verify`` names
what is damaged or orphaned.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.checkpoint import checkpoint_to_state_dict
from tierstore.cli import main as cli
from tierstore.errors import CorruptStateError, FormatVersionError
from tierstore.integrations.snapshot import (
    REFERENCE_NAME,
    SNAPSHOT_NAME,
    check_trainer_checkpoints,
    load_trainer_snapshot,
    read_reference,
    save_trainer_snapshot,
    snapshot_nbytes,
)

SHARD = 1024
BUDGET = 40 << 10  # the arena plus one resident shard; the state (8 x 4096 params x 8 B = 256 KiB) streams


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4096, generator=gen)) for _ in range(8)]


def step(opt: torch.optim.Optimizer, ps: list[torch.Tensor], k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint of step 2 taken from a durable optimizer that then trains (and commits) 4 more steps."""
    ps = params()
    ref_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, fused=True)
    with TieredAdamW(ps, lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD, state_dir=str(tmp_path / "state"),
                     commit_every=1) as opt:  # fmt: skip
        assert opt.disk_bytes > 0
        for k in range(2):
            step(opt, ps, k)
            step(ref, ref_ps, k)
        ckpt = tmp_path / "run" / "checkpoint-2"
        save_trainer_snapshot(opt, ckpt)
        state_bytes = opt.layout.state_nbytes
        for k in range(2, 6):  # training goes on: the state directory rewrites its files in place
            step(opt, ps, k)
            opt.commit()
        assert opt.committed_step == 6
    return ckpt, {"torch": ref.state_dict(), "state_bytes": state_bytes}


def test_a_snapshot_stays_valid_while_training_goes_on_and_costs_the_state_once(saved) -> None:
    ckpt, info = saved
    got = checkpoint_to_state_dict(ckpt / SNAPSHOT_NAME)
    for i, entry in info["torch"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][key], entry[key]), (i, key)
    assert read_reference(ckpt)["step_count"] == 2
    used = snapshot_nbytes(ckpt / SNAPSHOT_NAME)
    assert info["state_bytes"] <= used <= info["state_bytes"] + (256 << 10)  # the state once, plus metadata
    assert check_trainer_checkpoints(ckpt.parent) == []
    with TieredAdamW(params(1), lr=1e-2) as fresh:  # another machine: a RAM-only optimizer, no state_dir
        load_trainer_snapshot(fresh, ckpt)
        assert fresh.step_count == 2


def test_deleting_the_folder_frees_everything_and_the_state_dir_is_untouched(saved, tmp_path: Path) -> None:
    ckpt, _ = saved
    before = sorted(os.listdir(tmp_path / "state"))
    shutil.rmtree(ckpt)  # what save_total_limit rotation does
    assert os.listdir(tmp_path / "run") == []
    assert sorted(os.listdir(tmp_path / "state")) == before


def verify(path: Path, capsys) -> tuple[int, str]:
    code = cli(["verify", str(path), "--no-progress"])
    return code, capsys.readouterr().out


def test_verify_names_orphans_damage_and_missing_snapshots(saved, capsys) -> None:
    ckpt, _ = saved
    run = ckpt.parent
    assert verify(run, capsys)[0] == 0
    assert verify(ckpt, capsys)[0] == 0

    leftover = ckpt / f".{SNAPSHOT_NAME}.partial-x1y2"  # a save that crashed half-way
    shutil.copytree(ckpt / SNAPSHOT_NAME, leftover)
    orphan = run / "checkpoint-4"
    shutil.copytree(ckpt / SNAPSHOT_NAME, orphan / SNAPSHOT_NAME)  # a snapshot whose reference never came
    code, out = verify(run, capsys)
    assert code == 3, out
    assert str(leftover) in out and str(orphan / SNAPSHOT_NAME) in out and "bytes" in out and "delete" in out
    shutil.rmtree(leftover)
    shutil.rmtree(orphan)

    chunk = next(p for p in sorted((ckpt / SNAPSHOT_NAME / "exp_avg_sq").rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[8] ^= 0x01
    chunk.write_bytes(bytes(data))
    code, out = verify(run, capsys)
    assert code == 1 and "checkpoint-2" in out, out
    with TieredAdamW(params(), lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD) as opt, pytest.raises(
        CorruptStateError, match="checkpoint-2.*damaged"
    ):
        load_trainer_snapshot(opt, ckpt)

    shutil.rmtree(ckpt / SNAPSHOT_NAME)
    code, out = verify(run, capsys)
    assert code == 1 and "missing" in out and "copied whole" in out, out


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (lambda r: "not json", CorruptStateError, "reference.*damaged"),
        (lambda r: json.dumps({**r, "format_version": 99}), FormatVersionError, "upgrade tierstore"),
        (lambda r: json.dumps({**r, "snapshot": "../elsewhere"}), CorruptStateError, "snapshot names"),
        (lambda r: json.dumps({**r, "zarr_json_sha256": "0" * 64}), CorruptStateError, "not the one"),
    ],
)
def test_a_bad_reference_is_refused_naming_the_checkpoint(saved, edit, error, match) -> None:
    ckpt, _ = saved
    path = ckpt / REFERENCE_NAME
    path.write_text(edit(json.loads(path.read_text())))
    with TieredAdamW(params(), lr=1e-2) as opt, pytest.raises(error, match=match) as info:
        load_trainer_snapshot(opt, ckpt)
    assert "checkpoint-2" in str(info.value)
    assert opt.step_count == 0  # nothing was loaded


def test_an_arrays_metadata_replaced_is_refused(saved) -> None:
    """The reference pins every zarr.json, not only the root's: an array's shape, type or codecs edited is caught."""
    ckpt, _ = saved
    arrays = sorted(p for p in (ckpt / SNAPSHOT_NAME).rglob("zarr.json") if p.parent != ckpt / SNAPSHOT_NAME)
    assert arrays, "the snapshot has array metadata"
    meta = json.loads(arrays[0].read_text())
    meta.setdefault("attributes", {})["edited"] = True  # still valid zarr metadata, other bytes
    arrays[0].write_text(json.dumps(meta))
    with TieredAdamW(params(), lr=1e-2) as opt, pytest.raises(CorruptStateError, match="array metadata") as info:
        load_trainer_snapshot(opt, ckpt)
    assert "checkpoint-2" in str(info.value) and opt.step_count == 0


def test_a_linked_array_metadata_is_not_followed(saved, tmp_path) -> None:
    ckpt, _ = saved
    target = next(p for p in (ckpt / SNAPSHOT_NAME).rglob("zarr.json") if p.parent != ckpt / SNAPSHOT_NAME)
    shutil.copy(target, tmp_path / "elsewhere.json")
    target.unlink()
    target.symlink_to(tmp_path / "elsewhere.json")
    with TieredAdamW(params(), lr=1e-2) as opt, pytest.raises(CorruptStateError, match="no readable zarr.json"):
        load_trainer_snapshot(opt, ckpt)


def test_a_version_1_reference_still_loads(saved) -> None:
    """References written before metadata_sha256 (format version 1) load, checked by their root digest."""
    ckpt, _ = saved
    path = ckpt / REFERENCE_NAME
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "metadata_sha256"}
    path.write_text(json.dumps({**old, "format_version": 1}))
    with TieredAdamW(params(), lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD) as opt:
        load_trainer_snapshot(opt, ckpt)
        assert opt.step_count == 2
    path.write_text(json.dumps({**old, "format_version": 2}))  # version 2 without it is damaged
    with TieredAdamW(params(), lr=1e-2) as opt, pytest.raises(CorruptStateError, match="metadata_sha256"):
        load_trainer_snapshot(opt, ckpt)
