"""Gradients that leave the device during backward: a host copy, the device gradient freed.

With ``opt.attach(model, offload_grads=True)`` (the default for parameters on
a GPU), a post-accumulate-grad hook on every optimized parameter copies each
finished gradient into a host store and sets ``param.grad`` to ``None``, so
the device holds weights plus a bucket in flight, not weights plus every
gradient. CUDA gradients go through pinned buckets (``bucket_bytes`` each,
two alternating, like DeepSpeed's ``reduce_bucket_size``) on a side stream;
CPU gradients are copied directly, so the same logic runs (and is tested)
without a GPU.

Gradient accumulation happens on the host: the first backward after a step
copies, later ones add in the gradient's dtype, which is exactly what
autograd does on the device (``grad = grad + new``), so results stay bitwise
equal. The step consumes the host gradients; step counts advance once per
real update. Because ``param.grad`` is ``None``, tools that read it need the
optimizer's versions: :meth:`GradientOffload.clip_grad_norm_` (exactly
``torch.nn.utils.clip_grad_norm_`` over the host gradients) and
:meth:`GradientOffload.unscale_` (``GradScaler.unscale_`` and its inf check on
the host gradients); ``scaler.step(opt)`` works as usual.

Example
-------
>>> import torch
>>> w = torch.nn.Parameter(torch.ones(4))
>>> offload = GradientOffload([w], bucket_bytes=1 << 20)
>>> for _ in range(2):  # two micro-batches
...     (w * 2).sum().backward()
>>> w.grad is None, offload.grads()[0].tolist()
(True, [4.0, 4.0, 4.0, 4.0])
>>> offload.remove()
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._platform import torch_private
from .._platform.dtensor import local_tensor
from .._platform.hostmem import HostBuffer
from ..errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 4 << 20  # 4 MiB per pinned bucket (two alternate: inside the documented 16 MiB overhead)


class _CudaBuckets:
    """Two pinned host buckets filled on a side stream (the CUDA-only part of the offload)."""

    def __init__(self, bucket_bytes: int, pin: bool | None) -> None:
        self.bucket_bytes = bucket_bytes
        self.buffers = [HostBuffer(bucket_bytes, pin=pin) for _ in range(2)]
        self.stream = torch.cuda.Stream()
        self.events: list[Any] = [None, None]
        self.pending: list[list[tuple[int, int, int, Tensor]]] = [[], []]  # (param, start, offset, store view)
        self.fill = [0, 0]
        self.current = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def copy(self, index: int, grad: Tensor, land: Any) -> None:
        """Queue ``grad`` (on the GPU) into the buckets; ``land(index, start, host_chunk)`` lands each chunk."""
        flat = grad.detach().reshape(-1)
        size = flat.element_size()
        per_bucket = self.bucket_bytes // size
        self.stream.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is ready there
        for start in range(0, flat.numel(), per_bucket):
            chunk = flat[start : start + per_bucket]
            nbytes = chunk.numel() * size
            if self.fill[self.current] + nbytes > self.bucket_bytes:
                self._switch(land)
            k = self.current
            offset = self.fill[k]
            host = self.buffers[k].tensor[offset : offset + nbytes].view(chunk.dtype)
            with torch.cuda.stream(self.stream):
                host.copy_(chunk, non_blocking=True)
            self.pending[k].append((index, start, offset, host))
            self.fill[k] += nbytes
        grad.record_stream(self.stream)  # its memory is reused only after the copy finished

    def _switch(self, land: Any) -> None:
        k = self.current
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[k] = event
        self.current = 1 - k
        self._land(self.current, land)

    def _land(self, k: int, land: Any) -> None:
        event = self.events[k]
        if event is not None:
            event.synchronize()
        for index, start, _offset, host in self.pending[k]:
            land(index, start, host)
        self.pending[k] = []
        self.fill[k] = 0
        self.events[k] = None

    def drain(self, land: Any) -> None:
        """Land every chunk in flight (after the side stream finished them)."""
        self.stream.synchronize()
        for k in (1 - self.current, self.current):
            self._land(k, land)

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()


class GradientOffload:
    """Post-accumulate-grad hooks moving every gradient into a host store (see the module docs).

    Parameters
    ----------
    params
        The parameters whose gradients to offload (trainable ones get hooks).
    bucket_bytes
        Bytes of each of the two pinned buckets CUDA gradients pass through.
    pin
        Pin the buckets (``None``: when CUDA is available).

    Raises
    ------
    ConfigError
        If ``bucket_bytes`` is below 4096.
    """

    def __init__(self, params: Sequence[Tensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, pin: bool | None = None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 4096:
            raise ConfigError(f"grad_bucket_bytes={bucket_bytes!r} must be an int >= 4096, e.g. 32 << 20")
        self.params = list(params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._store: dict[int, Tensor] = {}  # param index -> host gradient (param dtype and shape)
        self._live: set[int] = set()  # host gradients holding this step's (accumulated) value
        self._lock = threading.Lock()
        self.before_land: Any = None  # called with a parameter's position before its gradient lands
        cuda = any(local_tensor(p).device.type == "cuda" for p in self.params if p.requires_grad)
        self._buckets = _CudaBuckets(bucket_bytes, pin) if cuda else None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for p in self.params if p.requires_grad
        ]

    @property
    def bucket_nbytes(self) -> int:
        """Host bytes of the pinned buckets (0 without CUDA)."""
        return self._buckets.nbytes if self._buckets is not None else 0

    def _host(self, index: int, like: Tensor) -> Tensor:
        store = self._store.get(index)
        if store is None:
            store = self._store[index] = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        return store

    def _hook(self, param: Tensor) -> None:
        index = self._index[id(param)]
        grad = param.grad
        if grad is None:
            return
        local = local_tensor(grad)
        if self.before_land is not None:
            self.before_land(index)  # a step behind the loop may still read this host gradient
        self._host(index, local)  # allocated once, shaped like the parameter
        if self._buckets is not None and local.device.type == "cuda":
            self._buckets.copy(index, local, self._land)
        else:
            self._land(index, 0, local.detach().reshape(-1))
        param.grad = None

    def _land(self, index: int, start: int, chunk: Tensor) -> None:
        """Add (or, first after a step, copy) a chunk into the parameter's host gradient."""
        with self._lock:
            store = self._store[index].view(-1)
            piece = store[start : start + chunk.numel()]
            if index in self._live:
                piece.add_(chunk)
            else:
                piece.copy_(chunk)
                if start + chunk.numel() == store.numel():
                    self._live.add(index)

    def drain(self) -> None:
        """Wait until every gradient of the last backward is on the host."""
        if self._buckets is not None:
            self._buckets.drain(self._land)

    def grads(self) -> dict[int, Tensor]:
        """The host gradients of this step, by parameter position (after :meth:`drain`)."""
        self.drain()
        return {i: self._store[i] for i in sorted(self._live)}

    def zero_grad(self, *, set_to_none: bool) -> None:
        """``optimizer.zero_grad``: drop the host gradients, or zero them (then the next backward adds)."""
        self.drain()
        if set_to_none:
            self._live.clear()
            return
        for i in self._live:
            self._store[i].zero_()  # kept live: 0 + g, exactly as autograd accumulates into zeros

    def consume(self) -> None:
        """The step took the gradients: the next backward copies instead of adding."""
        self._live.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the host gradients; returns the total norm."""
        holders = [types.SimpleNamespace(grad=g) for g in self.grads().values()]
        return torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type, error_if_nonfinite, foreach)

    def unscale_(self, scaler: Any, optimizer: Any) -> None:
        """``scaler.unscale_(optimizer)`` on the host gradients: divide by the scale, record the inf check."""
        OptState = torch_private.amp_opt_state()  # noqa: N806 (torch's enum)
        if not scaler.is_enabled():
            return
        state = torch_private.grad_scaler_state(scaler, optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        scale = torch_private.grad_scaler_scale(scaler)
        if scale is None:
            raise RuntimeError("the GradScaler has not scaled a loss yet (scaler.scale(loss) first)")
        inv_scale = scale.double().reciprocal().float().cpu()
        found_inf = torch.zeros((), dtype=torch.float32)
        grads = list(self.grads().values())
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch_private.amp_unscale_(group, found_inf, inv_scale)
        state["found_inf_per_device"] = {found_inf.device: found_inf.to(scale.device)}
        state["stage"] = OptState.UNSCALED

    def found_inf(self, scaler: Any, optimizer: Any) -> bool:
        """GradScaler's unscale and inf check on the host gradients (once per step); True on an inf.

        ``GradScaler.step`` hands itself to an optimizer that declares
        ``_step_supports_amp_scaling``; the host gradients are unscaled here
        unless :meth:`unscale_` already did it.

        Raises
        ------
        ConfigError
            If ``scaler.unscale_(optimizer)`` was called: it cannot see offloaded gradients.
        """
        OptState = torch_private.amp_opt_state()  # noqa: N806 (torch's enum)
        state = torch_private.grad_scaler_state(scaler, optimizer)
        if state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
            raise ConfigError(
                "scaler.unscale_(opt) cannot see gradients offloaded to the host (param.grad is None); "
                "call opt.unscale_(scaler) instead, then opt.clip_grad_norm_(max_norm) if you clip"
            )
        if state["stage"] is OptState.READY:
            self.unscale_(scaler, optimizer)
        return bool(sum(float(v) for v in state["found_inf_per_device"].values()))

    def remove(self) -> None:
        """Remove the hooks and free the buckets."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None
