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

One math for every moment format. In ``"float32"`` the AdamW kernel updates the
shard's own bytes, exactly as ``torch.optim.AdamW(fused=True)`` would. In a
compressed format (:mod:`tierstore._compute.formats`) the parts of the shard that
parameters with a gradient occupy are cut into cache-sized chunks; for each
chunk a worker (:mod:`tierstore._platform.workers`) decodes the moments into its fp32
scratch, runs the same fused kernel on the chunk's pieces, and encodes the
moments back into the shard's bytes; the master stays fp32 in place. The
chunks cut parameters only at multiples of 64 elements (the AdamW kernel gives the
same bits as on the whole tensor) and moments only at block boundaries (the
codec gives the same bytes as on the whole field), and blocks of parameters
without a gradient are not touched, so the result equals decode -> kernel ->
encode on whole shards, bit for bit, for any chunking and thread count.
Where the compiled kernel passes its self-check (:mod:`tierstore._compute.fused_update`),
a worker runs a chunk's decode, kernel and encode in one compiled call instead,
with the same bytes; that call also reads dense bfloat16 CPU gradients and writes
dense bfloat16 CPU parameters itself (no staging copy, no ``param.copy_``).

Example
-------
>>> import torch
>>> from tierstore._layout.layout import Layout
>>> from tierstore._compute.hyper import GroupHyper
>>> w = torch.nn.Parameter(torch.ones(64)); w.grad = torch.ones(64)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> from collections import defaultdict
>>> active = gather([w], layout, defaultdict(dict))
>>> hyper = GroupHyper(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
>>> update = ShardUpdate(layout, active, [hyper], staging=None, uploads=None)
>>> update.shards
[0]
>>> flat = torch.zeros(2 * 1024)
>>> update(layout.shards[0], flat); round(w[0].item(), 4)
0.9
>>> update.publish_steps(state := defaultdict(dict), [w]); float(state[w]["step"])  # once the step succeeded
1.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._compute import codecs, formats, fused_update
from .._layout.layout import Layout, ShardSpec, round_up, update_chunk_numel
from .._layout.scalar_record import scalar_tensor
from .._layout.torch_format import step_tensor
from .._platform.dtensor import local_tensor
from .._platform.faults import crash_point
from .._platform.torch_private import foreach_add_
from .._platform.workers import run_each
from ..errors import ParamsChangedError

#: Staging buffer roles: fp32 gradients, raw (non-fp32) CUDA gradients, two upload buffers.
STAGE_FP32, STAGE_RAW, STAGE_UPLOAD = 0, 1, 2


@dataclass
class ActiveParam:
    """One parameter that has a gradient in the current step."""

    group: int
    param: Tensor  # flat view of the (local) parameter's data
    grad: Tensor  # flat view of its gradient
    staged: bool  # the gradient passes through staging before the AdamW kernel (other dtype or device; the fused
    # kernel reads dense bfloat16 CPU gradients unstaged, see ShardUpdate._cuts)
    cuda: bool  # the parameter lives on a GPU (its new value goes up)
    step: Tensor  # the parameter's step count after this step, what the AdamW kernel reads; it becomes torch's
    # per-parameter state["step"] only once the step succeeded (ShardUpdate.publish_steps)
    grad_cuda: bool = False  # the gradient lives on a GPU (it comes down through staging)
    # The algorithm's per-parameter scalars besides step (Algorithm.scalar_inits) as the step starts, and
    # after it (ShardUpdate computes those once; they become the parameter's state with its step count).
    scalars: dict[str, Tensor] = field(default_factory=dict)
    advanced: dict[str, Tensor] = field(default_factory=dict)
    advances: bool = True  # the step moves the count (Algorithm.advances); if not, `step` is the count as it was


class _Cut(NamedTuple):
    """One parameter's piece inside a range of shard elements, as the AdamW kernel takes it."""

    index: int  # the parameter's position
    active: ActiveParam
    s0: int  # shard elements [s0, s1)
    s1: int
    grad: Tensor  # fp32, staged where the gradient is not an fp32 CPU tensor (bfloat16 CPU ones: see _cuts)
    target: Tensor  # what the AdamW kernel updates: the master piece, or the fp32 parameter's
    param: Tensor  # the parameter's piece


def gather(
    params: Sequence[Tensor],
    layout: Layout,
    state: MutableMapping[Tensor, dict],
    *,
    grads: Mapping[int, Tensor] | None = None,
    advancing: Sequence[bool] | None = None,
) -> dict[int, ActiveParam]:
    """Check ``params`` against ``layout`` and collect those with a gradient.

    ``grads`` replaces ``param.grad`` (by position) when gradients were moved
    off the parameters (:mod:`tierstore._runtime.grad_offload`). ``advancing[g]``
    says whether a step of param group ``g`` moves its parameters' step counts
    (:meth:`~tierstore._compute.algorithms.base.Algorithm.advances`; default: every group's does). ``state`` is only
    read: each parameter's step count after this step is a new tensor
    (:attr:`ActiveParam.step`), which the caller publishes once the step
    succeeded, so a step that fails leaves every count where it was.

    Raises
    ------
    ParamsChangedError
        If parameters were added, removed, reshaped or re-typed since the
        layout was built, or a frozen parameter has a gradient.
    RuntimeError
        For a sparse gradient.
    """
    active: dict[int, ActiveParam] = {}
    scalar_inits = layout.algorithm.scalar_inits
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
        if not local.is_contiguous():  # checked at construction; `p.data = ...` may have changed it since
            raise ParamsChangedError(
                f"parameter {i} (shape {entry.shape}) is no longer contiguous; make it contiguous "
                "(param.data = param.data.contiguous()) before the step"
            )
        if grad.is_sparse:
            raise RuntimeError(f"{layout.algorithm.front} does not support sparse gradients; pass dense gradients")
        g = local_tensor(grad)
        if tuple(g.shape) != entry.shape:
            raise ParamsChangedError(f"the gradient of parameter {i} has shape {tuple(g.shape)}, expected {entry.shape}")
        st = state.get(p)
        before = st.get("step") if st else None
        advances = advancing is None or advancing[entry.group]
        scalars = {name: _scalar(st.get(name) if st else None, init) for name, init in scalar_inits.items()}
        flat = g.reshape(-1)
        if not flat.is_contiguous() and flat.device.type == "cpu":
            # A strided CPU gradient (a step slice, a zero-stride expand): the kernels read dense
            # runs. CUDA gradients come down through staging, which takes any strides.
            flat = flat.contiguous()
        active[i] = ActiveParam(
            group=entry.group,
            param=local.detach().view(-1),
            grad=flat,
            staged=local.device.type == "cuda" or g.dtype != torch.float32 or g.device.type != "cpu",
            cuda=local.device.type == "cuda",
            step=step_tensor(float(before) if before is not None else 0.0).add_(1 if advances else 0),  # fp32, as torch adds
            grad_cuda=g.device.type == "cuda",
            scalars=scalars,
            advances=advances,
        )
    return active


def _scalar(value: Any, init: float) -> Tensor:
    """A per-parameter scalar as the update reads it: the state's 0-d tensor, else ``init`` as torch creates it."""
    if isinstance(value, Tensor):
        return value
    return scalar_tensor(init if value is None else value)  # the dtype torch creates it in


def _publish_scalars(entry: dict[str, Any], values: Mapping[str, Tensor]) -> None:
    """Make ``values`` a parameter's scalars: a tensor of the same dtype already there takes them in
    place (torch updates its own in place), anything else is replaced."""
    for name, value in values.items():
        current = entry.get(name)
        if isinstance(current, Tensor) and current.dtype == value.dtype and current.dim() == 0 and current is not value:
            current.copy_(value)
        else:
            entry[name] = value


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
        Each param group's hyperparameters, snapshotted when the step started
        (the layout's algorithm's :meth:`~tierstore._compute.algorithms.base.Algorithm.snapshot`).
    staging
        ``staging(role)`` returns a staging buffer (fp32, one shard long);
        ``None`` when no gradient is staged.
    uploads
        The upload buffers for CUDA parameters (``None`` without CUDA).
    scratch
        A compressed layout's fp32 decode scratch (``None`` in ``"float32"``):
        :meth:`~tierstore._layout.layout.Layout.scratch_nbytes` for ``workers``.
    workers
        Threads a compressed layout's chunks run on.
    """

    def __init__(
        self,
        layout: Layout,
        active: Mapping[int, ActiveParam],
        hypers: Sequence[Any],
        *,
        staging: Callable[[int], Tensor] | None,
        uploads: UploadBuffers | None,
        scratch: Callable[[], Tensor] | None = None,
        workers: int = 1,
    ) -> None:
        self.layout = layout
        self.active = active
        self.hypers = hypers
        self.staging = staging
        self.uploads = uploads
        self.scratch = scratch
        self.workers = workers
        self.master = "master" in layout.fields
        self.shards = layout.shards_of(active)
        self.upload_event: Any = None  # the CUDA event of the last shard's parameter uploads
        self.ready: Any = None  # a CUDA event: the gradients and parameters are final (set behind the loop)
        self._constants: dict[int, bytes] = {}  # the fused kernel's constants per parameter, this step
        algorithm = layout.algorithm
        for a in active.values():  # once per parameter and step, not per piece
            if a.scalars:
                a.advanced = algorithm.advance_scalars(a.scalars, a.step, hypers[a.group]) if a.advances else a.scalars

    def publish_steps(self, state: MutableMapping[Tensor, dict], params: Sequence[Tensor]) -> None:
        """Make this step's counts the parameters' ``state[p]["step"]``: call once the step succeeded.

        A step tensor already there is incremented in place, as torch's AdamW
        increments its own (to the value the AdamW kernel used); a count kept as a
        number, or none yet, becomes this step's tensor. Counts of groups that do
        not advance (:attr:`ActiveParam.advances`) stay as they are.
        """
        in_place = []
        for i, a in self.active.items():
            _publish_scalars(state[params[i]], a.advanced)
            if not a.advances:
                continue  # a step that moves no count (Algorithm.advances)
            st = state[params[i]]
            current = st.get("step")
            if isinstance(current, Tensor) and current.dtype == torch.float32 and current.dim() == 0:
                in_place.append(current)
            else:
                st["step"] = a.step
        foreach_add_(in_place, 1)

    def __call__(self, shard: ShardSpec, flat: Tensor) -> None:
        """Update shard ``shard`` whose extent (its stored bytes, as 32-bit words) is ``flat``."""
        self.upload_event = None
        layout = self.layout
        master = layout.stored_fp32(flat, shard, "master") if self.master else None
        staging = self.staging(STAGE_FP32) if self.staging is not None else None
        work = [(seg, self.active[seg.param]) for seg in shard.segments if seg.param in self.active]
        if any(a.grad_cuda for _, a in work):
            self._stage_cuda_grads(work, staging)
        if layout.encoded:
            self._update_encoded(shard, flat, work, staging, master)
        else:
            moments = {f: v for f, v in layout.field_views(flat, shard).items() if f != "master"}
            self._kernel(work, staging, master, moments, 0, shard.capacity)
        crash_point("mid-update")
        if master is not None:
            # A compressed update gave CPU parameters their values chunk by chunk already.
            self._write_params(work, master, cpu=not layout.encoded)

    def _kernel(
        self,
        work: Sequence[tuple[Any, ActiveParam]],
        staging: Tensor | None,
        master: Tensor | None,
        moments: Mapping[str, Tensor],
        lo: int,
        hi: int,
        *,
        params_out: bool = False,
    ) -> None:
        """The fused kernel on the pieces of ``work`` inside shard elements ``[lo, hi)``.

        ``moments[field]`` holds the fp32 moments of elements ``[lo, hi)``
        (the whole shard when ``lo == 0``). Gradients that need staging are
        staged here, piece by piece. ``params_out``: CPU parameters then take
        their pieces of the updated master (while it is in the cache).
        """
        algorithm = self.layout.algorithm
        names = tuple(algorithm.scalar_inits)
        # One kernel call per param group (and whatever else the algorithm's kernel needs its pieces to share).
        buckets: dict[Any, tuple[list[Tensor], list[Tensor], dict[str, list[Tensor]], list[Tensor]]] = {}
        scalars: dict[Any, dict[str, list[Tensor]]] = {}
        outs: list[tuple[Tensor, Tensor]] = []
        for cut in self._cuts(work, staging, master, lo, hi):
            a, s0, s1 = cut.active, cut.s0, cut.s1
            if params_out and master is not None and not a.cuda:
                outs.append((cut.param, cut.target))
            key = (a.group, algorithm.bucket(float(a.step)))
            targets, grads, fields, steps = buckets.setdefault(key, ([], [], {f: [] for f in moments}, []))
            for name in names:
                scalars.setdefault(key, {n: [] for n in names})[name].append(a.scalars[name])
            targets.append(cut.target)
            grads.append(cut.grad)
            for f, values in moments.items():
                fields[f].append(values[s0 - lo : s1 - lo])
            steps.append(a.step)
        for key, (targets, grads, fields, steps) in buckets.items():
            # Only an algorithm with scalars besides step takes them (Algorithm.update).
            extra = {"scalars": scalars[key]} if names else {}
            algorithm.update(targets, grads, fields, steps, self.hypers[key[0]], **extra)
        for param, value in outs:
            param.copy_(value)

    def _update_encoded(
        self,
        shard: ShardSpec,
        extent: Tensor,
        work: Sequence[tuple[Any, ActiveParam]],
        staging: Tensor | None,
        master: Tensor | None,
    ) -> None:
        """Decode -> fused kernel -> encode, chunk by chunk, on the workers (see the module docs)."""
        layout, fmt = self.layout, self.layout.format
        fields = list(layout.encoded_fields)
        stored = {f: formats.split(fmt, layout.stored_field(extent, shard, f), shard.capacity) for f in fields}
        chunk = update_chunk_numel(layout.max_capacity)
        chunks = active_chunks(work, block=layout.param_align, chunk=chunk, capacity=shard.capacity)
        # tierstore's compiled update implements the algorithms that say so (AdamW); others decode -> kernel -> encode.
        compiled = layout.algorithm.compiled and fused_update.applies(fmt)
        fused = fused_update.kernel(fmt) if compiled else None
        if fused is not None:
            by_field = [stored[f] for f in fields]

            def fused_one(worker: int, span: tuple[int, int]) -> None:
                lo, hi = span
                pieces, copies = self._fused_pieces(work, staging, master, lo, hi)
                fused_update.update_chunk(fused, fmt, by_field, lo, hi, pieces)
                for param, value in copies:
                    param.copy_(value)

            run_each(chunks, fused_one, threads=self.workers)
            return
        scratch = self.scratch()
        per_worker = chunk * (len(fields) + 1)
        bn = fmt.block_numel or 1
        # Fields no format may store (Adagrad's sum) stay fp32 in the extent: the kernel updates them in place.
        plain = {f: layout.stored_fp32(extent, shard, f) for f in layout.fields if f != "master" and f not in fields}

        def one(worker: int, span: tuple[int, int]) -> None:
            lo, hi = span
            n = hi - lo
            base = worker * per_worker
            temp = scratch[base + len(fields) * chunk : base + len(fields) * chunk + n]
            moments = {f: scratch[base + k * chunk : base + k * chunk + n] for k, f in enumerate(fields)}
            moments.update({f: values[lo:hi] for f, values in plain.items()})
            for f in fields:
                codes, scales = stored[f]
                blocks = None if scales is None else scales[lo // bn : -(-hi // bn)]
                codecs.decode_chunk(fmt, f, codes[lo:hi], blocks, moments[f], temp=temp)
            self._kernel(work, staging, master, moments, lo, hi, params_out=True)
            for f in fields:
                codes, scales = stored[f]
                blocks = None if scales is None else scales[lo // bn : -(-hi // bn)]
                codecs.encode_chunk(fmt, f, moments[f], codes[lo:hi], blocks, temp=moments[f])

        # As many workers as the scratch has room for (Layout.scratch_nbytes sized it for self.workers).
        run_each(chunks, one, threads=max(1, min(self.workers, scratch.numel() // per_worker)))

    @staticmethod
    def _cuts(
        work: Sequence[tuple[Any, ActiveParam]],
        staging: Tensor | None,
        master: Tensor | None,
        lo: int,
        hi: int,
        *,
        raw_bf16: bool = False,
    ) -> Iterator[_Cut]:
        """The pieces of ``work`` inside shard elements ``[lo, hi)``, their gradients staged (fp32).

        ``raw_bf16``: bfloat16 CPU gradients are left as they are (the fused
        kernel widens them itself).
        """
        for seg, a in work:
            s0, s1 = max(seg.shard_offset, lo), min(seg.shard_offset + seg.length, hi)
            if s0 >= s1:
                continue
            p0 = seg.param_offset + s0 - seg.shard_offset
            p1 = p0 + s1 - s0
            grad = a.grad[p0:p1]
            raw = raw_bf16 and not a.grad_cuda and grad.dtype == torch.bfloat16
            if a.staged and not raw:
                if not a.grad_cuda:
                    staging[s0:s1].copy_(grad)
                grad = staging[s0:s1]
            param = a.param[p0:p1]
            yield _Cut(seg.param, a, s0, s1, grad, master[s0:s1] if master is not None else param, param)

    def _fused_pieces(
        self,
        work: Sequence[tuple[Any, ActiveParam]],
        staging: Tensor | None,
        master: Tensor | None,
        lo: int,
        hi: int,
    ) -> tuple[list[fused_update.Piece], list[tuple[Tensor, Tensor]]]:
        """The fused kernel's pieces of chunk ``[lo, hi)`` (:meth:`_cuts`), and the (parameter, master)
        copies left for CPU parameters that are neither fp32 nor bfloat16 (the compiled kernel writes those two
        and reads fp32 and bfloat16 gradients itself)."""
        pieces, copies = [], []
        for cut in self._cuts(work, staging, master, lo, hi, raw_bf16=True):
            a, out = cut.active, 0
            dtypes = fused_update.GRAD_BF16 if cut.grad.dtype == torch.bfloat16 else 0
            if master is not None and not a.cuda:
                if a.param.dtype == torch.float32:
                    out = cut.param.data_ptr()
                elif a.param.dtype == torch.bfloat16 and fused_update.bf16_param_flags() is not None:
                    out = cut.param.data_ptr()
                    dtypes |= fused_update.bf16_param_flags()
                else:
                    copies.append((cut.param, cut.target))
            constants = self._constants.get(cut.index)
            if constants is None:  # once per parameter and step (the step counts are final by now)
                constants = self._constants[cut.index] = fused_update.constants(self.hypers[a.group], float(a.step))
            pieces.append(fused_update.Piece(cut.s0 - lo, cut.s1 - cut.s0, cut.target.data_ptr(), cut.grad.data_ptr(),
                                             out, constants, dtypes))  # fmt: skip
        pieces.sort(key=lambda p: p.start)
        return pieces, copies

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

    def _write_params(self, work: list[tuple[Any, ActiveParam]], master: Tensor, *, cpu: bool = True) -> None:
        """Give each parameter its updated master values, cast to its dtype (``cpu=False``: CUDA ones only)."""
        cuda_work = []
        for seg, a in work:
            if a.cuda:
                cuda_work.append((seg, a))
            elif cpu:
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


def active_chunks(
    work: Sequence[tuple[Any, ActiveParam]], *, block: int, chunk: int, capacity: int
) -> list[tuple[int, int]]:
    """Shard element ranges a compressed update decodes, updates and encodes.

    The parts of the shard the pieces in ``work`` occupy, each rounded up to
    whole ``block``s (a parameter starts on a block boundary, so a block never
    holds two parameters), merged where they touch, and cut into pieces of
    at most ``chunk`` elements at multiples of ``chunk`` from each part's start.

    Example
    -------
    >>> from tierstore._layout.layout import Segment
    >>> work = [(Segment(0, 0, 0, 300), None), (Segment(1, 0, 512, 10), None)]
    >>> active_chunks(work, block=256, chunk=512, capacity=1024)
    [(0, 512), (512, 768)]
    """
    spans: list[list[int]] = []
    for seg, _ in sorted(work, key=lambda w: w[0].shard_offset):
        lo = seg.shard_offset
        hi = min(round_up(seg.shard_offset + seg.length, block), capacity)
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(b, min(b + chunk, hi)) for lo, hi in spans for b in range(lo, hi, chunk)]


def master_sync(
    layout: Layout, params: Sequence[Tensor], *, to_params: Callable[[int], bool]
) -> Callable[[ShardSpec, Tensor], None]:
    """A per-shard step that copies masters and parameters one way or the other.

    For each parameter piece in the shard, ``to_params(param_index)`` true
    copies the master into the parameter (cast to its dtype); false seeds the
    master from the parameter. Does nothing when the layout keeps no masters.
    Works on a shard's extent (the master is stored as fp32 in every format).
    """
    flat_params = {i: local_tensor(p).detach().view(-1) for i, p in enumerate(params) if p.requires_grad}
    has_master = "master" in layout.fields

    def sync(shard: ShardSpec, flat: Tensor) -> None:
        if not has_master:
            return
        master = layout.stored_fp32(flat, shard, "master")
        for seg in shard.segments:
            param = flat_params[seg.param][seg.param_slice]
            piece = master[seg.shard_slice]
            if to_params(seg.param):
                param.copy_(piece)
            else:
                piece.copy_(param)

    return sync
