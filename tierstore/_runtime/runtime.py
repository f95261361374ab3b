"""The running machinery of an open ``TieredAdamW``, and its lifetime.

A :class:`Runtime` holds what a built optimizer runs on: the journal (state
directory and commit protocol), the shard store, the pipeline, the CUDA
upload buffers, the step count, the statistics of the last step, and whether
a change failed part-way. It lives outside the optimizer's ``__dict__`` on
purpose: every copy of the optimizer object (``copy.copy``, or Lightning's
``LightningOptimizer``, which copies the optimizer's ``__dict__`` into an
object of a derived class) shares the one runtime, so a copy that goes away
cannot close what the original still uses. Resources are released by
:meth:`Runtime.close`, or, if nobody calls it, when the last object holding
the runtime's :meth:`~Runtime.owner` token is garbage collected (or the
interpreter exits).

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> import copy, gc
>>> w = torch.nn.Parameter(torch.ones(4))
>>> opt = TieredAdamW([w], lr=0.1)
>>> twin = copy.copy(opt); del twin; _ = gc.collect()  # a copy going away closes nothing
>>> w.grad = torch.ones(4); _ = opt.step(); opt.close()
>>> round(w[0].item(), 3)
0.899
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._compute import fused_update, native
from .._compute.hyper import GroupHyper
from .._config.knobs import Knobs
from .._layout.budget import TierPlan
from .._layout.layout import Layout, ShardSpec
from .._layout.scalar_record import record_of
from .._layout.spec import StateSpec
from .._layout.torch_format import param_scalars, param_steps, reset_param_steps, restore_groups
from .._platform import distributed, torch_private
from .._platform.workers import own_threads
from .._state.journal import Journal, Progress
from .._storage.pipeline import RunStats, ShardPipeline
from .._storage.store import ShardStore
from ..errors import ClosedError, StepFailedError
from ..sizes import format_size
from .access import ShardVisit
from .grad_offload import GradientOffload
from .overlap import Attachment
from .update import ActiveParam, ShardUpdate, UploadBuffers

log = logging.getLogger(__name__)


@dataclass
class StepStats(RunStats):
    """One step: the pipeline's time split and traffic, plus what its commit wrote.

    ``drive_bytes`` is what this step wrote to the drive: its streamed shards
    and, when a commit started at its end, the resident shards that commit
    writes (once per commit, not once per step).
    """

    committed: bool = False  # a commit of this step started at its end
    commit_bytes: int = 0  # resident bytes that commit writes
    drive_bytes: int = 0
    committed_step: int | None = None  # the last durable commit when the step ended
    step_seconds: float = 0.0  # the step's own wall time
    gap_seconds: float = 0.0  # the loop's time since the previous step ended
    pinned_bytes: int = 0  # host memory pinned for CUDA copies (within ram_budget)


_OUR_THREADS = ("tierstore-commit", "tierstore-step", "tierstore-read", "tierstore-write")
_OPEN: weakref.WeakSet[Runtime] = weakref.WeakSet()  # runtimes an owner token keeps (closed ones too)


def _close_at_exit() -> None:
    """Close every runtime still open, before concurrent.futures stops its thread pools."""
    for runtime in list(_OPEN):
        runtime._close_quietly()  # close() is idempotent


# Runs before concurrent.futures' own exit hook, which was registered earlier (LIFO); where the
# private hook is missing, atexit (and weakref's finalizers) remain.
torch_private.register_atexit(_close_at_exit)


class _Owner:
    """The token whose lifetime bounds a runtime's resources (see :meth:`Runtime.owner`)."""

    __slots__ = ("__weakref__",)


class Runtime:
    """What an open optimizer runs on (see the module docs).

    Parameters
    ----------
    journal, store, pipeline
        The commit protocol, the shards, the streaming pipeline (store not yet open).
    state, param_groups, params
        The optimizer's ``state`` dict, ``param_groups`` list and parameters
        (the same objects the optimizer holds), for the step bookkeeping a
        commit records.
    scalar_inits
        The algorithm's per-parameter scalars besides ``step`` (NAdam's
        ``mu_product``), which a commit records beside the steps.
    """

    def __init__(
        self,
        journal: Journal,
        store: ShardStore,
        pipeline: ShardPipeline,
        *,
        state: dict[Tensor, dict[str, Any]],
        param_groups: list[dict[str, Any]],
        params: Sequence[Tensor],
        scalar_inits: Mapping[str, float] | None = None,
    ) -> None:
        self.journal = journal
        self.store = store
        self.pipeline = pipeline
        self.uploads = UploadBuffers()
        self.attachment: Attachment | None = None
        self.overlap_always = False  # attach(overlap=True): behind the loop even with nothing to hide
        self.offload: GradientOffload | None = None
        self.step_count = 0  # steps that succeeded (a failed step never counts)
        self._in_flight = 0  # a step scheduled behind the loop, not yet done (0 or 1)
        self._count_lock = threading.Lock()  # step_count and _in_flight move together
        self.last_run: StepStats | None = None
        self._last_step_end: float | None = None
        self.failure: BaseException | None = None
        self.closed = False
        self.closed_by = ""  # who closed it, when not the user (a trainer integration): its message says so
        self._pid = os.getpid()
        self._state = state
        self._param_groups = param_groups
        self._params = params
        self._scalar_inits = dict(scalar_inits or {})

    def owner(self) -> object:
        """A token to keep in the optimizer: when the last holder is gone, :meth:`close` runs.

        At interpreter exit every runtime still open is closed while the thread
        pools can still run work (:func:`_close_at_exit`).
        """
        token = _Owner()
        finalizer = weakref.finalize(token, self._close_quietly)
        finalizer.atexit = False  # _close_at_exit closes it first, while the I/O pools still run
        self._pid = os.getpid()  # only this process closes it (see _close_quietly)
        _OPEN.add(self)
        return token

    def progress(self, update: ShardUpdate | None = None) -> Progress:
        """A snapshot of the step bookkeeping a commit records; with ``update``: as it will be after that step."""
        steps = param_steps(self._state, self._params)
        inits = self._scalar_inits
        scalars = param_scalars(self._state, self._params, inits) if inits else []
        count = self.step_count
        if update is not None:
            for i, a in update.active.items():
                if a.advances:
                    steps[i] = float(a.step)
                if inits:
                    scalars[i] = a.advanced  # what publish_steps makes them once the step succeeded
            count += 1
        return Progress.capture(count, steps, self._param_groups, record_of(inits, steps, scalars))

    def steps_taken(self) -> int:
        """Steps that succeeded, plus the one running behind the loop (it counts until it fails)."""
        with self._count_lock:
            return self.step_count + self._in_flight

    def _step_done(self, update: ShardUpdate, *, behind: bool) -> None:
        """The step of ``update`` succeeded: its counts become the parameters' and it is counted."""
        update.publish_steps(self._state, self._params)
        with self._count_lock:
            self.step_count += 1
            if behind:
                self._in_flight -= 1

    @property
    def committed_step(self) -> int | None:
        """The step a crash now would resume at (``None``: nothing committed, or no durability)."""
        return self.journal.committed_step if self.journal.committing else None

    # -- changes ------------------------------------------------------
    @contextlib.contextmanager
    def mutation(self) -> Iterator[None]:
        """Run a state change; if it fails part-way, refuse further use (the state is half-updated).

        The committed state on disk is untouched by a failed change, so a new
        optimizer built with ``resume=True`` continues from the last commit.
        """
        try:
            with self.journal.changing(self.progress):
                yield
        except BaseException as exc:
            self.pipeline.invalidate()
            self.failure = exc
            raise

    def commit(self) -> None:
        """Commit the last change with the current step bookkeeping, and wait until it is durable."""
        self.journal.commit(self.progress(), wait=True)

    def run_step(
        self,
        shards: Sequence[int],
        update: Any,
        *,
        threads: Any,
        progress: Progress,
        agreed: tuple[float, bool] | None = None,
    ) -> None:
        """One step: the update of ``shards`` through the pipeline, then its commit per the policy.

        ``threads`` is the intra-op thread setting to run the update under;
        ``progress`` the step bookkeeping captured when the step was called,
        with this step's counts (published by the caller once this returns). ``agreed``: the start of the
        step (seconds waited) and the commit decision, already taken on the
        training loop's thread (under torch.distributed their collectives
        must run there, in step with the loop's own).
        """
        started = time.monotonic()
        gap = 0.0 if self._last_step_end is None else started - self._last_step_end
        with self.mutation():
            stall = self.journal.start_of_step() if agreed is None else agreed[0]
            run = RunStats()
            if shards:
                with threads:
                    run = self.pipeline.run(shards, update, before_write=self.journal.before_write)
            ended = time.monotonic()
            stall += run.persist_wait + run.commit_wait
            resident_before = self.journal.stats.resident_bytes
            decision = None if agreed is None else agreed[1]
            committed = self.journal.end_step(
                progress, gap=gap, step_seconds=ended - started, stall=stall, decision=decision
            )
        self._last_step_end = time.monotonic()
        if shards:
            commit_bytes = self.journal.stats.resident_bytes - resident_before
            self.last_run = StepStats(
                **{f.name: getattr(run, f.name) for f in dataclasses.fields(run)},  # shallow: no deep copies
                committed=committed,
                commit_bytes=commit_bytes,
                drive_bytes=run.bytes_written + commit_bytes,
                committed_step=self.committed_step,
                step_seconds=ended - started,
                gap_seconds=gap,
                pinned_bytes=self.store.pinned_nbytes,
            )

    def require_open(self) -> None:
        """Raise if the optimizer is closed or an earlier change failed part-way."""
        if self.closed:
            by = f" ({self.closed_by})" if self.closed_by else ""
            raise ClosedError(f"this optimizer is closed{by}; build a new one (with resume=True to continue its state)")
        if self.failure is not None:
            durable = self.journal.durable and self.journal.persistent
            where = f" from state_dir={str(self.journal.directory)!r}" if durable else ""
            raise StepFailedError(
                f"an earlier step or commit failed part-way ({type(self.failure).__name__}: {self.failure}); "
                f"this optimizer's state is half-updated. Build a new TieredAdamW with resume=True"
                f"{where} to continue from the last committed step ({self.journal.committed_step_text()})"
            ) from self.failure

    def new_update(
        self, layout: Layout, spec: StateSpec, active: list[ActiveParam], hypers: list[GroupHyper], *, knobs: Knobs
    ) -> ShardUpdate:
        """The update of one step over ``active``, on this runtime's buffers."""
        streams = layout.encoded and any(not self.store.is_resident(i) for i in layout.shards_of(active))
        return ShardUpdate(
            layout,
            active,
            hypers,
            staging=self.store.staging_buffer if spec.staged else None,
            uploads=self.uploads if spec.cuda else None,
            scratch=self.store.scratch_buffer if layout.encoded else None,
            workers=knobs.codec_threads(streaming=streams, behind=self.attachment is not None),
        )

    # -- whole-state access (tierstore._runtime.access) -------------------------
    def visit(
        self, layout: Layout, visit: ShardVisit, shards: Iterable[int] | None = None, *, decode_threads: int | None = None
    ) -> int:
        """Call ``visit(shard, flat)`` once per shard, read-only, through the pipeline; return the shards read.

        With ``decode_threads`` ``flat`` holds the shard's fp32 values (a
        compressed format decoded into the scratch buffer); ``None``: the
        stored extent.
        """
        order = range(len(layout.shards)) if shards is None else shards
        if decode_threads is not None and layout.encoded:
            inner = visit

            def visit(shard: ShardSpec, extent: Tensor) -> None:
                wide = self.store.scratch_buffer()[: layout.wide_nbytes(shard) // 4]
                layout.decode_shard(shard, extent, wide, threads=decode_threads)
                inner(shard, wide)

        return self.pipeline.run(order, visit, write=False).reads

    def replace(
        self,
        layout: Layout,
        fill: ShardVisit,
        *,
        sync: ShardVisit,
        param_steps: dict[int, float],
        groups: Sequence[dict[str, Any]],
        step_count: int | None,
        encode_threads: int | None,
        groups_like_torch: bool = False,
        param_scalars: Mapping[int, Mapping[str, Tensor]] | None = None,
    ) -> None:
        """Overwrite every shard with ``fill``, then ``sync`` it (masters), replace the step bookkeeping, commit.

        ``param_scalars`` are the parameters' other per-parameter scalars (NAdam's ``mu_product``), kept with their steps.

        With ``encode_threads`` ``fill`` sets fp32 values that are then encoded
        into the shard; ``None``: ``fill`` sets the stored bytes. A failure
        part-way refuses further use (:meth:`mutation`).
        """

        def fill_and_sync(shard: ShardSpec, extent: Tensor) -> None:
            if encode_threads is not None and layout.encoded:
                wide = self.store.scratch_buffer()[: layout.wide_nbytes(shard) // 4]
                fill(shard, wide)
                layout.encode_shard(shard, wide, extent, threads=encode_threads)
            else:
                fill(shard, extent)
            sync(shard, extent)

        with self.mutation():
            if step_count is not None:
                self.step_count = int(step_count)
            self.pipeline.run(range(len(layout.shards)), fill_and_sync, read=False)
            reset_param_steps(self._state, self._params, param_steps, param_scalars)
            restore_groups(self._param_groups, groups, like_torch=groups_like_torch, algorithm=layout.algorithm)
            self.commit()

    def describe(self, layout: Layout, plan: TierPlan) -> str:
        """One line: parameters, state size (and format when compressed), where it lives, files, pinning."""
        p, files = plan, ""
        disk = 0 if self.closed else self.store.disk_nbytes
        if disk:
            files = f"; files {format_size(disk)} ({'2 copies, durable' if self.journal.durable else '1 copy'})"
        if not self.closed and len(self.store.drives) > 1:  # a state over several drives: what each holds
            files += f"; over {len(self.store.drives)} drives: " + ", ".join(
                f"{path} {shards} shards {format_size(nbytes)} ({backend})"
                for path, shards, nbytes, backend in self.store.drive_shares()
            )
        pins = self.store.pins.stats()
        if pins.pinned_bytes:
            files += f"; pinned {format_size(pins.pinned_bytes)}"
        if pins.fallback is not None and pins.pageable_bytes:
            files += f"; {format_size(pins.pageable_bytes)} pageable (pinning failed)"
        fmt = ""
        if layout.encoded:
            # How the update runs (compiled and fused, or torch ops: 1.5-3x apart) is worth a glance.
            # Never decided here: describe() and repr() must not load or build the library.
            fused = fused_update.status(layout.format, decide=False) if fused_update.applies(layout.format) else ""
            if fused == "undecided":
                codec = "; update path undecided until the first step"
            elif fused == "fused kernel":
                codec = "; update compiled"
            elif layout.format.block_numel and native.part_status("int8 codec") == "":
                codec = "; codec compiled, kernel in torch"
            else:
                codec = "; update in torch ops"
            per_param = layout.bytes_per_element
            actual = p.state_nbytes / max(1, layout.trainable_numel)
            # Small shards: each field's page padding can eat what the format saves.
            padded = f", {actual:.3g} with page padding at this shard size" if actual > 1.1 * per_param else ""
            fmt = (
                f" ({layout.format.name} moments, {per_param:.3g} B/param{padded}; "
                f"decode scratch {format_size(p.scratch_nbytes)}{codec})"
            )
        return (
            f"{layout.trainable_numel:,} trainable params, state {format_size(p.state_nbytes)}{fmt} in "
            f"{len(layout.shards)} shards: {len(p.resident)} resident ({format_size(p.resident_nbytes)}), "
            f"{len(p.disk_shards)} streamed from disk ({format_size(p.disk_nbytes)}), arena {p.arena_slots} x "
            f"{format_size(p.slot_nbytes)}{files}{self._commit_lag()}"
        )

    def _commit_lag(self) -> str:
        """Where the commits are: the committed step, how far behind the loop, and a warning when that grows.

        Commits finish in the background, so the step a crash would resume at
        trails :attr:`step_count`; "" without durable commits.
        """
        journal = self.journal
        if self.closed or not journal.committing:
            return ""
        stats, committed = journal.stats, journal.committed_step
        lag = self.step_count - (committed or 0)
        text = f"; committed step {committed} ({lag} behind, at most {max(lag, stats.max_lag)} so far)"
        if stats.lag_growing():
            text += "; WARNING: the lag grows at every commit, the drive cannot keep up (docs/troubleshooting.md)"
        return text

    # -- lifetime -----------------------------------------------------
    def schedule_step(self, update: ShardUpdate, *, progress: Progress, knobs: Knobs) -> None:
        """Run one step's update now, or behind the training loop when a model is attached."""
        streams = any(not self.store.is_resident(i) for i in update.shards)
        # Behind the loop only when something can hide there: reads and writes of streamed
        # shards, or CUDA copies. A CPU update of resident state needs the cores the forward
        # uses, so it would only compete with it (the overlap's H = min(F, S - C/n) is 0).
        behind = self.attachment is not None and (self.overlap_always or streams or update.uploads is not None)
        if not behind:
            threads = own_threads(knobs.streaming_threads if streams else None)
            self.run_step(update.shards, update, threads=threads, progress=progress)
            self._step_done(update, behind=False)  # only a step that succeeded moves the counts
            return
        # Behind the loop: the update runs on the attachment's thread, in first-use order.
        order = self.attachment.order(update.shards, update.active)
        if torch.cuda.is_available() and update.uploads is not None:
            # The worker's copies wait for what the loop queued so far (backward, clipping).
            update.ready = torch.cuda.Event()
            update.ready.record()
        threads = own_threads(knobs.overlap_threads)
        agreed = None
        if self.journal.committing and distributed.rank_and_world()[1] > 1:
            # Collectives stay on this thread, in step with the loop's own (FSDP, DDP).
            with self.mutation():
                agreed = (self.journal.start_of_step(), self.journal.decide(progress.step_count))

        def run(done: Callable[..., None]) -> None:
            def visit(shard: ShardSpec, flat: Tensor) -> None:
                update(shard, flat)
                done(shard.index, update.upload_event)

            try:
                self.run_step(order, visit, threads=threads, progress=progress, agreed=agreed)
                self._step_done(update, behind=True)
            except BaseException:
                with self._count_lock:
                    self._in_flight -= 1  # a failed step never counts
                raise

        with self._count_lock:
            self._in_flight += 1  # counted from now (step_count right after step()), until it fails
        try:
            self.attachment.submit(order, run)
        except BaseException:
            with self._count_lock:
                self._in_flight -= 1
            raise

    def attach(
        self,
        model: nn.Module,
        params: Sequence[Tensor],
        layout: Layout,
        *,
        cuda: bool,
        offload_grads: bool,
        grad_bucket_bytes: int,
        pin: bool | None,
        overlap: bool | None = None,
    ) -> None:
        """Hook ``model`` so steps run behind the loop (and gradients leave the device, with ``offload_grads``).

        ``overlap``: see :meth:`tierstore.TieredAdamW.attach`.
        """
        self.detach()
        self.overlap_always = bool(overlap)
        attachment = self.attachment = Attachment(model, params, layout)
        if cuda:
            self.uploads.stream = torch.cuda.Stream()  # parameters go up beside the forward, not in its stream
        if offload_grads:
            self.offload = GradientOffload(params, bucket_bytes=grad_bucket_bytes, pin=pin)
            self.offload.before_land = attachment.wait_for_param
        if attachment.unattached:
            log.warning(
                "attach(%s): %d optimized parameters are not owned by it; a forward that uses them "
                "waits (and warns), other reads need opt.synchronize()",
                type(model).__name__,
                len(attachment.unattached),
            )

    def synchronize(self) -> None:
        """Wait for a step running behind the training loop.

        Raises
        ------
        StepFailedError
            If that step failed (its error chained as the cause), every time.
        """
        if self.attachment is None:
            return
        try:
            self.attachment.wait()
        except BaseException:
            if self.failure is None:  # not the step's failure: an interrupt while waiting, say
                raise
            self.require_open()  # the same StepFailedError every later call raises
            raise

    def detach(self) -> None:
        """Remove the model's hooks (after the step in flight) and the gradient offload's."""
        attachment, self.attachment = self.attachment, None
        offload, self.offload = self.offload, None
        self.uploads.stream = None
        try:
            if attachment is not None:
                attachment.detach()
        finally:
            if offload is not None:
                offload.remove()

    def close(self) -> None:
        """Commit a clean close (non-durable state dirs), then release everything; safe twice."""
        if self.closed:
            return
        try:
            with contextlib.suppress(BaseException):  # a failed step is recorded in self.failure
                self.detach()
            if self.failure is None:
                self.journal.close(self.progress())
        finally:
            self.closed = True
            self.release()

    def release(self, *, discard: bool = False) -> None:
        """Free memory, threads and files and unlock the directory, without committing."""
        self.uploads.synchronize()
        self.journal.stop_commits()  # the commit thread may still use the store
        self.store.close()
        self.journal.release(discard=discard)

    def _close_quietly(self) -> None:
        """Close without raising: called when the last holder is gone, or at interpreter exit."""
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker, say) inherited this object: the files, the
            # lock and the state belong to the parent, which keeps using them. Leave them be.
            return
        if threading.current_thread().name.startswith(_OUR_THREADS):
            # Garbage collection ran on one of our own threads (a commit, a step, an I/O worker):
            # closing here would wait for that very thread. Close from a new one instead.
            threading.Thread(target=self._close_quietly, name="tierstore-close").start()
            return
        try:
            self.close()
        except Exception:  # garbage collection or interpreter exit: report, there is no caller to raise to
            log.exception("closing an optimizer that was not closed failed; resume from its last commit")
