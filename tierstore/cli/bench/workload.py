"""The synthetic model ``bench step`` optimizes: fp32 parameters with fixed gradients.

Parameters come as a transformer-like mix: large matrices of 8 Mi elements
and a small bias vector after each, the last matrix holding the remainder,
so shards both split parameters and pack several. Gradients are drawn once
and reused every step: the optimizer's cost does not depend on their values.

Example
-------
>>> params = build(10_000)
>>> sum(p.numel() for p in params), all(p.grad is not None for p in params)
(10000, True)
"""

from __future__ import annotations

import torch

MATRIX_NUMEL = 8 << 20  # 8 Mi elements (32 MiB in fp32)
BIAS_NUMEL = 4096


def parse_elements(text: str) -> int:
    """An element count written as ``4Mi``, ``16Ki``, ``2e8`` or ``1000`` (binary suffixes).

    Example
    -------
    >>> parse_elements("4Mi"), parse_elements("2e8")
    (4194304, 200000000)
    """
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


def param_sizes(numel: int) -> list[int]:
    """Tensor sizes adding up to ``numel``: matrices, each followed by a small bias.

    Example
    -------
    >>> param_sizes(3 * (8 << 20))
    [8384512, 4096, 8384512, 4096, 8384512, 4096]
    """
    sizes: list[int] = []
    left = numel
    while left > 0:
        matrix = min(MATRIX_NUMEL, left)
        bias = BIAS_NUMEL if matrix > 2 * BIAS_NUMEL else 0
        sizes.append(matrix - bias)
        if bias:
            sizes.append(bias)
        left -= matrix
    return sizes


def build(numel: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """CPU parameters of ``numel`` elements in all, each with a ``.grad`` of the same ``dtype``.

    Memory: 2 x ``dtype``'s size per element (parameter and gradient; fp32: 8
    bytes), touched now so a process's baseline RSS includes it. Values are
    drawn in fp32 and rounded, so every dtype sees the same numbers.
    """
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in param_sizes(numel):
        p = torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen)
        g = torch.empty(n, dtype=torch.float32).normal_(0.0, 1e-3, generator=gen)
        p = p.to(dtype).requires_grad_()
        p.grad = g.to(dtype)
        params.append(p)
    return params


def state_fields(*, keep_master: bool) -> tuple[str, ...]:
    """The state fields TieredAdamW keeps for fp32 CPU parameters."""
    return ("exp_avg", "exp_avg_sq") + (("master",) if keep_master else ())
