"""``TieredAdadelta``: a drop-in ``torch.optim.Adadelta`` whose state lives in tiers.

The front of the Adadelta algorithm (:data:`tierstore._compute.algorithms.adadelta.ADADELTA`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.
The update is torch's own Adadelta implementation run on flat pieces of the
state (:mod:`tierstore._compute.algorithms.functional`).

Example
-------
>>> import torch
>>> from tierstore import TieredAdadelta
>>> model = torch.nn.Linear(64, 64)
>>> with TieredAdadelta(model.parameters(), lr=1.0, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['acc_delta', 'square_avg', 'step']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import ADADELTA
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredAdadelta"]


class TieredAdadelta(TieredOptimizer):
    """Adadelta (rho, weight decay, maximize) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.Adadelta`` for fp32 parameters,
    whatever the shards, budget and tier, with ``foreach=False`` (torch's
    default on the CPU, and this front's for ``foreach=None``) and with
    ``foreach=True`` (torch's foreach implementation, whose rounding differs
    for some classes: pass the same value to both). Other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does.

    The state holds ``square_avg`` and ``acc_delta``; ``moment_dtype`` may
    compress both.

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, rho, eps, weight_decay, maximize
        As ``torch.optim.Adadelta``; per-group values are allowed.
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
        The values ``torch.optim.Adadelta`` refuses, with its messages and the fix,
        and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredAdadelta([w], lr=1.0)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.997, 0.997, 0.997]
    """

    algorithm = ADADELTA

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.Adadelta, lr..foreach may be passed positionally.
        hyper = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize, capturable=capturable,
                     foreach=foreach, differentiable=differentiable)  # fmt: skip
        super().__init__(params, hyper, **tiers)
