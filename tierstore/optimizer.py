"""``TieredAdamW``: a drop-in ``torch.optim.AdamW`` whose state lives in tiers.

The front of the AdamW algorithm (:data:`tierstore._compute.algorithms.ADAMW`):
torch's constructor, its arguments passed to :class:`~tierstore.tiered_optimizer.TieredOptimizer`,
which every tiered optimizer shares (the machinery behind it is described there).

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> model = torch.nn.Linear(64, 64)
>>> with TieredAdamW(model.parameters(), lr=1e-3, ram_budget="64KiB", shard_numel=4096) as opt:
...     model(torch.randn(8, 64)).square().mean().backward()
...     opt.step(); opt.zero_grad()
...     opt.state_dict()["state"][0]["exp_avg"].shape
torch.Size([64, 64])
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ._compute.algorithms import ADAMW
from ._config.knobs import DEFAULT_IO_WORKERS, DEFAULT_PREFETCH_DEPTH, DEFAULT_REQUEST_BYTES
from .tiered_optimizer import TieredOptimizer

__all__ = ["TieredAdamW"]


class TieredAdamW(TieredOptimizer):
    """AdamW (decoupled weight decay) with state in RAM and on local disk.

    Results are bitwise equal to ``torch.optim.AdamW(fused=True)`` for fp32
    parameters. For bf16/fp16 parameters (or parameters on a GPU) an fp32
    master copy is kept in the state and is the authoritative value: it equals
    ``torch.optim.AdamW(fused=True)`` run on fp32 copies fed the same
    gradients cast to fp32, and the parameter receives it cast to its dtype.

    Parameters
    ----------
    params
        Parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
    lr, betas, eps, weight_decay, amsgrad, maximize
        As ``torch.optim.AdamW``; per-group values are allowed.
    state_dir
        Directory for the disk tier (created if missing), or a list of them,
        one per drive: the first (the home) holds the manifest, and the
        shards are spread over all of them by each drive's measured bandwidth
        (``TIERSTORE_DRIVE_BANDWIDTHS`` gives the figures instead of a probe),
        with one commit over all. A resume passes the same directories in
        the same order. ``None``: a private temporary directory, made only
        when the state does not fit in ``ram_budget``, removed by :meth:`close`.
    ram_budget
        Host RAM the state may use: bytes (``int``), a string such as
        ``"512MiB"``/``"2GB"``, or a share of the state's size: ``"1/8"``,
        ``"12.5%"`` or ``0.125`` (:func:`tierstore.sizes.parse_budget`).
        ``None``: all state in RAM.
    backend
        ``"auto"``, ``"direct"`` (``O_DIRECT``), ``"buffered"`` or ``"mmap"``.
    shard_numel
        Elements per shard (rounded up to a multiple of 1024). ``None`` picks
        4 Mi, or less when the budget is small. Part of the state's identity.
    prefetch_depth
        Shards read ahead of the one being updated (the arena has
        ``prefetch_depth + 2`` slots). A tuning knob: never changes results.
    io_workers, request_bytes
        I/O threads per direction and the request size (a multiple of 4096,
        rounded up to whole 1 MiB checksum blocks). Tuning knobs (docs/tuning.md).
    keep_master
        Keep an fp32 master copy even for fp32 CPU parameters. ``None``: only
        when some parameter is not fp32 or not on the CPU.
        With it, the state directory alone can restore fp32 parameters after a crash.
    moment_dtype
        How the moments are stored, in RAM and on disk: ``"float32"`` (the
        default: bitwise equal to ``torch.optim.AdamW(fused=True)``),
        ``"bfloat16"`` or ``"int8"`` (blockwise quantized); the update runs in
        fp32 either way. ``torch.float32``/``torch.bfloat16``/``torch.int8``
        and ``"fp32"``/``"bf16"`` name the same formats. Part of the state's
        identity. See ``docs/formats.md``.
    pin_memory
        Pin host buffers for CUDA; ``None`` pins exactly when CUDA is available.
    update_threads
        Intra-op threads for the update while shards stream from disk
        (``None``: all cores but one, which the I/O threads keep). Steps with
        all state in RAM use torch's own setting. A tuning knob.
    durable
        Keep ``state_dir`` crash-consistent: commits that a crash or power cut
        never loses (``None``: on when a ``state_dir`` is given). With
        ``durable=False`` a ``state_dir`` is resumable only after :meth:`close`.
    commit_every
        How often a durable optimizer commits, in the background: ``"auto"``
        (as often as the drive keeps up, at least every 5 minutes), a step
        count, a duration such as ``"10min"``, or both as a pair (see
        :mod:`tierstore._state.commit_policy`, :attr:`committed_step`, :meth:`commit`).
    resume
        ``True``: continue the committed state in ``state_dir`` (a missing
        or empty directory is a ``NoStateError`` naming it); ``"auto"``:
        continue it when there is one, else start fresh (the setting for a
        job that is restarted); ``False``: the directory must hold no
        state. The layout must match these parameters; :attr:`step_count`
        says which step to resume data loading and LR schedules from.
    resume_step
        Resume at this committed step instead of the last (a durable
        directory also keeps the commit before its last).
    restore_params
        On resume, write the committed master weights back into the
        parameters (when the state has masters).
    knobs
        A knobs file written by ``tierstore tune`` (``None``: none). It sets
        ``io_workers``, ``request_bytes``, ``prefetch_depth`` and
        ``update_threads`` where they are left at their defaults (explicit
        arguments win), and gives a new state over several directories its
        drives' measured bandwidths. Resources only: any state runs with any
        knobs file. See ``docs/tuning.md``.

    Raises
    ------
    ValueError (ConfigError)
        Invalid hyperparameters or knobs (a value of the wrong type also is a
        ``TypeError``, ``ConfigTypeError``), checked as ``torch.optim.AdamW`` checks them;
        a ``knobs`` file that is missing, a link, not a knobs file or holds a value
        out of range (a newer one: ``FormatVersionError``).
    BudgetError
        ``ram_budget`` below what the streaming arena needs.
    StateDirError, StateDirInUseError, StateExistsError, NotStateDirError
        Unusable, busy, or already populated ``state_dir``, or a directory
        holding files that are not a tierstore state.
    NoStateError
        ``resume=True`` and ``state_dir`` is missing or holds no committed state.
    DriveSetError
        A list of directories that are not the drives of one state: one missing,
        of another state, given twice or out of order, or another number of them
        (the message names the directory and the fix).
    LayoutMismatchError, FormatVersionError, CorruptStateError
        On resume: state of another model, of a newer format, or damaged.

    Example
    -------
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = TieredAdamW([w], lr=0.1)
    >>> w.grad = torch.ones(3); _ = opt.step(); opt.close()
    >>> [round(x, 3) for x in w.tolist()]
    [0.899, 0.899, 0.899]
    """

    algorithm = ADAMW

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        state_dir: str | list[str] | None = None,
        ram_budget: int | float | str | None = None,
        backend: str = "auto",
        shard_numel: int | None = None,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        io_workers: int = DEFAULT_IO_WORKERS,
        request_bytes: int = DEFAULT_REQUEST_BYTES,
        keep_master: bool | None = None,
        moment_dtype: str | torch.dtype = "float32",
        pin_memory: bool | None = None,
        update_threads: int | None = None,
        durable: bool | None = None,
        commit_every: Any = "auto",
        resume: bool | str = False,
        resume_step: int | None = None,
        restore_params: bool = True,
        knobs: str | os.PathLike | None = None,
    ) -> None:
        # Note: like torch.optim.AdamW, lr..amsgrad may be passed positionally.
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, hyper, state_dir=state_dir, ram_budget=ram_budget, backend=backend,
                         shard_numel=shard_numel, prefetch_depth=prefetch_depth, io_workers=io_workers,
                         request_bytes=request_bytes, keep_master=keep_master, moment_dtype=moment_dtype,
                         pin_memory=pin_memory, update_threads=update_threads, durable=durable,
                         commit_every=commit_every, resume=resume, resume_step=resume_step,
                         restore_params=restore_params, knobs=knobs)  # fmt: skip

    # -- adapters -------------------------------------------------------
    @classmethod
    def from_deepspeed_config(cls, params: Any, config: Any, **overrides: Any) -> TieredAdamW:
        """Build from a DeepSpeed config (a dict or a JSON path).

        Maps ``optimizer.type/params`` and ``zero_optimization.offload_optimizer``
        (``device``, ``nvme_path``, ``ratio``, ``buffer_count``, ``pin_memory``, ...);
        keys it cannot honour raise ``ConfigError``. ``overrides`` win over the
        config. See :mod:`tierstore.deepspeed_config` for the mapping table.

        Example
        -------
        >>> import torch
        >>> cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        ...        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        >>> with TieredAdamW.from_deepspeed_config(torch.nn.Linear(4, 4).parameters(), cfg) as opt:
        ...     opt.param_groups[0]["lr"]
        0.001
        """
        from .deepspeed_config import deepspeed_kwargs, materialize_params, optimizer_arguments

        params = materialize_params(params)
        kwargs, _ = deepspeed_kwargs(params, config, accepted=optimizer_arguments(cls.__init__), **overrides)
        return cls(params, **kwargs)
