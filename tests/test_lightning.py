"""TieredAdamW under PyTorch Lightning: fit, checkpoint through Lightning, resume, bitwise.

A ``LightningModule`` whose ``configure_optimizers`` returns TieredAdamW (a tight
``ram_budget``, so most shards stream from disk) with a ``StepLR`` stepping every
batch is trained by a ``Trainer`` on the CPU. The run is cut after the first epoch,
checkpointed by Lightning's ``ModelCheckpoint`` (which calls
``optimizer.state_dict()``), and resumed by a fresh module and ``Trainer`` with
``ckpt_path`` (Lightning calls ``optimizer.load_state_dict`` and restores the
scheduler and the loops). The resumed weights and optimizer state equal an
uninterrupted fit bitwise, and both equal the same fit with
``torch.optim.AdamW(fused=True)``.

Lightning wraps the optimizer in a ``LightningOptimizer`` whose class derives from
the optimizer's and which copies its ``__dict__``; when such a wrapper went away it
used to close the shard store (``ClosedError`` on the first step). The machinery now
lives in a runtime shared by every copy (``tierstore._runtime.runtime``).

Skipped where Lightning is not installed, unless ``TIERSTORE_REQUIRE_LIGHTNING=1``
(CI installs the ``lightning`` extra and sets it).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW


def need_lightning():
    if os.environ.get("TIERSTORE_REQUIRE_LIGHTNING") == "1":
        import lightning

        return lightning
    return pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")


L = need_lightning()

BATCHES = 3  # batches per epoch: the checkpoint is taken after epoch 0, at global step 3
TIGHT = 40 << 10  # 40 KiB: the 4-slot arena plus one resident shard; the rest on disk


def data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(BATCHES * 8, 32, generator=gen), torch.randn(BATCHES * 8, 8, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)


class Regressor(L.LightningModule):
    def __init__(self, optimizer: str, state_dir: Path | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 8))
        self.kind = optimizer
        self.state_dir = state_dir
        self.opt: torch.optim.Optimizer | None = None

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        if self.kind == "tiered":
            self.opt = TieredAdamW(
                self.parameters(), lr=1e-2, weight_decay=0.1, ram_budget=TIGHT, shard_numel=1024, state_dir=self.state_dir
            )
            assert self.opt.disk_bytes > 0  # the disk tier is exercised
        else:
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(epochs: int, root: Path, **kw) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kw,
    )


def run(module: Regressor, epochs: int, root: Path, *, ckpt_path: str | None = None, callbacks: list | None = None) -> L.Trainer:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|GPU available|LightningModule.log).*")
        t = trainer(epochs, root, callbacks=callbacks or [], enable_checkpointing=bool(callbacks))
        t.fit(module, data(), ckpt_path=ckpt_path)
    return t


def moments(opt: torch.optim.Optimizer) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    sd = opt.state_dict()
    return [(float(e["step"]), e["exp_avg"], e["exp_avg_sq"]) for _, e in sorted(sd["state"].items())]


def assert_same(a: Regressor, b: Regressor) -> None:
    for (name, x), (_, y) in zip(a.net.named_parameters(), b.net.named_parameters()):
        assert torch.equal(x, y), name
    for (sa, ma, va), (sb, mb, vb) in zip(moments(a.opt), moments(b.opt)):
        assert sa == sb and torch.equal(ma, mb) and torch.equal(va, vb)
    assert a.opt.param_groups[0]["lr"] == b.opt.param_groups[0]["lr"]


def test_fit_checkpoint_resume_equals_uninterrupted_and_torch_adamw(tmp_path: Path) -> None:
    whole = Regressor("tiered", tmp_path / "whole-state")
    t = run(whole, 2, tmp_path / "whole")
    assert t.global_step == 2 * BATCHES and whole.opt.step_count == 2 * BATCHES
    assert whole.opt.param_groups[0]["lr"] == 1e-2 * 0.5**3  # StepLR every 2 of 6 steps

    reference = Regressor("torch")
    run(reference, 2, tmp_path / "torch")
    assert_same(whole, reference)

    first = Regressor("tiered", tmp_path / "first-state")
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
    run(first, 1, tmp_path / "first", callbacks=[checkpoints])
    [path] = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == BATCHES and len(saved["optimizer_states"]) == 1
    assert set(saved["optimizer_states"][0]["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}  # torch's format
    first.opt.close()

    resumed = Regressor("tiered", tmp_path / "resumed-state")  # a fresh, empty state directory
    t = run(resumed, 2, tmp_path / "resumed", ckpt_path=str(path))
    assert t.global_step == 2 * BATCHES
    assert_same(resumed, whole)
    resumed.opt.close()
    whole.opt.close()


def test_save_checkpoint_after_fit_and_the_wrapper_leave_the_store_open(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after ``fit`` (the LightningOptimizer wrappers are gone by then)."""
    module = Regressor("tiered", tmp_path / "state")
    t = run(module, 1, tmp_path / "run")
    wrapped = t.strategy._lightning_optimizers[0]
    assert isinstance(wrapped, type(module.opt)) and wrapped is not module.opt
    del wrapped
    t.strategy._lightning_optimizers = []
    import gc

    gc.collect()
    t.save_checkpoint(tmp_path / "after.ckpt")
    module.opt.step()  # the store is still open: no ClosedError
    module.opt.close()
    assert torch.load(tmp_path / "after.ckpt", weights_only=False)["global_step"] == BATCHES
