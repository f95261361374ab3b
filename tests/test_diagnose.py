"""``tierstore.diagnose``: peaks classified by where they come from, exact byte counts, labels, the CLI.

On the CPU (process RSS): a model whose memory is its optimizer state (a big
Linear, a tiny batch) and one whose memory is activations (tiny weights, a
huge batch) must be told apart; the byte counts of weights, gradients and
AdamW state are exact; every figure says whether it was measured, counted or
estimated, and no estimate is ever called measured; the verdict's arithmetic
(a ``ram_budget`` and the peak's drop net of TieredAdamW's own RAM) holds by
hand; the CLI prints a table or JSON.
"""

from __future__ import annotations

import gc
import json
import mmap
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW
from tierstore._layout.budget import OVERHEAD_BYTES
from tierstore.cli import main
from tierstore.diagnose import Figure, MemoryReport, RssProbe, default_loss, diagnose
from tierstore.diagnose.report import COUNTED, ESTIMATED, KINDS, MEASURED
from tierstore.diagnose.verdict import verdict

MiB = 1 << 20


def budget_plus_overhead(budget: int | None) -> tuple[int | None, int]:
    """A stand-in for the planner: TieredAdamW fills its ram_budget and adds the fixed overhead."""
    return budget, (budget or 0) + OVERHEAD_BYTES


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


def cpu_verdict(**kw):
    args = dict(device_type="cpu", params=250 * MiB, grads=250 * MiB, state=1000 * MiB, activations=10 * MiB,
                activations_kind=COUNTED, peak=2500 * MiB, limit=None, tiered=budget_plus_overhead)  # fmt: skip
    return verdict(**{**args, **kw})


@pytest.mark.parametrize(
    ("limit", "budget"),
    [
        (None, 250 * MiB),  # no limit: a quarter of the 1000 MiB state
        # limit - (peak - state) - 5% headroom - TieredAdamW's fixed overhead = 2000 - 1500 - 100 - 16 = 384 MiB
        (2000 * MiB, 2000 * MiB - 1500 * MiB - 100 * MiB - OVERHEAD_BYTES),
        (1000 * MiB, None),  # the rest of the peak (1500 MiB) alone exceeds the limit: no budget helps
    ],
)
def test_verdict_arithmetic_on_the_cpu(limit: int | None, budget: int | None) -> None:
    found = cpu_verdict(limit=limit)
    assert found.dominant == "optimizer_state"
    assert found.suggested_ram_budget == budget
    if budget is not None:
        assert f'ram_budget="{budget >> 20}MiB"' in found.advice
        drop = {f.name: f for f in found.estimates}["peak drop with TieredAdamW"]
        # The peak drops by the state minus what TieredAdamW itself holds: the budget and the fixed overhead.
        assert drop.nbytes == 1000 * MiB - budget - OVERHEAD_BYTES and drop.kind == ESTIMATED


def test_verdict_subtracts_the_arena_the_planner_raises_the_budget_to() -> None:
    """A budget below the streaming arena is raised to it: the drop is net of that, not of the asked budget."""
    arena = 300 * MiB

    def planner(budget: int | None) -> tuple[int | None, int]:
        used = max(budget or 0, arena)
        return used, used + OVERHEAD_BYTES

    found = cpu_verdict(tiered=planner)  # asks a quarter, 250 MiB: below the arena
    assert found.suggested_ram_budget == arena
    figures = {f.name: f for f in found.estimates}
    assert figures["peak drop with TieredAdamW"].nbytes == 1000 * MiB - arena - OVERHEAD_BYTES
    assert "raised from 250.00 MiB" in figures["suggested ram_budget"].how


def test_verdict_on_a_state_smaller_than_tieredadamws_own_ram_advises_against_offloading() -> None:
    found = cpu_verdict(params=100, grads=100, state=4 * MiB, activations=1000, peak=300 * MiB)
    assert found.dominant == "optimizer_state" and found.suggested_ram_budget is None
    assert "does not lower the peak" in found.advice and "Keep torch.optim.AdamW" in found.advice
    assert {f.name: f.nbytes for f in found.estimates}["peak drop with TieredAdamW"] == 0


def test_verdict_picks_the_larger_movable_part() -> None:
    common = dict(params=100, grads=100, peak=10_000)
    assert cpu_verdict(state=200, activations=300, **common).dominant == "activations"
    assert cpu_verdict(state=300, activations=200, **common).dominant == "optimizer_state"
    assert cpu_verdict(state=0, activations=90, **common).dominant == "parameters"  # both under half of weights + grads


#: Figures that are arithmetic, never a measurement.
ESTIMATES = ("suggested ram_budget", "ram_budget considered", "TieredAdamW's host RAM", "peak drop with TieredAdamW", "GPU memory freed",
             "halving the batch saves")  # fmt: skip
SIZE = r"\d[\d,]*(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)"


@pytest.mark.parametrize("heavy", ["state", "activations"])
def test_every_figure_says_how_it_was_obtained_and_no_estimate_is_measured(heavy: str) -> None:
    model, batch = state_heavy() if heavy == "state" else activation_heavy(rows=100_000)
    report = diagnose(model, batch, mse)
    data = json.loads(json.dumps(report.to_dict()))
    kinds = {f["name"]: f["kind"] for f in data["figures"]}
    assert set(kinds.values()) <= set(KINDS) and all(f["how"] for f in data["figures"])
    assert {p["kind"] for p in data["phases"]} == {MEASURED}
    for name in ("peak", "process baseline", "forward growth"):
        assert kinds[name] == MEASURED, name
    for name in ("parameters", "gradients", "optimizer state", "saved for backward"):
        assert kinds[name] == COUNTED, name
    estimates = [n for n in kinds if n in ESTIMATES]
    assert estimates, kinds  # each verdict estimates something: a drop, or what halving the batch saves
    assert all(kinds[n] == ESTIMATED for n in estimates), kinds
    # Activations say which source gave them, with that source's kind.
    assert report.activations_from in ("forward growth", "saved for backward")
    assert kinds["activations"] == kinds[report.activations_from]
    assert report.activation_bytes == report.figure(report.activations_from).nbytes
    # The text: each figure's row names its kind; an estimate's row never says measured.
    text = str(report)
    for fig in report.figures:
        row = next(line for line in text.splitlines() if line.strip().startswith(fig.name + " "))
        assert re.search(rf"\b{fig.kind}\b", row), row
        if fig.kind == ESTIMATED:
            assert "measured" not in row, row
    # The verdict's sentences quote no number without its kind (or "given", for the user's own limit).
    sentences = "\n".join(text.splitlines()[-2:])
    untagged = [m.group(0) for m in re.finditer(rf"{SIZE}(?! \((?:{'|'.join(KINDS)}|given)\))", sentences)]
    assert not untagged, (untagged, sentences)
    assert "dominated by" not in text
    assert re.search(r"largest (movable )?part: \w[\w ]* \((\d+%|under 1%) of the peak; the process baseline is "
                     rf"{SIZE} \(measured\)", text), text  # fmt: skip


def test_an_estimate_cannot_be_labelled_with_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind 'guessed'"):
        Figure("peak drop with TieredAdamW", 1, "guessed", "a guess")


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
