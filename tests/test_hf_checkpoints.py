"""Hugging Face ``Trainer`` checkpoints with ``TieredAdamW``, by snapshot (``tierstore.integrations.hf``).

A tiny ``LlamaForCausalLM`` (about 25k parameters, built from a config: no
download) whose optimizer state (200 KB) is five times its ``ram_budget``.
``TieredAdamW.state_dict`` is made to raise in every tiered run: no
checkpoint may build the state in RAM. Results are compared bitwise: a run
interrupted and resumed equals the uninterrupted run, which equals
``Trainer``'s own ``torch.optim.AdamW(fused=True)`` with the same groups.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.errors import ClosedError, CorruptStateError
from tierstore.integrations.snapshot import REFERENCE_NAME, SNAPSHOT_NAME, check_trainer_checkpoints

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tierstore.integrations.hf")

SHARD = 1024
BUDGET = 40 << 10  # 40 KiB: the arena plus one resident shard; the state is 200 KB


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def no_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any TieredAdamW.state_dict() call (the whole state in RAM) fails the test."""

    def refuse(self):
        raise AssertionError("state_dict() materialised the whole optimizer state")

    monkeypatch.setattr(TieredAdamW, "state_dict", refuse)


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def token_data(n: int = 24, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


class StopAt(transformers.TrainerCallback):
    """Stands for a kill: the job dies after ``step`` optimizer steps (in-process, so the test stays fast)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"killed at step {self.step}")


def run(out: Path, *, optimizer: str = "tiered", state_dir: Path | None = None, resume=None, stop: int | None = None,
        trainer_cls=None, **args):  # fmt: skip
    """Train the tiny model with Trainer; returns (model, trainer)."""
    model = tiny_llama()
    if optimizer == "tiered":
        kwargs = dict(lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD, state_dir=str(state_dir), resume="auto")
        cls_kwargs = (TieredAdamW, kwargs)
    else:
        cls_kwargs = (torch.optim.AdamW, dict(lr=1e-2, fused=True))
    settings = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_strategy="steps",
                    save_steps=2, logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                    weight_decay=0.1, lr_scheduler_type="linear")  # fmt: skip
    settings.update(args)
    trainer_cls = trainer_cls or (hf.TieredTrainer if optimizer == "tiered" else transformers.Trainer)
    trainer = trainer_cls(model=model, args=transformers.TrainingArguments(**settings), train_dataset=token_data(),
                          eval_dataset=token_data(8), optimizer_cls_and_kwargs=cls_kwargs,
                          callbacks=[StopAt(stop)] if stop else None)  # fmt: skip
    if stop:
        with pytest.raises(KeyboardInterrupt):
            trainer.train(resume_from_checkpoint=resume)
        opt = hf.tiered_optimizer(trainer.optimizer)
        assert opt.commit() == stop  # the state directory is ahead of the last checkpoint
        opt.close()  # a killed process releases its lock by dying
    else:
        trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_trainer_checkpoints_by_snapshot_rotate_and_resume_bitwise(tmp_path: Path, no_state_dict) -> None:
    """save_steps=2, save_total_limit=2, killed at step 5, resume_from_checkpoint=True == 6 straight steps == torch."""
    straight, trainer = run(tmp_path / "straight", state_dir=tmp_path / "s1", save_total_limit=2)
    opt = hf.tiered_optimizer(trainer.optimizer)
    assert opt.layout.state_nbytes > 4 * BUDGET
    with pytest.raises(ClosedError, match="CloseTieredOptimizer closed it"):  # closed by on_train_end
        opt.check_usable()
    names = sorted(os.listdir(tmp_path / "straight"))
    assert names == ["checkpoint-4", "checkpoint-6"]  # rotation deleted checkpoint-2, snapshot and all
    for name in names:
        files = set(os.listdir(tmp_path / "straight" / name))
        assert {REFERENCE_NAME, SNAPSHOT_NAME, "scheduler.pt", "trainer_state.json"} <= files
        assert "optimizer.pt" not in files
    assert check_trainer_checkpoints(tmp_path / "straight") == []

    run(tmp_path / "killed", state_dir=tmp_path / "s2", stop=5)  # the state directory committed step 5
    # resume="auto" opens step 5, the trainer's checkpoint-4 replaces it: the state directory follows.
    resumed, trainer = run(tmp_path / "killed", state_dir=tmp_path / "s2", resume=True)
    assert hf.tiered_optimizer(trainer.optimizer).step_count == 6
    assert_same(resumed, straight)

    reference, _ = run(tmp_path / "torch", optimizer="torch", save_strategy="no")
    assert_same(straight, reference)


def test_param_groups_are_trainers_and_a_copied_checkpoint_resumes(tmp_path: Path, no_state_dict) -> None:
    """hf.param_groups == Trainer.create_optimizer's groups; resume from a copy of the folder elsewhere."""
    model = tiny_llama()
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp_path / "x"), weight_decay=0.1,
                                   use_cpu=True, report_to=[]))  # fmt: skip
    built = trainer.create_optimizer()
    mine = hf.param_groups(model, 0.1)
    assert [[id(p) for p in g["params"]] for g in built.param_groups] == [[id(p) for p in g["params"]] for g in mine]
    assert [g["weight_decay"] for g in mine] == [0.1, 0.0]
    assert any("norm" in n for n, p in model.named_parameters() if any(p is q for q in mine[1]["params"]))

    straight, _ = run(tmp_path / "a", state_dir=tmp_path / "s1", max_steps=4)
    copy = tmp_path / "elsewhere" / "checkpoint-2"
    shutil.copytree(tmp_path / "a" / "checkpoint-2", copy)
    shutil.rmtree(tmp_path / "a")
    resumed, _ = run(tmp_path / "b", state_dir=tmp_path / "s2", max_steps=4, resume=str(copy))
    assert_same(resumed, straight)


def test_missing_or_damaged_snapshot_or_save_only_model_is_refused_naming_the_checkpoint(tmp_path: Path) -> None:
    run(tmp_path / "a", state_dir=tmp_path / "s1", max_steps=2, save_only_model=False)
    ckpt = tmp_path / "a" / "checkpoint-2"
    broken = tmp_path / "broken" / "checkpoint-2"
    shutil.copytree(ckpt, broken, ignore=shutil.ignore_patterns(SNAPSHOT_NAME))  # copied without the snapshot
    with pytest.raises(CorruptStateError, match=r"checkpoint-2.*missing.*copied whole"):
        run(tmp_path / "b", state_dir=tmp_path / "s2", max_steps=4, resume=str(broken))
    assert [f.kind for f in check_trainer_checkpoints(broken)] == ["error"]

    damaged = tmp_path / "damaged" / "checkpoint-2"
    shutil.copytree(ckpt, damaged)
    chunk = next(p for p in sorted((damaged / SNAPSHOT_NAME / "exp_avg").rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes()); data[100] ^= 0xFF; chunk.write_bytes(bytes(data))  # noqa: E702
    with pytest.raises(CorruptStateError, match=r"checkpoint-2.*damaged"):
        run(tmp_path / "c", state_dir=tmp_path / "s3", max_steps=4, resume=str(damaged))

    run(tmp_path / "m", state_dir=tmp_path / "s4", max_steps=2, save_only_model=True)
    assert not {REFERENCE_NAME, SNAPSHOT_NAME} & set(os.listdir(tmp_path / "m" / "checkpoint-2"))
    with pytest.raises(CorruptStateError, match=r"checkpoint-2.*save_only_model=True"):
        run(tmp_path / "m", state_dir=tmp_path / "s5", max_steps=4, resume=True)


def test_load_best_model_at_end_keeps_the_best_checkpoint_with_its_snapshot(tmp_path: Path, no_state_dict) -> None:
    _, trainer = run(tmp_path / "a", state_dir=tmp_path / "s", max_steps=4, eval_strategy="steps", eval_steps=2,
                     save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="loss",
                     greater_is_better=True)  # fmt: skip  (the worse loss is "best": the best is not the last)
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2")
    assert os.listdir(tmp_path / "a") == ["checkpoint-2"]  # the last (4) went, the best stayed
    assert check_trainer_checkpoints(best) == []


def test_resume_from_a_torch_adamw_optimizer_pt_equals_torch(tmp_path: Path, no_state_dict) -> None:
    """A run that saved optimizer.pt with torch.optim.AdamW resumes under TieredAdamW (mmap, streamed): same bits."""
    theirs, _ = run(tmp_path / "torch", optimizer="torch")
    assert "optimizer.pt" in os.listdir(tmp_path / "torch" / "checkpoint-4")
    mine, _ = run(tmp_path / "mine", state_dir=tmp_path / "s", resume=str(tmp_path / "torch" / "checkpoint-4"))
    assert_same(mine, theirs)


# -- within the budget: peak RSS of a child process ---------------------------------
CHILD = r"""
import gc, json, sys
import torch
import tierstore.checkpoint, tierstore.optimizer  # imported before the baseline, as the memory kit does
from tierstore import TieredAdamW
from tierstore.integrations.snapshot import load_trainer_snapshot, save_trainer_snapshot
from tierstore.integrations.torch_file import load_torch_optimizer_file
from tierstore.testing.memory import MemoryProbe, build_params

cfg = json.loads(sys.argv[1])
work, budget = cfg["work"], cfg["ram_budget"]
params = build_params(cfg["params"])
ref = torch.optim.AdamW(params, lr=1e-3, fused=True)  # what a migrating run saved (and torch's warm-up)
ref.step()
torch.save(ref.state_dict(), f"{work}/optimizer.pt")
del ref
gc.collect()
probe = MemoryProbe()
probe.baseline()
with probe.phase("construct"):
    opt = TieredAdamW(params, lr=1e-3, state_dir=f"{work}/state", ram_budget=budget, shard_numel=cfg["shard_numel"])
with probe.phase("step"):
    opt.step()
with probe.phase("save_snapshot"):
    save_trainer_snapshot(opt, f"{work}/checkpoint-1")
with probe.phase("load_snapshot"):
    load_trainer_snapshot(opt, f"{work}/checkpoint-1")
with probe.phase("load_torch_file"):
    load_torch_optimizer_file(opt, f"{work}/optimizer.pt")
state = opt.layout.state_nbytes
opt.close()
print("RESULT " + json.dumps({"state": state, "phases": {p.name: p.peak_growth for p in probe.phases}}))
"""


def test_snapshot_save_and_resume_stay_within_the_budget_in_a_child(tmp_path: Path) -> None:
    """Peak RSS growth of save, snapshot load and optimizer.pt load (mmap) <= ram_budget + 16 MiB; state 48 MB."""
    import json
    import subprocess
    import sys

    from tierstore.testing.memory import OVERHEAD_BYTES

    budget = 4 << 20
    cfg = {"work": str(tmp_path), "ram_budget": budget, "params": 6_000_000, "shard_numel": 128 << 10}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["state"] > 10 * budget
    over = {name: peak for name, peak in result["phases"].items() if peak > budget + OVERHEAD_BYTES}
    assert not over, f"peak RSS growth above {budget + OVERHEAD_BYTES} bytes: {over} (all: {result['phases']})"


def test_a_fresh_run_on_a_committed_state_dir_is_refused(tmp_path: Path) -> None:
    """resume="auto" opened step 5 of the state directory, but the Trainer starts at step 0: refused, not mixed."""
    from tierstore.errors import ConfigError

    run(tmp_path / "first", state_dir=tmp_path / "s", stop=5)  # the state directory committed step 5
    with pytest.raises(ConfigError, match=r"resumed step 5 from state_dir=.*starts at step 0.*resume_from_checkpoint"):
        run(tmp_path / "again", state_dir=tmp_path / "s")  # no resume_from_checkpoint


def test_a_checkpoint_without_its_scheduler_is_refused_before_the_optimizer_is_touched(tmp_path: Path) -> None:
    run(tmp_path / "a", state_dir=tmp_path / "s1", max_steps=2)
    ckpt = tmp_path / "a" / "checkpoint-2"
    os.unlink(ckpt / "scheduler.pt")
    model = tiny_llama()
    opt = TieredAdamW(model.parameters(), lr=1e-2, ram_budget=BUDGET, shard_numel=SHARD)
    trainer = hf.TieredTrainer(model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path / "b"),
                               report_to=[], use_cpu=True), optimizers=(opt, None))  # fmt: skip
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    with pytest.raises(CorruptStateError, match=r"checkpoint-2.*no scheduler\.pt"):
        trainer._load_optimizer_and_scheduler(str(ckpt))
    assert opt.step_count == 0  # the snapshot (step 2) was not loaded
    opt.close()
