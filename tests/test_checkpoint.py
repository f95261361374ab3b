"""Streaming zarr checkpoints and torch state-dict conversions (issue 3, point 5).

A checkpoint saved by one optimizer and loaded by a fresh one (other RAM
budget, backend and shard size) continues training bitwise equal to
``torch.optim.AdamW(fused=True)`` run without interruption; the arrays are
readable with plain ``zarr``; conversions to and from torch AdamW state
dicts continue bitwise too; bad inputs raise the documented errors.
"""

from __future__ import annotations

import errno
import json
import os
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore.checkpoint._writer as ckwriter
from tierstore import (
    ConfigError,
    CorruptStateError,
    DiskFullError,
    FormatVersionError,
    LayoutMismatchError,
    StepFailedError,
    TieredAdamW,
)
from tierstore._layout.layout import Layout
from tierstore._storage.chunkfile import ChunkFiles
from tierstore.checkpoint import (
    FORMAT_VERSION,
    CheckpointExistsError,
    checkpoint_to_state_dict,
    export_statedir,
    load_checkpoint,
    save_checkpoint,
    state_dict_to_checkpoint,
    statedir_to_state_dict,
    verify_checkpoint,
)

# -- a small model, its reference, and training ------------------------------------


@dataclass(frozen=True)
class Model:
    """Two param groups (a frozen parameter in the first), shapes that span shards."""

    dtype: torch.dtype = torch.float32
    amsgrad: bool = False

    shapes = ((70, 130), (33,), (5000,), (4, 4, 9))
    group_of = (0, 0, 1, 1)
    state_index = (0, 1, 3, 4)  # in state dicts; index 2 is the frozen parameter

    def params(self, seed: int) -> tuple[list[torch.nn.Parameter], torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(self.dtype)) for s in self.shapes]
        frozen = torch.nn.Parameter(torch.randn(6, generator=gen), requires_grad=False)
        return params, frozen

    def groups(self, params: list, frozen: torch.Tensor | None, *, lr: float = 1e-2) -> list[dict]:
        first = [p for p, g in zip(params, self.group_of) if g == 0]
        second = [p for p, g in zip(params, self.group_of) if g == 1]
        return [
            {"params": first + ([frozen] if frozen is not None else []), "lr": lr, "weight_decay": 0.1},
            {"params": second, "lr": lr * 3, "betas": (0.8, 0.99), "weight_decay": 0.0, "amsgrad": self.amsgrad},
        ]

    def reference(self, params: list) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
        """fp32 copies under torch.optim.AdamW(fused=True): the uninterrupted run."""
        ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        frozen = torch.nn.Parameter(torch.zeros(6), requires_grad=False)
        return ref, torch.optim.AdamW(self.groups(ref, frozen), fused=True)


def grads(step: int, params: list, skip: int | None = None) -> None:
    """Deterministic gradients for ``step`` (parameter ``skip`` gets none)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        p.grad = None if i == skip else g.to(p.dtype)


def train(opt: torch.optim.Optimizer, params: list, steps: range, *, ref: tuple | None = None, skip_first: int | None = None) -> None:
    for step in steps:
        grads(step, params, skip=skip_first if step == 0 else None)
        opt.step()
        if ref is not None:
            ref_params, ref_opt = ref
            for p, r in zip(params, ref_params):
                r.grad = None if p.grad is None else p.grad.float()
            ref_opt.step()


def assert_matches_reference(opt: TieredAdamW, params: list, ref_params: list, ref_opt: torch.optim.AdamW) -> None:
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    for i, p, r in zip(Model.state_index, params, ref_params):
        ours = sd["state"][i]
        theirs = ref_sd["state"][i]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[key], theirs[key]), (i, key)
        assert float(ours["step"]) == float(theirs["step"])
        if p.dtype == torch.float32 and "master_param" not in ours:
            assert torch.equal(p.detach(), r.detach()), i
        else:
            assert torch.equal(ours["master_param"], r.detach()), i
            assert torch.equal(p.detach(), r.detach().to(p.dtype)), i


# -- round trips ----------------------------------------------------------------


ROUND_TRIPS = [
    # (model, save config, load config, checksum)
    pytest.param(
        Model(),
        dict(ram_budget="160KiB", backend="direct", shard_numel=4096),
        dict(ram_budget=None, backend="auto", shard_numel=8192),
        "xxh3",
        id="fp32-disk-to-ram-bigger-shards",
    ),
    pytest.param(
        Model(dtype=torch.bfloat16),
        dict(ram_budget=None, shard_numel=8192),
        dict(ram_budget="200KiB", backend="buffered", shard_numel=2048),
        "crc32c",
        id="bf16-master-ram-to-disk-smaller-shards",
    ),
    pytest.param(
        Model(amsgrad=True),
        dict(ram_budget="300KiB", backend="mmap", shard_numel=3072),
        dict(ram_budget="300KiB", backend="direct", shard_numel=5120),
        None,
        id="amsgrad-mmap-to-direct-unaligned-shards",
    ),
]


@pytest.mark.parametrize("model, save_cfg, load_cfg, checksum", ROUND_TRIPS)
def test_round_trip_continues_bitwise(tmp_path: Path, model: Model, save_cfg: dict, load_cfg: dict, checksum: str | None) -> None:
    params, frozen = model.params(seed=1)
    ref = model.reference(params)
    with TieredAdamW(model.groups(params, frozen), state_dir=tmp_path / "a", **save_cfg) as opt:
        train(opt, params, range(3), ref=ref, skip_first=1)
        save_checkpoint(opt, tmp_path / "ckpt.zarr", checksum=checksum)
    if model.dtype != torch.float32:
        # Fresh parameters with other values: the checkpoint's masters must restore them.
        params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    with TieredAdamW(model.groups(params, frozen, lr=0.5), state_dir=tmp_path / "b", **load_cfg) as opt:
        opt.load_checkpoint(tmp_path / "ckpt.zarr")
        assert opt.step_count == 3
        assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[1]["betas"] == (0.8, 0.99)
        train(opt, params, range(3, 5), ref=ref)
        assert opt.step_count == 5
        assert_matches_reference(opt, params, *ref)


def test_loaded_state_is_committed_and_resumable(tmp_path: Path) -> None:
    model = Model()
    params, frozen = model.params(seed=2)
    with TieredAdamW(model.groups(params, frozen), shard_numel=4096) as opt:
        train(opt, params, range(2))
        opt.save_checkpoint(tmp_path / "ckpt.zarr")
        expected = opt.state_dict()
    with TieredAdamW(model.groups(params, frozen), state_dir=tmp_path / "s", ram_budget="200KiB", shard_numel=4096) as opt:
        load_checkpoint(opt, tmp_path / "ckpt.zarr")
    with TieredAdamW(model.groups(params, frozen), state_dir=tmp_path / "s", resume=True) as opt:
        assert opt.step_count == 2
        got = opt.state_dict()
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


def test_readable_with_plain_zarr(tmp_path: Path) -> None:
    model = Model(dtype=torch.bfloat16, amsgrad=True)
    params, frozen = model.params(seed=3)
    with TieredAdamW(model.groups(params, frozen), ram_budget="160KiB", shard_numel=2048) as opt:
        train(opt, params, range(2))
        opt.save_checkpoint(tmp_path / "ckpt.zarr")
        sd = opt.state_dict()
        layout = opt.layout
    g = zarr.open_group(str(tmp_path / "ckpt.zarr"), mode="r")
    attrs = g.attrs.asdict()
    assert attrs["format"] == "tierstore-checkpoint" and attrs["format_version"] == 1
    assert attrs["layout"] == json.loads(json.dumps(layout.to_dict()))
    assert attrs["fingerprint"] == layout.fingerprint and attrs["step_count"] == 2
    assert sorted(attrs["arrays"]) == ["exp_avg", "exp_avg_sq", "master_param", "max_exp_avg_sq"]
    assert attrs["param_steps"] == [2.0, 2.0, None, 2.0, 2.0]
    assert [grp["lr"] for grp in attrs["param_groups"]] == [1e-2, 3e-2]
    for name in attrs["arrays"]:
        assert g[name].shape == (layout.total_numel,) and g[name].chunks == (layout.shard_numel,)
        assert g[name].dtype == np.float32
    for entry in attrs["params"]:
        if not entry["trainable"]:
            assert entry["start"] == -1 and entry["shape"] == [6]
            continue
        start, numel, shape = entry["start"], entry["numel"], tuple(entry["shape"])
        state = sd["state"][entry["index"]]
        for name, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("master_param", "master_param")):
            plain = torch.from_numpy(g[name][start : start + numel].reshape(shape))
            assert torch.equal(plain, state[key]), (entry["index"], name)
        if entry["group"] == 1:
            plain = torch.from_numpy(g["max_exp_avg_sq"][start : start + numel].reshape(shape))
            assert torch.equal(plain, state["max_exp_avg_sq"])


@settings(max_examples=40)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    frozen=st.lists(st.booleans(), min_size=8, max_size=8),
    shard_a=st.integers(1, 20000),
    shard_b=st.integers(1, 20000),
)
def test_param_starts_do_not_depend_on_shard_numel(sizes: list[int], frozen: list[bool], shard_a: int, shard_b: int) -> None:
    tensors = [torch.empty(n, device="meta").requires_grad_(not f) for n, f in zip(sizes, frozen)]
    a = Layout.build([tensors], shard_numel=shard_a, fields=("exp_avg",))
    b = Layout.build([tensors], shard_numel=shard_b, fields=("exp_avg", "master"))
    assert [p.start for p in a.params] == [p.start for p in b.params]
    assert a.total_numel == b.total_numel


# -- memory: one shard at a time ---------------------------------------------------


def test_save_streams_one_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(1 << 20, generator=gen))]  # 12 MiB of state in 16 shards
    with TieredAdamW(params, state_dir=tmp_path / "s", ram_budget="4MiB", shard_numel=1 << 16) as opt:
        grads(0, params)
        opt.step()
        visits: list[int] = []
        real = opt.visit_stored

        def spy(visit, shards=None):
            def counted(shard, flat):
                visits.append(shard.index)
                return visit(shard, flat)

            return real(counted, shards)

        monkeypatch.setattr(opt, "visit_stored", spy)
        monkeypatch.setattr(opt, "state_dict", lambda: pytest.fail("save must not materialise the state"))
        chunk_bytes = (1 << 16) * 4
        tracemalloc.start()
        try:
            save_checkpoint(opt, tmp_path / "ckpt.zarr")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert sorted(visits) == list(range(len(opt.layout.shards)))
        # numpy/zarr buffers are traced: a few chunks at most, against 48 chunks of state.
        assert peak < 6 * chunk_bytes, peak


# -- torch state dicts -----------------------------------------------------------


@pytest.mark.parametrize("source", ["checkpoint", "state_dir"])
def test_to_torch_state_dict_continues_bitwise(tmp_path: Path, source: str) -> None:
    model = Model(amsgrad=True)
    params, frozen = model.params(seed=5)
    ref = model.reference(params)
    with TieredAdamW(model.groups(params, frozen), state_dir=tmp_path / "s", ram_budget="300KiB", shard_numel=4096) as opt:
        train(opt, params, range(3), ref=ref, skip_first=0)
        opt.save_checkpoint(tmp_path / "ckpt.zarr")
    sd = checkpoint_to_state_dict(tmp_path / "ckpt.zarr") if source == "checkpoint" else statedir_to_state_dict(tmp_path / "s")
    assert sorted(sd["state"]) == [0, 1, 3, 4]  # the frozen parameter (index 2) has no state
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3, 4]]
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(model.groups(resumed, torch.nn.Parameter(torch.zeros(6), requires_grad=False)), fused=True)
    torch_opt.load_state_dict(sd)
    train(torch_opt, resumed, range(3, 5), ref=ref)
    for a, b in zip(resumed, ref[0]):
        assert torch.equal(a.detach(), b.detach())
    ours, theirs = torch_opt.state_dict()["state"], ref[1].state_dict()["state"]
    for i in theirs:
        assert sorted(ours[i]) == sorted(theirs[i])  # max_exp_avg_sq in the amsgrad group only
        for key in theirs[i]:
            assert torch.equal(ours[i][key], theirs[i][key]), (i, key)


@pytest.mark.parametrize("give_params", [True, False])
def test_from_torch_state_dict_continues_bitwise(tmp_path: Path, give_params: bool) -> None:
    model = Model()
    params, frozen = model.params(seed=6)
    ref = model.reference(params)
    train(ref[1], ref[0], range(3))
    state_dict_to_checkpoint(
        ref[1].state_dict(),
        tmp_path / "ckpt.zarr",
        shard_numel=2048,
        params=[p for g in model.groups(ref[0], frozen) for p in g["params"]] if give_params else None,
    )
    mine = [torch.nn.Parameter(r.detach().clone()) for r in ref[0]]
    with TieredAdamW(model.groups(mine, frozen, lr=0.7), ram_budget="200KiB", shard_numel=4096) as opt:
        opt.load_checkpoint(tmp_path / "ckpt.zarr")
        assert opt.step_count == 3 and opt.param_groups[1]["lr"] == 3e-2
        train(opt, mine, range(3, 5), ref=ref)
        assert_matches_reference(opt, mine, *ref)


def test_from_torch_without_params_needs_them_for_stateless_trainable(tmp_path: Path) -> None:
    model = Model()
    params, frozen = model.params(seed=7)
    ref = model.reference(params)
    train(ref[1], ref[0], range(1), skip_first=0)  # parameter 0 never got a gradient: no state
    sd = ref[1].state_dict()
    state_dict_to_checkpoint(sd, tmp_path / "bare.zarr")
    with TieredAdamW(model.groups(params, frozen)) as opt, pytest.raises(LayoutMismatchError, match=r"parameter 0 .*unknown.*params="):
        opt.load_checkpoint(tmp_path / "bare.zarr")
    state_dict_to_checkpoint(sd, tmp_path / "full.zarr", params=[p for g in model.groups(ref[0], frozen) for p in g["params"]])
    mine = [torch.nn.Parameter(r.detach().clone()) for r in ref[0]]
    with TieredAdamW(model.groups(mine, frozen), shard_numel=4096) as opt:
        opt.load_checkpoint(tmp_path / "full.zarr")
        assert 0 not in opt.state_dict()["state"]
        train(opt, mine, range(1, 3), ref=ref)
        assert_matches_reference(opt, mine, *ref)


def test_tiered_state_dict_with_masters_through_a_checkpoint(tmp_path: Path) -> None:
    model = Model(dtype=torch.bfloat16)
    params, frozen = model.params(seed=10)
    ref = model.reference(params)
    with TieredAdamW(model.groups(params, frozen), shard_numel=4096) as opt:
        train(opt, params, range(2), ref=ref)
        state_dict_to_checkpoint(opt.state_dict(), tmp_path / "ckpt.zarr", shard_numel=1024)
    fresh = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    with TieredAdamW(model.groups(fresh, frozen), shard_numel=2048) as opt:
        opt.load_checkpoint(tmp_path / "ckpt.zarr")  # masters restore the bf16 parameters
        train(opt, fresh, range(2, 4), ref=ref)
        assert_matches_reference(opt, fresh, *ref)


# -- export ---------------------------------------------------------------------


def test_export_statedir_equals_save_checkpoint(tmp_path: Path) -> None:
    model = Model(dtype=torch.bfloat16)
    params, frozen = model.params(seed=8)
    with TieredAdamW(model.groups(params, frozen), state_dir=tmp_path / "s", ram_budget="200KiB", shard_numel=4096) as opt:
        train(opt, params, range(2))
        opt.save_checkpoint(tmp_path / "saved.zarr")
    export_statedir(tmp_path / "s", tmp_path / "exported.zarr")
    a = zarr.open_group(str(tmp_path / "saved.zarr"), mode="r")
    b = zarr.open_group(str(tmp_path / "exported.zarr"), mode="r")
    for key in ("layout", "fingerprint", "step_count", "param_steps", "param_groups", "params", "arrays"):
        assert a.attrs[key] == b.attrs[key], key
    for name in a.attrs["arrays"]:
        assert np.array_equal(a[name][:], b[name][:]), name


# -- errors ---------------------------------------------------------------------


def _saved(tmp_path: Path, model: Model = Model(), **save: object) -> Path:
    params, frozen = model.params(seed=9)
    path = tmp_path / "ckpt.zarr"
    with TieredAdamW(model.groups(params, frozen), shard_numel=4096) as opt:
        train(opt, params, range(1))
        save_checkpoint(opt, path, **save)
    return path


def _other_models() -> list:
    m = Model()

    def reshaped():
        params, frozen = m.params(seed=0)
        params[1] = torch.nn.Parameter(torch.zeros(34))
        return m.groups(params, frozen)

    def fewer():
        params, frozen = m.params(seed=0)
        return m.groups(params[:-1], frozen)

    def regrouped():
        params, frozen = m.params(seed=0)
        return [{"params": params + [frozen]}]

    def unfrozen():
        params, frozen = m.params(seed=0)
        frozen.requires_grad_(True)
        return m.groups(params, frozen)

    return [
        pytest.param(reshaped, r"parameter 1 has shape \(33,\).*\(34,\)", id="shape"),
        pytest.param(fewer, r"5 parameters, this optimizer has 4", id="count"),
        pytest.param(regrouped, r"2 param groups, this optimizer has 1", id="groups"),
        pytest.param(unfrozen, r"parameter 2 .*frozen.*in this optimizer", id="frozen"),
    ]


@pytest.mark.parametrize("groups, message", _other_models())
def test_checkpoint_of_another_model_is_refused(tmp_path: Path, groups, message: str) -> None:
    path = _saved(tmp_path)
    with TieredAdamW(groups()) as opt:
        with pytest.raises(LayoutMismatchError, match=message) as info:
            opt.load_checkpoint(path)
        assert "same parameters" in str(info.value)
        opt.step()  # refused before anything changed: the optimizer stays usable


def _set_attr(path: Path, **changes: object) -> None:
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"].update(changes)
    (path / "zarr.json").write_text(json.dumps(meta))


def _flip_chunk(path: Path) -> None:
    chunk = path / "exp_avg" / "c" / "1"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x10
    chunk.write_bytes(data)


BAD_CHECKPOINTS = [
    pytest.param(lambda p: _set_attr(p, format_version=FORMAT_VERSION + 1), FormatVersionError,
                 f"format_version {FORMAT_VERSION + 1}.*Upgrade", id="newer-version"),
    pytest.param(lambda p: _set_attr(p, format="other"), FormatVersionError, "not a tierstore checkpoint", id="other-format"),
    pytest.param(lambda p: (p / "zarr.json").unlink(), CorruptStateError, "no zarr.json", id="no-metadata"),
    pytest.param(lambda p: (p / "exp_avg_sq" / "c" / "0").unlink(), CorruptStateError, "stores 3 of its 4 chunks", id="missing-chunk"),
    pytest.param(lambda p: _set_attr(p, params=[]), CorruptStateError, "parameter index", id="bad-index"),
]


@pytest.mark.parametrize("damage, error, message", BAD_CHECKPOINTS)
def test_bad_checkpoint_is_refused_before_any_change(tmp_path: Path, damage, error: type, message: str) -> None:
    path = _saved(tmp_path)
    damage(path)
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen), shard_numel=4096) as opt:
        with pytest.raises(error, match=message):
            opt.load_checkpoint(path)
        opt.step()


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
def test_corrupt_chunk_is_detected(tmp_path: Path, checksum: str) -> None:
    path = _saved(tmp_path, checksum=checksum)
    _flip_chunk(path)
    with pytest.raises(CorruptStateError, match=r"chunk 1 .*array exp_avg"):
        checkpoint_to_state_dict(path)
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen), shard_numel=4096) as opt:
        with pytest.raises(CorruptStateError, match=r"chunk 1 .*array exp_avg"):
            opt.load_checkpoint(path)
        with pytest.raises(StepFailedError):  # the state was half-replaced: rebuild (resume=True)
            opt.step()


def _chunk_bytes(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("c/*"))}


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c", None])
def test_chunk_files_are_what_zarr_writes_and_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksum: str | None) -> None:
    """tierstore writes chunk files itself (no zarr buffers): byte for byte what zarr writes, edge
    chunk padding and crc32c included, and either reader reads either writer's checkpoint."""
    model = Model(dtype=torch.bfloat16)  # 3 fields; 10_523 elements: the edge chunk is partly padding
    ours = _saved(tmp_path / "ours", model, checksum=checksum)
    with monkeypatch.context() as m:
        m.setattr(ChunkFiles, "of", classmethod(lambda cls, directory, array: None))
        theirs = _saved(tmp_path / "zarr", model, checksum=checksum)  # as tierstore wrote them before
        through_zarr = checkpoint_to_state_dict(ours)
    assert _chunk_bytes(ours) == _chunk_bytes(theirs) and len(_chunk_bytes(ours)) == 3 * 4  # 3 fields x 4 chunks
    direct = checkpoint_to_state_dict(theirs)
    for sd in (through_zarr, direct):
        for i, entry in checkpoint_to_state_dict(ours)["state"].items():
            assert all(torch.equal(sd["state"][i][k], v) for k, v in entry.items() if k != "step")
    g = zarr.open_group(str(ours), mode="r")
    total = g.attrs["total_numel"]
    assert g["exp_avg"][:].shape == (total,) and np.array_equal(g["exp_avg"][:], zarr.open_group(str(theirs), mode="r")["exp_avg"][:])


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_chunk_is_detected_when_read_in_parts(tmp_path: Path, checksum: str, damage: str) -> None:
    """An optimizer with other shard cuts reads chunks partly (streamed through 1 MiB of scratch):
    the whole chunk is still verified."""
    path = _saved(tmp_path, checksum=checksum)
    chunk = path / "exp_avg" / "c" / "1"
    if damage == "flip":
        _flip_chunk(path)
    else:
        chunk.write_bytes(chunk.read_bytes()[:-8])
    params, frozen = Model().params(seed=0)
    with (
        TieredAdamW(Model().groups(params, frozen), shard_numel=3072) as opt,
        pytest.raises(CorruptStateError, match=r"chunk 1 .*array exp_avg.*(checksum|CRC32C|bytes)"),
    ):
        opt.load_checkpoint(path)
    assert any("exp_avg" in p and "chunk 1 " in p for p in verify_checkpoint(path))


def test_amsgrad_checkpoint_needs_amsgrad_optimizer(tmp_path: Path) -> None:
    path = _saved(tmp_path, Model(amsgrad=True))
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen)) as opt, pytest.raises(ConfigError, match="amsgrad=True"):
        opt.load_checkpoint(path)


def test_overwrite_rules(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen)) as opt:
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            opt.save_checkpoint(path)
        opt.save_checkpoint(path, overwrite=True)
        assert zarr.open_group(str(path), mode="r").attrs["step_count"] == 0
        other = tmp_path / "precious"
        other.mkdir()
        (other / "keep.txt").write_text("mine")
        with pytest.raises(CheckpointExistsError, match="not a tierstore checkpoint"):
            opt.save_checkpoint(other, overwrite=True)
        assert (other / "keep.txt").read_text() == "mine"
        with pytest.raises(ConfigError, match="checksum='md5'"):
            opt.save_checkpoint(tmp_path / "x.zarr", checksum="md5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.zarr", "precious"]


def test_failed_save_leaves_nothing_and_the_optimizer_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _saved(tmp_path)
    before = (path / "zarr.json").read_bytes()
    real = ckwriter.CheckpointWriter.write
    calls = []

    def failing(self, shard, field, data):
        calls.append(shard.index)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, shard, field, data)

    monkeypatch.setattr(ckwriter.CheckpointWriter, "write", failing)
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen), state_dir=tmp_path / "s", ram_budget="200KiB", shard_numel=4096) as opt:
        with pytest.raises(OSError, match="No space"):
            opt.save_checkpoint(path, overwrite=True)
        assert (path / "zarr.json").read_bytes() == before  # the old checkpoint is intact
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.zarr", "s"]  # no partial directory left
        grads(0, params)
        opt.step()


def test_disk_full_is_disk_full_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckwriter, "_write_chunk_file", full)  # where chunk files are written (not through zarr)
    params, frozen = Model().params(seed=0)
    with TieredAdamW(Model().groups(params, frozen)) as opt, pytest.raises(DiskFullError, match="free space"):
        opt.save_checkpoint(tmp_path / "ckpt.zarr")
    assert os.listdir(tmp_path) == []


BAD_STATE_DICTS = [
    pytest.param({"state": {}}, "not a torch optimizer state dict", id="no-groups"),
    pytest.param({"state": {5: {}}, "param_groups": [{"params": [0]}]}, "parameter ids \\[5\\]", id="unknown-id"),
    pytest.param(
        {"state": {0: {"step": torch.tensor(1.0), "momentum_buffer": torch.zeros(3)}}, "param_groups": [{"params": [0]}]},
        # SGD's key: refused as SGD's state once SGD is registered (tests/test_algorithm_identity.py)
        "lacks \\['exp_avg', 'exp_avg_sq'\\]|is torch.optim.SGD state",
        id="not-adamw",
    ),
]


@pytest.mark.parametrize("state_dict, message", BAD_STATE_DICTS)
def test_bad_state_dicts(tmp_path: Path, state_dict: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        state_dict_to_checkpoint(state_dict, tmp_path / "c.zarr")
    assert not (tmp_path / "c.zarr").exists()


def test_state_dict_params_must_match(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    ref = torch.optim.AdamW([w])
    w.grad = torch.ones(4)
    ref.step()
    with pytest.raises(ConfigError, match="params has 2 tensors"):
        state_dict_to_checkpoint(ref.state_dict(), tmp_path / "c.zarr", params=[w, w])
    with pytest.raises(ConfigError, match="has 4 elements, params\\[0\\] has 5"):
        state_dict_to_checkpoint(ref.state_dict(), tmp_path / "c.zarr", params=[torch.zeros(5, requires_grad=True)])
