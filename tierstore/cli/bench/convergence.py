"""Convergence of moment formats: the same model, batches and schedule under each optimizer.

Two models, both built in code and trained on the text the package ships
(``tierstore/cli/demo/corpus.txt``, bytes as tokens; the last ``EVAL_FRACTION``
is held out for evaluation): the demo's :class:`~tierstore.cli.demo.model.TinyGPT`
and a GPT-2 causal LM built from a ``transformers.GPT2Config`` (no download).
Each contender starts from the same initial weights and sees the same
batches; the eval loss is measured every ``eval_every`` steps on fixed
windows of the held-out slice.

Contenders: ``torch.optim.AdamW(fused=True)`` (fp32, the baseline),
torchao's and bitsandbytes' ``AdamW8bit`` (on the CPU), and our formats
(``ours-<format>[-<rounding>][-raw]``): the registered formats run through
``TieredAdamW(moment_dtype=...)``, codec variants (stochastic rounding, an
int8 second moment without the square root) through the stand-in
:class:`~tierstore.cli.bench.codec_adamw.CodecAdamW`, which does the same
math (and equals ``TieredAdamW`` bit for bit on the registered formats).

Example
-------
>>> result = run_model("demo", ["torch-adamw-fp32", "ours-int8"], steps=2, eval_every=1,
...                    batch_size=2, context=16, eval_windows=2, small=True)
>>> sorted(result["contenders"]), result["contenders"]["ours-int8"]["steps"]
(['ours-int8', 'torch-adamw-fp32'], 2)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..._compute import formats
from ...errors import ConfigError
from ..demo.model import BatchStream, ModelConfig, TinyGPT, load_corpus
from .codec_adamw import CodecAdamW

EVAL_FRACTION = 0.1
WARMUP_STEPS = 50
MIN_LR_FRACTION = 0.1
CLIP_NORM = 1.0
BASELINE = "torch-adamw-fp32"

MODELS: dict[str, dict[str, Any]] = {
    # name: learning rate, weight decay, default batch/context, builder
    "demo": dict(lr=3e-3, weight_decay=0.1, batch_size=4, context=64),
    "gpt2": dict(lr=1e-3, weight_decay=0.1, batch_size=2, context=32),
}


def build_model(name: str, *, context: int, small: bool = False) -> nn.Module:
    """The model ``name`` with seed 0 weights; ``loss(x, y)`` gives mean next-byte cross-entropy."""
    torch.manual_seed(0)
    if name == "demo":
        return TinyGPT(ModelConfig(d_model=32, n_layer=1, n_head=2, context=context) if small else ModelConfig(context=context))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        width, layers = (32, 1) if small else (384, 6)  # 384 x 6 layers: 10.8 M parameters
        cfg = GPT2Config(
            vocab_size=256, n_positions=context, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        return _LossWrapper(GPT2LMHeadModel(cfg))
    raise ConfigError(f"model={name!r} is unknown; use one of {sorted(MODELS)}")


class _LossWrapper(nn.Module):
    """Gives a Hugging Face causal LM the ``loss(x, y)`` of the demo model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def our_format(name: str) -> formats.MomentFormat:
    """``ours-<format>[-<rounding>][-raw]`` as a format record (``-raw``: int8 second moment without sqrt)."""
    parts = name.removeprefix("ours-").split("-")
    fmt = formats.moment_format(parts[0])
    for part in parts[1:]:
        if part in ("nearest", "stochastic"):
            fmt = dataclasses.replace(fmt, name=f"{fmt.name}-{part}", rounding=part)
        elif part == "raw":
            fmt = dataclasses.replace(fmt, name=f"{fmt.name}-raw", sqrt_second=False)
        else:
            raise ConfigError(f"contender {name!r}: unknown variant {part!r}; use nearest, stochastic or raw")
    return fmt


def make_optimizer(
    name: str, params: list[Tensor], *, lr: float, weight_decay: float
) -> tuple[torch.optim.Optimizer, str, str | None]:
    """The optimizer called ``name``, how it is implemented (a short label), and the
    temporary state directory to remove after it is closed (None if it has none)."""
    if name == BASELINE:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True), "torch.optim.AdamW(fused=True)", None
    if name == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=lr, weight_decay=weight_decay), "torchao.optim.AdamW8bit", None
    if name == "bnb-adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay), "bitsandbytes.optim.AdamW8bit", None
    if name.startswith("ours-"):
        fmt = our_format(name)
        from ...optimizer import TieredAdamW

        if formats.FORMATS.get(fmt.name) == fmt:  # a state format: the real optimizer (all state in RAM)
            opt = TieredAdamW(params, lr=lr, weight_decay=weight_decay, moment_dtype=fmt.name)
            return opt, f"TieredAdamW(moment_dtype={fmt.name!r})", None
        # A codec variant (stochastic rounding, raw second moment): the stand-in doing the same math.
        return CodecAdamW(params, lr=lr, weight_decay=weight_decay, moment_dtype=fmt), f"stand-in CodecAdamW({fmt})", None
    raise ConfigError(f"contender {name!r} is unknown")


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr)  # torchao keeps lr as a tensor
        else:
            group["lr"] = lr


def lr_at(step: int, steps: int, base: float) -> float:
    """Linear warm-up for ``WARMUP_STEPS``, then cosine down to ``MIN_LR_FRACTION`` of ``base``."""
    if step < WARMUP_STEPS:
        return base * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return base * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def run_model(
    model_name: str,
    contenders: list[str],
    *,
    steps: int,
    eval_every: int,
    batch_size: int | None = None,
    context: int | None = None,
    eval_windows: int = 32,
    batch_seed: int = 0,
    small: bool = False,
    progress: Callable[[str], None] | None = None,
    on_contender: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``model_name`` under each contender; the losses, eval curve and timing of each."""
    spec = MODELS[model_name]
    batch_size = batch_size or spec["batch_size"]
    context = context or spec["context"]
    corpus = load_corpus()
    cut = int(corpus.numel() * (1 - EVAL_FRACTION))
    train, held_out = corpus[:cut], corpus[cut:].long()
    stream = BatchStream(train, context=context, batch_size=batch_size, seed=batch_seed)
    starts = torch.linspace(0, held_out.numel() - context - 1, eval_windows).long()
    window = held_out[starts[:, None] + torch.arange(context + 1)]
    eval_x, eval_y = window[:, :-1], window[:, 1:]
    initial = build_model(model_name, context=context, small=small)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in initial.parameters()),
        "batch_size": batch_size, "context": context, "lr": spec["lr"], "weight_decay": spec["weight_decay"],
        "batch_seed": batch_seed,
        "train_tokens": train.numel(), "eval_tokens": int(eval_x.numel()), "contenders": {},
    }
    for name in contenders:
        model = copy.deepcopy(initial)
        params = [p for p in model.parameters() if p.requires_grad]
        record: dict[str, Any] = {"steps": 0}
        try:
            opt, impl, state_dir = make_optimizer(name, params, lr=spec["lr"], weight_decay=spec["weight_decay"])
        except Exception as exc:  # an optional library that cannot run here: say why, go on
            record["error"] = f"{type(exc).__name__}: {exc}"
            out["contenders"][name] = record
            continue
        record["impl"] = impl
        train_losses, evals, opt_seconds = [], [], 0.0
        start = time.perf_counter()
        for step in range(steps):
            x, y = stream.batch(step)
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, CLIP_NORM)
            _set_lr(opt, lr_at(step, steps, spec["lr"]))
            t0 = time.perf_counter()
            opt.step()
            opt_seconds += time.perf_counter() - t0
            train_losses.append(loss.item())
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                with torch.no_grad():
                    evals.append((step + 1, model.loss(eval_x, eval_y).item()))
                if progress:
                    progress(f"{model_name} {name} step {step + 1}: train {loss.item():.4f} eval {evals[-1][1]:.4f}")
        if hasattr(opt, "close"):
            opt.close()
        if state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)
        record.update(
            steps=steps, train_loss=train_losses, eval=evals, final_eval=evals[-1][1],
            best_eval=min(v for _, v in evals), seconds=time.perf_counter() - start, optimizer_seconds=opt_seconds,
        )
        out["contenders"][name] = record
        if on_contender:
            on_contender(out)
    relative_to_baseline(out)
    return out


def relative_to_baseline(model_result: dict[str, Any]) -> None:
    """Add ``final_vs_fp32`` / ``best_vs_fp32`` (relative differences) to every contender."""
    base = model_result["contenders"].get(BASELINE, {})
    for record in model_result["contenders"].values():
        if "final_eval" in record and "final_eval" in base:
            record["final_vs_fp32"] = record["final_eval"] / base["final_eval"] - 1
            record["best_vs_fp32"] = record["best_eval"] / base["best_eval"] - 1


def plot(results: dict[str, Any], path: str) -> None:
    """Eval-loss curves, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    cols = min(2, len(models))
    rows = -(-len(models) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5 * rows), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, (model_name, data) in zip(axes.flat, models.items()):
        for name, rec in data["contenders"].items():
            if "eval" not in rec:
                continue
            steps, losses = zip(*rec["eval"])
            style = "-" if name == BASELINE else ("--" if name.startswith("ours") else ":")
            ax.plot(steps, losses, style, label=f"{name} (final {rec['final_eval']:.3f})")
        ax.set_title(f"{model_name}: {data['params'] / 1e6:.2f} M params, batch {data['batch_size']}x{data['context']}, "
                     "eval loss on held-out text", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
