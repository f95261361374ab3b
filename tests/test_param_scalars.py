"""Per-parameter scalars besides ``step`` (TieredNAdam's ``mu_product``) through everything that stores a state.

``mu_product`` is the product of every step's momentum factor, which reads
that step's ``beta1`` and ``momentum_decay``: the runs here change both
between steps, so a value made up from the step count would differ. Each
test checks bit for bit against ``torch.optim.NAdam`` (parameters, and every
state tensor with torch's keys, order and dtype): a state directory resumed
after a close, at its previous commit and after a SIGKILL; zarr checkpoints
(save/load, export, torch state dicts both ways, ``tierstore to-torch``);
DCP (its placeholders and a torch state dict of real tensors). Crafted
manifests and checkpoints with bad scalars are refused naming the key, and
an AdamW state records no scalars at all (its files stay as they were).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tierstore import CorruptStateError, TieredAdamW, TieredNAdam
from tierstore._state.manifest_file import manifest_checksum
from tierstore._state.reader import StateReader
from tierstore.checkpoint import (
    checkpoint_to_state_dict,
    export_statedir,
    load_checkpoint,
    save_checkpoint,
    state_dict_to_checkpoint,
    statedir_to_state_dict,
)
from tierstore.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's single-process warning

HYPER = dict(lr=2e-2, momentum_decay=0.05, weight_decay=0.01)
STREAMED = dict(shard_numel=1024, ram_budget="40KiB", backend="buffered")
SHAPES = ((6000,), (7, 3), (5,))  # the last never has a gradient: no state, its scalars null


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _twins() -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    a = _params()
    return a, [nn.Parameter(p.detach().clone()) for p in a]


def _step(opts: list[Any], twins: list[list[nn.Parameter]], k: int) -> None:
    """Step ``k`` on every optimizer: parameter 1 starts a step later; beta1 and momentum_decay change at step 2."""
    g = torch.Generator().manual_seed(100 + k)
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    for opt, params in zip(opts, twins):
        if k == 2:
            for group in opt.param_groups:
                group["betas"] = (0.8, 0.99)
                group["momentum_decay"] = 0.2
        for i, p in enumerate(params):
            p.grad = None if i == 2 or (i == 1 and k == 0) else grads[i].clone()
        opt.step()


def _train(opt: Any, ref: torch.optim.Optimizer, a: list, b: list, start: int, stop: int) -> None:
    for k in range(start, stop):
        _step([opt, ref], [a, b], k)


def _state_equal(got: dict, want: dict) -> None:
    assert sorted(got["state"]) == sorted(want["state"])
    for key, entry in want["state"].items():
        mine = got["state"][key]
        assert list(mine) == list(entry), (key, list(mine), list(entry))  # torch's keys in torch's order
        for name, value in entry.items():
            assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), (key, name, mine[name], value)


def _equal(opt: Any, ref: torch.optim.Optimizer, a: list, b: list) -> None:
    _state_equal(opt.state_dict(), ref.state_dict())
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def _mu(ref: torch.optim.Optimizer, params: list) -> list[float | None]:
    return [float(ref.state[p]["mu_product"]) if p in ref.state else None for p in params]


# -- state directories -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("durable", [True, False])
def test_nadam_resumes_a_closed_state_dir_bitwise(tmp_path: Path, durable: bool) -> None:
    a, b = _twins()
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, state_dir=tmp_path, durable=durable, **STREAMED, **HYPER) as opt:
        assert opt.plan.disk_shards  # shards streamed from the drive
        _train(opt, ref, a, b, 0, 3)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["param_scalars"] == {"mu_product": _mu(ref, b)}  # each parameter its own, null without a step
    assert manifest["param_scalars"]["mu_product"][2] is None and manifest["param_steps"][2] is None
    fresh = [nn.Parameter(q.detach().clone()) for q in b]  # fp32 parameters keep no master: the model's own values
    with TieredNAdam(fresh, state_dir=tmp_path, resume=True, **HYPER) as opt:
        assert opt.step_count == 3 and opt.param_groups[0]["momentum_decay"] == 0.2  # the groups as committed
        _equal(opt, ref, fresh, b)
        _train(opt, ref, fresh, b, 3, 6)
        _equal(opt, ref, fresh, b)


def test_nadam_resumes_its_previous_commit_bitwise(tmp_path: Path) -> None:
    """A durable directory keeps the commit before its last; its scalars roll back with its steps."""
    a, b = _twins()
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, state_dir=tmp_path, commit_every=1, **STREAMED, **HYPER) as opt:
        _train(opt, ref, a, b, 0, 3)
        at_three = ref.state_dict()
        at_three = {"state": {k: {n: v.clone() for n, v in e.items()} for k, e in at_three["state"].items()}}
        _train(opt, ref, a, b, 3, 4)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["previous"]["step_count"] == 3 and manifest["previous"]["param_scalars"]["mu_product"] != manifest["param_scalars"]["mu_product"]
    with TieredNAdam(_params(), state_dir=tmp_path, resume=True, resume_step=3, **HYPER) as opt:
        assert opt.step_count == 3
        _state_equal(opt.state_dict(), at_three)


def test_nadam_resumes_bitwise_after_a_kill(tmp_path: Path) -> None:
    """The conformance kit's check: SIGKILL mid-step in a durable state_dir, resume, finish on torch's run."""
    from tierstore.testing.algorithm import AlgorithmCase, check_resume_after_kill

    P = functools.partial
    case = AlgorithmCase("nadam-momentum-decay", P(TieredNAdam, lr=1e-2, momentum_decay=0.1, betas=(0.85, 0.99)),
                         P(torch.optim.NAdam, lr=1e-2, momentum_decay=0.1, betas=(0.85, 0.99)))  # fmt: skip
    check_resume_after_kill(case, tmp_path)


# -- zarr checkpoints and torch state dicts ---------------------------------------------------------------------


def test_nadam_checkpoints_round_trip_bitwise(tmp_path: Path) -> None:
    a, b = _twins()
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, state_dir=tmp_path / "state", **STREAMED, **HYPER) as opt:
        _train(opt, ref, a, b, 0, 3)
        save_checkpoint(opt, tmp_path / "ck.zarr")
    saved_mu = _mu(ref, b)
    attrs = json.loads((tmp_path / "ck.zarr" / "zarr.json").read_text())["attributes"]
    assert attrs["param_scalars"] == {"mu_product": saved_mu}
    # Into a new optimizer of another shard size, in RAM: bitwise on, step by step.
    with TieredNAdam(a, shard_numel=2048, **HYPER) as opt:
        load_checkpoint(opt, tmp_path / "ck.zarr")
        assert opt.param_scalars() == {"mu_product": _mu(ref, b)}
        _equal(opt, ref, a, b)
        _train(opt, ref, a, b, 3, 5)
        _equal(opt, ref, a, b)
    # The checkpoint and the state directory as torch state dicts: torch's mu_product, and torch continues from them.
    for converted in (checkpoint_to_state_dict(tmp_path / "ck.zarr"), statedir_to_state_dict(tmp_path / "state")):
        assert [float(e["mu_product"]) for e in converted["state"].values()] == saved_mu[:2]
        c, d = _twins()
        mine, theirs = torch.optim.NAdam(c, **HYPER), torch.optim.NAdam(d, **HYPER)
        _train(mine, theirs, c, d, 0, 3)
        mine.load_state_dict(converted)
        _state_equal(mine.state_dict(), theirs.state_dict())
        _train(mine, theirs, c, d, 3, 5)
        _state_equal(mine.state_dict(), theirs.state_dict())


def test_nadam_export_and_torch_conversions_carry_mu_product(tmp_path: Path) -> None:
    from tierstore.cli import main

    a, b = _twins()
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, state_dir=tmp_path / "state", **STREAMED, **HYPER) as opt:
        _train(opt, ref, a, b, 0, 3)
    want = ref.state_dict()
    export_statedir(tmp_path / "state", tmp_path / "exported.zarr")
    assert main(["to-torch", str(tmp_path / "state"), str(tmp_path / "dir.pt")]) == 0
    assert main(["to-torch", "--from-zarr", str(tmp_path / "exported.zarr"), str(tmp_path / "zarr.pt")]) == 0
    for name in ("dir.pt", "zarr.pt"):
        _state_equal(torch.load(tmp_path / name, weights_only=True), want)
    # A torch NAdam's state dict becomes a checkpoint that a TieredNAdam continues bitwise.
    state_dict_to_checkpoint(want, tmp_path / "torch.zarr", algorithm="nadam", params=b)
    for path in ("torch.zarr", "exported.zarr"):
        c = _params()
        mine = TieredNAdam(c, **HYPER)
        d = [nn.Parameter(p.detach().clone()) for p in b]
        theirs = torch.optim.NAdam(d, **HYPER)
        theirs.load_state_dict(copy.deepcopy(want))  # torch keeps the step tensors it is given, and steps them
        with mine:
            load_checkpoint(mine, tmp_path / path)
            for p, q in zip(c, d):
                p.data.copy_(q)
            _equal(mine, theirs, c, d)
            _train(mine, theirs, c, d, 3, 5)
            _equal(mine, theirs, c, d)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, r"lacks \['mu_product'\]"),
        (torch.tensor(float("nan")), r"the mu_product of parameter 0 is tensor\(nan\); it must be a finite number"),
        (float("inf"), r"the mu_product of parameter 0 is inf; it must be a finite number"),
        (torch.ones(2), r"the mu_product of parameter 0 is tensor\(\[1., 1.\]\)"),
        ("0.5", r"the mu_product of parameter 0 is '0.5'"),
    ],
)
def test_a_torch_state_dict_without_a_finite_mu_product_is_refused(tmp_path: Path, value: Any, message: str) -> None:
    b = _params()
    ref = torch.optim.NAdam(b, **HYPER)
    _step([ref], [b], 0)
    broken = ref.state_dict()
    if value is None:
        del broken["state"][0]["mu_product"]
    else:
        broken["state"][0]["mu_product"] = value
    with pytest.raises(ConfigError, match=message):
        state_dict_to_checkpoint(broken, tmp_path / "ck.zarr", algorithm="nadam")
    assert not (tmp_path / "ck.zarr").exists()


# -- DCP -----------------------------------------------------------------------------------------------------------


def test_nadam_dcp_save_and_load_bitwise(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tierstore.dcp import ALGORITHM_KEY, TieredStateful

    # Note: dcp.load of a trainable parameter that never took a step fails in DCP's planner ("Missing key
    # in checkpoint state_dict: ...step"), for every algorithm: every parameter here takes steps.
    a, b = (p[:2] for p in _twins())
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, **STREAMED, **HYPER) as opt:
        _train(opt, ref, a, b, 0, 3)
        listed = TieredStateful(opt).state_dict()
        assert [list(e) for e in listed["state"].values()] == [["step", "mu_product", "exp_avg", "exp_avg_sq"]] * 2
        assert listed[ALGORITHM_KEY] == "nadam"
        dcp.save({"optim": TieredStateful(opt)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with TieredNAdam(a, state_dir=tmp_path / "state", shard_numel=2048, **HYPER) as opt:
        dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        assert opt.step_count == 3
        _equal(opt, ref, a, b)
        _train(opt, ref, a, b, 3, 5)
        _equal(opt, ref, a, b)
    # What the load committed is what a resume finds.
    fresh = [nn.Parameter(q.detach().clone()) for q in b]
    with TieredNAdam(fresh, state_dir=tmp_path / "state", resume=True, **HYPER) as opt:
        _equal(opt, ref, fresh, b)


def test_nadam_dcp_loads_torch_tensors_and_refuses_a_missing_mu_product(tmp_path: Path) -> None:
    """Real tensors in the FQN layout (a torch.optim.NAdam's state keyed by index, as get_optimizer_state_dict keys it)."""
    from tierstore.dcp import TieredStateful

    a, b = _twins()
    ref = torch.optim.NAdam(b, **HYPER)
    with TieredNAdam(a, **HYPER) as trained:
        _train(trained, ref, a, b, 0, 3)  # a's values as b's
    saved = ref.state_dict()
    real = {"state": {str(k): dict(e) for k, e in saved["state"].items()},
            "param_groups": [{**g, "params": [str(i) for i in g["params"]]} for g in saved["param_groups"]]}  # fmt: skip
    with TieredNAdam(a, **HYPER) as opt:
        TieredStateful(opt).load_state_dict(real)
        _equal(opt, ref, a, b)
        _train(opt, ref, a, b, 3, 4)
        _equal(opt, ref, a, b)
        for bad in (None, torch.tensor(float("nan"))):
            broken = {**real, "state": {k: dict(e) for k, e in real["state"].items()}}
            if bad is None:
                del broken["state"]["1"]["mu_product"]
            else:
                broken["state"]["1"]["mu_product"] = bad
            with pytest.raises(ConfigError, match=r"the loaded state of 1 has a step but no mu_product that is a finite number"):
                TieredStateful(opt).load_state_dict(broken)
        _equal(opt, ref, a, b)  # nothing was loaded


# -- the access protocol ------------------------------------------------------------------------------------------


def test_replace_shards_needs_the_scalars_and_adamw_has_none() -> None:
    a = _params()
    with TieredNAdam(a, **HYPER) as opt:
        _step([opt], [a], 0)
        keep = lambda shard, flat: None  # noqa: E731 -- never runs: refused first
        with pytest.raises(ConfigError, match=r"TieredNAdam keeps a per-parameter mu_product .* replace_shards needs "
                           r"param_scalars .*param_scalars=None"):  # fmt: skip
            opt.replace_shards(keep, param_steps={0: 1.0})
        with pytest.raises(ConfigError, match=r"param_scalars.mu_product\[0\]=nan, expected a finite number"):
            opt.replace_shards(keep, param_steps={0: 1.0}, param_scalars={"mu_product": [math.nan, None, None]})
        assert opt.step_count == 1 and opt.param_scalars()["mu_product"][0] is not None  # nothing replaced
    with TieredAdamW(_params()) as opt:
        assert opt.param_scalars() is None


def test_an_adamw_state_records_no_scalars(tmp_path: Path) -> None:
    a = _params()
    with TieredAdamW(a, state_dir=tmp_path / "state", **STREAMED) as opt:
        _step([opt], [a], 0)
        save_checkpoint(opt, tmp_path / "ck.zarr")
    assert "param_scalars" not in json.loads((tmp_path / "state" / "manifest.json").read_text())
    assert "param_scalars" not in json.loads((tmp_path / "ck.zarr" / "zarr.json").read_text())["attributes"]


# -- crafted files --------------------------------------------------------------------------------------------------


def _craft_manifest(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    data["manifest_checksum"] = manifest_checksum(data)
    path.write_text(json.dumps(data))


def _set(key: str, value: Any):
    def edit(m: dict) -> None:
        target = m
        *parents, last = key.split(".")
        for k in parents:
            target = target[k]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value

    return edit


def _set_entry(index: int, value: Any):
    def edit(m: dict) -> None:
        m["param_scalars"]["mu_product"][index] = value

    return edit


_DELETE = object()
BAD_MANIFESTS = [
    pytest.param(_set_entry(0, math.nan), r"param_scalars.mu_product\[0\]=nan, expected a finite number", id="nan"),
    pytest.param(_set_entry(0, math.inf), r"param_scalars.mu_product\[0\]=inf, expected a finite number", id="inf"),
    pytest.param(_set_entry(1, 1e39), r"mu_product\[1\]=1e\+39, expected a finite number within float32's range", id="past-float32"),
    pytest.param(_set_entry(0, "0.5"), r"mu_product\[0\]='0.5', expected a finite number", id="string"),
    pytest.param(_set_entry(0, True), r"mu_product\[0\]=True, expected a finite number", id="bool"),
    pytest.param(_set_entry(0, None), r"mu_product\[0\]=None, expected a finite number .* has a step", id="null-with-a-step"),
    pytest.param(_set_entry(2, 0.5), r"mu_product\[2\]=0.5, expected null \(parameter 2 has no step", id="value-without-a-step"),
    pytest.param(_set("param_scalars.mu_product", [0.5]), r"param_scalars.mu_product=\[0.5\], expected a list of 3 entries", id="short"),
    pytest.param(_set("param_scalars", _DELETE), r"param_scalars=None, expected \{'mu_product'", id="missing"),
    pytest.param(_set("param_scalars", {"mu_product": [0.5, 0.5, None], "eta": [1.0, 1.0, None]}),
                 r"param_scalars=\{'mu_product': \[0.5, 0.5, None\], 'eta': \[1.0, 1.0, None\]\}, expected \{'mu_product'",
                 id="another-name"),
    pytest.param(_set("param_scalars", [0.5, 0.5, None]), r"param_scalars=\[0.5, 0.5, None\], expected", id="a-list"),
    pytest.param(_set("previous.param_scalars.mu_product", [math.nan, None, None]),
                 r"previous.param_scalars.mu_product\[0\]=nan", id="previous-nan"),
]  # fmt: skip


@pytest.fixture(scope="module")
def nadam_state(tmp_path_factory) -> Path:
    """A durable TieredNAdam state directory after three steps (copied per test)."""
    d = tmp_path_factory.mktemp("nadam") / "state"
    a = _params()
    ref = torch.optim.NAdam(_params(), **HYPER)
    with TieredNAdam(a, state_dir=d, commit_every=1, **STREAMED, **HYPER) as opt:
        _train(opt, ref, a, _params(), 0, 3)
    return d


@pytest.mark.parametrize(("edit", "message"), BAD_MANIFESTS)
def test_a_crafted_manifest_with_bad_scalars_is_refused(nadam_state: Path, tmp_path: Path, edit, message: str) -> None:
    import shutil

    d = tmp_path / "state"
    shutil.copytree(nadam_state, d)
    _craft_manifest(d / "manifest.json", edit)
    with pytest.raises(CorruptStateError, match=message):
        TieredNAdam(_params(), state_dir=d, resume=True, **HYPER)
    with pytest.raises(CorruptStateError, match=message):
        StateReader(d)
    with pytest.raises(CorruptStateError, match=message):
        statedir_to_state_dict(d)


def test_an_adamw_manifest_with_scalars_is_refused(tmp_path: Path) -> None:
    a = _params()
    with TieredAdamW(a, state_dir=tmp_path, **STREAMED) as opt:
        _step([opt], [a], 0)
    _craft_manifest(tmp_path / "manifest.json", _set("param_scalars", {"mu_product": [0.5, None, None]}))
    with pytest.raises(CorruptStateError, match=r"param_scalars=.*expected no such record \(the state's algorithm "
                       r"keeps no per-parameter scalar besides step\)"):  # fmt: skip
        TieredAdamW(_params(), state_dir=tmp_path, resume=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [p for p in BAD_MANIFESTS if not p.id.startswith("previous")],
)
def test_a_crafted_checkpoint_with_bad_scalars_is_refused(nadam_state: Path, tmp_path: Path, edit, message: str) -> None:
    export_statedir(nadam_state, tmp_path / "ck.zarr")
    path = tmp_path / "ck.zarr" / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta["attributes"])
    path.write_text(json.dumps(meta))
    message = message.replace(", expected", "; it must be")
    with pytest.raises(CorruptStateError, match=rf"checkpoint .*{message}"):
        checkpoint_to_state_dict(tmp_path / "ck.zarr")
    with TieredNAdam(_params(), **HYPER) as opt, pytest.raises(CorruptStateError, match=message):
        load_checkpoint(opt, tmp_path / "ck.zarr")
