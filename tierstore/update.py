"""The per-shard AdamW update of one step, and the master <-> parameter copies.

:func:`gather` checks the parameters against the layout and collects those
with a gradient (:class:`ActiveParam`). A :class:`ShardUpdate` is built for
one step from them and the param groups' hyperparameters (snapshotted by the
caller) and is called by the pipeline once per shard: it buckets the shard's
segments by param group, stages gradients that are not fp32 CPU tensors
(CUDA gradients come down through pinned staging, one synchronisation per
shard), runs the fused kernel on slices of the shard, and writes updated
masters back into the parameters (CUDA: through two alternating pinned
upload buffers, :class:`UploadBuffers`). :func:`master_sync` copies masters
and parameters one way or the other, shard by shard (fresh state, resume,
loaded state).

Example
-------
>>> import torch
>>> from tierstore.layout import Layout
>>> from tierstore.hyper import GroupHyper
>>> w = torch.nn.Parameter(torch.ones(64)); w.grad = torch.ones(64)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> from collections import defaultdict
>>> active = gather([w], layout, defaultdict(dict))
>>> hyper = GroupHyper(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
>>> update = ShardUpdate(layout, active, [hyper], staging=None, uploads=None)
>>> update.shards
[0]
>>> flat = torch.zeros(2 * 1024)
>>> update.step_counts(); update(layout.shards[0], flat); round(w[0].item(), 4)
0.9
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .dtensor import local_tensor
from .errors import ParamsChangedError
from .faults import crash_point
from .hyper import GroupHyper
from .kernel import adamw
from .layout import Layout, ShardSpec
from .torch_format import step_tensor

#: Staging buffer roles: fp32 gradients, raw (non-fp32) CUDA gradients, two upload buffers.
STAGE_FP32, STAGE_RAW, STAGE_UPLOAD = 0, 1, 2


@dataclass
class ActiveParam:
    """One parameter that has a gradient in the current step."""

    group: int
    param: Tensor  # flat view of the (local) parameter's data
    grad: Tensor  # flat view of its gradient
    staged: bool  # the gradient passes through staging before the kernel (other dtype or device)
    cuda: bool  # the parameter lives on a GPU (its new value goes up)
    step: Tensor  # the parameter's step count (torch's per-parameter state["step"])
    grad_cuda: bool = False  # the gradient lives on a GPU (it comes down through staging)


def gather(
    params: Sequence[Tensor],
    layout: Layout,
    state: MutableMapping[Tensor, dict],
    *,
    grads: Mapping[int, Tensor] | None = None,
) -> dict[int, ActiveParam]:
    """Check ``params`` against ``layout`` and collect those with a gradient.

    ``grads`` replaces ``param.grad`` (by position) when gradients were moved
    off the parameters (:mod:`tierstore.grad_offload`). A parameter taking its
    first step gets ``state[p]["step"] = 0`` (the caller increments the counts).

    Raises
    ------
    ParamsChangedError
        If parameters were added, removed, reshaped or re-typed since the
        layout was built, or a frozen parameter has a gradient.
    RuntimeError
        For a sparse gradient.
    """
    active: dict[int, ActiveParam] = {}
    for i, (p, entry) in enumerate(zip(params, layout.params)):
        grad = p.grad if grads is None else grads.get(i)
        if grad is None:
            continue
        if not entry.trainable:
            if entry.numel == 0:
                if not p.requires_grad:
                    continue
                # An empty parameter holds no state but, as in torch, counts its steps.
            else:
                raise ParamsChangedError(
                    f"parameter {i} (shape {entry.shape}) was frozen (requires_grad=False) when the "
                    "optimizer was built but now has a gradient; build the optimizer after unfreezing, "
                    "or set its .grad to None"
                )
        local = local_tensor(p)
        if tuple(local.shape) != entry.shape or str(p.dtype).removeprefix("torch.") != entry.dtype:
            raise ParamsChangedError(
                f"parameter {i} is now {tuple(local.shape)} {p.dtype}, but the optimizer was built "
                f"for {entry.shape} {entry.dtype}; build a new optimizer after changing the model"
            )
        if grad.is_sparse:
            raise RuntimeError("TieredAdamW does not support sparse gradients")
        g = local_tensor(grad)
        if tuple(g.shape) != entry.shape:
            raise ParamsChangedError(f"the gradient of parameter {i} has shape {tuple(g.shape)}, expected {entry.shape}")
        st = state[p]
        if "step" not in st:
            st["step"] = step_tensor(0)
        active[i] = ActiveParam(
            group=entry.group,
            param=local.detach().view(-1),
            grad=g.reshape(-1),
            staged=local.device.type == "cuda" or g.dtype != torch.float32 or g.device.type != "cpu",
            cuda=local.device.type == "cuda",
            step=st["step"],
            grad_cuda=g.device.type == "cuda",
        )
    return active


class UploadBuffers:
    """Two pinned host buffers that alternate for parameter uploads to a GPU, with their events.

    One buffer is cast into while the other one's copy to the GPU may still
    run; an event per buffer says when its copy finished. Lives as long as
    the optimizer: the alternation continues across steps.
    """

    def __init__(self) -> None:
        self._events: list[Any] = [None, None]
        self._last = 0
        self.stream: Any = None  # a side stream for uploads while the step runs behind the loop (CUDA)

    def next(self) -> int:
        """The buffer to fill next, once the copy that last used it has finished."""
        which = self._last = 1 - self._last
        event = self._events[which]
        if event is not None:
            event.synchronize()
        return which

    def record(self, which: int) -> Any:
        """Mark the copies just queued from buffer ``which``; returns their event."""
        event = torch.cuda.Event()
        event.record(self.stream) if self.stream is not None else event.record()
        self._events[which] = event
        return event

    def copying(self) -> Any:
        """The stream context uploads are queued in (the side stream, when there is one)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for every upload in flight."""
        for event in self._events:
            if event is not None:
                event.synchronize()


class ShardUpdate:
    """One step's update, called by the pipeline as ``update(shard, flat)`` for each touched shard.

    Parameters
    ----------
    layout
        The state's layout.
    active
        The parameters with a gradient (:func:`gather`).
    hypers
        Each param group's hyperparameters, snapshotted when the step started.
    staging
        ``staging(role)`` returns a staging buffer (fp32, one shard long);
        ``None`` when no gradient is staged.
    uploads
        The upload buffers for CUDA parameters (``None`` without CUDA).
    """

    def __init__(
        self,
        layout: Layout,
        active: Mapping[int, ActiveParam],
        hypers: Sequence[GroupHyper],
        *,
        staging: Callable[[int], Tensor] | None,
        uploads: UploadBuffers | None,
    ) -> None:
        self.layout = layout
        self.active = active
        self.hypers = hypers
        self.staging = staging
        self.uploads = uploads
        self.master = "master" in layout.fields
        self.amsgrad = "max_exp_avg_sq" in layout.fields
        self.shards = layout.shards_of(active)
        self.upload_event: Any = None  # the CUDA event of the last shard's parameter uploads
        self.ready: Any = None  # a CUDA event: the gradients and parameters are final (set behind the loop)

    def step_counts(self) -> None:
        """Advance the step count of every parameter taking part (before any shard is updated)."""
        if self.active:
            torch._foreach_add_([a.step for a in self.active.values()], 1)

    def __call__(self, shard: ShardSpec, flat: Tensor) -> None:
        self.upload_event = None
        views = self.layout.field_views(flat, shard)
        exp_avg, exp_avg_sq = views["exp_avg"], views["exp_avg_sq"]
        max_sq = views.get("max_exp_avg_sq")
        master = views.get("master")
        staging = self.staging(STAGE_FP32) if self.staging is not None else None
        work = [(seg, self.active[seg.param]) for seg in shard.segments if seg.param in self.active]
        if any(a.grad_cuda for _, a in work):
            self._stage_cuda_grads(work, staging)
        buckets: dict[int, tuple[list[Tensor], ...]] = {}
        for seg, a in work:
            grad = a.grad[seg.param_slice]
            if a.staged:
                if not a.grad_cuda:
                    staging[seg.shard_slice].copy_(grad)
                grad = staging[seg.shard_slice]
            target = master[seg.shard_slice] if master is not None else a.param[seg.param_slice]
            bucket = buckets.setdefault(a.group, ([], [], [], [], [], []))
            bucket[0].append(target)
            bucket[1].append(grad)
            bucket[2].append(exp_avg[seg.shard_slice])
            bucket[3].append(exp_avg_sq[seg.shard_slice])
            if max_sq is not None:
                bucket[4].append(max_sq[seg.shard_slice])
            bucket[5].append(a.step)
        for group, (ps, gs, ms, vs, maxs, steps) in buckets.items():
            hyper = self.hypers[group]
            adamw(ps, gs, ms, vs, maxs if hyper.amsgrad else [], steps, **hyper.kernel_kwargs())
        crash_point("mid-update")
        if master is not None:
            self._write_params(work, master)

    def _stage_cuda_grads(self, work: list[tuple[Any, ActiveParam]], staging: Tensor) -> None:
        """Copy this shard's CUDA gradients to host staging (one sync per shard)."""
        raw = self.staging(STAGE_RAW).view(torch.uint8)
        stream = torch.cuda.current_stream()
        if self.ready is not None:
            stream.wait_event(self.ready)  # on another thread: wait for the loop's backward
        pending = []
        for seg, a in work:
            if not a.grad_cuda:
                continue
            s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
            src = a.grad[seg.param_slice]
            if src.dtype == torch.float32:
                staging[s0:s1].copy_(src, non_blocking=True)
            else:
                size = src.element_size()
                dst = raw[s0 * size : s1 * size].view(src.dtype)
                dst.copy_(src, non_blocking=True)
                pending.append((dst, s0, s1))
        stream.synchronize()
        for dst, s0, s1 in pending:
            staging[s0:s1].copy_(dst)

    def _write_params(self, work: list[tuple[Any, ActiveParam]], master: Tensor) -> None:
        """Give each parameter its updated master values, cast to its dtype."""
        cuda_work = []
        for seg, a in work:
            if a.cuda:
                cuda_work.append((seg, a))
            else:
                a.param[seg.param_slice].copy_(master[seg.shard_slice])
        if not cuda_work:
            return
        which = self.uploads.next()
        out = self.staging(STAGE_UPLOAD + which).view(torch.uint8)
        if self.ready is not None and self.uploads.stream is not None:
            self.uploads.stream.wait_event(self.ready)  # never overwrite a parameter queued work still reads
        with self.uploads.copying():
            for seg, a in cuda_work:
                s0, s1 = seg.shard_offset, seg.shard_offset + seg.length
                size = a.param.element_size()
                host = out[s0 * size : s1 * size].view(a.param.dtype)
                host.copy_(master[s0:s1])
                a.param[seg.param_slice].copy_(host, non_blocking=True)
        self.upload_event = self.uploads.record(which)


def master_sync(
    layout: Layout, params: Sequence[Tensor], *, to_params: Callable[[int], bool]
) -> Callable[[ShardSpec, Tensor], None]:
    """A per-shard step that copies masters and parameters one way or the other.

    For each parameter piece in the shard, ``to_params(param_index)`` true
    copies the master into the parameter (cast to its dtype); false seeds the
    master from the parameter. Does nothing when the layout keeps no masters.
    """
    flat_params = {i: local_tensor(p).detach().view(-1) for i, p in enumerate(params) if p.requires_grad}
    has_master = "master" in layout.fields

    def sync(shard: ShardSpec, flat: Tensor) -> None:
        if not has_master:
            return
        master = layout.field_view(flat, shard, "master")
        for seg in shard.segments:
            param = flat_params[seg.param][seg.param_slice]
            piece = master[seg.shard_slice]
            if to_params(seg.param):
                param.copy_(piece)
            else:
                piece.copy_(param)

    return sync


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (``None``, or more than now: leave torch's setting alone)."""
    before = torch.get_num_threads()
    if threads is None or threads >= before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
