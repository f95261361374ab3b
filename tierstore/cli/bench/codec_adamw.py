"""A stand-in for ``TieredAdamW(moment_dtype=...)``: AdamW with moments kept encoded.

The convergence benchmark trains codec *variants* that are not state formats
(stochastic rounding, an int8 second moment without the square root) with
this small optimizer, which does the one math ``TieredAdamW`` does (and
equals it bit for bit on the registered formats): the trainable parameters are laid out with
:class:`~tierstore._layout.layout.Layout` (the same flat space, shards and segments),
and per shard each moment field is decoded into fp32 scratch
(:func:`tierstore._compute.codecs.decode`), updated in place by the fused kernel
(:func:`tierstore._compute.kernel.adamw`), and encoded back
(:func:`tierstore._compute.codecs.encode`, stochastic rounding keyed by the shard's
flat offset). Parameters are fp32 and are their own master. With
``moment_dtype="float32"`` the result is bitwise equal to
``torch.optim.AdamW(fused=True)``.

Example
-------
>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3000))
>>> opt = CodecAdamW([w], lr=0.1, moment_dtype="int8")
>>> w.grad = torch.full((3000,), 0.5)
>>> opt.step()
>>> round(float(w[0]), 4)
0.899
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..._compute import codecs, formats
from ..._compute.kernel import adamw
from ..._layout.layout import Layout

FIELDS = ("exp_avg", "exp_avg_sq")


class CodecAdamW(torch.optim.Optimizer):
    """AdamW whose moments live encoded in ``moment_dtype`` (one param group, fp32 params).

    Parameters
    ----------
    params
        fp32 CPU parameters (one group).
    moment_dtype
        A :mod:`tierstore._compute.formats` format name or :class:`~tierstore._compute.formats.MomentFormat`.
    shard_numel
        Elements per shard of the flat space (as ``TieredAdamW``).
    seed
        Seed of stochastic rounding.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moment_dtype: str | formats.MomentFormat = "float32",
        shard_numel: int = 1 << 20,
        seed: int = 0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("CodecAdamW takes one param group")
        self.format = formats.moment_format(moment_dtype)
        self.seed = seed
        group = self.param_groups[0]["params"]
        # The layout TieredAdamW builds for this format (int8 blocks start at parameters).
        registered = "int8" if self.format.block_numel else None
        self.layout = Layout.build([group], shard_numel=shard_numel, fields=FIELDS, moment_dtype=registered)
        self.encoded = {
            (s.index, f): torch.zeros(self.format.encoded_nbytes(s.capacity), dtype=torch.uint8)
            for s in self.layout.shards
            for f in FIELDS
        }
        self.scratch = {f: torch.zeros(self.layout.max_capacity) for f in FIELDS}
        self.step_count = torch.tensor(0.0)
        # Zero-filled bytes decode to zero moments in every format (int8: zero scales),
        # so the buffers above are a valid initial state.

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        group = self.param_groups[0]
        params = group["params"]
        self.step_count += 1
        beta1, beta2 = group["betas"]
        for shard in self.layout.shards:
            cap = shard.capacity
            scratch = {f: self.scratch[f][:cap] for f in FIELDS}
            for f in FIELDS:
                codecs.decode(self.format, f, self.encoded[shard.index, f], scratch[f])
            ps, gs, ms, vs = [], [], [], []
            for seg in shard.segments:
                p = params[seg.param]
                if p.grad is None:
                    continue
                sl = slice(seg.param_offset, seg.param_offset + seg.length)
                ps.append(p.view(-1)[sl])
                gs.append(p.grad.view(-1)[sl])
                ms.append(scratch["exp_avg"][seg.shard_offset : seg.shard_offset + seg.length])
                vs.append(scratch["exp_avg_sq"][seg.shard_offset : seg.shard_offset + seg.length])
            adamw(
                ps, gs, ms, vs, [], [self.step_count] * len(ps),
                lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                eps=group["eps"], amsgrad=False, maximize=False,
            )
            key = formats.RoundingKey(seed=self.seed, step=int(self.step_count), offset=shard.start)
            for f in FIELDS:
                codecs.encode(self.format, f, scratch[f], self.encoded[shard.index, f], key=key)
        return None
