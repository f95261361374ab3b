"""Lion's update on fp32 pieces: lion-pytorch's torch ops, and the compiled one-pass kernel with the same bits.

lion-pytorch's ``update_fn`` runs seven torch ops per parameter (two of them
allocate a temporary as large as it): :func:`torch_update` is exactly
those ops, the reference. ``codec_kernel.c``'s ``ts_lion`` computes the same
in one pass over each element (:func:`compiled_update`), on several threads
for large steps. Its multiply-adds are torch's ``add(..., alpha=)``: one FMA
where torch's CPU capability computes them so (AVX2, AVX512), two roundings
where it does not (DEFAULT). :func:`kernel` checks the compiled kernel once
per process against :func:`torch_update` (every tail length, zeros of both
signs, subnormals, NaN and infinities, with and without weight decay, betas
of 0 and 1) and keeps the torch ops where any bit differs.

Example
-------
>>> import torch
>>> hyper = LionHyper(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0)
>>> p, g, m = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4)
>>> update([p], [g], [m], hyper)
>>> p.tolist(), round(float(m[0]), 6)
([0.8999999761581421, 0.8999999761581421, 0.8999999761581421, 0.8999999761581421], 0.005)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._platform import torch_private
from .._platform.workers import run_each
from . import native

#: ``ts_lion_piece`` of ``codec_kernel.c``: the three addresses, the length, the six float constants.
PIECE = struct.Struct("=3Qq6f")
UNFUSED = 1  # LION_UNFUSED: add(..., alpha=) rounded twice (torch's DEFAULT capability)
#: Elements per task when a step runs on several threads (each task is one pass over ~1 MiB per array).
TASK_NUMEL = 1 << 18
_FLAGS: dict[str, int] = {}  # "flags": the recipe the self-check chose


@dataclass(frozen=True)
class LionHyper:
    """One param group's Lion hyperparameters for a step (``weight_decay`` as lion-pytorch uses it:
    divided by the constructor's lr with ``decoupled_weight_decay``)."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float

    def constants(self) -> tuple[float, float, float, float, float, float]:
        """lion-pytorch's Python scalars, in ``ts_lion_piece``'s order (torch rounds each to float)."""
        lr, wd, b1, b2 = self.lr, self.weight_decay, self.beta1, self.beta2
        return 1.0 - lr * wd, b1, 1.0 - b1, b2, 1.0 - b2, -lr


def torch_update(targets: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], hyper: LionHyper) -> None:
    """lion-pytorch's ``update_fn`` on each piece: the same torch ops in the same order."""
    wd_factor, b1, c1, b2, c2, neg_lr = hyper.constants()
    for p, g, m in zip(targets, grads, exp_avgs):
        p.mul_(wd_factor)
        update = m.clone().mul_(b1).add(g, alpha=c1).sgn_()
        p.add_(update, alpha=neg_lr)
        m.mul_(b2).add_(g, alpha=c2)


def _dense(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def compiled_update(
    lib: native.Kernel,
    flags: int,
    targets: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    hyper: LionHyper,
    *,
    threads: int = 1,
) -> None:
    """``ts_lion`` on the pieces (dense fp32 CPU tensors), cut into tasks for ``threads`` threads when large."""
    consts = hyper.constants()
    tasks: list[list[bytes]] = [[]]
    size = 0
    step = TASK_NUMEL if threads > 1 else 1 << 62
    for p, g, m in zip(targets, grads, exp_avgs):
        n = p.numel()
        pa, ga, ma = p.data_ptr(), g.data_ptr(), m.data_ptr()
        for lo in range(0, n, step):
            k = min(step, n - lo)
            if size and size + k > step:
                tasks.append([])
                size = 0
            tasks[-1].append(PIECE.pack(pa + 4 * lo, ga + 4 * lo, ma + 4 * lo, k, *consts))
            size += k

    def one(worker: int, task: list[bytes]) -> None:
        lib.lion(b"".join(task), len(task), flags)  # ctypes releases the GIL

    run_each([t for t in tasks if t], one, threads=max(1, min(threads, len(tasks))))


def update(targets: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor], hyper: LionHyper) -> None:
    """Lion's update of the pieces in place: compiled where :func:`kernel` passed its check, else torch ops.

    The compiled one runs on torch's intra-op thread count (one inside
    tierstore's own single-threaded workers), as the torch ops would.
    """
    k = kernel()
    if k is None or not all(_dense(t) for ts in (targets, grads, exp_avgs) for t in ts):
        torch_update(targets, grads, exp_avgs, hyper)
        return
    compiled_update(k, _FLAGS["flags"], targets, grads, exp_avgs, hyper, threads=torch.get_num_threads())


def kernel() -> native.Kernel | None:
    """The compiled library where its Lion update matches :func:`torch_update` bit for bit here, else None."""
    return native.checked("lion update", _self_check)


def _recipes() -> list[int]:
    """The flags to try: the capability's own first (FMA on AVX2/AVX512, none on DEFAULT), then the other."""
    own = UNFUSED if torch_private.cpu_capability() == "DEFAULT" else 0
    return [own, UNFUSED - own]


def _cases(gen: torch.Generator) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(param, grad, exp_avg) of every tail length up to 32 and a few large ones, with special values."""
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-41, 3e38])
    out = []
    for n in [*range(1, 33), 64, 100, 1000, 70_001]:
        p, g, m = (torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-6, 3, (1,), generator=gen)) for _ in range(3))
        for t in (p, g, m):
            if n > 8:
                t[torch.randint(0, n, (3,), generator=gen)] = specials[torch.randint(0, 8, (3,), generator=gen)]
        if n % 5 == 0:
            m[::3] = g[::3] * -0.1  # m * beta1 and g * (1 - beta1) cancel to (about) zero
        out.append((p, g, m))
    return out


def _self_check(lib: native.Kernel) -> str | None:
    """Why the compiled Lion update differs from lion-pytorch's torch ops (None when it does not); records the flags."""
    variants = [
        LionHyper(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0),
        LionHyper(lr=3e-3, beta1=0.95, beta2=0.98, weight_decay=0.1),
        LionHyper(lr=0.5, beta1=0.0, beta2=1.0, weight_decay=1.0),
        LionHyper(lr=1e-2, beta1=1.0, beta2=0.0, weight_decay=1e3),
    ]
    why = None
    for flags in _recipes():
        gen = torch.Generator().manual_seed(7)
        why = None
        for i, hyper in enumerate(variants):
            cases = _cases(gen)
            mine = [[t.clone() for t in case] for case in cases]
            torch_update(*zip(*cases), hyper)
            compiled_update(lib, flags, *zip(*mine), hyper, threads=2 if i % 2 else 1)
            for (p, _, m), (p2, _, m2) in zip(cases, mine):
                if not (torch.equal(p.view(torch.int32), p2.view(torch.int32)) and torch.equal(m.view(torch.int32), m2.view(torch.int32))):
                    why = f"its results differ from lion-pytorch's torch ops ({p.numel()} elements, {hyper})"
                    break
            if why:
                break
        if why is None:
            _FLAGS["flags"] = flags
            return None
    return why


__all__ = ["PIECE", "LionHyper", "compiled_update", "kernel", "torch_update", "update"]
