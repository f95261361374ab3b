"""The test oracle of ``moment_dtype``: AdamW whose moments are kept encoded, one tensor at a time.

:class:`FormatOracle` is what a ``TieredAdamW(moment_dtype=...)`` must equal
bit for bit: every parameter's moments are stored encoded as whole tensors
(no layout, no shards, no arena, no threads); each step decodes them with
the NumPy reference codecs (``codec="reference"``), runs the AdamW kernel on
the whole parameter (``kernel="fused"``: ``torch._fused_adamw_``, as
``torch.optim.AdamW(fused=True)``; ``"reference"``: the textbook update) and
encodes them back. Parameters that are not fp32 get an fp32 master copy,
updated with the gradient cast to fp32 and cast back into the parameter, as
``TieredAdamW`` keeps one.

Why per tensor equals per shard: a block format's blocks start at every
parameter's first element in both (``TieredAdamW`` aligns parameters to
blocks), the AdamW kernel is elementwise, and the codecs encode each element (each
block) independently of the others.

Example
-------
>>> import torch
>>> w = torch.nn.Parameter(torch.ones(300))
>>> opt = FormatOracle([w], lr=0.1, moment_dtype="int8")
>>> w.grad = torch.full((300,), 0.5); _ = opt.step()
>>> sorted(opt.state_dict()["state"][0]), round(float(w[0]), 4)
(['exp_avg', 'exp_avg_sq', 'step'], 0.899)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .._compute import codecs, formats
from .._compute.kernel import adamw

__all__ = ["FormatOracle"]

FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class FormatOracle(torch.optim.Optimizer):
    """AdamW with encoded moments, per tensor (see the module docs).

    Parameters
    ----------
    params, lr, betas, eps, weight_decay, amsgrad, maximize
        As ``torch.optim.AdamW``.
    moment_dtype
        A :mod:`tierstore._compute.formats` format name.
    kernel
        ``"fused"`` or ``"reference"`` (:func:`tierstore._compute.kernel.adamw`).
    codec
        ``"reference"`` (the NumPy oracle) or ``"fast"``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        moment_dtype: str = "float32",
        kernel: str = "fused",
        codec: str = "reference",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self.format = formats.moment_format(moment_dtype)
        self.kernel = kernel
        self.codec = codec

    def _decode(self, field: str, encoded: Tensor, numel: int) -> Tensor:
        out = torch.empty(numel)
        codecs.decode(self.format, field, encoded, out, impl=self.codec)
        return out

    def _encode(self, field: str, values: Tensor) -> Tensor:
        out = torch.zeros(self.format.encoded_nbytes(values.numel()), dtype=torch.uint8)
        codecs.encode(self.format, field, values, out, impl=self.codec)
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            fields = FIELDS if group["amsgrad"] else FIELDS[:2]
            for p in group["params"]:
                if p.grad is None:
                    continue
                n = p.numel()
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    for f in FIELDS:
                        st[f] = torch.zeros(self.format.encoded_nbytes(n), dtype=torch.uint8)
                    if p.dtype != torch.float32:
                        st["master_param"] = p.detach().to(torch.float32).reshape(-1).clone()
                st["step"] += 1
                moments = {f: self._decode(f, st[f], n) for f in fields}
                master = st.get("master_param")
                target = master if master is not None else p.detach().view(-1)
                beta1, beta2 = group["betas"]
                adamw(
                    [target], [p.grad.detach().reshape(-1).to(torch.float32)], [moments["exp_avg"]],
                    [moments["exp_avg_sq"]], [moments["max_exp_avg_sq"]] if group["amsgrad"] else [], [st["step"]],
                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    amsgrad=group["amsgrad"], maximize=group["maximize"], impl=self.kernel,
                )
                for f in fields:
                    st[f] = self._encode(f, moments[f])
                if master is not None:
                    p.detach().view(-1).copy_(master)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format, moments decoded (what ``TieredAdamW.state_dict()`` gives)."""
        index = 0
        state: dict[int, dict[str, Tensor]] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                st = self.state.get(p)
                if st:
                    entry = {"step": st["step"].clone()}
                    for f in FIELDS if group["amsgrad"] else FIELDS[:2]:
                        entry[f] = self._decode(f, st[f], p.numel()).view(p.shape)
                    if "master_param" in st:
                        entry["master_param"] = st["master_param"].clone().view(p.shape)
                    state[index] = entry
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}
