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
from .palette import LINESTYLES, OKABE_ITO, SERIES, legend_below

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


# -- targets and verdicts ------------------------------------------------------------
FORMAT_TARGET_PCT = 1.0  # a format's final eval loss at most 1% above fp32 AdamW's (issue 10)
SOURCE = "docs/formats.md (Convergence; issue 10)"
TARGET_FORMATS = ("bfloat16", "int8")


def base_model(key: str) -> tuple[str, int]:
    """A results key (``"demo"``, ``"demo@seed1"``) as (model, batch seed).

    Example
    -------
    >>> base_model("demo@seed2"), base_model("gpt2")
    (('demo', 2), ('gpt2', 0))
    """
    name, _, seed = key.partition("@seed")
    return name, int(seed) if seed else 0


def by_model(results: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """The runs of ``results["models"]`` grouped by model: model -> batch seed -> that run's result."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for key, data in results["models"].items():
        name, seed = base_model(key)
        out.setdefault(name, {})[data.get("batch_seed", seed)] = data
    return out


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and compressed format: final eval loss vs fp32 AdamW's (%), one repeat per batch seed.

    The seeds are the repeats: a single run of a small model scatters by
    about 2% for every optimizer that is not bitwise fp32, so one seed is
    UNDECIDED. Lower than fp32 is no defect: the target bounds how much worse.
    """
    from .verdict import Target, judge

    out = []
    for model, seeds in by_model(results).items():
        for fmt in TARGET_FORMATS:
            name = f"ours-{fmt}"
            samples = [100 * run["contenders"][name]["final_vs_fp32"] for _, run in sorted(seeds.items())
                       if run["contenders"].get(name, {}).get("final_vs_fp32") is not None]
            if not samples and not any(name in run["contenders"] for run in seeds.values()):
                continue
            out.append(judge(Target(f"final_vs_fp32[{model}/{fmt}]",
                                    f"{MODEL_WORDS.get(model, model)}: TieredAdamW with {fmt} moments, final eval "
                                    "loss vs fp32 AdamW's (relative; one repeat per batch seed)",
                                    "<=", FORMAT_TARGET_PCT, unit="%", source=SOURCE,
                                    more="run more batch seeds: --seeds 0,1,2"), samples))
    return out


# -- the plot ------------------------------------------------------------------------
MODEL_WORDS = {"demo": "demo model", "gpt2": "GPT-2"}
# Every contender keeps one colour and line style in every panel; the baseline is black.
STYLES: dict[str, tuple[str, str]] = {
    BASELINE: (OKABE_ITO["black"], "-"),
    "ours-float32": (OKABE_ITO["grey"], "--"),
    "ours-bfloat16": (SERIES[0], "-"),
    "ours-int8": (SERIES[1], "-"),
    "torchao-adamw8bit": (SERIES[2], "-."),
    "bnb-adamw8bit": (SERIES[3], "--"),
    "ours-bfloat16-stochastic": (SERIES[5], ":"),
    "ours-int8-stochastic": (SERIES[4], ":"),
    "ours-int8-nearest-raw": (SERIES[4], "-."),
}


def contender_label(name: str) -> str:
    """A contender's name in plain words.

    Example
    -------
    >>> contender_label("ours-int8-nearest-raw")
    'ablation: int8 moments, the second moment stored without its square root'
    >>> contender_label("bnb-adamw8bit"), contender_label("ours-bfloat16")
    ('bitsandbytes AdamW8bit (8-bit moments)', 'TieredAdamW, bfloat16 moments')
    """
    fixed = {BASELINE: "torch.optim.AdamW(fused=True), fp32 (the baseline)",
             "torchao-adamw8bit": "torchao AdamW8bit (8-bit moments)",
             "bnb-adamw8bit": "bitsandbytes AdamW8bit (8-bit moments)"}
    if name in fixed:
        return fixed[name]
    if not name.startswith("ours-"):
        return name
    parts = name.removeprefix("ours-").split("-")
    if len(parts) == 1:
        return f"TieredAdamW, {parts[0]} moments"
    words = [f"{parts[0]} moments"]
    if "stochastic" in parts:
        words.append("stochastic rounding")
    if "raw" in parts:
        words = [f"{parts[0]} moments, the second moment stored without its square root"]
    return "ablation: " + ", ".join(words)


def _style(name: str, i: int) -> tuple[str, str]:
    return STYLES.get(name, (SERIES[i % len(SERIES)], LINESTYLES[i % len(LINESTYLES)]))


def plot(results: dict[str, Any], path: str) -> None:
    """One row per model: the eval-loss curves of its first batch seed, and beside them each
    contender's final eval loss against fp32 AdamW's, one dot per seed, with the target."""
    from .report import new_figure, save_figure

    models = by_model(results)
    names = list(models)
    fig, axes = new_figure(2, width=7.0, height=5.6, nrows=len(names))
    found = {v["key"]: v for v in verdicts(results)}
    for row, model in enumerate(names):
        seeds = models[model]
        curves, finals = axes[2 * row], axes[2 * row + 1]
        first = seeds[min(seeds)]
        contenders = [n for n in first["contenders"] if "eval" in first["contenders"][n]]
        for i, name in enumerate(contenders):
            colour, style = _style(name, i)
            steps, losses = zip(*first["contenders"][name]["eval"])
            curves.plot(steps, losses, linestyle=style, color=colour, linewidth=2.0 if name == BASELINE else 1.4,
                        label=f"{contender_label(name)}: final {first['contenders'][name]['final_eval']:.3f}")
        curves.set_title(f"{MODEL_WORDS.get(model, model)}, {first['params'] / 1e6:.2f} M params, batches of "
                         f"{first['batch_size']} x {first['context']} bytes: eval loss (batch seed {min(seeds)})",
                         fontsize=9)
        curves.set_xlabel("optimizer step")
        curves.set_ylabel("held-out eval loss (cross-entropy, nats per byte)", fontsize=8)
        curves.grid(alpha=0.3)
        legend_below(curves, ncol=1, fontsize=7)
        # Below: final eval loss vs fp32's per contender, a dot per seed and a bar at the median.
        rows = [n for n in dict.fromkeys(n for run in seeds.values() for n in run["contenders"])
                if n != BASELINE and any(run["contenders"].get(n, {}).get("final_vs_fp32") is not None
                                         for run in seeds.values())]
        for y, name in enumerate(rows):
            colour, _ = _style(name, y)
            values = [100 * run["contenders"][name]["final_vs_fp32"] for run in seeds.values()
                      if run["contenders"].get(name, {}).get("final_vs_fp32") is not None]
            finals.scatter(values, [y] * len(values), color=colour, s=28, zorder=3, edgecolor="black", linewidth=0.4)
            median = sorted(values)[len(values) // 2] if len(values) % 2 else sum(sorted(values)[len(values) // 2 - 1:
                                                                                       len(values) // 2 + 1]) / 2
            finals.plot([median, median], [y - 0.3, y + 0.3], color=colour, linewidth=2.5, zorder=2)
        finals.set_yticks(range(len(rows)), [contender_label(n) for n in rows], fontsize=8)
        finals.invert_yaxis()
        finals.axvline(0.0, color=OKABE_ITO["black"], linewidth=1.0, zorder=1)
        finals.axvline(FORMAT_TARGET_PCT, color=OKABE_ITO["black"], linestyle="--", linewidth=1.2, zorder=1,
                       label=f"target for bfloat16 and int8: at most {FORMAT_TARGET_PCT:g}% above fp32 "
                             "(median over seeds)")
        finals.scatter([], [], color="white", edgecolor="black", s=28, label="one batch seed (bar: their median)")
        finals.set_xlabel(f"final eval loss vs fp32 AdamW's (%; lower is better), {len(seeds)} batch "
                          f"seed{'s' if len(seeds) > 1 else ''}")
        verdict = "; ".join(f"{fmt} {found[k]['verdict']}" for fmt in TARGET_FORMATS
                            if (k := f"final_vs_fp32[{model}/{fmt}]") in found)
        finals.set_title(f"{MODEL_WORDS.get(model, model)}: final eval loss vs fp32"
                         + (f" (targets: {verdict})" if verdict else ""), fontsize=9)
        finals.grid(axis="x", alpha=0.3)
        legend_below(finals, ncol=1, fontsize=7)
    save_figure(fig, path)
