"""``TieredLion``: a drop-in lion-pytorch ``Lion`` whose state lives in tiers.

The front of the Lion algorithm (:data:`tierstore._compute.algorithms.lion.LION`):
lion-pytorch's constructor, its arguments passed to
:class:`~tierstore.tiered_optimizer.TieredOptimizer`. lion-pytorch itself is
not needed to run it (only to compare with it: ``pip install lion-pytorch``).

Example
-------
>>> import torch
>>> from tierstore import TieredLion
>>> model = torch.nn.Linear(64, 64)
>>> with TieredLion(model.parameters(), lr=1e-4, weight_decay=0.1, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     sorted(opt.state_dict()["state"][0])
['exp_avg']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._compute.algorithms import LION
from ..errors import ConfigError
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TieredLion"]


class TieredLion(TieredOptimizer):
    """Lion (Chen et al., 2023) with state in RAM and on local disk.

    Results are bitwise equal to lion-pytorch's ``Lion`` (``lion_pytorch.Lion``)
    for fp32 parameters, whatever the shards, budget and tier; other
    parameters keep an fp32 master copy, as :class:`tierstore.TieredAdamW`
    does. The update runs in one compiled pass over each element
    (``codec_kernel.c``'s ``ts_lion``), checked once per process against
    lion-pytorch's torch ops, which run instead where any bit differs
    (:mod:`tierstore._compute.lion_kernel`). The state holds ``exp_avg``
    only (``moment_dtype`` may compress it) and, as lion-pytorch's, its
    state dicts have no ``step``.

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, betas, weight_decay
        As lion-pytorch's ``Lion`` (``lr > 0``, each beta in [0, 1]); per-group values are allowed.
    use_triton
        lion-pytorch's CUDA kernel: ``True`` is refused (the update runs on the CPU).
    decoupled_weight_decay
        As lion-pytorch: each group's ``weight_decay`` is divided by the
        constructor's ``lr`` (a setting of the optimizer, not of its groups).
    **tiers
        Where and how the state is kept (``state_dir``, ``ram_budget``,
        ``moment_dtype``, ``resume``, ...), as :class:`tierstore.TieredAdamW` documents them.

    Raises
    ------
    ValueError (ConfigError)
        For what lion-pytorch asserts (``lr > 0``, betas in [0, 1]), with the
        fix, and for ``use_triton=True``; a value that is not a number is a
        ``TypeError`` (``ConfigTypeError``).

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredLion([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.9, 0.9, 0.9]
    """

    algorithm = LION

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        use_triton: bool = False,
        decoupled_weight_decay: bool = False,
        **tiers: Any,
    ) -> None:
        # Note: like lion_pytorch.Lion, every argument may be passed positionally.
        if use_triton:
            raise ConfigError(
                "use_triton=True runs lion-pytorch's Triton kernel on a GPU; TieredLion updates on the CPU: "
                "pass use_triton=False"
            )
        self._init_lr = lr
        self.decoupled_wd = bool(decoupled_weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), **tiers)

    def _snapshot(self, group: dict[str, Any]) -> Any:
        # lion-pytorch reads decoupled_weight_decay from the optimizer, not the group: wd /= init_lr.
        if self.decoupled_wd:
            group = {**group, "weight_decay": group["weight_decay"] / self._init_lr}
        return super()._snapshot(group)
