"""``TieredRMSprop``: a drop-in ``torch.optim.RMSprop`` whose state lives in tiers.

The front of the RMSprop algorithm (:data:`tierstore._compute.algorithms.rmsprop.RMSPROP`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.
The update is torch's own RMSprop implementation run on flat pieces of the
state (:mod:`tierstore._compute.algorithms.functional`).

Example
-------
>>> import torch
>>> from tierstore import TieredRMSprop
>>> model = torch.nn.Linear(64, 64)
>>> with TieredRMSprop(model.parameters(), lr=0.01, momentum=0.9, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['momentum_buffer', 'square_avg', 'step']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import RMSPROP
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredRMSprop"]


class TieredRMSprop(TieredOptimizer):
    """RMSprop (momentum, centered, weight decay, maximize) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.RMSprop`` for fp32 parameters,
    whatever the shards, budget and tier, with ``foreach=False`` (torch's
    default on the CPU, and this front's for ``foreach=None``) and with
    ``foreach=True`` (torch's foreach implementation, whose rounding differs
    for some classes: pass the same value to both). Other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does.

    The state holds ``square_avg``, ``momentum_buffer`` when some group has
    ``momentum > 0`` and ``grad_avg`` when some group is ``centered``, each
    present at construction (a group that takes up an option later needs
    its field). ``moment_dtype`` may compress ``square_avg`` and
    ``momentum_buffer``; ``centered=True`` keeps float32 moments (its
    ``square_avg - grad_avg**2`` must not go negative).

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, alpha, eps, weight_decay, momentum, centered, maximize
        As ``torch.optim.RMSprop``; per-group values are allowed.
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
        The values ``torch.optim.RMSprop`` refuses, with its messages and the fix,
        and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredRMSprop([w], lr=0.01)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.9, 0.9, 0.9]
    """

    algorithm = RMSPROP

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.RMSprop, every hyperparameter may be passed positionally.
        hyper = dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
                     capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)  # fmt: skip
        super().__init__(params, hyper, **tiers)
