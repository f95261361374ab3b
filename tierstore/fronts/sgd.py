"""``TieredSGD``: a drop-in ``torch.optim.SGD`` whose state lives in tiers.

The front of the SGD algorithm (:data:`tierstore._compute.algorithms.sgd.SGD`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`.

Example
-------
>>> import torch
>>> from tierstore import TieredSGD
>>> model = torch.nn.Linear(64, 64)
>>> with TieredSGD(model.parameters(), lr=0.1, momentum=0.9, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['momentum_buffer']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import SGD
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredSGD"]


class TieredSGD(TieredOptimizer):
    """SGD (momentum, dampening, Nesterov, weight decay, maximize) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.SGD(fused=True)`` for fp32
    parameters, whatever the shards, budget and tier; other parameters keep an
    fp32 master copy, as :class:`tierstore.TieredAdamW` does. The update is
    torch's fused CPU kernel (``torch._fused_sgd_``). The state holds
    ``momentum_buffer`` when some group uses momentum (it may be stored in a
    compressed ``moment_dtype``), and nothing else: without momentum and
    without masters there is no state at all, and nothing is written to disk.

    As in torch, ``momentum_buffer`` starts as a parameter's first gradient
    (after weight decay) and a state dict lists it from then; the state dict
    has no ``step`` (tierstore counts each parameter's steps with momentum
    internally, and a loaded buffer counts as one). Note: where torch's fused
    SGD raises because some parameters of a group have a buffer and others
    take their first step, TieredSGD gives each its own first step (as
    torch's for-loop SGD does).

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, momentum, dampening, weight_decay, nesterov, maximize
        As ``torch.optim.SGD``; per-group values are allowed (momentum needs
        some group with ``momentum > 0`` at construction, which adds its field).
    foreach, fused
        Accepted for torch's signature: the fused kernel always runs, so
        ``fused=False`` and ``foreach=True`` are refused.
    differentiable
        No meaning for an update that runs outside autograd: ``True`` is refused.
    **tiers
        Where and how the state is kept (``state_dir``, ``ram_budget``,
        ``moment_dtype``, ``resume``, ...), as :class:`tierstore.TieredAdamW` documents them.

    Raises
    ------
    ValueError (ConfigError)
        The values ``torch.optim.SGD`` refuses, with its messages and the fix,
        and the flags above.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredSGD([w], lr=0.1, momentum=0.9)
    >>> for _ in range(2):
    ...     w.grad = torch.ones(3); _ = opt.step()
    >>> [round(x, 3) for x in w.tolist()], opt.state_dict()["state"][0]["momentum_buffer"].tolist()
    ([0.71, 0.71, 0.71], [1.899999976158142, 1.899999976158142, 1.899999976158142])
    >>> opt.close()
    """

    algorithm = SGD

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float | Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        **tiers: Any,
    ) -> None:
        # Note: like torch.optim.SGD, lr..nesterov may be passed positionally.
        hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                     maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)  # fmt: skip
        super().__init__(params, hyper, **tiers)
