"""Lightning checkpoints with ``TieredAdamW``, by snapshot (``tierstore.integrations.lightning``).

A ``LightningModule`` whose optimizer state (about 170 KB) is several times
its ``ram_budget``, trained with ``TieredCheckpoints`` in the callbacks.
``TieredAdamW.state_dict`` is made to raise in every run: no checkpoint may
build the state in RAM. Results are compared bitwise: a run killed and
resumed from Lightning's checkpoint equals the uninterrupted run, which
equals the same fit with ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW
from tierstore.cli import main as cli
from tierstore.errors import ClosedError, CorruptStateError
from tierstore.integrations.snapshot import REFERENCE_NAME, SNAPSHOT_NAME, check_trainer_checkpoints
from tierstore.testing.memory import OVERHEAD_BYTES

if os.environ.get("TIERSTORE_REQUIRE_LIGHTNING") == "1":
    import lightning as L
else:
    L = pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")
from tierstore.integrations.lightning import REFERENCE_KEY, TieredCheckpoints, snapshot_folder  # noqa: E402

BATCHES = 4  # batches per epoch
BUDGET = 48 << 10  # 48 KiB: the arena plus a resident shard or two; the rest streams from state_dir


@pytest.fixture
def no_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any TieredAdamW.state_dict() call (the whole state in RAM) fails the test."""

    def refuse(self):
        raise AssertionError("state_dict() materialised the whole optimizer state")

    monkeypatch.setattr(TieredAdamW, "state_dict", refuse)


def data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(BATCHES * 8, 32, generator=gen), torch.randn(BATCHES * 8, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str = "tiered", state_dir: Path | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))
        self.kind, self.state_dir = optimizer, state_dir
        self.opt: torch.optim.Optimizer | None = None

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        if self.kind == "tiered":
            self.opt = TieredAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, ram_budget=BUDGET, shard_numel=1024,
                                   state_dir=self.state_dir, resume="auto")  # fmt: skip
            assert self.opt.layout.state_nbytes > 3 * BUDGET  # most of the state streams
        else:
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Killed(Exception):
    """Lightning turns a KeyboardInterrupt into SystemExit after its graceful shutdown; this passes through."""


class KillAt(L.Callback):
    """Stands for a kill: the job dies after ``step`` optimizer steps (in-process, so the test stays fast)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def fit(module: Regressor, root: Path, *, epochs: int = 2, callbacks=(), ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), callbacks=list(callbacks),
                        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks))  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|GPU available|ckpt_path).*")
        trainer.fit(module, data(), ckpt_path=ckpt_path)
    return trainer


def checkpoints(dirpath: Path, **kw) -> L.pytorch.callbacks.ModelCheckpoint:
    """Every n steps, top-k by step (the newest k kept), as a run that keeps recent checkpoints sets it up."""
    return L.pytorch.callbacks.ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", **kw)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_checkpoints_by_snapshot_rotate_and_resume_after_a_kill_bitwise(tmp_path: Path, no_state_dict) -> None:
    """Top-2 every 2 steps plus last; killed at step 7; fit(ckpt_path=last) == 8 straight steps == torch."""
    straight = Regressor(state_dir=tmp_path / "s1")
    fit(straight, tmp_path / "r1", callbacks=[TieredCheckpoints(), checkpoints(tmp_path / "c1", save_top_k=2,
                                                                               every_n_train_steps=2, save_last=True)])  # fmt: skip
    with pytest.raises(ClosedError, match=r"TieredCheckpoints closed it.*close_at_end=False"):  # closed when fit ended
        straight.opt.check_usable()
    names = sorted(os.listdir(tmp_path / "c1"))
    ckpts = [n for n in names if n.endswith(".ckpt")]
    assert ckpts == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names  # step 2 and 4 rotated out
    assert sorted(set(names) - set(ckpts)) == [n + ".tierstore" for n in ckpts]  # one snapshot each, nothing else
    for name in ckpts:
        assert {REFERENCE_NAME, SNAPSHOT_NAME} == set(os.listdir(tmp_path / "c1" / (name + ".tierstore")))
        saved = torch.load(tmp_path / "c1" / name, weights_only=True)  # plain values: no pickled objects
        [state] = saved["optimizer_states"]
        assert set(state) == {REFERENCE_KEY} and state[REFERENCE_KEY]["step_count"] == saved["global_step"]
    assert check_trainer_checkpoints(tmp_path / "c1") == []

    with pytest.raises(Killed):
        killed = Regressor(state_dir=tmp_path / "s2")
        fit(killed, tmp_path / "r2", callbacks=[TieredCheckpoints(close_at_end=False), KillAt(7),
                                                checkpoints(tmp_path / "c2", save_last=True)])  # fmt: skip
    assert killed.opt.commit() == 7  # the state directory is ahead of the last checkpoint (step 4, epoch 0's end)
    killed.opt.close()  # a killed process releases its lock by dying
    # resume="auto" opens step 7; the checkpoint's snapshot (step 4) replaces it: the state directory follows.
    # (Checkpoints at an epoch's end: Lightning replays a mid-epoch checkpoint's epoch from its first batch.)
    resumed = Regressor(state_dir=tmp_path / "s2")
    fit(resumed, tmp_path / "r2", callbacks=[TieredCheckpoints()], ckpt_path=str(tmp_path / "c2" / "last.ckpt"))
    assert resumed.opt.step_count == 8
    assert_same(resumed, straight)

    reference = Regressor("torch")
    fit(reference, tmp_path / "r3")
    assert_same(straight, reference)


def test_a_copied_folder_resumes_a_link_resolves_and_damage_is_named(tmp_path: Path, no_state_dict) -> None:
    first = Regressor(state_dir=tmp_path / "s1")
    fit(first, tmp_path / "r1", epochs=1, callbacks=[TieredCheckpoints(), checkpoints(tmp_path / "c", save_top_k=1,
                                                                                      save_last="link")])  # fmt: skip
    assert os.path.islink(tmp_path / "c" / "last.ckpt")  # shares the checkpoint's snapshot
    assert not os.path.exists(snapshot_folder(tmp_path / "c" / "last.ckpt"))
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "c", moved, symlinks=True)

    whole = Regressor(state_dir=tmp_path / "s2")
    fit(whole, tmp_path / "r2", callbacks=[TieredCheckpoints()])
    resumed = Regressor(state_dir=tmp_path / "s3")
    fit(resumed, tmp_path / "r3", callbacks=[TieredCheckpoints()], ckpt_path=str(moved / "last.ckpt"))
    assert_same(resumed, whole)

    target = moved / os.readlink(moved / "last.ckpt")
    shutil.rmtree(snapshot_folder(target) / SNAPSHOT_NAME)
    with pytest.raises(CorruptStateError, match=r"epoch=0-step=4\.ckpt\.tierstore.*missing"):
        fit(Regressor(state_dir=tmp_path / "s4"), tmp_path / "r4", callbacks=[TieredCheckpoints()], ckpt_path=str(target))
    shutil.rmtree(snapshot_folder(target))
    with pytest.raises(CorruptStateError, match=r"copy the \.ckpt file together with its epoch=0-step=4\.ckpt\.tierstore/"):
        fit(Regressor(state_dir=tmp_path / "s5"), tmp_path / "r5", callbacks=[TieredCheckpoints()], ckpt_path=str(target))


def test_a_ckpt_deleted_by_hand_leaves_an_orphan_that_verify_names(tmp_path: Path, capsys) -> None:
    module = Regressor(state_dir=tmp_path / "s")
    fit(module, tmp_path / "r", epochs=1, callbacks=[TieredCheckpoints(), checkpoints(tmp_path / "c", save_top_k=1)])
    [ckpt] = sorted((tmp_path / "c").glob("*.ckpt"))
    assert cli(["verify", str(tmp_path / "c")]) == 0
    ckpt.unlink()
    [finding] = check_trainer_checkpoints(tmp_path / "c")
    assert finding.kind == "orphan" and finding.path == str(snapshot_folder(ckpt)) and finding.nbytes > 0
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "c")]) == 3
    assert f"{ckpt.name}, which is gone" in capsys.readouterr().out


# -- within the budget: peak RSS of a child process ---------------------------------
CHILD = r"""
import json, sys, warnings
import torch
import lightning as L
import tierstore.checkpoint, tierstore.optimizer  # imported before the baseline, as the memory kit does
from tierstore import TieredAdamW
from tierstore.integrations import lightning as tl
from tierstore.testing.memory import MemoryProbe

warnings.filterwarnings("ignore")
cfg = json.loads(sys.argv[1])
work, budget = cfg["work"], cfg["ram_budget"]
probe = MemoryProbe()
# tierstore's part of each save and resume, measured from just before it (the model's weights and
# grads, and Lightning's own file, are the trainer's, as with torch.optim.AdamW).
save = tl.SnapshotCheckpointIO._write_snapshot
def saving(*a):
    probe.baseline()
    with probe.phase("save"):
        return save(*a)
tl.SnapshotCheckpointIO._write_snapshot = staticmethod(saving)
whole = L.Trainer.save_checkpoint
def whole_save(*a, **k):  # Lightning's own part too: its TorchCheckpointIO buffered the whole file in RAM
    probe.baseline()
    with probe.phase("whole save"):
        return whole(*a, **k)
L.Trainer.save_checkpoint = whole_save
restore = tl._load_reference
def loading(*a):
    probe.baseline()
    with probe.phase("load"):
        return restore(*a)
tl._load_reference = loading

class Wide(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(cfg["width"], cfg["width"])
    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()
    def configure_optimizers(self):
        return TieredAdamW(self.parameters(), lr=1e-3, state_dir=f"{work}/state", ram_budget=budget,
                           shard_numel=cfg["shard_numel"], resume="auto")

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2, cfg["width"])), batch_size=1)
def fit(ckpt_path=None):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{work}/ckpt", every_n_train_steps=1)
    t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=work, callbacks=[tl.TieredCheckpoints(), ckpt])
    module = Wide()
    t.fit(module, data, ckpt_path=ckpt_path)
    return t
fit()
import glob
fit(ckpt_path=sorted(glob.glob(f"{work}/ckpt/*.ckpt"))[0])
state = cfg["width"] * (cfg["width"] + 1) * 8
peaks = {}
for p in probe.phases:
    peaks[p.name] = max(peaks.get(p.name, 0), p.peak_growth)
print("RESULT " + json.dumps({"state": state, "phases": peaks}))
"""


def test_save_and_resume_stay_within_the_budget_in_a_child(tmp_path: Path) -> None:
    """Peak RSS growth while Lightning saves (the snapshot, and the whole save with the model's 21 MB of
    weights in the .ckpt) and resumes <= ram_budget + 16 MiB; the state is 42 MB."""
    budget = 4 << 20
    cfg = {"work": str(tmp_path), "ram_budget": budget, "width": 2300, "shard_numel": 128 << 10}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["state"] > 10 * budget
    phases = result["phases"]
    assert {"save", "whole save", "load"} <= set(phases), phases
    over = {name: peak for name, peak in phases.items() if peak > budget + OVERHEAD_BYTES}
    assert not over, f"peak RSS growth above {budget + OVERHEAD_BYTES} bytes: {over} (all: {phases})"


def test_a_fresh_fit_on_a_committed_state_dir_is_refused(tmp_path: Path) -> None:
    """resume="auto" opened the state directory's last commit, but fit starts at step 0: refused, not mixed."""
    from tierstore.errors import ConfigError

    first = Regressor(state_dir=tmp_path / "s")
    fit(first, tmp_path / "r1", epochs=1, callbacks=[TieredCheckpoints()])
    again = Regressor(state_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match=r"resumed step \d+ from state_dir=.*starts at step 0.*ckpt_path"):
        fit(again, tmp_path / "r2", epochs=1, callbacks=[TieredCheckpoints()])
    assert again.opt.step_count == first.opt.step_count > 0  # nothing trained on
    again.opt.close()


@pytest.mark.parametrize("crash", ["before the file", "after the file", "mid-settle"])
def test_a_checkpoint_saved_again_under_its_name_survives_a_crash_at_each_point(tmp_path: Path, monkeypatch, crash) -> None:
    """last.ckpt saved at step 1, then again at step 3 with a crash at each point of the second save: the file on
    disk always loads the snapshot of its own step (found by its digest), never the other save's."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from tierstore.integrations import lightning as tl

    ws = [torch.nn.Parameter(torch.randn(4096)) for _ in range(4)]
    path = tmp_path / "last.ckpt"
    io = tl.SnapshotCheckpointIO(TorchCheckpointIO())

    def train_and_save(opt, steps):
        for _ in range(steps):
            for w in ws:
                w.grad = torch.ones_like(w)
            opt.step()
        io.save_checkpoint({"optimizer_states": [tl._Pending(opt, 0)], "global_step": opt.step_count}, path)

    class Crash(Exception):
        pass

    def crashing(*_a, **_k):
        raise Crash

    with TieredAdamW(ws, lr=0.1, ram_budget=BUDGET, shard_numel=1024) as opt:
        train_and_save(opt, 1)
        if crash == "before the file":
            monkeypatch.setattr(tl, "write_output_file", crashing)
        elif crash == "after the file":
            monkeypatch.setattr(tl, "_settle", crashing)
        else:
            real_rename = os.rename

            def rename(src, dst):  # the old snapshot is gone, the new one keeps its spare name
                if str(src).endswith(tl.SPARE_SUFFIX):
                    raise Crash
                real_rename(src, dst)

            monkeypatch.setattr(tl.os, "rename", rename)
        with pytest.raises(Crash):
            train_and_save(opt, 2)
        monkeypatch.undo()
    expected = 1 if crash == "before the file" else 3
    [state] = io.load_checkpoint(path)["optimizer_states"]
    assert state[REFERENCE_KEY]["step_count"] == expected
    with TieredAdamW([torch.nn.Parameter(torch.zeros(4096)) for _ in range(4)], lr=0.1) as fresh:
        tl._load_reference(fresh, state[REFERENCE_KEY])
        assert fresh.step_count == expected

    # The next save completes and leaves one snapshot folder, under its final name.
    with TieredAdamW(ws, lr=0.1, ram_budget=BUDGET, shard_numel=1024) as opt:
        train_and_save(opt, 1)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.tierstore"]
    assert check_trainer_checkpoints(tmp_path) == []


def test_a_snapshot_that_is_not_the_files_own_is_refused(tmp_path: Path) -> None:
    """Two checkpoints' snapshots swapped by hand: the digest the .ckpt pins names the mix-up."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from tierstore.integrations import lightning as tl

    ws = [torch.nn.Parameter(torch.randn(4096)) for _ in range(2)]
    io = tl.SnapshotCheckpointIO(TorchCheckpointIO())
    with TieredAdamW(ws, lr=0.1) as opt:
        for name in ("a.ckpt", "b.ckpt"):
            for w in ws:
                w.grad = torch.ones_like(w)
            opt.step()
            io.save_checkpoint({"optimizer_states": [tl._Pending(opt, 0)]}, tmp_path / name)
    os.rename(tmp_path / "a.ckpt.tierstore", tmp_path / "x")
    os.rename(tmp_path / "b.ckpt.tierstore", tmp_path / "a.ckpt.tierstore")
    [state] = io.load_checkpoint(tmp_path / "a.ckpt")["optimizer_states"]
    with TieredAdamW([torch.nn.Parameter(torch.zeros(4096)) for _ in range(2)], lr=0.1) as fresh, pytest.raises(
        CorruptStateError, match=r"a\.ckpt.*not the one this checkpoint saved"
    ):
        tl._load_reference(fresh, state[REFERENCE_KEY])


def test_a_remote_checkpoint_path_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from tierstore.errors import ConfigError
    from tierstore.integrations import lightning as tl

    monkeypatch.chdir(tmp_path)
    ws = [torch.nn.Parameter(torch.randn(16))]
    io = tl.SnapshotCheckpointIO(TorchCheckpointIO())
    with TieredAdamW(ws, lr=0.1) as opt, pytest.raises(ConfigError, match=r"s3://bucket/last\.ckpt.*remote URL"):
        io.save_checkpoint({"optimizer_states": [tl._Pending(opt, 0)]}, "s3://bucket/last.ckpt")
    assert os.listdir(tmp_path) == []  # no local folder named like the URL
