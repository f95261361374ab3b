"""``TieredAdam``: a drop-in ``torch.optim.Adam`` whose state lives in tiers.

The front of the Adam algorithm (:data:`tierstore._compute.algorithms.adam.ADAM`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.

Example
-------
>>> import torch
>>> from tierstore import TieredAdam
>>> model = torch.nn.Linear(64, 64)
>>> with TieredAdam(model.parameters(), lr=1e-3, weight_decay=0.01, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['exp_avg', 'exp_avg_sq', 'step']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import ADAM
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredAdam"]


class TieredAdam(TieredOptimizer):
    """Adam (L2 weight decay, or decoupled with ``decoupled_weight_decay=True``) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.Adam(fused=True)`` for fp32
    parameters, whatever the shards, budget and tier; other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does. The update is
    torch's fused CPU kernel (``torch._fused_adam_``; ``torch._fused_adamw_``
    for a group with ``decoupled_weight_decay=True``, as torch runs it).
    ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` may all be stored in a
    compressed ``moment_dtype``.

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay
        As ``torch.optim.Adam``; per-group values are allowed (``amsgrad``
        needs ``amsgrad=True`` at construction, which adds its field).
    foreach, fused
        Accepted for torch's signature: the fused kernel always runs, so
        ``fused=False`` and ``foreach=True`` are refused.
    capturable, differentiable
        No meaning for an update that runs on the CPU outside autograd: ``True`` is refused.
    **tiers
        Where and how the state is kept (``state_dir``, ``ram_budget``,
        ``moment_dtype``, ``resume``, ...), as :class:`tierstore.TieredAdamW` documents them.

    Raises
    ------
    ValueError (ConfigError)
        The values ``torch.optim.Adam`` refuses, with its messages and the fix,
        and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredAdam([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.9, 0.9, 0.9]
    """

    algorithm = ADAM

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.Adam, lr..amsgrad may be passed positionally.
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                     foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                     decoupled_weight_decay=decoupled_weight_decay)  # fmt: skip
        super().__init__(params, hyper, **tiers)
