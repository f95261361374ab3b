"""A small byte-level decoder-only transformer and the text it learns, for the demo.

Everything is built in code and from the text shipped with the package
(``corpus.txt``): no downloads. Tokens are bytes (vocabulary 256), so any
text works. The model is the usual pre-LN GPT shape: token and position
embeddings, ``n_layer`` blocks of causal self-attention and an MLP, a final
LayerNorm and a head tied to the token embedding. There is no dropout, so two
copies with the same weights fed the same batch compute the same bits.

Example
-------
>>> import torch
>>> model = TinyGPT(ModelConfig(d_model=32, n_layer=1, n_head=2, context=16))
>>> batches = BatchStream(load_corpus(), context=16, batch_size=2, seed=0)
>>> x, y = batches.batch(0)
>>> loss = model.loss(x, y)
>>> loss.shape, 4.5 < loss.item() < 7.0
(torch.Size([]), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch
from torch import Tensor, nn
from torch.nn import functional as F

VOCAB = 256  # byte-level tokens


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`TinyGPT`; the defaults give about 0.83 M parameters."""

    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    context: int = 64
    vocab: int = VOCAB


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v)]
        att = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only language model over bytes.

    Parameters
    ----------
    cfg
        Its shape. ``d_model`` must be divisible by ``n_head``.

    Raises
    ------
    ValueError
        If ``d_model`` is not a multiple of ``n_head``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} must be a multiple of n_head={cfg.n_head}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, one piece of optimizer state
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape ``(batch, time, vocab)`` for token ids ``(batch, time)``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-byte cross-entropy (nats)."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_corpus() -> Tensor:
    """The shipped ``corpus.txt`` as a ``uint8`` tensor of bytes (comment lines ``#`` dropped)."""
    text = resources.files("tierstore.cli.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
    return torch.frombuffer(bytearray(body.encode("utf-8")), dtype=torch.uint8)


class BatchStream:
    """Reproducible training batches: batch ``i`` depends only on ``seed`` and ``i``.

    Both optimizers of the demo read the same batches from their own stream.

    Parameters
    ----------
    data
        Token ids (bytes) of the corpus.
    context, batch_size
        Sequence length and sequences per batch.
    seed
        Seed of the random window offsets.
    """

    def __init__(self, data: Tensor, *, context: int, batch_size: int, seed: int) -> None:
        if data.numel() <= context + 1:
            raise ValueError(
                f"the corpus has {data.numel()} tokens; it needs more than context + 1 = {context + 1}"
            )
        self.data = data.long()
        self.context = context
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, i: int) -> tuple[Tensor, Tensor]:
        """Inputs and next-token targets, each ``(batch_size, context)``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(
            0, self.data.numel() - self.context - 1, (self.batch_size,), generator=gen
        )
        offsets = starts[:, None] + torch.arange(self.context + 1)
        window = self.data[offsets]
        return window[:, :-1], window[:, 1:]
