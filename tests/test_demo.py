"""The demo: its loss curve equals torch AdamW's, it respects its budget, and its CLI behaves."""

from __future__ import annotations

import json

import pytest
import torch

from tierstore.cli import main
from tierstore.cli.demo import run as demo
from tierstore.cli.demo.model import BatchStream, ModelConfig, TinyGPT, load_corpus


def test_curve_equals_torch_adamw_within_budget(tmp_path):
    result = demo.train(steps=3, state_dir=tmp_path / "state")
    assert result.equal, (result.losses, result.reference_losses)
    assert result.losses == result.reference_losses and result.params_equal
    assert result.ram_budget == result.state_bytes // 8
    assert result.ram_bytes <= result.ram_budget
    assert result.disk_bytes > 0 and result.backend is not None
    assert len(result.losses) == 3


def test_explicit_budget_is_respected(tmp_path):
    budget = 256 << 10  # 256 KiB
    result = demo.train(
        steps=2,
        state_dir=tmp_path / "s",
        ram_budget=budget,
        config=ModelConfig(d_model=64, n_layer=2),
    )
    assert result.equal
    assert result.ram_bytes <= budget < result.state_bytes


def test_a_different_reference_is_caught(tmp_path, monkeypatch):
    def other(params):
        return torch.optim.AdamW(params, lr=demo.LR * 2, weight_decay=demo.WEIGHT_DECAY, fused=True)

    monkeypatch.setattr(demo, "reference_optimizer", other)
    result = demo.train(
        steps=3, state_dir=None, config=ModelConfig(d_model=64, n_layer=1), batch_size=4
    )
    assert not result.equal
    assert result.first_mismatch == 2  # step 1's loss comes before any update


def test_cli_runs_twice_and_cleans_up(tmp_path, capsys):
    parent = tmp_path / "demo-state"
    for _ in range(2):
        assert main(["demo", "--steps", "2", "--state-dir", str(parent), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["equal"] is True and summary["first_mismatch"] is None
        assert summary["ram_bytes"] <= summary["ram_budget"] < summary["state_bytes"]
        assert summary["state_dir"].startswith(str(parent))
    assert not parent.exists()  # made by the run, emptied and removed by it


def test_cli_keep_state_and_report(tmp_path, capsys):
    parent = tmp_path / "kept"
    assert main(["demo", "--steps", "1", "--state-dir", str(parent), "--keep-state"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "peak RSS" in out and "state in RAM" in out
    (run_dir,) = parent.iterdir()
    assert run_dir.name.startswith("run-") and (run_dir / "manifest.json").exists()


def test_cli_mismatch_exits_nonzero(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        demo, "reference_optimizer", lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True)
    )
    assert main(["demo", "--steps", "2", "--state-dir", str(tmp_path / "d")]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--steps", "0"], 2),
        (["--steps", "many"], 2),
        (["--ram-budget", "lots"], 2),  # ConfigError, reported by the CLI as a usage error
        (["--ram-budget", "1KiB"], 2),  # BudgetError (a ConfigError): the arena does not fit
    ],
)
def test_cli_bad_flags(tmp_path, capsys, argv, code):
    parent = tmp_path / "bad"
    try:
        rc = main(["demo", "--state-dir", str(parent), *argv])
    except SystemExit as exc:  # argparse rejects the flag itself
        rc = exc.code
    assert rc == code
    err = capsys.readouterr().err
    assert ("error" in err) and not parent.exists()


def test_batches_are_reproducible_and_shifted():
    data = load_corpus()
    assert 30_000 < data.numel() < 80_000
    a = BatchStream(data, context=16, batch_size=3, seed=5)
    b = BatchStream(data, context=16, batch_size=3, seed=5)
    (xa, ya), (xb, yb) = a.batch(7), b.batch(7)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a.batch(8)[0], xa)


def test_model_head_is_tied_and_causal():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(d_model=32, n_layer=1, n_head=2, context=8))
    assert model.head.weight is model.tok.weight
    x = torch.randint(0, 256, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 256  # change only the future
    with torch.no_grad():
        assert torch.equal(model(x)[0, :5], model(y)[0, :5])
    with pytest.raises(ValueError, match="multiple of n_head"):
        TinyGPT(ModelConfig(d_model=30, n_head=4))
