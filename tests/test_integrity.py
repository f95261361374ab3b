"""Byte flips in any state file are detected before the state is used."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tierstore import CorruptStateError, TieredAdamW
from tierstore._state.reader import StateReader

SHAPES = [(300, 7), (1000, 33), (5,), (4099,)]


def _train(state_dir: Path, steps: int = 3, **kw) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    with TieredAdamW(params, lr=1e-2, state_dir=str(state_dir), shard_numel=2048, keep_master=True, **kw) as opt:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    return params


def _flip(path: Path, offset: int) -> int:
    data = bytearray(path.read_bytes())
    old = data[offset]
    data[offset] ^= 1 << random.Random(offset).randrange(8)
    path.write_bytes(bytes(data))
    return old


def _restore(path: Path, offset: int, old: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = old
    path.write_bytes(bytes(data))


def _detected(state_dir: Path) -> bool:
    try:
        with StateReader(state_dir) as reader:
            return bool(reader.verify())
    except CorruptStateError:
        return True


@pytest.mark.parametrize("name", ["shards.0.bin", "shards.1.bin", "manifest.json"])
def test_random_byte_flips_in_every_state_file_are_detected(tmp_path, name):
    state = tmp_path / "state"
    _train(state, ram_budget="200KiB")
    path = state / name
    assert not _detected(state)
    rng = random.Random(name)
    size = path.stat().st_size
    offsets = sorted({rng.randrange(size) for _ in range(25)} | {0, size - 1})
    for offset in offsets:
        old = _flip(path, offset)
        assert _detected(state), f"flip at byte {offset} of {name} went unnoticed"
        _restore(path, offset, old)
    assert not _detected(state)


def _committed_offset(state: Path, rng: random.Random) -> tuple[Path, int, int]:
    manifest = json.loads((state / "manifest.json").read_text())
    with StateReader(state) as reader:
        shard = rng.randrange(len(reader.layout.shards))
        start = sum(reader.layout.shard_nbytes(s) for s in reader.layout.shards[:shard])
        nbytes = reader.layout.shard_nbytes(shard)
    rec = manifest["shards"][shard]
    return state / f"shards.{rec['copy']}.bin", start + rng.randrange(nbytes), shard


@pytest.mark.parametrize("budget", [None, "100KiB"])
def test_corrupt_committed_shard_stops_training_before_use(tmp_path, budget):
    state = tmp_path / "state"
    _train(state, ram_budget=budget)
    manifest_before = (state / "manifest.json").read_bytes()
    path, offset, shard = _committed_offset(state, random.Random(7))
    _flip(path, offset)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    with pytest.raises(CorruptStateError, match=rf"shard {shard} in .*{path.name}"):
        opt = TieredAdamW(params, lr=1e-2, state_dir=str(state), ram_budget=budget, resume=True)
        try:
            for p in params:
                p.grad = torch.ones(p.shape)
            opt.step()
        finally:
            opt.close()
    # Nothing was trained on the corrupt bytes and the commit record is unchanged.
    assert (state / "manifest.json").read_bytes() == manifest_before


def test_verify_names_shard_and_file(tmp_path):
    state = tmp_path / "state"
    _train(state, ram_budget="100KiB")
    path, offset, shard = _committed_offset(state, random.Random(3))
    _flip(path, offset)
    with StateReader(state) as reader:
        problems = reader.verify()
    assert [(p.shard, Path(p.file).name, p.severity) for p in problems] == [(shard, path.name, "error")]


def test_flip_in_non_durable_disk_shard_is_detected_on_resume(tmp_path):
    state = tmp_path / "state"
    _train(state, ram_budget="100KiB", durable=False)
    path, offset, shard = _committed_offset(state, random.Random(11))
    _flip(path, offset)
    assert _detected(state)
