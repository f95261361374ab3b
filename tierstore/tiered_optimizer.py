"""``TieredOptimizer``: the torch optimizer front every tiered algorithm shares.

A front validates its arguments, builds the state's layout and machinery,
gathers each step's gradients and delegates. What it knows of its algorithm
comes from one description (:class:`~tierstore._compute.algorithms.base.Algorithm`,
the class attribute :attr:`TieredOptimizer.algorithm`): torch's checks and
group keys, the per-step snapshot of a group's hyperparameters, the state's
fields and the update. What the state holds is decided by
:mod:`tierstore._layout.spec`, the per-shard update is
:mod:`tierstore._runtime.update`, the commit protocol
:mod:`tierstore._state.journal`, the running machinery and its lifetime
:mod:`tierstore._runtime.runtime`, and torch's state-dict format
:mod:`tierstore._layout.torch_format`. Adapters (checkpoints, DCP) use the
public access protocol of :mod:`tierstore._runtime.access`.

A front is a subclass with the torch class's constructor, e.g.
:class:`tierstore.TieredAdamW`, that passes its hyperparameters on.

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> issubclass(TieredAdamW, TieredOptimizer), TieredAdamW.algorithm.name
(True, 'adamw')
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._compute.algorithms import Algorithm
from ._compute.algorithms.in_use import using
from ._compute.formats import moment_format
from ._config.knobs import (
    DEFAULT_IO_WORKERS,
    DEFAULT_PREFETCH_DEPTH,
    DEFAULT_REQUEST_BYTES,
    Knobs,
    check_int,
)
from ._config.knobs_file import read_knobs_file
from ._layout.budget import TierPlan
from ._layout.layout import Layout, layout_format
from ._layout.scalar_record import given_scalars, record_of
from ._layout.spec import check_param_kinds
from ._layout.torch_format import (
    check_same_params,
    empty_state_dict,
    extra_state,
    flat_sources,
    incoming_state,
    load_extra_state,
    own_state_keys,
    packed_groups,
    param_scalars,
    param_steps,
    require_state_dict,
)
from ._platform import torch_private
from ._platform.dtensor import placed_like
from ._platform.dynamo import disable_dynamo
from ._runtime.access import ShardVisit
from ._runtime.grad_offload import DEFAULT_BUCKET_BYTES
from ._runtime.runtime import Runtime, StepStats
from ._runtime.startup import start
from ._runtime.update import gather, master_sync
from ._state.commit_policy import CommitPolicy
from ._state.journal import Journal
from .errors import ConfigError, ParamsChangedError
from .sizes import budget_request

__all__ = ["TieredOptimizer"]

log = logging.getLogger(__name__)

# torch marks these with torch._disable_dynamo, whose first call imports torch._dynamo
# (70 MiB of RSS): call them without it while nothing compiles (tierstore._platform.dynamo).
_TORCH_ADD_PARAM_GROUP = disable_dynamo(torch.optim.Optimizer.add_param_group)
_TORCH_ZERO_GRAD = disable_dynamo(torch.optim.Optimizer.zero_grad)


class TieredOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose elementwise state lives in tiers (RAM and local disk).

    Subclasses set :attr:`algorithm` and give the torch class's constructor;
    the keyword arguments from ``state_dir`` on are the tiers' (documented on
    :class:`tierstore.TieredAdamW`).
    """

    # Note: unlike torch's optimizers, state for every trainable parameter exists
    # from construction (it has a place in the layout); state_dict() still lists
    # only parameters that took at least one step, as torch does.

    #: The algorithm whose state this front stores (a subclass sets it).
    algorithm: ClassVar[Algorithm]

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        hyper: Mapping[str, Any],
        *,
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
        """``hyper`` are the constructor's hyperparameters by name (checked as the torch class checks them)."""
        self._rt: Runtime | None = None  # until construction succeeds; makes close() safe on failure
        algorithm = self.algorithm
        algorithm.probe()  # a torch without the kernel fails here, not mid-step
        algorithm.check_group(hyper)
        self._budget = budget_request(ram_budget)  # a share resolves against the state's size in start()
        resources = dict(backend=backend, prefetch_depth=prefetch_depth, io_workers=io_workers,
                         request_bytes=request_bytes, update_threads=update_threads, pin_memory=pin_memory)
        # A knobs file (tierstore tune) fills the knobs left at their defaults; explicit arguments win.
        self._tuned = None if knobs is None else read_knobs_file(knobs)
        self._knobs = Knobs(**(resources if self._tuned is None else self._tuned.apply(resources)))
        if shard_numel is not None:
            check_int("shard_numel", shard_numel, 1)
        self._format = layout_format(moment_format(moment_dtype))  # None is an error here, not the default
        Journal.check_arguments(state_dir, durable=durable, resume=resume)
        policy = CommitPolicy.parse(commit_every)
        self._building = True
        super().__init__(params, algorithm.defaults(hyper))
        self._building = False
        # Each field's value before a parameter's first step (Adagrad's sum: initial_accumulator_value),
        # from the constructor's hyperparameters, as torch reads it.
        self._init_values = algorithm.initial_values(self.defaults)
        for gi, group in enumerate(self.param_groups):
            algorithm.check_group(group, f" in param group {gi}")
        self._params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        check_param_kinds(self._params)
        # What a rebuild (add_param_group) lays out again: the choices of this constructor.
        self._build_args = dict(shard_numel=shard_numel, keep_master=keep_master, durable=durable, policy=policy)
        # A state directory's layout names its algorithm: this one resolves even when it is not registered
        # (the generic adapter's), and only because this optimizer runs it.
        with using(algorithm):
            journal = Journal.open(state_dir, resume=resume, resume_step=resume_step, durable=durable, policy=policy)
            started = start(journal, self.param_groups, self._params, self.state, knobs=self._knobs,
                            ram_budget=self._budget, shard_numel=shard_numel, keep_master=keep_master,
                            restore_params=restore_params, moment_dtype=self._format, algorithm=algorithm,
                            init=self._init_values, bandwidths=self._drive_figures(journal))  # fmt: skip
        self._spec, self._layout, self._plan, self._rt = started.spec, started.layout, started.plan, started.runtime
        # Every copy of this object shares the runtime and this token; when the last
        # one is gone, the runtime closes (instead of a __del__ that a copy would run).
        self._owner = self._rt.owner()

    def _drive_figures(self, journal: Journal) -> list[float] | None:
        """The knobs file's bandwidth of each directory of a state over several (where a new one's shards
        go, instead of a probe); ``None`` without a knobs file, or one that lacks a directory's drive."""
        drives = journal.drives
        if self._tuned is None or drives is None or drives.paths is None or drives.count < 2:
            return None
        return self._tuned.bandwidths_for(drives.paths)

    def _runtime(self, *, synchronize: bool = True) -> Runtime:
        """The open runtime, after the step running behind the loop (if any); raises if closed or failed."""
        if self._rt is None:
            raise ConfigError(f"this {type(self).__name__} was not built (its constructor raised)")
        self._rt.require_open()
        if synchronize:
            self._rt.synchronize()
            self._rt.require_open()
        return self._rt

    # -- torch.optim.Optimizer API ------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as the torch class's ``add_param_group`` does; :meth:`state_dict` then lists it.

        The layout of the state covers every parameter, so adding some lays
        the state out again: the current state is carried over (through
        :meth:`state_dict`, so it passes through RAM once) into a new store
        with the same budget and format, and the new parameters start with
        no state, as in torch. This works while the state lives in RAM or in
        a private temporary directory (``state_dir=None``). A user's
        ``state_dir`` is the state's identity on disk and a rewrite of it
        could not be made crash-consistent, so there it is refused: put every
        group in the constructor instead (a group that should start later
        takes no step while its parameters have no gradient).

        Raises
        ------
        ParamsChangedError
            With a ``state_dir``, or while :meth:`attach` is in effect.
        ValueError, TypeError
            As torch raises them (a parameter already in a group, a
            hyperparameter torch refuses, a parameter tierstore cannot hold).

        Example
        -------
        >>> import torch
        >>> from tierstore import TieredAdamW
        >>> a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        >>> opt = TieredAdamW([a], lr=0.1)
        >>> a.grad = torch.ones(3); _ = opt.step()
        >>> opt.add_param_group({"params": [b], "lr": 0.01})
        >>> [g["params"] for g in opt.state_dict()["param_groups"]], opt.step_count
        ([[0], [1]], 1)
        >>> opt.close()
        """
        if getattr(self, "_building", False):
            _TORCH_ADD_PARAM_GROUP(self, param_group)
            return
        rt = self._runtime()
        if rt.journal.persistent:
            name = type(self).__name__
            raise ParamsChangedError(
                f"add_param_group: the state in state_dir={str(rt.journal.directory)!r} is laid out for the "
                "parameters it was built with, and rewriting it for more could not be made crash-consistent. "
                f"Build the {name} with every group from the start, e.g. {name}([group1, group2], ...): "
                "a group that should start later takes no step while its parameters have no gradient"
            )
        if rt.attachment is not None or rt.offload is not None:
            raise ParamsChangedError("add_param_group while attached to a model: call detach() first, then attach() again")
        saved = self.state_dict()
        before = list(self.param_groups)
        try:
            _TORCH_ADD_PARAM_GROUP(self, param_group)
            self.algorithm.check_group(self.param_groups[-1], f" in param group {len(self.param_groups) - 1}")
            params = [p for g in self.param_groups for p in g["params"]]
            check_param_kinds(params)
            self._relayout(params, saved)
        except BaseException:
            self.param_groups[:] = before  # nothing changed: the old state is still the one in use
            raise

    def _relayout(self, params: list[Tensor], saved: dict[str, Any]) -> None:
        """Lay the state out for ``params`` (the param groups as they now are) and carry ``saved`` over."""
        args = self._build_args
        journal = Journal.open(None, resume=False, resume_step=None, durable=args["durable"], policy=args["policy"])
        old = self._spec, self._layout, self._plan, self._rt, self._params
        steps = old[3].step_count
        # The new store is built beside the old one, so a failure (a budget the new layout
        # does not fit) leaves the optimizer as it was.
        started = start(journal, self.param_groups, params, self.state, knobs=self._knobs, ram_budget=self._budget,
                        shard_numel=args["shard_numel"], keep_master=args["keep_master"], restore_params=False,
                        moment_dtype=self._format, algorithm=self.algorithm, init=self._init_values)  # fmt: skip
        self._spec, self._layout, self._plan, self._rt = started.spec, started.layout, started.plan, started.runtime
        self._params = params
        try:
            extended = dict(saved)
            extended["param_groups"] = [*saved["param_groups"], self.state_dict()["param_groups"][-1]]
            self.load_state_dict(extended)
            self._rt.step_count = steps
        except BaseException:
            self._rt.close()
            self._spec, self._layout, self._plan, self._rt, self._params = old
            raise
        old[3].close()  # a RAM or private state: nothing to commit, its memory and directory go
        self._owner = self._rt.owner()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scaler: Any = None) -> Any:
        """Perform one optimizer step over every parameter that has a gradient.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step`` when the
        gradients were offloaded to the host (:meth:`attach`): the unscale and
        inf check then run on the host gradients, and an inf skips the step.

        Raises
        ------
        ClosedError
            After :meth:`close`.
        ParamsChangedError
            If parameters were added, reshaped or re-typed since construction,
            or a parameter frozen at construction now has a gradient.
        """
        rt = self._runtime()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_same_params(self.param_groups, self._params)
        offload = rt.offload
        if offload is not None and grad_scaler is not None and offload.found_inf(grad_scaler, self):
            offload.consume()  # GradScaler skips this step: the gradients are spent
            return loss
        grads = offload.grads() if offload is not None else None
        advancing = [self.algorithm.advances(g) for g in self.param_groups]
        active = gather(self._params, self._layout, self.state, grads=grads, advancing=advancing)
        if offload is not None:
            offload.consume()
        hypers = [self._snapshot(g) for g in self.param_groups]
        update = rt.new_update(self._layout, self._spec, active, hypers, knobs=self._knobs)
        # The step counts move only when the step succeeds (the runtime publishes them); the
        # commit records them as they will be, with the hyperparameters as of now. Note: torch
        # increments them before its kernel runs; a failed step here leaves them, and refuses
        # further use (StepFailedError).
        rt.schedule_step(update, progress=rt.progress(update), knobs=self._knobs)
        return loss

    # -- behind the training loop (tierstore._runtime.overlap) -----------------
    def attach(
        self,
        model: torch.nn.Module,
        *,
        offload_grads: bool | None = None,
        grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool | None = None,
    ) -> TieredOptimizer:
        """Run each step behind the training loop: ``step()`` returns once the update is scheduled.

        The update runs on a background thread in the order ``model``'s
        forward first uses the parameters; a forward pre-hook on each module
        waits for that module's parameters, so results stay bitwise equal to
        the synchronous step. Code that reads parameters outside a forward
        (``model.state_dict()``, an EMA) calls :meth:`synchronize` first.
        See :mod:`tierstore._runtime.overlap`.

        ``overlap=None`` runs a step behind the loop when something can hide
        there: shards streamed from disk, or copies to a GPU. A step of
        CPU parameters with all state in RAM is pure CPU work that would
        compete with the forward for the same cores, so it runs at once
        (never slower than unattached). ``True``: always behind the loop.

        With ``offload_grads`` (``None``: when parameters are on a GPU)
        gradients leave the device as backward finishes each, into host
        buffers; ``param.grad`` is then ``None``: clip with
        :meth:`clip_grad_norm_`, unscale with :meth:`unscale_`. See
        :mod:`tierstore._runtime.grad_offload`.

        Raises
        ------
        ConfigError
            If ``model`` owns none of the optimizer's parameters, or
            ``grad_bucket_bytes`` is below 4096.

        Example
        -------
        >>> import torch
        >>> from tierstore import TieredAdamW
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = TieredAdamW(model.parameters()).attach(model)
        >>> model(torch.ones(1, 4)).sum().backward(); _ = opt.step()
        >>> opt.synchronize(); opt.close()
        """
        rt = self._runtime()
        offload = self._spec.cuda if offload_grads is None else bool(offload_grads)
        rt.attach(model, self._params, self._layout, cuda=self._spec.cuda, offload_grads=offload,
                  grad_bucket_bytes=grad_bucket_bytes, pin=self._knobs.pin_memory, overlap=overlap)  # fmt: skip
        torch_private.set_amp_scaling_step(self, offload)  # GradScaler then hands itself to step()
        return self

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's gradients; returns the total norm.

        With gradients offloaded to the host (:meth:`attach`), ``param.grad``
        is ``None`` and torch's function would clip nothing: this one clips the
        host copies, with exactly torch's arithmetic, once every gradient is
        down. Without offload it is torch's function over the parameters.
        """
        rt = self._runtime(synchronize=False)
        if rt.offload is not None:
            return rt.offload.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
        return torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type, error_if_nonfinite, foreach)

    def unscale_(self, scaler: Any) -> None:
        """``scaler.unscale_(self)``, on the host gradients when they were offloaded (:meth:`attach`)."""
        rt = self._runtime(synchronize=False)
        if rt.offload is None:
            scaler.unscale_(self)
        else:
            rt.offload.unscale_(scaler, self)

    def detach(self) -> None:
        """Undo :meth:`attach`: steps run synchronously again (after the one in flight)."""
        torch_private.set_amp_scaling_step(self, False)
        if self._rt is not None:
            self._rt.detach()

    def synchronize(self) -> None:
        """Wait until the step running behind the loop has updated every parameter and state.

        Raises
        ------
        StepFailedError
            If that step failed (the message names its error and how to resume).
        """
        self._runtime()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Note: with set_to_none=False the gradients are zeroed in place, which a
        # step still running behind the loop may be reading: synchronize first.
        rt = self._rt
        if rt is not None and not rt.closed:
            if not set_to_none:
                rt.synchronize()
            if rt.offload is not None:  # the gradients live on the host: zero (or drop) those
                rt.offload.zero_grad(set_to_none=set_to_none)
        _TORCH_ZERO_GRAD(self, set_to_none=set_to_none)

    def __copy__(self) -> TieredOptimizer:
        # Note: a copy shares the running state (the runtime and its owner token), as
        # wrappers that copy __dict__ do; torch's __getstate__ would drop it.
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo: dict) -> TieredOptimizer:
        # Note: torch's optimizers deep-copy; this one's state is files and buffers with one owner
        # (a state directory takes one lock), so it is refused with the way out (docs/compatibility.md).
        raise TypeError(
            f"a {type(self).__name__} cannot be deep-copied: its state lives in files and buffers it owns. Use "
            f"state_dict() (or save_checkpoint) and load it into a new {type(self).__name__}"
        )

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled: its state lives in files and buffers it owns. Pickle "
            f"state_dict() instead (or save_checkpoint), and load it into a new {type(self).__name__}"
        )

    # -- state dict ---------------------------------------------------
    @disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """The state in the torch class's format (plus ``master_param`` with masters).

        Materialises every moment as a full CPU tensor: for models whose state
        fits in RAM. Larger states stream with ``save_checkpoint``. For DTensor
        (FSDP2) parameters the states are DTensors placed like the parameter,
        holding this rank's part, as torch's optimizers keep them (so
        ``get_optimizer_state_dict`` and DCP see each rank's shard).
        """
        self._runtime()  # synchronizes: a step behind the loop finishes first
        for pre_hook in torch_private.optimizer_hooks(self, "state_dict_pre"):
            pre_hook(self)
        layout = self._layout
        groups, keys = packed_groups(self.param_groups, self._params)  # as torch numbers them
        scalars = param_scalars(self.state, self._params, self.algorithm.scalar_inits)
        result, flats = empty_state_dict(layout, param_steps(self.state, self._params), groups, keys=keys, scalars=scalars)
        if flats:
            self.visit_shards(lambda shard, flat: layout.copy_out(shard, flat, flats), layout.shards_of(flats))
        for i, key in keys.items():
            for field in result["state"].get(key, ()):
                if field != "step":
                    result["state"][key][field] = placed_like(result["state"][key][field], self._params[i])
        # What a user or a scheduler keeps in optimizer.state besides tierstore's own keys travels
        # as torch's state_dict carries it: extra keys of a parameter's entry, and keys that are
        # not parameters. Note: unlike the moments, they live in RAM only (no state directory,
        # checkpoint or DCP keeps them).
        per_param, others = extra_state(self.state, self._params, keys, own_state_keys(layout))
        for key, extras in per_param.items():
            result["state"].setdefault(key, {}).update(extras)
        result["state"].update(others)
        for post_hook in torch_private.optimizer_hooks(self, "state_dict_post"):
            hook_result = post_hook(self, result)
            if hook_result is not None:
                result = hook_result
        return result

    @disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class or its torch class (``TieredAdamW``: ``torch.optim.AdamW``).

        Raises
        ------
        ValueError (ConfigError)
            If its groups or parameter counts do not match, a hyperparameter is
            invalid, it uses amsgrad without this optimizer's ``max_exp_avg_sq``,
            or a tensor has the wrong size. Nothing is loaded then.
        """
        self._runtime()
        require_state_dict(state_dict)
        state_dict = dict(state_dict)
        for pre_hook in torch_private.optimizer_hooks(self, "load_state_dict_pre"):
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        layout = self._layout
        incoming, others = incoming_state(state_dict, self.param_groups, layout)
        sources = flat_sources(incoming, layout)
        steps = {i: s for i, e in incoming.items() if (s := self.algorithm.loaded_step(e)) is not None}
        own = own_state_keys(layout)
        extras = {i: {k: v for k, v in e.items() if k not in own} for i, e in incoming.items()}
        # Note: torch state dicts carry no global step count; the most advanced
        # parameter's step is the number of steps taken (what step_count reports).
        self._replace(
            # A parameter the state dict gives no entry starts over, as in torch: its fields at their initial values.
            lambda shard, flat: layout.copy_in(shard, flat, sources, init=self._init_values),
            param_steps=steps,
            groups=[{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]],
            masters_given={i for i, src in sources.items() if "master" in src},
            step_count=int(max(steps.values(), default=0)),
            groups_like_torch=True,
            param_scalars={i: self.algorithm.loaded_scalars(incoming[i]) for i in steps},
        )
        load_extra_state(self.state, self._params, {i: e for i, e in extras.items() if e}, others)
        for post_hook in torch_private.optimizer_hooks(self, "load_state_dict_post"):
            post_hook(self)

    # -- the access protocol for adapters (tierstore._runtime.access) ----------
    def param_steps(self) -> list[float | None]:
        """Each parameter's step count, in layout order (``None`` before its first)."""
        return param_steps(self.state, self._params)

    def param_scalars(self) -> dict[str, list[float | None]] | None:
        """Each parameter's scalars besides its step, in layout order, as adapters record them beside
        :meth:`param_steps`: ``{name: [value or None per parameter]}`` (NAdam: ``mu_product``);
        ``None`` for an algorithm that keeps none (AdamW). See :mod:`tierstore._layout.scalar_record`."""
        inits = self.algorithm.scalar_inits
        return record_of(inits, self.param_steps(), param_scalars(self.state, self._params, inits))

    def _snapshot(self, group: dict[str, Any]) -> Any:
        """``group``'s hyperparameters for this step (:meth:`~tierstore._compute.algorithms.base.Algorithm.snapshot`).

        A front whose torch class reads a setting from the optimizer rather than from
        its param groups (lion-pytorch's ``decoupled_weight_decay``) adds it here.
        """
        return self.algorithm.snapshot(group, self._layout.fields)

    def check_usable(self) -> None:
        """Raise ``ClosedError`` after :meth:`close`, ``StepFailedError`` after a failed change."""
        self._runtime()

    def visit_shards(self, visit: ShardVisit, shards: Iterable[int] | None = None) -> int:
        """Call ``visit(shard, flat)`` with every shard's current fp32 values, read-only.

        ``shards`` limits the visit to those shard indices. Disk shards stream
        through the arena, so this needs no RAM beyond the budget; ``flat`` is
        valid only during the call. Returns the shards read from the drive
        (resident shards and shards still in an arena slot are not read).
        See :mod:`tierstore._runtime.access`.
        """
        threads = self._knobs.codec_threads(streaming=False, behind=False)
        return self._runtime().visit(self._layout, visit, shards, decode_threads=threads)

    def visit_stored(self, visit: ShardVisit, shards: Iterable[int] | None = None) -> None:
        """Call ``visit(shard, extent)`` with every shard's stored bytes, read-only.

        ``extent`` holds the shard's fields as stored (the moments in
        :attr:`moment_dtype`), see :meth:`~tierstore._layout.layout.Layout.stored_field`;
        in ``"float32"`` it is what :meth:`visit_shards` gives. See :mod:`tierstore._runtime.access`.
        """
        self._runtime().visit(self._layout, visit, shards)

    def replace_shards(
        self,
        fill: ShardVisit,
        *,
        param_steps: dict[int, float],
        groups: list[dict[str, Any]] | None = None,
        masters_given: set[int] | None = None,
        step_count: int | None = None,
        stored: bool = False,
        param_scalars: dict[str, list[float | None]] | None = None,
    ) -> None:
        """Overwrite the whole state, shard by shard, and commit it (see :mod:`tierstore._runtime.access`).

        ``fill(shard, flat)`` sets every fp32 element of ``flat`` (with
        ``stored=True``: every stored byte of the extent). Masters of
        parameters not in ``masters_given`` are seeded from the parameters;
        ``param_steps``, ``groups`` and ``step_count`` replace the bookkeeping,
        and ``param_scalars`` (as :meth:`param_scalars` gives them) the scalars
        besides the step of an algorithm that keeps some.

        Raises
        ------
        ConfigError
            For an algorithm with per-parameter scalars besides ``step`` (NAdam's ``mu_product``)
            when ``param_scalars`` lacks a finite value for a parameter given a step. Nothing is replaced then.
        """
        scalars = given_scalars(param_scalars, self.algorithm.scalar_inits, list(param_steps), len(self._params),
                                type(self).__name__)  # fmt: skip
        self._replace(fill, param_steps=param_steps, groups=groups, masters_given=masters_given,
                      step_count=step_count, stored=stored, param_scalars=scalars or None)  # fmt: skip

    def _replace(
        self,
        fill: ShardVisit,
        *,
        param_steps: dict[int, float],
        groups: list[dict[str, Any]] | None,
        masters_given: set[int] | None,
        step_count: int | None,
        stored: bool = False,
        groups_like_torch: bool = False,
        param_scalars: dict[int, dict[str, Tensor]] | None = None,
    ) -> None:
        """:meth:`replace_shards`; ``groups_like_torch``: groups become the given ones, as torch's
        ``load_state_dict`` makes them (:func:`~tierstore._layout.torch_format.restore_groups`);
        ``param_scalars``: the parameters' other per-parameter scalars (NAdam's ``mu_product``)."""
        rt = self._runtime()
        given = masters_given or set()
        rt.replace(self._layout, fill, sync=master_sync(self._layout, self._params, to_params=given.__contains__),
                   param_steps=param_steps, groups=groups or [], step_count=step_count,
                   encode_threads=None if stored else self._knobs.codec_threads(streaming=False, behind=False),
                   groups_like_torch=groups_like_torch, param_scalars=param_scalars)  # fmt: skip

    # -- adapters -------------------------------------------------------
    def save_checkpoint(self, path: str, **options: Any) -> None:
        """Stream the state into a zarr v3 store at ``path``, one chunk per shard.

        See :func:`tierstore.checkpoint.save_checkpoint` for the layout and options.
        """
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path, **options)

    def load_checkpoint(self, path: str, **options: Any) -> None:
        """Stream a zarr checkpoint written by :meth:`save_checkpoint` back into the state.

        See :func:`tierstore.checkpoint.load_checkpoint`.
        """
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path, **options)

    # -- introspection ------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The state's layout (parameters, shards, fields)."""
        return self._layout

    @property
    def plan(self) -> TierPlan:
        """How ``ram_budget`` was split (arena, staging, resident shards)."""
        return self._plan

    @property
    def step_count(self) -> int:
        """Number of completed :meth:`step` calls (the step to resume data and schedules from).

        A step that failed does not count. A step running behind the loop
        (:meth:`attach`) counts from when ``step()`` returns, unless it fails.
        """
        return self._rt.steps_taken() if self._rt is not None else 0

    @property
    def committed_step(self) -> int | None:
        """The step a crash (process kill or power loss) now would resume at.

        ``None`` without durability (no ``state_dir``, or ``durable=False``).
        Commits finish in the background, so this may lag :attr:`step_count`;
        :meth:`commit` waits.
        """
        return self._rt.committed_step if self._rt is not None else None

    def commit(self, *, wait: bool = True) -> int | None:
        """Commit the current step now (unless it is committed already) and wait until it is durable.

        For a user who wants "this step is durable" before, say, logging it.
        ``wait=False`` only starts it. Returns :attr:`committed_step`.
        Without durability this does nothing and returns ``None``.

        Raises
        ------
        ClosedError, StepFailedError
            If the optimizer is closed, or a step or commit failed before.
        """
        rt = self._runtime()
        with rt.mutation():
            rt.journal.commit(rt.progress(), wait=wait)
        return rt.committed_step

    @property
    def state_dir(self) -> str | None:
        """The state directory in use, or ``None`` when all state is in RAM without one."""
        directory = self._rt.journal.directory if self._rt is not None else None
        return str(directory) if directory is not None else None

    @property
    def backend(self) -> str | None:
        """The I/O backend in use (``None`` when nothing is on disk)."""
        store = self._rt.store if self._rt is not None else None
        return store.backend_name if store is not None and store.files else None

    @property
    def ram_bytes(self) -> int:
        """Host RAM held for state: arena, staging and resident shards."""
        return self._plan.ram_nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the host RAM above pinned for CUDA copies (0 without CUDA, or when pinning failed)."""
        rt = self._rt
        return 0 if rt is None or rt.closed else rt.store.pinned_nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of state in files."""
        rt = self._rt
        return 0 if rt is None or rt.closed else rt.store.disk_nbytes

    @property
    def last_step_stats(self) -> StepStats | None:
        """The last :meth:`step`: its time split (read wait, update, write wait, waits for
        commits), bytes read and written to the drive, and whether a commit started."""
        return self._rt.last_run if self._rt is not None else None

    @property
    def moment_dtype(self) -> str:
        """How the moments are stored: ``"float32"``, ``"bfloat16"`` or ``"int8"``."""
        return self._format.name

    def describe(self) -> str:
        """One line: parameters, state size (and its moment format when compressed), and where it lives."""
        return self._rt.describe(self._layout, self._plan)

    # -- lifecycle ----------------------------------------------------
    def close(self) -> None:
        """Release memory, threads, files and the directory lock; safe to call twice.

        A private (``state_dir=None``) directory is removed. With
        ``durable=False`` and a ``state_dir``, the resident shards are written
        out and a clean manifest is committed, so the directory can be resumed.
        If ``close`` is never called, it runs when the optimizer (and every
        copy of it) is garbage collected, or at interpreter exit.
        """
        if self._rt is not None:
            self._rt.close()

    def close_for(self, who: str) -> None:
        """:meth:`close`, saying who closed it (a trainer integration): a later use's ``ClosedError`` names it."""
        if self._rt is not None and not self._rt.closed:
            self._rt.closed_by = who
        self.close()

    def __enter__(self) -> TieredOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = self._rt is None or self._rt.closed
        return f"{type(self).__name__}({'closed' if closed else self.describe()})"
