"""The step behind the training loop: each module's forward waits for exactly its own parameters.

After ``opt.attach(model)``, ``step()`` returns once the update is scheduled;
the update runs on a background thread (:class:`Attachment`), shard by shard
in the order the forward first uses the parameters, and a forward pre-hook on
each module that owns optimized parameters waits until the shards holding
those parameters are updated (:class:`ShardBoard`). Results are exactly
those of the synchronous step: no parameter is read before its update
finished, and every update reads the gradients and hyperparameters of the
``step()`` call that scheduled it.

What this cannot see, and what must call ``opt.synchronize()`` first: code
that reads or writes parameters outside a module's forward (``model.state_dict()``,
an EMA of the weights, ``torch.func.functional_call``, a metric on the
weights). A forward of a module that is *not* attached but owns optimized
parameters is detected (a global forward pre-hook, active only while an
update is in flight): it waits too, and warns once.

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
>>> with TieredAdamW(model.parameters(), lr=0.1) as opt:
...     _ = opt.attach(model)
...     for _ in range(2):
...         model(torch.ones(2, 4)).sum().backward()
...         opt.step(); opt.zero_grad()  # step() returns before the update is done
...     opt.synchronize()  # now every parameter holds its update
...     opt.step_count
2
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from .._layout.layout import Layout
from ..errors import ConfigError, StepFailedError

log = logging.getLogger(__name__)


class ShardBoard:
    """Which shards of one step are updated: waiters block per shard, not on the whole step.

    Example
    -------
    >>> board = ShardBoard([0, 1])
    >>> board.done(0); board.wait([0]); board.pending([0, 1])
    [1]
    """

    def __init__(self, shards: Iterable[int]) -> None:
        self._events = {s: threading.Event() for s in shards}
        self._uploads: dict[int, Any] = {}  # shard -> CUDA event of its parameter uploads
        self._error: BaseException | None = None

    def done(self, shard: int, upload: Any = None) -> None:
        """Shard ``shard``'s parameters are updated (on a GPU: once ``upload``, a CUDA event, completes)."""
        if upload is not None:
            self._uploads[shard] = upload
        event = self._events.get(shard)
        if event is not None:
            event.set()

    def fail(self, error: BaseException) -> None:
        """Release every waiter: the step failed, and each of them raises."""
        self._error = error
        for event in self._events.values():
            event.set()

    def pending(self, shards: Iterable[int]) -> list[int]:
        return [s for s in shards if s in self._events and not self._events[s].is_set()]

    def wait(self, shards: Iterable[int]) -> None:
        """Block until every listed shard is updated; raise if the step failed."""
        uploads = []
        for s in shards:
            event = self._events.get(s)
            if event is not None:
                event.wait()
                uploads.append(self._uploads.get(s))
        for upload in uploads:
            if upload is not None:  # the GPU waits for the upload, not the CPU
                torch.cuda.current_stream().wait_event(upload)
        if self._error is not None:
            raise StepFailedError(
                f"the optimizer step running behind the loop failed ({type(self._error).__name__}: "
                f"{self._error}); this module's parameters were not updated. Build a new TieredAdamW with "
                "resume=True to continue from the last committed step (opt.synchronize() raises the same)"
            ) from self._error


class Attachment:
    """The hooks on one model and the background thread that runs its optimizer's steps.

    Parameters
    ----------
    model
        The model whose forward uses the optimizer's parameters.
    params
        The optimizer's parameters, in layout order.
    layout
        The state's layout (which shards hold which parameter).

    Raises
    ------
    ConfigError
        If the model owns none of the optimizer's parameters.
    """

    def __init__(self, model: nn.Module, params: Sequence[Tensor], layout: Layout) -> None:
        self.layout = layout
        cuda = [p.device for p in params if p.device.type == "cuda"]
        self._device = cuda[0] if cuda else None  # the worker thread's CUDA device (a thread starts on 0)
        index = {id(p): i for i, p in enumerate(params) if layout.params[i].trainable}
        self._shards_of_module: dict[int, list[int]] = {}
        self._params_of_module: dict[int, list[int]] = {}
        modules: list[nn.Module] = []
        for module in model.modules():
            owned = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if owned:
                modules.append(module)
                self._params_of_module[id(module)] = owned
                self._shards_of_module[id(module)] = layout.shards_of(owned)
        if not modules:
            raise ConfigError(
                f"attach({type(model).__name__}): the model owns none of this optimizer's trainable "
                "parameters; attach the model the optimizer was built from"
            )
        covered = {i for owned in self._params_of_module.values() for i in owned}
        self.unattached = sorted(set(index.values()) - covered)
        self._param_modules = index  # id(param) -> index, for the global check
        self._first_use: dict[int, int] = {}  # param index -> order of first use in a forward
        self._ran: set[int] = set()  # params whose owning module's forward ran since the last step
        self._functional: list[int] = []  # shards of params used with no forward of their module
        self._board: ShardBoard | None = None
        self._future: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-step")
        self._warned = self._warned_functional = False
        self._global_hook: Any = None  # only while an update is in flight
        # prepend: run before other pre-hooks that read the parameters (FSDP2's all-gather).
        self._handles = [m.register_forward_pre_hook(self._pre_forward, prepend=True) for m in modules]
        # The root waits for parameters read functionally (F.linear(x, self.head.weight)), whose
        # own module's forward never runs, so its hook never waits for them.
        self._handles.append(model.register_forward_pre_hook(self._pre_root, prepend=True))

    # -- hooks ----------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        key = id(module)
        params = self._params_of_module.get(key, ())
        for i in params:
            self._first_use.setdefault(i, len(self._first_use))
        self._ran.update(params)
        board = self._board
        if board is not None:
            board.wait(self._shards_of_module[key])

    def _pre_root(self, module: nn.Module, args: Any) -> None:
        board = self._board
        if board is not None and self._functional:
            board.wait(self._functional)

    def _any_forward(self, module: nn.Module, args: Any) -> None:
        """A module that is not attached but owns parameters being updated must wait too."""
        board = self._board
        if board is None or id(module) in self._shards_of_module:
            return
        owned = [self._param_modules[id(p)] for p in module.parameters(recurse=False) if id(p) in self._param_modules]
        if not owned:
            return
        shards = self.layout.shards_of(owned)
        if board.pending(shards) and not self._warned:
            self._warned = True
            warnings.warn(
                f"a {type(module).__name__} that is not part of the attached model uses parameters whose "
                "update is still running; it waited for them. Attach the model that owns them "
                "(opt.attach(model)) to keep the overlap, or call opt.synchronize() before using them",
                stacklevel=2,
            )
        board.wait(shards)

    def wait_for_param(self, index: int) -> None:
        """Block until parameter ``index``'s shards of the step in flight are updated."""
        board = self._board
        if board is not None:
            board.wait(s for s, _ in self.layout.segments_of(index))

    # -- scheduling -----------------------------------------------------
    def order(self, shards: Sequence[int], updated: Iterable[int] = ()) -> list[int]:
        """``shards`` in the order the last forward first used their parameters (unused last).

        ``updated`` are the parameters this step updates. Those whose module's
        forward did not run since the last step were read some other way
        (functionally, through the parent's forward): their shards go first,
        and the root module's forward waits for them.
        """
        functional = [i for i in updated if i not in self._ran] if self._ran else []
        self._ran = set()
        self._functional = self.layout.shards_of(functional)
        if self._functional and not self._warned_functional:
            self._warned_functional = True
            log.info(
                "%d optimized parameters got gradients without their module's forward running (a "
                "functional use such as F.linear(x, m.weight)): the model's forward waits for them first",
                len(functional),
            )
        if not self._first_use:
            return self._functional + [s for s in shards if s not in set(self._functional)]
        last = len(self._first_use)
        rank = {}
        for s in shards:
            rank[s] = min((self._first_use.get(seg.param, last) for seg in self.layout.shards[s].segments), default=last)
        first = set(self._functional)
        return sorted(shards, key=lambda s: (s not in first, rank[s], s))

    def submit(self, shards: Sequence[int], run: Callable[..., None]) -> None:
        """Run ``run(done)`` in the background; ``done(shard, upload=None)`` marks a shard's parameters updated."""
        self.wait()
        board = ShardBoard(shards)

        def work() -> None:
            if self._device is not None:
                torch.cuda.set_device(self._device)
            try:
                run(board.done)
            except BaseException as exc:
                board.fail(exc)
                raise
            finally:
                for s in shards:
                    board.done(s)

        self._board = board  # before the work starts: a forward must wait from now on
        try:
            self._future = self._pool.submit(work)
        except BaseException:
            self._board = None
            raise
        # A module outside the attached model that uses pending parameters waits too (only while
        # an update is in flight: the hook takes every module off nn.Module's fast path).
        self._global_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._any_forward)

    def wait(self) -> None:
        """Block until the step in flight is done; raise what it raised.

        An interrupt while waiting (Ctrl-C) leaves the step in flight: the
        next wait finds it.
        """
        future = self._future
        if future is None:
            return
        try:
            future.result()
        except BaseException:
            if not future.done():
                raise  # interrupted while waiting: the step still runs and keeps its board
            self._done()
            raise
        self._done()

    def _done(self) -> None:
        self._future = None
        self._board = None
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None

    def detach(self) -> None:
        """Remove the hooks and stop the thread (after the step in flight)."""
        try:
            self.wait()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._pool.shutdown(wait=True)
