"""Hostile checkpoints, layouts, state directories and output paths (issue 21, part 4).

Each case is a crafted or damaged input with the tierstore error it must
raise: nothing hangs, nothing is written outside the output path, nothing
returns memory that was not read from a verified file. A table per kind of
input: layouts (``Layout.from_dict``), checkpoint metadata (zarr
attributes, arrays, chunk files), torch state dicts given to
``state_dict_to_checkpoint``, state directories read offline, and output
paths (``to-torch``, ``export``, checkpoint saves). The command line's side,
with timeouts, is in ``test_cli_exit_codes.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TieredAdamW
from tierstore._layout.layout import MAX_SHARD_NUMEL, Layout
from tierstore._state.manifest_file import manifest_checksum as _manifest_checksum
from tierstore._state.statedir import MANIFEST
from tierstore.checkpoint import (
    checkpoint_to_state_dict,
    export_statedir,
    load_checkpoint,
    state_dict_to_checkpoint,
    statedir_to_state_dict,
    verify_checkpoint,
    write_output_file,
)
from tierstore.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptStateError,
    StateDirError,
)

SHARD = 1024
# What a refusal tells the user to do (every message names one): the fixes tierstore's errors give.
FIX = re.compile(r"write it again|write the checkpoint again|restore|start over|pass |remove|upgrade|choose another", re.I)


def _model(seed: int = 0, *, amsgrad: bool = False) -> tuple[list[dict[str, Any]], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(2500, generator=gen))
    b = torch.nn.Parameter(torch.randn(40, generator=gen))
    frozen = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    groups = [{"params": [w, frozen]}, {"params": [b], "lr": 0.01, "amsgrad": amsgrad}]
    return groups, [w, b]


def _train(opt: TieredAdamW, params: list[torch.nn.Parameter], steps: int = 2) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A state directory and checkpoints (float32, int8) of it, made once; cases damage copies."""
    root = tmp_path_factory.mktemp("hostile")
    groups, params = _model(amsgrad=True)
    with TieredAdamW(groups, state_dir=root / "state", shard_numel=SHARD, amsgrad=True) as opt:
        _train(opt, params)
        opt.save_checkpoint(root / "f32.zarr")
    groups, params = _model()
    with TieredAdamW(groups, shard_numel=SHARD, moment_dtype="int8") as opt:
        _train(opt, params)
        opt.save_checkpoint(root / "int8.zarr")
    return {"state": root / "state", "f32": root / "f32.zarr", "int8": root / "int8.zarr"}


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _ends_within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a daemon thread; the exception it raised (None: it returned). Fails if it hangs."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s: it hangs"
    return outcome[0]


# -- layouts ----------------------------------------------------------------------


def _layout_dict() -> dict[str, Any]:
    w = torch.zeros(3000, requires_grad=True)
    b = torch.zeros(10, requires_grad=True)
    frozen = torch.zeros(4, dtype=torch.int64)
    return Layout.build([[w, frozen], [b]], shard_numel=2048, fields=("exp_avg", "exp_avg_sq")).to_dict()


def _edit(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``data[a][b]...`` (a dotted path, integers index lists); the value ``KeyError`` deletes."""

    def edit(data: dict[str, Any]) -> None:
        *parents, last = (int(k) if k.isdigit() else k for k in path.split("."))
        target = data
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value

    return edit


LAYOUTS = [
    pytest.param(_edit("layout_version", True), "layout_version True", id="version-bool"),
    pytest.param(_edit("shard_numel", True), "shard_numel=True must be an int, not bool", id="shard-bool"),
    pytest.param(_edit("shard_numel", 2048.0), "shard_numel=2048.0 must be an int, not float", id="shard-float"),
    pytest.param(_edit("shard_numel", 0), r"shard_numel=0 is outside", id="shard-zero"),
    pytest.param(_edit("shard_numel", 1 << 62), r"shard_numel=\d+ is outside", id="shard-huge"),
    pytest.param(_edit("shard_numel", 2000), "not a multiple of 1024", id="shard-unaligned"),
    pytest.param(_edit("fields", []), r"fields=\[\] lack \['exp_avg', 'exp_avg_sq'\], which this algorithm's state always holds", id="fields-empty"),
    pytest.param(_edit("fields", ["exp_avg_sq", "exp_avg"]), "in that order", id="fields-order"),
    pytest.param(_edit("fields", ["exp_avg", "exp_avg"]), "distinct", id="fields-duplicate"),
    pytest.param(_edit("fields", ["exp_avg", "momentum"]), "distinct names", id="fields-unknown"),
    pytest.param(_edit("moment_dtype", "fp8"), "moment_dtype='fp8'", id="format-unknown"),
    pytest.param(_edit("extra", 1), "unknown keys", id="unknown-key"),
    pytest.param(_edit("params", {}), "params must be a list", id="params-dict"),
    pytest.param(_edit("params.0", [1, 2]), r"params\[0\] has list", id="entry-list"),
    pytest.param(_edit("params.0.start", KeyError), r"params\[0\] has \[", id="entry-missing-key"),
    pytest.param(_edit("params.0.owner", "x"), r"params\[0\] has \[", id="entry-extra-key"),
    pytest.param(_edit("params.1.index", 0), r"params\[1\] index=0 is outside \[1, 1\]", id="index"),
    pytest.param(_edit("params.2.group", 0.0), r"group=0.0 must be an int", id="group-float"),
    pytest.param(_edit("params.1.group", 1), None, id="group-ok"),  # groups may move on early: valid
    pytest.param(_edit("params.0.group", -1), r"group=-1 is outside", id="group-negative"),
    pytest.param(_edit("params.0.shape", [-3000]), r"shape=\[-3000\]", id="shape-negative"),
    pytest.param(_edit("params.0.shape", [3000.0]), r"shape=\[3000.0\]", id="shape-float"),
    pytest.param(_edit("params.0.shape", [1] * 65), "at most 64", id="shape-ndim"),
    pytest.param(_edit("params.0.numel", 2999), "not the product of its shape", id="numel-mismatch"),
    pytest.param(_edit("params.1.numel", 0), "not the product of its shape", id="numel-zero-frozen"),
    pytest.param(_edit("params.0.numel", 3000.0), "not the product of its shape", id="numel-float"),
    pytest.param(_edit("params.0.dtype", "float99"), "dtype='float99'", id="dtype-unknown"),
    pytest.param(_edit("params.0.dtype", "float"), "dtype='float'", id="dtype-alias"),
    pytest.param(_edit("params.0.dtype", "Tensor"), "dtype='Tensor'", id="dtype-not-a-dtype"),
    pytest.param(_edit("params.1.trainable", True), "trainable but has 4 elements of int64", id="trainable-int"),
    pytest.param(_edit("params.0.trainable", 1), "trainable=1 must be true or false", id="trainable-int-flag"),
    pytest.param(_edit("params.2.start", 2944), r"start=2944 is outside \[3008, 3008\]", id="start-overlap"),
    pytest.param(_edit("params.2.start", 3072), r"start=3072 is outside", id="start-gap"),
    pytest.param(_edit("params.2.start", 3010), r"start=3010 is outside", id="start-unaligned"),
    pytest.param(_edit("params.2.start", -1), r"start=-1 is outside", id="start-trainable-none"),
    pytest.param(_edit("params.1.start", 3008), r"start=3008 is outside \[-1, -1\]", id="start-frozen"),
]


@pytest.mark.parametrize("edit, message", LAYOUTS)
def test_crafted_layout_is_refused(edit: Callable[[dict[str, Any]], None], message: str | None) -> None:
    data = _layout_dict()
    edit(data)
    if message is None:
        assert Layout.from_dict(data).trainable_numel == 3010
        return
    with pytest.raises(ConfigError, match=message):
        Layout.from_dict(data)


@pytest.mark.parametrize("shape", [[1 << 40], [1 << 30, 1 << 30]])
def test_huge_geometry_is_refused_at_once(shape: list[int]) -> None:
    """A parameter of 2**40 elements in 1024-element shards would cut 2**30 shards: refused, not looped."""
    data = _layout_dict()
    data["shard_numel"] = 1024
    data["params"] = [{**data["params"][0], "shape": shape, "numel": math.prod(shape)}]
    error = _ends_within(5, lambda: Layout.from_dict(data))
    assert isinstance(error, ConfigError) and "shards, more than" in str(error)


def test_build_refuses_what_from_dict_would_refuse() -> None:
    with pytest.raises(ConfigError, match="above the largest shard"):
        Layout.build([[torch.zeros(4, requires_grad=True)]], shard_numel=MAX_SHARD_NUMEL + 1, fields=("exp_avg",))


# -- checkpoints -----------------------------------------------------------------


def _meta(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _fingerprint(layout: dict[str, Any]) -> str:
    """What Layout.fingerprint computes, without checking the layout (a crafter need not)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def _attrs(**changes: Any) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        meta = _meta(ck / "zarr.json")
        meta["attributes"].update(changes)
        (ck / "zarr.json").write_text(json.dumps(meta))

    return damage


def _attr_edit(path: str, value: Any) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        meta = _meta(ck / "zarr.json")
        _edit(path, value)(meta["attributes"])
        (ck / "zarr.json").write_text(json.dumps(meta))

    return damage


def _layout_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Change the checkpoint's layout and give it a matching fingerprint (what a crafter would do)."""

    def damage(ck: Path) -> None:
        meta = _meta(ck / "zarr.json")
        attrs = meta["attributes"]
        edit(attrs["layout"])
        attrs["fingerprint"] = _fingerprint(attrs["layout"])
        (ck / "zarr.json").write_text(json.dumps(meta))

    return damage


def _array_meta(name: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        path = ck / name / "zarr.json"
        meta = _meta(path)
        edit(meta)
        path.write_text(json.dumps(meta))

    return damage


def _replace(rel: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(ck: Path) -> None:
        path = ck / rel
        path.unlink()
        make(path)

    return damage


def _drop_exp_avg_sq(ck: Path) -> None:
    """A layout without exp_avg_sq, its fingerprint and array list made to match."""
    _layout_edit(_edit("fields", ["exp_avg", "max_exp_avg_sq"]))(ck)
    _attrs(arrays=["exp_avg", "max_exp_avg_sq"])(ck)


def _set_block(meta: dict[str, Any]) -> None:
    meta["attributes"]["block_numel"] = 128


def _shift_map(meta: dict[str, Any]) -> None:
    meta["attributes"]["map"] = meta["attributes"]["map"][1:] + [0.0]


def _gzip(meta: dict[str, Any]) -> None:
    meta["codecs"].append({"name": "gzip", "configuration": {"level": 1}})


def _scale_chunks(meta: dict[str, Any]) -> None:
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [8]


def _chunks(numel: int) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [numel]

    return edit


def _params_swapped(ck: Path) -> None:
    """The parameter index moved by one: moments would load onto other parameters."""
    meta = _meta(ck / "zarr.json")
    index = meta["attributes"]["params"]
    index[0]["start"], index[2]["start"] = index[2]["start"], index[0]["start"]
    (ck / "zarr.json").write_text(json.dumps(meta))


def _big_zarr_json(ck: Path) -> None:
    os.truncate(ck / "exp_avg" / "zarr.json", 300 << 20)  # sparse: costs nothing to make


CHECKPOINTS = [
    # Metadata that would have been trusted: each names the key and what was expected.
    pytest.param("f32", _attrs(arrays=["exp_avg", "max_exp_avg_sq"]), r"missing \['exp_avg_sq'\].*never read as zeros", id="array-list-lacks-exp_avg_sq"),
    # The layout itself is refused (Layout.from_dict: a field its algorithm always holds is missing).
    pytest.param("f32", _drop_exp_avg_sq, r"lack \['exp_avg_sq'\], which this algorithm's state always holds", id="layout-lacks-exp_avg_sq"),
    pytest.param("f32", _attrs(arrays=["exp_avg", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]), "lists arrays", id="array-list-duplicate"),
    pytest.param("f32", _attrs(step_count=-1), r"step_count=-1", id="step-count-negative"),
    pytest.param("f32", _attrs(step_count=2.5), r"step_count=2.5", id="step-count-float"),
    pytest.param("f32", _attrs(step_count=True), r"step_count=True", id="step-count-bool"),
    pytest.param("f32", _attr_edit("param_steps.0", -2.0), r"param_steps\[0\]=-2.0", id="param-step-negative"),
    pytest.param("f32", _attr_edit("param_steps.0", float("nan")), r"param_steps\[0\]=nan", id="param-step-nan"),
    pytest.param("f32", _attr_edit("param_steps.0", 1.5), r"param_steps\[0\]=1.5", id="param-step-fraction"),
    pytest.param("f32", _attr_edit("param_steps.0", "2"), r"param_steps\[0\]='2'", id="param-step-string"),
    pytest.param("f32", _attrs(param_steps=[2.0]), "1 param_steps for the 3 parameters", id="param-steps-short"),
    pytest.param("f32", _attr_edit("param_groups.0.lr", -0.1), "Invalid learning rate: -0.1", id="lr-negative"),
    pytest.param("f32", _attr_edit("param_groups.0.lr", float("nan")), "Invalid learning rate: nan", id="lr-nan"),
    pytest.param("f32", _attr_edit("param_groups.0.lr", "0.1"), "lr='0.1'", id="lr-string"),
    pytest.param("f32", _attr_edit("param_groups.0.betas", [1.0, 0.999]), "beta parameter at index 0", id="beta-one"),
    pytest.param("f32", _attr_edit("param_groups.0.betas", [0.9]), "pair of numbers", id="betas-single"),
    pytest.param("f32", _attr_edit("param_groups.0.eps", -1e-8), "Invalid epsilon", id="eps-negative"),
    pytest.param("f32", _attr_edit("param_groups.0.weight_decay", None), "weight_decay=None", id="decay-null"),
    pytest.param("f32", _attr_edit("param_groups.0.amsgrad", "yes"), "amsgrad='yes'", id="amsgrad-string"),
    pytest.param("f32", _attrs(param_groups=[{"lr": 0.1, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}]), "1 param_groups; its parameters name 2", id="groups-short"),
    pytest.param("int8", _attr_edit("param_groups.1.amsgrad", True), "uses amsgrad but the state has no max_exp_avg_sq", id="amsgrad-without-field"),
    pytest.param("f32", _attrs(checksum="md5"), "checksum='md5'", id="checksum-unknown"),
    pytest.param("f32", _attrs(total_numel=1 << 40), "total_numel", id="total-numel"),
    pytest.param("f32", _attrs(shard_numel=2048), "shard_numel=2048", id="shard-numel-attr"),
    # The parameter index against the layout.
    pytest.param("f32", _params_swapped, r"parameter 0 in the index .* has start=", id="index-shifted"),
    pytest.param("f32", _attr_edit("params.0.group", False), "has group=False", id="index-group-bool"),
    pytest.param("f32", _attr_edit("params.1.shape", [9]), r"has shape=\[9\]", id="index-shape"),
    pytest.param("f32", _attr_edit("params.0.has_master", True), "keeps no master", id="index-master"),
    # A crafted layout behind a matching fingerprint.
    pytest.param("f32", _layout_edit(_edit("params.1.numel", 0)), "not the product of its shape", id="layout-numel-zero"),
    pytest.param("f32", _attr_edit("layout.shard_numel", 1 << 62), "no readable layout", id="layout-huge-shard"),
    # int8: the decoder must not trust what differs from the format.
    pytest.param("int8", _array_meta("exp_avg", _set_block), "block_numel=128 where its format needs 256", id="int8-block"),
    pytest.param("int8", _array_meta("exp_avg", _shift_map), "attribute map=", id="int8-map"),
    pytest.param("int8", _array_meta("exp_avg_scales", _scale_chunks), r"in chunks of \(8,\)", id="int8-scale-chunks"),
    # The codes array's own chunking: 768 is neither the shard size nor a multiple of the 256-element
    # block; 512 is a multiple of the block, but not the shard (a chunk would straddle two shards' codes).
    pytest.param("int8", _array_meta("exp_avg", _chunks(768)), r"in chunks of \(768,\).*needs .* in chunks of \(1024,\)", id="int8-codes-chunks-768"),
    pytest.param("int8", _array_meta("exp_avg_sq", _chunks(512)), r"in chunks of \(512,\).*needs .* in chunks of \(1024,\)", id="int8-codes-chunks-512"),
    pytest.param("int8", _attrs(moment_dtype="bfloat16"), "moment_dtype='bfloat16'", id="int8-format-attr"),
    pytest.param("int8", _attrs(format_version=1), "format_version 1", id="int8-version-1"),
    pytest.param("f32", _array_meta("exp_avg", _gzip), "GzipCodec", id="codec-gzip"),
    pytest.param("f32", _array_meta("exp_avg", lambda m: m["attributes"].update(chunk_checksums=[1, 2, 3])), "chunk checksums", id="checksums-malformed"),
    # Files that are not regular files: refused before zarr opens anything (no hang, no link followed).
    pytest.param("f32", _replace("exp_avg/c/1", lambda p: os.mkfifo(p)), "exp_avg/c/1 is a FIFO", id="chunk-fifo"),
    pytest.param("f32", _replace("exp_avg/c/1", lambda p: p.symlink_to("/dev/zero")), "is a symbolic link", id="chunk-dev-zero-link"),
    pytest.param("f32", _replace("zarr.json", lambda p: os.mkfifo(p)), "zarr.json is a FIFO", id="zarr-json-fifo"),
    pytest.param("int8", _replace("exp_avg/zarr.json", lambda p: p.symlink_to("../exp_avg_sq/zarr.json")), "is a symbolic link", id="array-meta-link"),
    pytest.param("f32", _big_zarr_json, "more than the", id="zarr-json-huge"),
]


@pytest.mark.parametrize("source, damage, message", CHECKPOINTS)
def test_crafted_checkpoint_is_refused_by_every_reader(
    sources: dict[str, Path], tmp_path: Path, source: str, damage: Callable[[Path], None], message: str
) -> None:
    ck = _copy(sources[source], tmp_path)
    damage(ck)
    for read in (checkpoint_to_state_dict, verify_checkpoint):
        error = _ends_within(10, lambda read=read: read(ck))
        assert isinstance(error, CorruptStateError), (read.__name__, error)
        assert re.search(message, str(error)), (read.__name__, str(error))
        assert str(ck) in str(error) and FIX.search(str(error)), f"no path or no fix in {str(error)!r}"
    groups, _ = _model(amsgrad=source == "f32")
    with TieredAdamW(groups, shard_numel=SHARD, amsgrad=source == "f32") as opt:
        error = _ends_within(10, lambda: load_checkpoint(opt, ck))
        assert isinstance(error, CorruptStateError), error
        assert str(ck) in str(error) and FIX.search(str(error)), f"no path or no fix in {str(error)!r}"
        opt.step()  # refused before any change: the optimizer is still usable


def test_chunk_of_the_wrong_size_is_reported_per_chunk(sources: dict[str, Path], tmp_path: Path) -> None:
    """Read through zarr (int8 codes), a chunk file is checked before zarr reads it whole."""
    ck = _copy(sources["int8"], tmp_path)
    os.truncate(ck / "exp_avg" / "c" / "1", 1 << 30)  # sparse 1 GiB: would be read into RAM whole
    problems = verify_checkpoint(ck)
    assert len(problems) == 1 and "holds 1073741824 bytes, a chunk is 1024" in problems[0]


def test_missing_moment_is_never_zeros(sources: dict[str, Path], tmp_path: Path) -> None:
    """The old reader filled a field the checkpoint did not list with zeros."""
    ck = _copy(sources["f32"], tmp_path)
    _attrs(arrays=["exp_avg", "max_exp_avg_sq"])(ck)
    shutil.rmtree(ck / "exp_avg_sq")
    with pytest.raises(CorruptStateError, match="never read as zeros"):
        checkpoint_to_state_dict(ck)


def test_checkpoint_without_amsgrad_loads_into_amsgrad_as_torch_does(sources: dict[str, Path]) -> None:
    """max_exp_avg_sq may be absent only from a checkpoint whose groups do not use amsgrad: the
    groups come back without it (as torch's load_state_dict restores them) and the field is zeros."""
    groups, _ = _model(amsgrad=True)
    with TieredAdamW(groups, shard_numel=SHARD, amsgrad=True, moment_dtype="int8") as opt:
        opt.load_checkpoint(sources["int8"])
        assert [g["amsgrad"] for g in opt.param_groups] == [False, False]
        state = opt.state_dict()["state"]
        assert all("max_exp_avg_sq" not in entry for entry in state.values())  # as torch lists it
        assert opt.step_count == 2


# -- torch state dicts given to state_dict_to_checkpoint ---------------------------------


def _torch_state_dict(*, amsgrad: bool = False) -> dict[str, Any]:
    w = torch.nn.Parameter(torch.ones(10))
    ref = torch.optim.AdamW([w], amsgrad=amsgrad)
    w.grad = torch.ones(10)
    ref.step()
    return ref.state_dict()


def _sd_edit(key: str, value: Any, *, amsgrad: bool = False) -> dict[str, Any]:
    sd = _torch_state_dict(amsgrad=amsgrad)
    if value is KeyError:
        del sd["state"][0][key]
    else:
        sd["state"][0][key] = value
    return sd


STATE_DICTS = [
    pytest.param(lambda: _sd_edit("exp_avg_sq", KeyError), r"lacks \['exp_avg_sq'\]; a missing tensor is never written as zeros", id="no-exp_avg_sq"),
    pytest.param(lambda: _sd_edit("max_exp_avg_sq", KeyError, amsgrad=True), r"lacks \['max_exp_avg_sq'\] \(its param group uses amsgrad\)", id="no-max-in-amsgrad"),
    pytest.param(lambda: _sd_edit("step", KeyError), r"lacks \['step'\]", id="no-step"),
    pytest.param(lambda: _sd_edit("step", torch.tensor(-1.0)), "a step is a whole number", id="step-negative"),
    pytest.param(lambda: _sd_edit("step", torch.tensor(float("nan"))), "a step is a whole number", id="step-nan"),
    pytest.param(lambda: _sd_edit("exp_avg_sq", torch.zeros(9)), "has 9 elements, its exp_avg 10", id="size-differs"),
    pytest.param(lambda: _sd_edit("exp_avg", [0.0] * 10), "is list, not a tensor", id="not-a-tensor"),
    pytest.param(lambda: {**_torch_state_dict(), "param_groups": [{**_torch_state_dict()["param_groups"][0], "lr": -1.0}]}, "Invalid learning rate", id="lr-negative"),
]


@pytest.mark.parametrize("make, message", STATE_DICTS)
def test_incomplete_state_dict_is_refused(tmp_path: Path, make: Callable[[], dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        state_dict_to_checkpoint(make(), tmp_path / "ck.zarr", shard_numel=SHARD)
    assert not any(tmp_path.iterdir())  # nothing was left behind


def test_dcp_load_of_a_state_without_exp_avg_sq_is_refused() -> None:
    from tierstore.dcp import TieredStateful

    model = torch.nn.Linear(4, 3)
    with TieredAdamW(model.parameters(), lr=0.1) as opt:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        stateful = TieredStateful(opt, model)
        sd = {
            "state": {fqn: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(p.shape)} for fqn, p in model.named_parameters()},
            "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": ["weight", "bias"]}],
        }
        with pytest.raises(ConfigError, match=r"has a step but no \['exp_avg_sq'\]"):
            stateful.load_state_dict(sd)


# -- state directories read offline ------------------------------------------------------


def _manifest_edit(edit: Callable[[dict[str, Any]], None], *, fingerprint: bool = False) -> Callable[[Path], None]:
    """Rewrite the manifest as a crafter would: edited, with a valid checksum (and fingerprint)."""

    def damage(d: Path) -> None:
        m = json.loads((d / MANIFEST).read_text())
        edit(m)
        if fingerprint:
            m["fingerprint"] = _fingerprint(m["layout"])
        m["manifest_checksum"] = _manifest_checksum(m)
        (d / MANIFEST).write_text(json.dumps(m))

    return damage


def _uninitialised(m: dict[str, Any]) -> None:
    """A frozen parameter that says it has no elements but a shape, and a step: the old reader
    returned a torch.empty tensor of that shape as its state."""
    m["layout"]["params"][1]["numel"] = 0
    m["param_steps"][1] = 2.0


STATE_DIRS = [
    pytest.param(_manifest_edit(_uninitialised, fingerprint=True), "numel", id="empty-memory-as-state"),
    pytest.param(_manifest_edit(lambda m: m["layout"].update(shard_numel=True), fingerprint=True), "shard_numel", id="shard-bool"),
    pytest.param(_manifest_edit(lambda m: m.update(step_count=-3)), "step_count", id="step-negative"),
    pytest.param(_manifest_edit(lambda m: m["param_groups"][0].update(lr=-1.0)), "learning rate|lr", id="lr-negative"),
    pytest.param(_manifest_edit(lambda m: m.update(param_groups=[m["param_groups"][0]])), "param_groups|group", id="groups-short"),
    pytest.param(_replace("shards.0.bin", lambda p: os.mkfifo(p)), "FIFO", id="shard-fifo"),
    pytest.param(_replace(MANIFEST, lambda p: os.mkfifo(p)), "FIFO", id="manifest-fifo"),
    pytest.param(_replace("shards.1.bin", lambda p: p.symlink_to("/dev/zero")), "symbolic link", id="shard-link"),
]


@pytest.mark.parametrize("damage, message", STATE_DIRS)
def test_crafted_state_dir_is_refused_by_every_reader(sources: dict[str, Path], tmp_path: Path, damage: Callable[[Path], None], message: str) -> None:
    d = _copy(sources["state"], tmp_path)
    damage(d)
    for read in (statedir_to_state_dict, lambda d: export_statedir(d, tmp_path / "out.zarr")):
        error = _ends_within(10, lambda read=read: read(d))
        assert isinstance(error, CorruptStateError), error
        assert re.search(message, str(error)), str(error)
    assert not (tmp_path / "out.zarr").exists()


def test_reading_a_missing_or_wrong_kind_of_state_dir(tmp_path: Path) -> None:
    with pytest.raises(StateDirError, match="does not exist"):
        statedir_to_state_dict(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDirError, match="is a regular file, not a directory"):
        statedir_to_state_dict(tmp_path / "file")


# -- output paths ------------------------------------------------------------------------


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    return victim


def test_output_file_replaces_only_a_regular_file(tmp_path: Path) -> None:
    out = tmp_path / "sd.pt"
    write_output_file(out, lambda f: f.write(b"one"), overwrite=False)
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        write_output_file(out, lambda f: f.write(b"two"), overwrite=False)
    write_output_file(out, lambda f: f.write(b"two"), overwrite=True)
    assert out.read_bytes() == b"two" and [p.name for p in tmp_path.iterdir()] == ["sd.pt"]


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "device"])
def test_output_file_never_replaces_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "sd.pt"
    victim = _victim(tmp_path)
    if kind == "symlink":
        out.symlink_to(victim)
    elif kind == "directory":
        out.mkdir()
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        try:
            os.mknod(out, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    error = _ends_within(10, lambda: write_output_file(out, lambda f: f.write(b"x"), overwrite=True))
    assert isinstance(error, CheckpointExistsError) and "overwrite replaces only a regular file" in str(error)
    assert victim.read_text() == "keep me" and os.path.lexists(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "sd.pt"]  # no temporary left


def test_planted_partial_link_is_never_written_through(tmp_path: Path) -> None:
    """The old to-torch wrote `.OUT.partial` with torch.save, following a link planted under that name."""
    out = tmp_path / "sd.pt"
    victim = _victim(tmp_path)
    (tmp_path / ".sd.pt.partial").symlink_to(victim)
    write_output_file(out, lambda f: f.write(b"state"), overwrite=False)
    assert out.read_bytes() == b"state" and victim.read_text() == "keep me"
    assert not out.is_symlink()


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
@pytest.mark.parametrize("draws", ["always-that-name", "that-name-first"])
def test_a_link_or_fifo_at_the_temporary_name_itself_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str, draws: str
) -> None:
    """The temporary's random name made known (as if guessed or raced): a link or FIFO planted exactly
    there is neither followed nor waited on (O_CREAT | O_EXCL | O_NOFOLLOW); another name is drawn, and
    when every draw is taken the write ends in a clear error, within 10 s either way."""
    from tierstore.checkpoint import _files

    fixed = "0123456789abcdef"
    names = iter([fixed]) if draws == "that-name-first" else None

    class Drawn:  # stands for the secrets module _files draws names from
        @staticmethod
        def token_hex(nbytes: int) -> str:
            return next(names, os.urandom(nbytes).hex()) if names is not None else fixed

    monkeypatch.setattr(_files, "secrets", Drawn)
    out = tmp_path / "sd.pt"
    tmp = tmp_path / f".sd.pt.{fixed}.partial"  # the name write_output_file draws
    victim = _victim(tmp_path)
    if planted == "symlink":
        tmp.symlink_to(victim)
    else:
        os.mkfifo(tmp)
    error = _ends_within(10, lambda: write_output_file(out, lambda f: f.write(b"state"), overwrite=False))
    assert victim.read_text() == "keep me", "the planted link was written through"
    assert tmp.is_symlink() if planted == "symlink" else stat.S_ISFIFO(os.lstat(tmp).st_mode), "the planted name was replaced"
    if draws == "that-name-first":
        assert error is None and out.read_bytes() == b"state" and not out.is_symlink()
    else:
        assert isinstance(error, StateDirError), error
        assert str(tmp_path) in str(error) and "temporary" in str(error) and FIX.search(str(error)), str(error)
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["elsewhere", tmp.name, *(["sd.pt"] if error is None else [])]
    ), "a temporary was left behind"


def test_output_file_in_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StateDirError, match="existing, writable directory"):
        write_output_file(tmp_path / "no" / "sd.pt", lambda f: f.write(b"x"), overwrite=False)


@pytest.mark.parametrize("kind", ["symlink-to-checkpoint", "file", "plain-directory", "fifo-metadata"])
def test_checkpoint_overwrite_replaces_only_a_checkpoint(sources: dict[str, Path], tmp_path: Path, kind: str) -> None:
    out = tmp_path / "ck.zarr"
    real = _copy(sources["f32"], tmp_path / "real")  # a checkpoint a link points at
    before = sorted(str(p.relative_to(real)) for p in real.rglob("*"))
    if kind == "symlink-to-checkpoint":
        out.symlink_to(real)
    elif kind == "file":
        out.write_text("not mine")
    elif kind == "plain-directory":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.mkdir()
        os.mkfifo(out / "zarr.json")  # the old check asked zarr, which waited on it
    error = _ends_within(10, lambda: export_statedir(sources["state"], out, overwrite=True))
    assert isinstance(error, CheckpointExistsError) and "replaces only a tierstore checkpoint directory" in str(error)
    assert sorted(str(p.relative_to(real)) for p in real.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.zarr", "real"]  # no partial directory left


def test_checkpoint_overwrite_of_a_checkpoint_works(sources: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(sources["int8"], tmp_path)
    export_statedir(sources["state"], out, overwrite=True)
    assert checkpoint_to_state_dict(out)["state"][0]["exp_avg"].numel() == 2500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8.zarr"]
