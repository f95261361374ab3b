"""``tierstore.diagnose``: peaks classified by where they come from, exact byte counts, the CLI.

On the CPU (process RSS): a model whose memory is its optimizer state (a big
Linear, a tiny batch) and one whose memory is activations (tiny weights, a
huge batch) must be told apart; the byte counts of weights, gradients and
AdamW state are exact; the CLI prints a table or JSON.
"""

from __future__ import annotations

import gc
import json
import mmap
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW
from tierstore.cli import main
from tierstore.diagnose import MemoryReport, RssProbe, _verdict, default_loss, diagnose


def state_heavy() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)), torch.randn(2, 1024)


def activation_heavy(rows: int = 250_000) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.randn(rows, 32)


def mse(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_optimizer_state_dominates_a_big_linear_with_a_tiny_batch() -> None:
    model, batch = state_heavy()
    before = [p.detach().clone() for p in model.parameters()]
    report = diagnose(model, batch, mse)
    assert report.dominant == "optimizer_state"
    assert report.param_bytes == nbytes(model) == report.grad_bytes
    assert report.optimizer_state_bytes >= 2 * report.param_bytes  # exp_avg + exp_avg_sq (+ step scalars)
    assert report.optimizer_state_bytes < 2 * report.param_bytes + 1024
    assert report.activation_bytes < report.optimizer_state_bytes // 4
    assert [p.name for p in report.phases] == ["model loaded", "forward", "backward", "optimizer step", "steady iteration"]
    assert report.suggested_ram_budget is not None and "TieredAdamW" in report.advice
    # lr=0 AdamW leaves the weights as they were, and no gradients are left behind.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_activations_dominate_small_weights_with_a_huge_batch() -> None:
    model, batch = activation_heavy()
    report = diagnose(model, batch, mse)
    assert report.dominant == "activations"
    # Two tanh outputs of 250,000 x 32 fp32 are saved for backward (the batch itself is not counted).
    assert report.saved_for_backward_bytes >= 2 * 250_000 * 32 * 4
    assert report.activation_bytes >= report.saved_for_backward_bytes
    assert report.optimizer_state_bytes < 64 << 10  # 64 KiB
    assert "checkpoint" in report.advice and report.suggested_ram_budget is None


def test_weights_dominate_without_optimizer_state() -> None:
    model, batch = state_heavy()
    report = diagnose(model, batch, mse, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), steady=False)
    assert report.optimizer_state_bytes == 0
    assert report.dominant == "parameters"
    assert "FSDP2" in report.advice
    assert [p.name for p in report.phases][-1] == "optimizer step"


def test_tiered_optimizer_reports_its_ram_tier() -> None:
    model, batch = state_heavy()
    budget = 4 << 20  # 4 MiB of a 32 MiB state

    def tiered(params):
        return TieredAdamW(params, lr=0.0, ram_budget=budget, shard_numel=1 << 16)

    report = diagnose(model, batch, mse, optimizer=tiered, steady=False)
    assert 0 < report.optimizer_state_bytes <= budget
    assert report.optimizer == "test_tiered_optimizer_reports_its_ram_tier.<locals>.tiered"


def test_memory_limit_sizes_the_suggested_budget() -> None:
    model, batch = state_heavy()
    roomy = diagnose(model, batch, mse, memory_limit=1 << 40, steady=False)  # 1 TiB
    assert roomy.suggested_ram_budget is None and "already fits" in roomy.advice
    tight = diagnose(model, batch, mse, memory_limit="1MiB", steady=False)
    assert tight.dominant == "optimizer_state" and tight.suggested_ram_budget is None
    assert "no room" in tight.advice


@pytest.mark.parametrize(
    ("limit", "budget"),
    [
        (None, 250 << 20),  # no limit: a quarter of the state
        # limit - (peak - state) - 5% headroom = 2000 - 1500 - 100 = 400 MiB of the 1000 MiB state
        (2000 << 20, 400 << 20),
        (1000 << 20, None),  # the rest of the peak (1500 MiB) alone exceeds the limit: no budget helps
    ],
)
def test_verdict_arithmetic_on_the_cpu(limit: int | None, budget: int | None) -> None:
    mib = 1 << 20  # 1 MiB
    dominant, advice, suggested = _verdict(
        device=torch.device("cpu"), params=250 * mib, grads=250 * mib, state=1000 * mib,
        activations=10 * mib, peak=2500 * mib, limit=limit,
    )
    assert dominant == "optimizer_state"
    assert suggested == budget
    if budget is not None:
        assert f'ram_budget="{budget >> 20}MiB"' in advice


def test_verdict_picks_the_larger_movable_part() -> None:
    common = dict(device=torch.device("cpu"), params=100, grads=100, peak=10_000, limit=None)
    assert _verdict(state=200, activations=300, **common)[0] == "activations"
    assert _verdict(state=300, activations=200, **common)[0] == "optimizer_state"
    assert _verdict(state=0, activations=90, **common)[0] == "parameters"  # both under half of weights + grads


def test_report_table_and_dict() -> None:
    model, batch = activation_heavy(rows=10_000)
    report = diagnose(model, batch, mse)
    text = str(report)
    for row in ("model loaded", "forward", "backward", "optimizer step", "steady iteration", "optimizer state", "activations"):
        assert row in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["dominant"] == report.dominant and len(data["phases"]) == 5
    assert data["param_bytes"] == report.param_bytes and isinstance(report, MemoryReport)


class DictModel(nn.Module):
    """A Hugging Face-like model: keyword inputs, an output with .loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(loss=(self.lin(x) - y).square().mean(), logits=None)


def test_default_loss_conventions() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    hf = DictModel()
    assert default_loss(hf, {"x": x, "y": y}).dim() == 0
    assert default_loss(hf, (x, y)).dim() == 0
    plain = nn.Linear(4, 4)
    assert torch.equal(default_loss(plain, x), plain(x).float().sum())

    class MapOut(nn.Module):
        def forward(self, x):
            return {"loss": x.sum()}

    assert default_loss(MapOut(), x).item() == pytest.approx(x.sum().item())

    class NoLoss(nn.Module):
        def forward(self, x):
            return {"logits": x}

    with pytest.raises(ValueError, match="without a loss tensor"):
        default_loss(NoLoss(), x)
    report = diagnose(hf, {"x": x, "y": y}, steady=False)
    assert report.param_bytes == nbytes(hf)


def test_bad_inputs() -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        diagnose(frozen, torch.randn(1, 2))
    with pytest.raises(ValueError, match="scalar tensor"):
        diagnose(nn.Linear(2, 2), torch.randn(3, 2), lambda m, b: m(b))
    with pytest.raises(ValueError, match="memory_limit"):
        diagnose(nn.Linear(2, 2), torch.randn(3, 2), memory_limit="lots")


def test_rss_probe_sees_a_transient_peak() -> None:
    """Fresh pages (an anonymous mmap, not malloc, which may reuse resident heap) raise the peak."""
    probe = RssProbe()
    gc.collect()  # no garbage from earlier tests freed mid-measurement
    size = 64 << 20  # 64 MiB
    with probe.watch() as peak:
        before = probe.current()
        pages = mmap.mmap(-1, size)
        pages.write(b"x" * size)  # touch every page
        pages.close()
    assert peak[0] - before >= size * 3 // 4


FACTORIES = '''
import torch
from torch import nn


def state_heavy(batch_size=2):
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    return model, torch.randn(batch_size, 1024), lambda m, b: m(b).square().mean()


def two(batch_size=4):
    model = nn.Linear(8, 1)
    return model, torch.randn(batch_size, 8)


def lightning_style():
    model = nn.Linear(8, 1)
    model.example_input_array = torch.randn(4, 8)
    return model


def no_batch():
    return nn.Linear(8, 1)


def wrong():
    return 42


def boom():
    raise RuntimeError("no GPU here")


def sgd(params):
    return torch.optim.SGD(params, lr=0.0)
'''


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "diag_models.py"
    path.write_text(textwrap.dedent(FACTORIES))
    return path


def test_cli_json(factories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--model", f"{factories}:state_heavy", "--batch-size", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dominant"] == "optimizer_state"
    assert data["param_bytes"] == (1024 * 1024 + 1024) * 4
    assert [p["name"] for p in data["phases"]][-1] == "steady iteration"


@pytest.mark.parametrize("factory", ["two", "lightning_style"])
def test_cli_table_and_conventions(factories: Path, factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["diagnose", "--model", f"{factories}:{factory}", "--device", "cpu", "--no-steady",
            "--optimizer", f"{factories}:sgd"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tierstore diagnose: cpu" in out and "optimizer step" in out and "steady" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nocolon"], "must be 'module:factory'"),
        (["--model", "no_such_module_xyz:f"], "cannot import"),
        (["--model", "{f}:missing"], "has no attribute"),
        (["--model", "{f}:no_batch"], "without a batch"),
        (["--model", "{f}:wrong"], "returned int"),
        (["--model", "{f}:boom"], "no GPU here"),
        (["--model", "{f}:lightning_style", "--batch-size", "2"], "takes no batch_size"),
        (["--model", "{f}:two", "--batch-size", "0"], "--batch-size 0"),
        (["--model", "{f}:two", "--device", "nonsense"], "--device 'nonsense'"),
        (["--model", "{f}:two", "--memory-limit", "lots"], "memory_limit"),
        (["--model", "/nonexistent/m.py:f"], "no file"),
    ],
)
def test_cli_bad_inputs(factories: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{f}", str(factories)) for a in argv]
    assert main(["diagnose", *argv]) == 2  # a --model or flag value that cannot be used: a usage error
    assert message in capsys.readouterr().err
