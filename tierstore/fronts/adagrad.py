"""``TieredAdagrad``: a drop-in ``torch.optim.Adagrad`` whose state lives in tiers.

The front of the Adagrad algorithm (:data:`tierstore._compute.algorithms.adagrad.ADAGRAD`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.

Example
-------
>>> import torch
>>> from tierstore import TieredAdagrad
>>> model = torch.nn.Linear(64, 64)
>>> with TieredAdagrad(model.parameters(), lr=0.01, initial_accumulator_value=0.1, ram_budget="64KiB",
...                    shard_numel=4096) as opt:
...     float(opt.state_dict()["state"][0]["sum"].max())  # every parameter has state from the start
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     float(opt.state_dict()["state"][0]["step"])
0.10000000149011612
1.0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import ADAGRAD
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredAdagrad"]


class TieredAdagrad(TieredOptimizer):
    """Adagrad (lr decay, initial accumulator value, weight decay, maximize) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.Adagrad(fused=True)`` for fp32
    parameters, whatever the shards, budget and tier; other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does. The update is
    torch's fused CPU kernel (``torch._fused_adagrad_``).

    As in torch, every parameter has state from construction: ``step`` 0 and
    ``sum`` filled with ``initial_accumulator_value`` (the constructor's: torch
    ignores a param group's own). Note: torch also lists frozen parameters in
    its state dict; tierstore holds no state for them.

    ``sum`` is always kept as fp32: a compressed ``moment_dtype`` applies to
    no field of Adagrad, because a sum that only grows stops growing once
    rounded (see :mod:`tierstore._compute.algorithms.adagrad`).

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize
        As ``torch.optim.Adagrad``; per-group values are allowed.
    foreach, fused
        Accepted for torch's signature: the fused kernel always runs, so
        ``fused=False`` and ``foreach=True`` are refused.
    differentiable
        No meaning for an update that runs outside autograd: ``True`` is refused.
    **tiers
        Where and how the state is kept (``state_dir``, ``ram_budget``,
        ``resume``, ...), as :class:`tierstore.TieredAdamW` documents them.

    Raises
    ------
    ValueError (ConfigError)
        The values ``torch.optim.Adagrad`` refuses, with its messages and the
        fix, and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredAdagrad([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.9, 0.9, 0.9]
    """

    algorithm = ADAGRAD

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.Adagrad, lr..foreach may be passed positionally.
        hyper = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                     initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
                     maximize=maximize, differentiable=differentiable, fused=fused)  # fmt: skip
        super().__init__(params, hyper, **tiers)
