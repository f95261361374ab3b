"""TieredAdamW inside the training stacks users have: Hugging Face ``Trainer``, gradient
accumulation, ``torch.compile``d models, ``torch.amp.GradScaler`` under autocast.

Every comparison is bitwise against ``torch.optim.AdamW(fused=True)`` fed the
same gradients; the tiered optimizers run with a tight ``ram_budget`` so most
shards stream from disk.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW

SHARD = 1024
TIGHT = 40 << 10  # 40 KiB: the 4-slot arena plus one resident shard; the rest on disk


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 8))


def micro_batch(step: int, part: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + part)
    return torch.randn(rows, 32, generator=gen), torch.randn(rows, 8, generator=gen)


def tiered(params, **kw) -> TieredAdamW:
    opt = TieredAdamW(params, ram_budget=TIGHT, shard_numel=SHARD, **kw)
    assert opt.disk_bytes > 0
    return opt


def assert_same(model: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def assert_same_state(mine: dict, theirs: dict) -> None:
    assert mine["state"].keys() == theirs["state"].keys()
    for i, entry in theirs["state"].items():
        assert float(mine["state"][i]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine["state"][i][key], entry[key]), (i, key)


# -- gradient accumulation --------------------------------------------------
@pytest.mark.parametrize("accumulate", [1, 3])
def test_gradient_accumulation_equals_torch_adamw(accumulate: int) -> None:
    """Several backward passes add into .grad, then one step: the same as torch AdamW."""
    model, ref_model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with tiered(model.parameters(), lr=1e-2, weight_decay=0.1) as opt:
        for m, o in ((model, opt), (ref_model, ref)):
            for step in range(4):
                o.zero_grad()
                for part in range(accumulate):
                    x, y = micro_batch(step, part)
                    (nn.functional.mse_loss(m(x), y) / accumulate).backward()
                o.step()
        assert_same(model, ref_model)
        assert_same_state(opt.state_dict(), ref.state_dict())


# -- torch.compile -------------------------------------------------------------
def run_compiled(backend: str) -> None:
    """One compiled model trains with TieredAdamW, then (reset) with torch AdamW: same weights."""
    model = mlp()
    init = copy.deepcopy(model.state_dict())
    compiled = torch.compile(model, backend=backend)

    def train(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        for step in range(3):
            x, y = micro_batch(step, 0)
            opt.zero_grad()
            nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()  # the optimizer runs eagerly: only the model is compiled
        return [p.detach().clone() for p in model.parameters()]

    with tiered(model.parameters(), lr=1e-2) as opt:
        mine = train(opt)
    model.load_state_dict(init)
    theirs = train(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_compiled_model_aot_eager() -> None:
    """Dynamo + AOTAutograd (the graph capture a compiled model goes through), without codegen: fast."""
    torch._dynamo.reset()
    run_compiled("aot_eager")


@pytest.mark.slow
def test_compiled_model_inductor() -> None:
    """The default backend; its C++ codegen takes ~40 s on a cold cache on 2 cores (~10 s warm)."""
    torch._dynamo.reset()
    run_compiled("inductor")


# -- GradScaler under autocast -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_scaler_with_autocast_skips_overflow_steps(dtype: torch.dtype) -> None:
    """scaler.step(opt) under CPU autocast; an inf gradient skips the step and leaves the state as it was."""
    model, ref_model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    with tiered(model.parameters(), lr=1e-2) as opt:
        for m, o in ((model, opt), (ref_model, ref)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
            for step in range(5):
                o.zero_grad()
                x, y = micro_batch(step, 0)
                with torch.autocast("cpu", dtype=dtype):
                    loss = nn.functional.mse_loss(m(x).float(), y)
                scaler.scale(loss).backward()
                if step == 2:
                    m[0].weight.grad[3, 3] = float("inf")
                    before = copy.deepcopy(o.state_dict())
                    weights = [p.detach().clone() for p in m.parameters()]
                scaler.step(o)
                scaler.update()
                if step == 2:  # skipped: neither state nor weights moved
                    assert_same_state(o.state_dict(), before)
                    assert all(torch.equal(a, b) for a, b in zip(weights, m.parameters()))
            assert scaler.get_scale() == 2.0**11  # halved once, by the overflow
        assert_same(model, ref_model)
        mine = opt.state_dict()
        assert_same_state(mine, ref.state_dict())
        assert {float(e["step"]) for e in mine["state"].values()} == {4.0}


# -- Hugging Face Trainer --------------------------------------------------------
def need_transformers():
    """The ``hf`` extra; skipped where it is not installed, unless TIERSTORE_REQUIRE_HF=1 (CI installs it)."""
    if os.environ.get("TIERSTORE_REQUIRE_HF") == "1":
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def tiny_llama(seed: int = 0):
    transformers = need_transformers()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)  # random init from a config: no download


def token_data(n: int = 32, length: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row, "labels": row} for row in ids]


def train_with_trainer(out: Path, optimizer: str, *, resume: str | None = None) -> nn.Module:
    transformers = need_transformers()
    model = tiny_llama()
    if optimizer == "tiered":
        opt = tiered(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="steps",
        save_steps=3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_data(), optimizers=(opt, schedule))
    trainer.train(resume_from_checkpoint=resume)
    if optimizer == "tiered":
        # Resumed: 3 steps loaded from optimizer.pt, then 3 more; the count continues.
        assert opt.step_count == 6
        opt.close()
    return model


def test_hf_trainer_checkpoint_resume_equals_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer(optimizers=(TieredAdamW, scheduler)) with accumulation; resume from checkpoint-3 == 6 straight steps."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # built from a config: nothing may be downloaded
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    need_transformers()
    straight = train_with_trainer(tmp_path / "run", "tiered")
    checkpoint = tmp_path / "run" / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)  # what Trainer wrote: our state_dict()
    assert {float(e["step"]) for e in saved["state"].values()} == {3.0}
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    resumed = train_with_trainer(tmp_path / "run", "tiered", resume=str(checkpoint))
    assert_same(resumed, straight)
    reference = train_with_trainer(tmp_path / "ref", "torch")
    assert_same(straight, reference)
    assert os.path.isdir(tmp_path / "run" / "checkpoint-6")
