"""``TieredNAdam``: a drop-in ``torch.optim.NAdam`` whose state lives in tiers.

The front of the NAdam algorithm (:data:`tierstore._compute.algorithms.nadam.NADAM`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.
The update is torch's own NAdam implementation run on flat pieces of the
state (:mod:`tierstore._compute.algorithms.functional`).

Example
-------
>>> import torch
>>> from tierstore import TieredNAdam
>>> model = torch.nn.Linear(64, 64)
>>> with TieredNAdam(model.parameters(), lr=2e-3, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['exp_avg', 'exp_avg_sq', 'mu_product', 'step']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import NADAM
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredNAdam"]


class TieredNAdam(TieredOptimizer):
    """NAdam (momentum decay, decoupled weight decay, maximize) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.NAdam`` for fp32 parameters,
    whatever the shards, budget and tier, with ``foreach=False`` (torch's
    default on the CPU, and this front's for ``foreach=None``) and with
    ``foreach=True`` (torch's foreach implementation, whose rounding differs
    for some classes: pass the same value to both). Other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does.

    The state holds ``exp_avg`` and ``exp_avg_sq`` (``moment_dtype`` may
    compress both) and, per parameter, ``step`` and ``mu_product`` (the
    product of the momentum schedule so far), which state dicts, state
    directories, checkpoints and DCP carry beside each step count (it cannot
    be recomputed from the count: ``betas`` and ``momentum_decay`` may change
    between steps).

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize
        As ``torch.optim.NAdam``; per-group values are allowed.
    foreach
        ``None`` or ``False``: torch's single-tensor implementation; ``True``: its foreach one.
    capturable, differentiable
        No meaning for an update that runs on the CPU outside autograd: ``True`` is refused.
    **tiers
        Where and how the state is kept (``state_dir``, ``ram_budget``,
        ``moment_dtype``, ``resume``, ...), as :class:`tierstore.TieredAdamW` documents them.

    Raises
    ------
    ValueError (ConfigError)
        The values ``torch.optim.NAdam`` refuses, with its messages and the fix,
        and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredNAdam([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.894, 0.894, 0.894]
    """

    algorithm = NADAM

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum_decay: float = 4e-3,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.NAdam, lr..decoupled_weight_decay may be passed positionally.
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                     decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, foreach=foreach,
                     capturable=capturable, differentiable=differentiable)  # fmt: skip
        super().__init__(params, hyper, **tiers)
