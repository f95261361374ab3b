"""accelerate's ``save_state``/``load_state`` with ``TieredAdamW``, by snapshot (``tierstore.integrations.accelerate``).

A small MLP with a LayerNorm (25k parameters, built here) whose optimizer
state (200 KB) is five times its ``ram_budget``, trained through
``Accelerator`` on the CPU with a ``LambdaLR`` schedule and accelerate's
automatic checkpoint naming. ``TieredAdamW.state_dict`` is made to raise in
every tiered run: no save or load may build the state in RAM. Results are
compared bitwise: a run killed and resumed equals the uninterrupted run,
which equals accelerate's own ``torch.optim.AdamW(fused=True)``.

Skipped where accelerate is not installed, unless ``TIERSTORE_REQUIRE_HF=1``
(CI installs the ``hf`` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.errors import ConfigError, CorruptStateError
from tierstore.integrations.snapshot import (
    REFERENCE_NAME,
    SNAPSHOT_NAME,
    check_trainer_checkpoints,
    snapshot_nbytes,
)

if os.environ.get("TIERSTORE_REQUIRE_HF") == "1":
    import accelerate
else:
    accelerate = pytest.importorskip("accelerate")
from accelerate.utils import DistributedType, ProjectConfiguration  # noqa: E402

from tierstore.integrations.accelerate import REFERENCE_KEY, checkpoint_by_snapshot  # noqa: E402

SHARD = 1024
BUDGET = 40 << 10  # 40 KiB: the arena plus one resident shard; the state is 200 KB
STEPS = 6


@pytest.fixture
def no_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any real TieredAdamW.state_dict() call (the whole state in RAM) fails the test."""

    def refuse(self):
        raise AssertionError("state_dict() materialised the whole optimizer state")

    monkeypatch.setattr(TieredAdamW, "state_dict", refuse)


def build(optimizer: str, state_dir: Path | None):
    """The model, its optimizer (no decay on biases and norms) and a schedule, from seed 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))  # fmt: skip
    decay = [p for p in model.parameters() if p.dim() == 2]
    groups = [{"params": decay, "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]  # fmt: skip
    if optimizer == "tiered":
        opt = TieredAdamW(groups, lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD, resume="auto",
                          state_dir=None if state_dir is None else str(state_dir))  # fmt: skip
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    return model, opt, sched


class Run:
    """One process's objects: an Accelerator (automatic checkpoint naming under ``project``), model, optimizer."""

    def __init__(self, project: Path, *, optimizer: str = "tiered", state_dir: Path | None = None,
                 snapshot: bool = True, total_limit: int | None = None) -> None:  # fmt: skip
        config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit)
        self.accelerator = accelerate.Accelerator(cpu=True, project_config=config)
        self.hooks = checkpoint_by_snapshot(self.accelerator) if snapshot else None
        self.model, self.opt, self.sched = self.accelerator.prepare(*build(optimizer, state_dir))

    @property
    def tiered(self) -> TieredAdamW:
        return self.opt.optimizer

    def train(self, steps: range, *, save_every: int = 0) -> None:
        for k in steps:
            gen = torch.Generator().manual_seed(1000 + k)
            x = torch.randn(8, 32, generator=gen)
            self.accelerator.backward(torch.nn.functional.mse_loss(self.model(x), x.flip(1)))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            if save_every and (k + 1) % save_every == 0:
                self.accelerator.save_state()

    def resume(self, folder: Path | None = None) -> None:
        """``load_state`` (the latest checkpoint when ``folder`` is None); later saves take the next names."""
        self.accelerator.load_state(None if folder is None else str(folder))
        names = os.listdir(Path(self.accelerator.project_dir) / "checkpoints")
        self.accelerator.project_configuration.iteration = max(int(n.split("_")[-1]) for n in names) + 1

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """Six uninterrupted steps, saving every 2 with total_limit=2: (the project folder, the final weights)."""
    project = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TieredAdamW, "state_dict", lambda self: pytest.fail("state_dict() materialised the state"))
        run = Run(project, state_dir=project / "state", total_limit=2)
        assert run.tiered.layout.state_nbytes > 4 * BUDGET
        run.train(range(STEPS), save_every=2)
        weights = run.weights()
        run.tiered.close()
    return project, weights


def test_save_state_writes_a_reference_and_a_snapshot_and_rotation_leaves_nothing(straight) -> None:
    """optimizer.bin is a small reference; total_limit=2 deleted checkpoint_0 and its snapshot; verify is clean."""
    project, _ = straight
    checkpoints = project / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_1", "checkpoint_2"]
    for name in ("checkpoint_1", "checkpoint_2"):
        folder = checkpoints / name
        assert {"optimizer.bin", REFERENCE_NAME, SNAPSHOT_NAME, "scheduler.bin", "model.safetensors"} <= set(os.listdir(folder))
        assert os.path.getsize(folder / "optimizer.bin") < 4096
        saved = torch.load(folder / "optimizer.bin", weights_only=True)
        assert not any(isinstance(v, torch.Tensor) for v in saved.values())
        assert saved[REFERENCE_KEY] == json.loads((folder / REFERENCE_NAME).read_text())
        assert saved[REFERENCE_KEY]["step_count"] == 2 * (int(name[-1]) + 1)
        state = saved[REFERENCE_KEY]["state_bytes"]
        assert state <= snapshot_nbytes(folder / SNAPSHOT_NAME) <= state + (256 << 10)  # the state once, plus metadata
    assert check_trainer_checkpoints(checkpoints) == []
    # Nothing of the rotated checkpoint_0 is left anywhere: one snapshot per kept folder, no hidden leftovers.
    snapshots = sorted(str(p.relative_to(project)) for p in project.rglob(f"*{SNAPSHOT_NAME}*") if p.is_dir())
    assert snapshots == [f"checkpoints/checkpoint_1/{SNAPSHOT_NAME}", f"checkpoints/checkpoint_2/{SNAPSHOT_NAME}"]


def test_killed_then_load_state_resumes_bitwise_equal_to_straight_and_to_torch(straight, tmp_path: Path,
                                                                               no_state_dict) -> None:  # fmt: skip
    """Killed after step 5 (saves at 2 and 4), new objects, load_state() of the latest == 6 straight steps == torch."""
    _, expected = straight
    first = Run(tmp_path, state_dir=tmp_path / "state")
    first.train(range(5), save_every=2)
    assert first.tiered.commit() == 5  # the state directory is ahead of the last checkpoint
    first.tiered.close()  # a killed process releases its lock by dying
    del first

    # A new process: resume="auto" opens step 5; load_state replaces it with checkpoint_1's step 4.
    second = Run(tmp_path, state_dir=tmp_path / "state")
    second.resume()
    assert second.tiered.step_count == 4
    second.train(range(4, STEPS), save_every=2)
    assert second.tiered.step_count == STEPS
    assert "state_dict" not in vars(second.tiered) and "load_state_dict" not in vars(second.tiered)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert_same(second.weights(), expected)
    second.tiered.close()

    reference = Run(tmp_path / "torch", optimizer="torch", snapshot=False)
    reference.train(range(STEPS))
    assert_same(reference.weights(), expected)


def test_a_copied_folder_resumes_and_a_plain_accelerate_folder_loads(straight, tmp_path: Path, no_state_dict) -> None:
    """checkpoint_1 copied elsewhere (the original deleted) resumes; so does a folder torch.optim.AdamW saved."""
    project, expected = straight
    copy = tmp_path / "elsewhere" / "checkpoint_1"
    shutil.copytree(project / "checkpoints" / "checkpoint_1", copy)
    run = Run(tmp_path / "a", state_dir=tmp_path / "s1")
    run.accelerator.load_state(str(copy))
    run.train(range(4, STEPS))
    assert_same(run.weights(), expected)
    run.tiered.close()

    plain = Run(tmp_path / "plain", optimizer="torch", snapshot=False)
    plain.train(range(4), save_every=4)
    saved = torch.load(tmp_path / "plain" / "checkpoints" / "checkpoint_0" / "optimizer.bin", weights_only=True)
    assert "state" in saved and REFERENCE_KEY not in saved  # accelerate's own optimizer.bin
    run = Run(tmp_path / "b", state_dir=tmp_path / "s2")
    run.accelerator.load_state(str(tmp_path / "plain" / "checkpoints" / "checkpoint_0"))
    assert run.tiered.step_count == 4
    run.train(range(4, STEPS))
    assert_same(run.weights(), expected)
    run.tiered.close()


def test_optimizers_other_than_tiered_take_accelerates_path(tmp_path: Path) -> None:
    run = Run(tmp_path, optimizer="torch")
    assert run.hooks.optimizer is None
    run.train(range(2), save_every=2)
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    assert not {REFERENCE_NAME, SNAPSHOT_NAME} & set(os.listdir(folder))
    before = run.opt.state_dict()
    saved = torch.load(folder / "optimizer.bin", weights_only=True)
    assert torch.equal(saved["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    run.accelerator.load_state(str(folder))
    assert torch.equal(run.opt.state_dict()["state"][0]["exp_avg_sq"], before["state"][0]["exp_avg_sq"])


def damaged_copies(source: Path, root: Path) -> dict[str, Path]:
    """Copies of checkpoint_2 broken in each way a folder can be: named by what is wrong."""
    cases = {}
    for name in ("no_snapshot", "no_reference", "flipped_chunk", "mixed"):
        folder = root / name / "checkpoint_2"
        shutil.copytree(source / "checkpoint_2", folder)
        cases[name] = folder
    shutil.rmtree(cases["no_snapshot"] / SNAPSHOT_NAME)
    os.unlink(cases["no_reference"] / REFERENCE_NAME)
    chunk = next(p for p in sorted((cases["flipped_chunk"] / SNAPSHOT_NAME / "exp_avg").rglob("*"))
                 if p.is_file() and p.name != "zarr.json")  # fmt: skip
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    # optimizer.bin of step 6 beside the reference and snapshot of step 4: a folder assembled from two saves.
    shutil.rmtree(cases["mixed"] / SNAPSHOT_NAME)
    shutil.copytree(source / "checkpoint_1" / SNAPSHOT_NAME, cases["mixed"] / SNAPSHOT_NAME)
    shutil.copy(source / "checkpoint_1" / REFERENCE_NAME, cases["mixed"] / REFERENCE_NAME)
    return cases


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_snapshot", r"checkpoint_2.*missing.*copied whole"),
        ("no_reference", r"checkpoint_2.*cannot read its optimizer reference"),
        ("flipped_chunk", r"checkpoint_2.*damaged"),
        ("mixed", r"checkpoint_2.*step 6.*step 4.*mixes two saves"),
    ],
)
def test_a_damaged_or_deleted_snapshot_is_an_error_naming_the_folder(straight, tmp_path: Path, case: str,
                                                                     match: str) -> None:  # fmt: skip
    project, _ = straight
    folder = damaged_copies(project / "checkpoints", tmp_path)[case]
    run = Run(tmp_path / "run", state_dir=tmp_path / "state")
    with pytest.raises(CorruptStateError, match=match):
        run.accelerator.load_state(str(folder))
    if case != "flipped_chunk":  # refused before anything was loaded; never a silent fresh start either way
        assert run.tiered.step_count == 0
    run.tiered.close()


def test_the_stand_ins_remove_themselves_and_a_stale_one_gives_the_real_state_dict(tmp_path: Path) -> None:
    """After save_state the optimizer's own state_dict is back; one left by a failed save yields after a step."""
    run = Run(tmp_path)
    run.train(range(1), save_every=1)
    assert "state_dict" not in vars(run.tiered)
    real = run.tiered.state_dict()
    assert torch.is_tensor(real["state"][0]["exp_avg"])

    run.hooks._before_save([], [], str(tmp_path / "failed"))  # a save_state that stopped before the optimizer
    assert "state_dict" in vars(run.tiered)
    run.train(range(1, 2))  # training went on
    assert torch.is_tensor(run.tiered.state_dict()["state"][0]["exp_avg"])
    assert "state_dict" not in vars(run.tiered)
    run.tiered.close()


def test_fsdp_deepspeed_and_megatron_keep_their_own_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP (DCP for FSDP2) the hooks place, save and load nothing: accelerate's path as before."""
    run = Run(tmp_path)
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        monkeypatch.setattr(accelerate.Accelerator, "distributed_type", property(lambda self, kind=kind: kind))
        run.hooks._before_save([], [], str(tmp_path / "fsdp"))
        run.hooks._before_load([], str(tmp_path / "fsdp"))
        assert not (tmp_path / "fsdp").exists()
        assert "state_dict" not in vars(run.tiered) and "load_state_dict" not in vars(run.tiered)
    run.tiered.close()


def test_misuse_is_refused_with_the_fix(tmp_path: Path) -> None:
    run = Run(tmp_path)
    with pytest.raises(ConfigError, match="already called"):
        checkpoint_by_snapshot(run.accelerator)
    other = TieredAdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    with pytest.raises(ConfigError, match="one TieredAdamW per Accelerator"):
        run.accelerator.prepare(other)
    late = accelerate.Accelerator(cpu=True)
    late.prepare(other)
    with pytest.raises(ConfigError, match="before prepare"):
        checkpoint_by_snapshot(late)
    other.close()
    run.hooks.remove()
    assert "prepare_optimizer" not in vars(run.accelerator)
    run.tiered.close()


# -- within the budget: peak RSS of a child process ---------------------------------
CHILD = r"""
import gc, json, sys
import torch, accelerate
import tierstore.checkpoint, tierstore.optimizer  # imported before the baseline, as the memory kit does
from tierstore import TieredAdamW
from tierstore.integrations.accelerate import checkpoint_by_snapshot
from tierstore.testing.memory import MemoryProbe, build_params

cfg = json.loads(sys.argv[1])
work, budget = cfg["work"], cfg["ram_budget"]
params = build_params(cfg["params"])
warm = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=1e-3, fused=True)  # torch's one-time warm-up
warm.step()
accelerator = accelerate.Accelerator(cpu=True)
checkpoint_by_snapshot(accelerator)
gc.collect()
probe = MemoryProbe()
probe.baseline()
with probe.phase("construct"):
    opt = accelerator.prepare(TieredAdamW(params, lr=1e-3, state_dir=f"{work}/state", ram_budget=budget,
                                          shard_numel=cfg["shard_numel"]))
with probe.phase("step"):
    opt.step()
with probe.phase("save_state"):
    accelerator.save_state(f"{work}/checkpoint")
with probe.phase("load_state"):
    accelerator.load_state(f"{work}/checkpoint")
state = opt.optimizer.layout.state_nbytes
step = opt.optimizer.step_count
opt.optimizer.close()
print("RESULT " + json.dumps({"state": state, "step": step, "phases": {p.name: p.peak_growth for p in probe.phases}}))
"""


def test_save_state_and_load_state_stay_within_the_budget_in_a_child(tmp_path: Path) -> None:
    """Peak RSS growth of save_state and load_state <= ram_budget + 16 MiB; the state is 32 MB (15x the budget).

    Only the optimizer is prepared, so the phases measure its part: the model's weights are saved by
    accelerate as before (safetensors), whatever the optimizer.
    """
    from tierstore.testing.memory import OVERHEAD_BYTES

    budget = 2 << 20
    cfg = {"work": str(tmp_path), "ram_budget": budget, "params": 4_000_000, "shard_numel": 64 << 10}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["state"] > 10 * budget and result["step"] == 1
    over = {name: peak for name, peak in result["phases"].items() if peak > budget + OVERHEAD_BYTES}
    assert not over, f"peak RSS growth above {budget + OVERHEAD_BYTES} bytes: {over} (all: {result['phases']})"
    assert os.path.getsize(tmp_path / "checkpoint" / "optimizer.bin") < 4096
