"""One training iteration, measured phase by phase: :func:`diagnose`.

The iteration runs from the model as loaded (the call's starting point):
forward, backward, the optimizer step, and a second, steady iteration (the
optimizer state now exists while activations are alive: what training
really sees). The probe (:mod:`tierstore.diagnose.probes`) measures each
phase; tensor sizes are counted exactly (parameters, gradients, the
optimizer's state, and what autograd saves for backward, with saved-tensor
hooks); the verdict (:mod:`tierstore.diagnose.verdict`) estimates what
would lower the peak.

``loss_fn(model, batch)`` returns the scalar loss. Without it the model is
called with the batch (``model(**batch)`` for a dict, ``model(*batch)`` for
a tuple or list, ``model(batch)`` otherwise) and the loss is the output's
``.loss`` (Hugging Face), its ``"loss"`` key, or the output itself, summed
when it is not a scalar (a stand-in whose backward pass needs the same
memory).

The default optimizer is ``torch.optim.AdamW(params, lr=0.0)``: its state is
real, and a zero learning rate leaves the weights unchanged. A registered
algorithm's name (``optimizer="adagrad"``) builds its torch class the same
way (with that class's defaults: ``torch.optim.SGD`` without momentum keeps
no state, so pass a factory for SGD with momentum). The advice names the
tiered front of the optimizer measured (a tiered front's own algorithm, or
the algorithm whose torch class it is; AdamW's for any other class) and
estimates its RAM from that algorithm's fields and the options its groups
use. Gradients are set to ``None`` before and after.

Example
-------
>>> import torch
>>> model = torch.nn.Linear(256, 256)
>>> report = diagnose(model, torch.randn(4, 256), lambda m, b: m(b).square().mean())
>>> report.optimizer_state_bytes >= 2 * report.param_bytes, report.dominant
(True, 'optimizer_state')
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..sizes import parse_size
from .probes import probe_for
from .report import COUNTED, MEASURED, Figure, MemoryReport, Phase
from .verdict import Tiered, verdict

if TYPE_CHECKING:  # torch is imported where it is used: `import tierstore` stays fast (the CLI's --help)
    import torch
    from torch import Tensor, nn

__all__ = ["diagnose", "default_loss", "optimizer_factory"]


def _storages(tensors: Iterator[Tensor]) -> dict[int, int]:
    """data_ptr -> nbytes of the distinct storages behind ``tensors``."""
    from torch import Tensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return seen


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    from torch import Tensor

    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def default_loss(model: nn.Module, batch: Any) -> Tensor:
    """Call the model with ``batch`` and take the loss from its output (see the module docstring).

    Raises
    ------
    ConfigError
        If the output holds no tensor to use as a loss.

    Example
    -------
    >>> import torch
    >>> default_loss(torch.nn.Linear(3, 2), torch.ones(4, 3)).dim()
    0
    """
    from torch import Tensor

    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, Tensor):
        loss = out
    if not isinstance(loss, Tensor):
        raise ConfigError(
            f"the model returned a {type(out).__name__} without a loss tensor; pass "
            "loss_fn=lambda model, batch: ... returning the scalar loss"
        )
    return loss if loss.dim() == 0 else loss.float().sum()


def _state_bytes(optimizer: torch.optim.Optimizer, name: str) -> tuple[int, str]:
    """Bytes of the optimizer's state (counted), and how they were counted."""
    ram = getattr(optimizer, "ram_bytes", None)  # TieredAdamW: its RAM tier, not the (empty) .state
    if isinstance(ram, int):
        return ram, f"{name}.ram_bytes: the buffers of its RAM tier (arena, staging, resident shards)"
    total = sum(_storages(t for st in optimizer.state.values() for t in _tensors_in(st)).values())
    return total, f"storages of the tensors in {name}'s state after a step"


def _close(optimizer: Any) -> None:
    close = getattr(optimizer, "close", None)
    if callable(close):
        close()


def _opt_name(factory: Any) -> str:
    if factory is None:
        return "torch.optim.AdamW(lr=0)"
    if isinstance(factory, str):
        return f"{_algorithm(factory).torch_class}(lr=0)"
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def _algorithm(name: str) -> Any:
    from .._compute.algorithms import algorithm_named

    return algorithm_named(name)


def optimizer_factory(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``params -> torch class(params, lr=0.0)`` of the registered algorithm called ``name``.

    Raises
    ------
    ConfigError
        For a name no algorithm is registered under, or a torch class that cannot be imported.

    Example
    -------
    >>> import torch
    >>> type(optimizer_factory("adamw")([torch.nn.Parameter(torch.ones(2))])).__name__
    'AdamW'
    """
    import importlib

    try:
        algorithm = _algorithm(name)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or pass a factory as MODULE:FACTORY (optimizer(params) -> the optimizer)") from None
    module, _, cls = algorithm.torch_class.rpartition(".")
    try:
        torch_class = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"optimizer {name!r} measures {algorithm.torch_class}, which cannot be imported here ({exc}); install "
            "it, or pass a factory (MODULE:FACTORY) that builds the optimizer to measure"
        ) from None
    return lambda params: torch_class(params, lr=0.0)


def _measured_algorithm(opt: Any) -> tuple[Any, frozenset[str]]:
    """The algorithm whose state ``opt`` keeps (a tiered front's own, or the one whose torch class ``opt`` is;
    AdamW's for a class tierstore does not know), and the options its groups use."""
    from .._compute.algorithms import ADAMW, ALGORITHMS

    found = getattr(getattr(opt, "layout", None), "algorithm", None)
    if found is None:
        kind = type(opt)
        for algorithm in ALGORITHMS.values():
            module, _, cls = algorithm.torch_class.rpartition(".")
            if kind.__name__ == cls and kind.__module__.startswith(module):
                found = algorithm
                break
    found = found or ADAMW
    return found, found.options(getattr(opt, "param_groups", []))


def _tiered(params: list[nn.Parameter], *, on_gpu: bool, algorithm: Any = None, options: frozenset[str] = frozenset()) -> Tiered:
    """The tiered front's host RAM at a ``ram_budget``, by the planner's arithmetic over these parameters
    (``algorithm``'s fields with ``options``; AdamW's by default)."""

    def at(budget: int | None) -> tuple[int | None, int]:
        import psutil

        from .._layout.budget import OVERHEAD_BYTES
        from ..planner import plan_memory

        try:
            plan = plan_memory(params, host_ram=psutil.virtual_memory().total, gpu=on_gpu, ram_budget=budget,
                               optimizer=algorithm or "adamw", options=options)  # fmt: skip
        except ConfigError:  # no per-element state (SGD without momentum): the front holds its fixed overhead only
            return None, OVERHEAD_BYTES
        h = plan.host
        if budget is None:  # TieredAdamW(ram_budget=None): every shard resident
            return None, h.all_resident + h.overhead
        return (None if h.budget >= h.all_resident else h.budget), h.tierstore_total

    return at


def diagnose(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    *,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | str | None = None,
    memory_limit: int | str | None = None,
    steady: bool = True,
) -> MemoryReport:
    """Run one training iteration (two with ``steady``) and say where memory peaks.

    Parameters
    ----------
    model
        The model, already on its device (the device of its first parameter
        decides the probe: CUDA memory stats or process RSS).
    batch
        One batch, on the model's device.
    loss_fn
        ``loss_fn(model, batch) -> scalar loss``; ``None``: :func:`default_loss`.
    optimizer
        ``optimizer(params) -> torch.optim.Optimizer``; ``None``:
        ``torch.optim.AdamW(params, lr=0.0)`` (real state, unchanged weights);
        a registered algorithm's name (``"adagrad"``): its torch class, ``lr=0.0``.
        A factory with a learning rate changes the weights.
    memory_limit
        Memory you have where the peak happens (GPU memory, or RAM for CPU
        training): bytes or a size string. Used to size the suggested
        ``ram_budget``; ``None``: the suggestion keeps a quarter of the state
        in RAM.
    steady
        Also measure a second iteration with the optimizer state alive.

    Returns
    -------
    MemoryReport
        ``str(report)`` is a table; ``report.to_dict()`` is JSON-ready. Every
        byte figure says whether it was measured, counted or estimated.

    Raises
    ------
    ConfigError
        If the model has no trainable parameters, no loss can be found, or
        ``optimizer`` names no registered algorithm.

    Example
    -------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> report = diagnose(model, torch.randn(100_000, 8))
    >>> report.dominant, report.figure("halving the batch saves").kind
    ('activations', 'estimated')
    """
    import torch
    from torch import Tensor

    # Note: loss_fn may be positional (the three-argument form reads naturally); the rest is keyword-only.
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (requires_grad=True); nothing to diagnose")
    limit = None if memory_limit is None else parse_size(memory_limit, name="memory_limit")
    compute_loss = loss_fn or default_loss
    make_opt = optimizer_factory(optimizer) if isinstance(optimizer, str) else optimizer or (lambda ps: torch.optim.AdamW(ps, lr=0.0))
    opt_name = _opt_name(optimizer)
    device = params[0].device
    probe = probe_for(device)
    for p in params:
        p.grad = None
    gc.collect()
    fixed = set(_storages(model.parameters())) | set(_storages(model.buffers())) | set(_storages(_tensors_in(batch)))
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in fixed:
                saved[storage.data_ptr()] = storage.nbytes()
        return t

    phases = [Phase("model loaded", probe.current(), None)]
    start = phases[0].current
    growth_in = "the first iteration"
    opt = None
    try:
        with probe.watch() as peak, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compute_loss(model, batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ConfigError(f"loss_fn returned {type(loss).__name__} {getattr(loss, 'shape', '')}; it must return a scalar tensor")
        phases.append(Phase("forward", probe.current(), peak[0]))
        forward_delta = max(0, phases[-1].current - start)
        with probe.watch() as peak:
            loss.backward()
            del loss
        phases.append(Phase("backward", probe.current(), peak[0]))
        grad_bytes = sum(_storages(p.grad for p in params if p.grad is not None).values())
        opt = make_opt(params)
        with probe.watch() as peak:
            opt.step()
        phases.append(Phase("optimizer step", probe.current(), peak[0]))
        state_bytes, state_how = _state_bytes(opt, opt_name)
        algorithm, options = _measured_algorithm(opt)
        if steady:
            opt.zero_grad(set_to_none=True)
            with probe.watch() as peak:
                before = probe.current()
                loss = compute_loss(model, batch)
                # The second forward's growth: free of one-time costs (lazy init, thread pools).
                forward_delta = max(0, probe.current() - before)
                growth_in = "the steady iteration"
                loss.backward()
                del loss
                opt.step()
            phases.append(Phase("steady iteration", probe.current(), peak[0]))
    finally:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            _close(opt)
        for p in params:
            p.grad = None
        del opt
        gc.collect()
    param_bytes = sum(_storages(params).values())
    saved_bytes = sum(saved.values())
    # Activations: the larger of what the probe saw the forward add and what autograd saved (RSS can
    # under-report a forward whose freed heap memory was reused; saved bytes miss the forward's temporaries).
    if forward_delta > saved_bytes:
        activations, from_, kind = forward_delta, "forward growth", MEASURED
    else:
        activations, from_, kind = saved_bytes, "saved for backward", COUNTED
    top = max((p for p in phases if p.peak is not None), key=lambda p: p.peak)
    found = verdict(
        device_type=device.type,
        params=param_bytes,
        grads=grad_bytes,
        state=state_bytes,
        activations=activations,
        activations_kind=kind,
        peak=top.peak,
        limit=limit,
        tiered=_tiered(params, on_gpu=device.type == "cuda", algorithm=algorithm, options=options),
        front=algorithm.front,
        torch_class=algorithm.torch_class,
    )
    measured_with = probe.kind.split(" (")[0]  # the header gives the details
    other = "forward growth (measured)" if from_ == "saved for backward" else "saved for backward (counted)"
    figures = (
        Figure("peak", top.peak, MEASURED, f"{measured_with}, during {top.name}"),
        Figure("process baseline", start, MEASURED, f"{measured_with} at '{phases[0].name}', the call's start"),
        Figure("parameters", param_bytes, COUNTED, "storages of the trainable parameters"),
        Figure("gradients", grad_bytes, COUNTED, "storages of the gradients after backward"),
        Figure("optimizer state", state_bytes, COUNTED, state_how),
        Figure("activations", activations, kind, f"from {from_} ({kind}), the larger of it and {other}"),
        Figure("forward growth", forward_delta, MEASURED, f"{measured_with} after the forward minus before it, in {growth_in}"),
        Figure("saved for backward", saved_bytes, COUNTED,
               "storages autograd saved for backward (saved-tensor hooks; weights and batch excluded)"),
        *found.estimates,
    )  # fmt: skip
    return MemoryReport(
        device=str(device),
        measured_with=probe.kind,
        optimizer=opt_name,
        phases=tuple(phases),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes,
        activation_bytes=activations,
        forward_delta_bytes=forward_delta,
        saved_for_backward_bytes=saved_bytes,
        peak_bytes=top.peak,
        peak_phase=top.name,
        dominant=found.dominant,
        advice=found.advice,
        suggested_ram_budget=found.suggested_ram_budget,
        baseline_bytes=start,
        activations_from=from_,
        figures=figures,
    )
