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
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from .errors import ClosedError, StepFailedError
from .journal import Journal, Progress
from .pipeline import RunStats, ShardPipeline
from .store import ShardStore
from .torch_format import param_steps
from .update import UploadBuffers

log = logging.getLogger(__name__)


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
    ) -> None:
        self.journal = journal
        self.store = store
        self.pipeline = pipeline
        self.uploads = UploadBuffers()
        self.step_count = 0
        self.last_run: RunStats | None = None
        self.failure: BaseException | None = None
        self.closed = False
        self._state = state
        self._param_groups = param_groups
        self._params = params

    def owner(self) -> object:
        """A token to keep in the optimizer: when the last holder is gone, :meth:`close` runs."""
        token = _Owner()
        weakref.finalize(token, self._close_quietly)
        return token

    def progress(self) -> Progress:
        """The step bookkeeping a commit records now."""
        return Progress(self.step_count, param_steps(self._state, self._params), self._param_groups)

    # -- changes ------------------------------------------------------
    @contextlib.contextmanager
    def mutation(self) -> Iterator[None]:
        """Run a state change; if it fails part-way, refuse further use (the state is half-updated).

        The committed state on disk is untouched by a failed change, so a new
        optimizer built with ``resume=True`` continues from the last commit.
        """
        try:
            with self.journal.changing():
                yield
        except BaseException as exc:
            self.pipeline.invalidate()
            self.failure = exc
            raise

    def commit(self) -> None:
        """Commit the last change with the current step bookkeeping."""
        self.journal.commit(self.progress())

    def require_open(self) -> None:
        """Raise if the optimizer is closed or an earlier change failed part-way."""
        if self.closed:
            raise ClosedError("this TieredAdamW is closed; build a new one (with resume=True to continue its state)")
        if self.failure is not None:
            durable = self.journal.durable and self.journal.persistent
            where = f" from state_dir={str(self.journal.directory)!r}" if durable else ""
            raise StepFailedError(
                f"an earlier step failed part-way ({type(self.failure).__name__}: {self.failure}); "
                f"this optimizer's state is half-updated. Build a new TieredAdamW with resume=True"
                f"{where} to continue from the last committed step ({self.journal.committed_step()})"
            ) from self.failure

    # -- lifetime -----------------------------------------------------
    def close(self) -> None:
        """Commit a clean close (non-durable state dirs), then release everything; safe twice."""
        if self.closed:
            return
        try:
            if self.failure is None:
                self.journal.close(self.progress())
        finally:
            self.closed = True
            self.release()

    def release(self, *, discard: bool = False) -> None:
        """Free memory, threads and files and unlock the directory, without committing."""
        self.uploads.synchronize()
        self.store.close()
        self.journal.release(discard=discard)

    def _close_quietly(self) -> None:
        with contextlib.suppress(Exception):  # garbage collection or interpreter exit: nothing sensible left to do
            self.close()
