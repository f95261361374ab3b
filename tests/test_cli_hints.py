"""What the command line says when it is used the way the docs' readers use it (issue 12).

``plan --model`` takes the factory ``diagnose`` takes; ``plan --state-dir``
on a path that does not exist names the directory it measured; ``export``
onto an existing checkpoint and ``to-torch`` on the wrong kind of source
name the flag that fixes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.cli import main
from tierstore.planner import load_model


def diagnose_factory(batch_size: int = 4):
    """What ``tierstore diagnose --model`` takes: (model, batch, loss_fn)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    return model, torch.randn(batch_size, 16), lambda m, b: m(b).square().mean()


def returns_a_list():
    return [torch.nn.Linear(2, 2)]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_model_takes_diagnose_factory(capsys) -> None:
    rc, out, err = _run(capsys, "plan", "--model", f"{__name__}:diagnose_factory", "--host-ram", "1GiB", "--json")
    assert rc == 0, err
    assert json.loads(out)["trainable_params"] == 16 * 32 + 32 + 32 * 16 + 16
    assert next(load_model(f"{__name__}:diagnose_factory").parameters()).device.type == "meta"


def test_plan_model_error_names_both_accepted_returns(capsys) -> None:
    rc, _, err = _run(capsys, "plan", "--model", f"{__name__}:returns_a_list", "--host-ram", "1GiB")
    assert rc == 2  # a --model that cannot be used: a usage error
    assert "returned a list" in err and "tuple whose first element is the model" in err


def test_plan_state_dir_that_does_not_exist_names_the_measured_parent(capsys, tmp_path) -> None:
    missing = tmp_path / "not" / "yet"
    rc, out, err = _run(capsys, "plan", "--params", "1B", "--host-ram", "64GiB", "--state-dir", str(missing))
    assert rc == 0, err
    assert f"--state-dir {missing} does not exist: the free space is that of {tmp_path}" in out
    rc, out, _ = _run(capsys, "plan", "--params", "1B", "--host-ram", "64GiB", "--state-dir", str(missing), "--json")
    assert any(str(tmp_path) in note for note in json.loads(out)["notes"])


def test_plan_state_dir_that_exists_adds_no_note(capsys, tmp_path) -> None:
    rc, out, _ = _run(capsys, "plan", "--params", "1B", "--host-ram", "64GiB", "--state-dir", str(tmp_path))
    assert rc == 0 and "does not exist" not in out


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    p = torch.nn.Parameter(torch.randn(3000))
    with TieredAdamW([p], state_dir=tmp_path / "state", ram_budget="48KiB", shard_numel=1024) as opt:
        p.grad = torch.ones_like(p)
        opt.step()
    return tmp_path / "state"


def test_export_onto_existing_checkpoint_names_the_flag(capsys, state_dir, tmp_path) -> None:
    out_path = tmp_path / "ck.zarr"
    assert _run(capsys, "export", str(state_dir), str(out_path), "--no-progress")[0] == 0
    rc, _, err = _run(capsys, "export", str(state_dir), str(out_path), "--no-progress")
    assert rc == 2 and "pass --overwrite" in err and "overwrite=True" not in err
    assert _run(capsys, "export", str(state_dir), str(out_path), "--no-progress", "--overwrite")[0] == 0


def test_to_torch_on_a_zarr_checkpoint_hints_at_from_zarr(capsys, state_dir, tmp_path) -> None:
    ck = tmp_path / "ck.zarr"
    assert _run(capsys, "export", str(state_dir), str(ck), "--no-progress")[0] == 0
    rc, _, err = _run(capsys, "to-torch", str(ck), str(tmp_path / "a.pt"))
    assert rc == 2 and "pass --from-zarr" in err
    rc, _, err = _run(capsys, "to-torch", str(state_dir), str(tmp_path / "b.pt"), "--from-zarr")
    assert rc == 2 and "drop --from-zarr" in err
    assert _run(capsys, "to-torch", str(ck), str(tmp_path / "c.pt"), "--from-zarr")[0] == 0
