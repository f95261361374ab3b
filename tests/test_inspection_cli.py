"""``tierstore inspect | verify | export | to-torch`` (issue 3, point 6).

``verify`` exits 0 on a clean directory, 1 when a committed shard or the
manifest is damaged (naming the shard and the file), 3 when only a stale
copy is; ``inspect --json`` reports what the manifest holds; ``export`` and
``to-torch`` produce a checkpoint and a state dict that load back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore._state.statedir import MANIFEST
from tierstore._storage.store import STATE_FILES
from tierstore.checkpoint import checkpoint_to_state_dict
from tierstore.cli import main

SHARD_NUMEL = 1024


def _params(seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(60, 100, generator=gen)),
        torch.nn.Parameter(torch.randn(50, generator=gen)),
        torch.nn.Parameter(torch.randn(3000, generator=gen).bfloat16()),
    ]
    return params, torch.nn.Parameter(torch.zeros(4), requires_grad=False)


def _groups(params: list, frozen: torch.Tensor) -> list[dict]:
    return [
        {"params": [params[0], frozen, params[1]], "lr": 2e-3},
        {"params": [params[2]], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A durable state directory after 3 steps (every shard has a committed and a stale copy)."""
    params, frozen = _params()
    d = tmp_path / "state"
    with TieredAdamW(_groups(params, frozen), state_dir=d, ram_budget="80KiB", shard_numel=SHARD_NUMEL) as opt:
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        assert opt.plan.disk_shards and opt.plan.resident  # both tiers are exercised
    return d


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _extent(d: Path, shard: int) -> tuple[int, int]:
    """Byte offset and size of a shard's extent in the state files."""
    manifest = _manifest(d)
    nfields = len(manifest["layout"]["fields"])
    sizes = []
    total = max(p["start"] + p["numel"] for p in manifest["layout"]["params"] if p["trainable"])
    for start in range(0, total, SHARD_NUMEL):
        capacity = min(SHARD_NUMEL, -(-total // 1024) * 1024 - start)
        sizes.append(capacity * 4 * nfields)
    return sum(sizes[:shard]), sizes[shard]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_clean_directory(state_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(state_dir)]) == 0
    assert "ok: step 3" in capsys.readouterr().out


@pytest.mark.parametrize("shard", [0, 2, -1])
def test_verify_committed_copy_flip(state_dir: Path, capsys: pytest.CaptureFixture, shard: int) -> None:
    records = _manifest(state_dir)["shards"]
    shard = shard % len(records)
    copy = records[shard]["copy"]
    offset, nbytes = _extent(state_dir, shard)
    _flip(state_dir / STATE_FILES[copy], offset + nbytes // 2 + 3)
    assert main(["verify", str(state_dir)]) == 1
    out = capsys.readouterr().out
    assert f"error: shard {shard} in {state_dir / STATE_FILES[copy]}" in out
    assert out.count("error: shard") == 1


def test_verify_stale_copy_flip_is_a_warning(state_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rec = _manifest(state_dir)["shards"][1]
    assert rec["stale_checksum"]
    offset, _ = _extent(state_dir, 1)
    stale = state_dir / STATE_FILES[1 - rec["copy"]]
    _flip(stale, offset)
    assert main(["verify", str(state_dir)]) == 3
    out = capsys.readouterr().out
    assert f"warning: shard 1 in {stale}" in out and "intact" in out


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_verify_manifest_flip(state_dir: Path, capsys: pytest.CaptureFixture, where: float) -> None:
    path = state_dir / MANIFEST
    _flip(path, int(path.stat().st_size * where))
    assert main(["verify", str(state_dir)]) == 1
    assert str(path) in capsys.readouterr().out


def _committed_file(d: Path) -> Path:
    return d / STATE_FILES[_manifest(d)["shards"][0]["copy"]]


def _stale_file(d: Path) -> Path:
    return d / STATE_FILES[1 - _manifest(d)["shards"][0]["copy"]]


@pytest.mark.parametrize(
    "damage, status, message",
    [
        pytest.param(lambda d: _committed_file(d).unlink(), 1, "is missing", id="committed-file-removed"),
        pytest.param(lambda d: os.truncate(_committed_file(d), 8192), 1, "truncated", id="committed-file-truncated"),
        pytest.param(lambda d: os.truncate(_stale_file(d), 8192), 3, "truncated", id="stale-file-truncated"),
        pytest.param(lambda d: (d / MANIFEST).unlink(), 1, "manifest.json is missing", id="no-manifest"),
        pytest.param(lambda d: _set_format_version(d, 99), 1, "format_version 99", id="newer-format"),
    ],
)
def test_verify_damaged_files(state_dir: Path, capsys: pytest.CaptureFixture, damage, status: int, message: str) -> None:
    damage(state_dir)
    assert main(["verify", str(state_dir)]) == status
    assert message in capsys.readouterr().out


def _set_format_version(d: Path, version: int) -> None:
    """Rewrite the manifest as a newer tierstore would: another version, a valid checksum."""
    from tierstore._state.manifest_file import manifest_checksum as _manifest_checksum

    raw = _manifest(d)
    raw["format_version"] = version
    raw["manifest_checksum"] = _manifest_checksum(raw)
    (d / MANIFEST).write_text(json.dumps(raw))


def test_inspect_json(state_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--json", str(state_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    manifest = _manifest(state_dir)
    assert info["kind"] == "state_dir" and info["step_count"] == 3
    assert info["clean"] is True and info["durable"] is True and info["interrupted_after_commit"] is False
    lay = info["layout"]
    assert (lay["params"], lay["trainable"], lay["frozen"]) == (4, 3, 1)
    assert lay["trainable_numel"] == 6000 + 50 + 3000
    assert lay["shard_numel"] == SHARD_NUMEL and lay["fields"] == ["master", "exp_avg", "exp_avg_sq"]
    assert lay["fingerprint"] == manifest["fingerprint"] and lay["shards"] == len(manifest["shards"])
    assert info["bytes"]["ram_budget"] == 80 << 10
    assert info["bytes"]["state_per_copy"] == lay["total_numel"] * 4 * 3
    assert set(info["bytes"]["files"]) == set(STATE_FILES)
    assert info["param_steps"] == {"with_state": 3, "min": 3.0, "max": 3.0}
    g0, g1 = info["param_groups"]
    assert (g0["lr"], g0["params"], g0["weight_decay"]) == (2e-3, 3, 0.01)
    assert (g1["lr"], g1["betas"], g1["weight_decay"], g1["params"]) == (5e-3, [0.8, 0.95], 0.0, 1)


def test_inspect_text(state_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(state_dir)]) == 0
    out = capsys.readouterr().out
    for text in ("committed step: 3", "clean, durable", "4 (3 trainable, 1 frozen)", "ram_budget of the last run: 80.00 KiB", "group 1 (1 params): lr=0.005 betas=(0.8, 0.95)"):
        assert text in out, text


def test_export_then_inspect_and_load(state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ckpt.zarr"
    assert main(["export", str(state_dir), str(out)]) == 0
    assert main(["export", str(state_dir), str(out)]) == 2  # exists: a usage error (--overwrite)
    assert "overwrite" in capsys.readouterr().err
    assert main(["export", "--overwrite", "--checksum", "crc32c", str(state_dir), str(out)]) == 0
    assert main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # after the "exported ..." line
    assert info["kind"] == "checkpoint" and info["checksum"] == "crc32c" and info["step_count"] == 3
    params, frozen = _params(seed=1)
    with TieredAdamW(_groups(params, frozen), shard_numel=4096) as opt:
        opt.load_checkpoint(out)
        assert opt.step_count == 3
        loaded = opt.state_dict()
    with TieredAdamW(_groups(*_params(seed=2)), state_dir=state_dir, resume=True) as opt:
        expected = opt.state_dict()
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)


@pytest.mark.parametrize("from_zarr", [False, True])
def test_to_torch(state_dir: Path, tmp_path: Path, from_zarr: bool) -> None:
    src = state_dir
    if from_zarr:
        src = tmp_path / "ckpt.zarr"
        assert main(["export", str(state_dir), str(src)]) == 0
    out = tmp_path / "adamw.pt"
    assert main(["to-torch", *(["--from-zarr"] if from_zarr else []), str(src), str(out)]) == 0
    assert main(["to-torch", *(["--from-zarr"] if from_zarr else []), str(src), str(out)]) == 2  # exists
    sd = torch.load(out)
    assert sorted(sd["state"]) == [0, 2, 3]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3]]
    params, frozen = _params()
    ref = torch.optim.AdamW(_groups([p.detach().float().requires_grad_() for p in params], frozen), fused=True)
    ref.load_state_dict(sd)  # loads into torch AdamW as is
    with TieredAdamW(_groups(*_params(seed=3)), state_dir=state_dir, resume=True) as opt:
        expected = opt.state_dict()
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(sd["state"][i][key], value), (i, key)
    if from_zarr:
        assert torch.equal(checkpoint_to_state_dict(src)["state"][3]["master_param"], sd["state"][3]["master_param"])


def test_commands_on_a_directory_without_state(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv in (["inspect", str(tmp_path)], ["verify", str(tmp_path)], ["export", str(tmp_path), str(tmp_path / "o.zarr")], ["to-torch", str(tmp_path), str(tmp_path / "o.pt")]):
        assert main(argv) == 2, argv  # missing input: a usage error
        captured = capsys.readouterr()
        assert "holds neither manifest.json" in captured.err and "restore" not in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
def test_verify_checkpoint(state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, checksum: str) -> None:
    out = tmp_path / "ckpt.zarr"
    assert main(["export", "--checksum", checksum, str(state_dir), str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    assert f"matches its {checksum} checksum" in capsys.readouterr().out
    _flip(out / "exp_avg_sq" / "c" / "2", 4000)
    assert main(["verify", str(out)]) == 1
    assert "error: chunk 2 (elements 2048..3072) of array exp_avg_sq" in capsys.readouterr().out
    (out / "master_param" / "c" / "0").unlink()
    assert main(["verify", str(out)]) == 1
    assert "stores 8 of its 9 chunks" in capsys.readouterr().out
