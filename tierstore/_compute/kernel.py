"""The AdamW update of one shard: a stateless function over lists of tensors.

:func:`adamw` has one signature for every variant, as ``torch.optim.adamw``
does: ``impl="fused"`` calls PyTorch's fused CPU kernel
(``torch._fused_adamw_``: vectorised and multi-threaded) and is what the
optimizer runs; ``impl="reference"`` is the plain textbook update, kept as a
readable test oracle. The fused kernel is elementwise, so calling it on
pieces of a tensor gives the same bits as calling it on the whole tensor,
provided the pieces start at multiples of the SIMD width (see
:mod:`tierstore._layout.layout`).

Example
-------
>>> import torch
>>> p, g = torch.ones(4), torch.full((4,), 0.5)
>>> m, v, step = torch.zeros(4), torch.zeros(4), torch.tensor(1.0)
>>> adamw([p], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.999,
...       weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
>>> round(float(p[0]), 4)
0.9
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._platform.torch_private import fused_adamw_kernel


def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    impl: str = "fused",
) -> None:
    """Update ``params`` and the moments in place; ``state_steps`` are already incremented.

    All tensors are fp32 CPU tensors of matching sizes, pairwise by position.
    ``max_exp_avg_sqs`` is empty unless ``amsgrad``.

    Raises
    ------
    ValueError
        If ``impl`` is neither ``"fused"`` nor ``"reference"``.
    """
    if not params:
        return
    if impl == "fused":
        fused_adamw_kernel()(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs if amsgrad else [],
            state_steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=amsgrad,
            maximize=maximize,
        )
    elif impl == "reference":
        for i, param in enumerate(params):
            _reference_one(
                param,
                grads[i],
                exp_avgs[i],
                exp_avg_sqs[i],
                max_exp_avg_sqs[i] if amsgrad else None,
                float(state_steps[i]),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
            )
    else:
        raise ValueError(f"impl={impl!r} is unknown; use 'fused' or 'reference'")


def _reference_one(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter), written out."""
    if maximize:
        grad = -grad
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
