"""Every private API of torch (and of the standard library) tierstore calls, in one place.

Private names change between releases without notice. Each is reached
through a function here that checks it exists and either falls back to a
public equivalent or raises :class:`~tierstore.errors.ConfigError` naming the
API, the installed version and the fix, so a torch release that drops one
fails in one known place instead of deep inside a step. Nothing is looked up
once and kept: a test (or a debugger) that replaces one of these names sees
its replacement used.

| API | used by | where it is missing |
|---|---|---|
| ``torch.backends.cpu.get_cpu_capability`` | the compiled update's recipe | ``"unknown"``: the torch path runs |
| ``torch._fused_adamw_`` | the update (:mod:`tierstore._compute.kernel`) | ``ConfigError`` when the optimizer is built |
| ``torch._fused_adam_``, ``_fused_sgd_``, ``_fused_adagrad_`` | the Adam, SGD and Adagrad updates (:mod:`tierstore._compute.algorithms`) | ``ConfigError`` when the optimizer is built |
| ``torch.optim.<name>._single_tensor_<name>``, ``._multi_tensor_<name>`` | the updates of RMSprop, Adamax, NAdam, RAdam, Adadelta | ``ConfigError`` when the optimizer is built |
| ``torch._disable_dynamo`` | ``step``/``state_dict`` never traced | the function runs unwrapped |
| ``threading._register_atexit`` | closing optimizers at exit before thread pools stop | ``atexit.register`` |
| ``torch._foreach_add_`` | step counts | a loop of ``add_`` |
| ``torch._amp_foreach_non_finite_check_and_unscale_`` | unscaling offloaded gradients | the same check and multiply per tensor |
| ``GradScaler._per_optimizer_states``, ``._scale``, ``OptState`` | unscaling offloaded gradients | ``ConfigError`` |
| ``Optimizer._optimizer_*_hooks`` | state-dict hooks | no hooks (torch then has no way to register them either) |
| ``torch._C._get_privateuse1_backend_name`` | DCP copy-ahead on custom devices | ``"privateuseone"`` |
| ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` | a DTensor's local part | ``ConfigError`` |
| ``torch.Tensor._make_wrapper_subclass`` | DCP's lazy tensors | ``ConfigError`` |
| ``sys._getframe`` | finding DCP's writer among the callers | ``inspect.currentframe`` |

Example
-------
>>> cpu_capability() in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "SVE"} or cpu_capability()
True
>>> import torch
>>> steps = [torch.tensor(1.0), torch.tensor(2.0)]
>>> foreach_add_(steps, 1); [float(s) for s in steps]
[2.0, 3.0]
"""

from __future__ import annotations

import atexit
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError

_PINNED = "tierstore is tested with torch 2.13 (pip install 'torch>=2.13,<2.14')"


def _missing(name: str, fix: str) -> ConfigError:
    return ConfigError(f"torch {torch.__version__} has no {name}, which tierstore needs; {fix} ({_PINNED})")


@functools.cache
def cpu_capability() -> str:
    """The CPU capability torch's kernels dispatch to in this process (``"DEFAULT"``, ``"AVX2"``, ``"AVX512"``, ...).

    ``ATEN_CPU_CAPABILITY`` lowers it; the answer is fixed for the process.
    Where torch has no ``torch.backends.cpu.get_cpu_capability`` the answer
    is ``"unknown"``, which no compiled-kernel recipe matches (the torch path
    then runs).
    """
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if get is None:
        return "unknown"
    return str(get())


# -- the fused update kernels ----------------------------------------------------------


def fused_adamw_kernel() -> Callable[..., Any]:
    """``torch._fused_adamw_``, torch's fused AdamW: the update every shard runs (bitwise torch's AdamW).

    There is no fallback: another kernel would not give torch's bits.

    Raises
    ------
    ConfigError
        Where this torch has no ``torch._fused_adamw_``.

    Example
    -------
    >>> callable(fused_adamw_kernel())
    True
    """
    kernel = getattr(torch, "_fused_adamw_", None)
    if kernel is None:
        raise _missing("torch._fused_adamw_ (its fused AdamW kernel)", "install torch 2.13")
    return kernel


def optim_kernel(module: str, name: str) -> Callable[..., Any]:
    """``torch.optim.<module>.<name>``: one of torch's functional optimizer implementations.

    The single-tensor and foreach ones (``_single_tensor_rmsprop``,
    ``_multi_tensor_rmsprop``, ...) are called directly: the public
    ``torch.optim.rmsprop.rmsprop`` is wrapped in ``torch._disable_dynamo``,
    whose first call imports ``torch._dynamo`` (70 MiB of RSS). There is no
    fallback: another implementation would not give torch's bits.

    Raises
    ------
    ConfigError
        Where this torch has no such function.

    Example
    -------
    >>> optim_kernel("rmsprop", "_single_tensor_rmsprop").__name__
    '_single_tensor_rmsprop'
    """
    import importlib

    try:
        found = getattr(importlib.import_module(f"torch.optim.{module}"), name, None)
    except ImportError:
        found = None
    if not callable(found):
        raise _missing(f"torch.optim.{module}.{name} (its functional {module} implementation)", "install torch 2.13")
    return found


def _fused_kernel(name: str, what: str) -> Callable[..., Any]:
    kernel = getattr(torch, name, None)
    if kernel is None:
        raise _missing(f"torch.{name} (its {what} kernel)", "install torch 2.13")
    return kernel


def fused_adam_kernel() -> Callable[..., Any]:
    """``torch._fused_adam_``, torch's fused Adam (L2 weight decay added to the gradient): bitwise ``torch.optim.Adam(fused=True)``.

    Raises
    ------
    ConfigError
        Where this torch has no ``torch._fused_adam_`` (no fallback gives torch's bits).

    Example
    -------
    >>> callable(fused_adam_kernel())
    True
    """
    return _fused_kernel("_fused_adam_", "fused Adam")


def fused_sgd_kernel() -> Callable[..., Any]:
    """``torch._fused_sgd_``, torch's fused SGD (momentum, dampening, Nesterov): bitwise ``torch.optim.SGD(fused=True)``.

    Raises
    ------
    ConfigError
        Where this torch has no ``torch._fused_sgd_`` (no fallback gives torch's bits).

    Example
    -------
    >>> callable(fused_sgd_kernel())
    True
    """
    return _fused_kernel("_fused_sgd_", "fused SGD")


def fused_adagrad_kernel() -> Callable[..., Any]:
    """``torch._fused_adagrad_``, torch's fused Adagrad: bitwise ``torch.optim.Adagrad(fused=True)``.

    Raises
    ------
    ConfigError
        Where this torch has no ``torch._fused_adagrad_`` (no fallback gives torch's bits).

    Example
    -------
    >>> callable(fused_adagrad_kernel())
    True
    """
    return _fused_kernel("_fused_adagrad_", "fused Adagrad")


def foreach_add_(tensors: Sequence[Tensor], value: float) -> None:
    """``torch._foreach_add_(tensors, value)``: add ``value`` to every tensor in place.

    Falls back to a loop of ``add_`` (the same values) where the foreach op is missing.
    """
    if not tensors:  # torch's op refuses an empty list
        return
    add = getattr(torch, "_foreach_add_", None)
    if add is not None:
        add(list(tensors), value)
        return
    for t in tensors:
        t.add_(value)


# -- dynamo -----------------------------------------------------------------------------


def disable_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._disable_dynamo(fn)``: ``fn`` never traced by ``torch.compile``.

    Falls back to ``fn`` itself where torch has no ``_disable_dynamo``
    (``torch.compile`` may then trace it, as it would any function).
    """
    disable = getattr(torch, "_disable_dynamo", None)
    return fn if disable is None else disable(fn)


def disable_dynamo_wrapper_code() -> Any:
    """The code object of ``torch._disable_dynamo``'s wrapper (to recognise it), or None where it is missing."""
    disable = getattr(torch, "_disable_dynamo", None)
    return None if disable is None else getattr(disable(lambda: None), "__code__", None)


# -- the standard library ---------------------------------------------------------------


def register_atexit(fn: Callable[[], None]) -> str:
    """Run ``fn`` at interpreter exit before ``concurrent.futures`` stops its thread pools.

    ``threading._register_atexit`` runs hooks when the main thread ends,
    before ``atexit`` (and concurrent.futures registers its own there, so
    ours, registered later, runs first). Where it is missing (another Python)
    or refuses (already shutting down), ``atexit.register`` is used. Returns
    which one took it.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(fn)
            return "threading"
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(fn)
    return "atexit"


def caller_frame(depth: int = 1) -> FrameType | None:
    """The frame ``depth`` levels above the caller of this function (``sys._getframe(depth + 1)``).

    Falls back to walking ``inspect.currentframe()`` where ``sys._getframe``
    is missing; None where the interpreter keeps no frames or the stack is shallower.
    """
    get = getattr(sys, "_getframe", None)
    if get is not None:
        try:
            return get(depth + 1)
        except ValueError:  # the stack is shallower
            return None
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        if frame is None:
            return None
        frame = frame.f_back
    return frame


# -- torch.optim.Optimizer and torch.amp.GradScaler internals ---------------------------

#: The hook registries of ``torch.optim.Optimizer`` that ``state_dict``/``load_state_dict`` run.
OPTIMIZER_HOOKS = ("state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post")


def optimizer_hooks(optimizer: torch.optim.Optimizer, which: str) -> list[Callable[..., Any]]:
    """The hooks registered on ``optimizer`` with ``register_<which>_hook``, in the order torch runs them.

    Falls back to none where torch keeps no such registry (it then has no
    ``register_*`` method for them either).

    Raises
    ------
    ValueError
        If ``which`` is not one of :data:`OPTIMIZER_HOOKS` (a programming error).
    """
    if which not in OPTIMIZER_HOOKS:
        raise ValueError(f"unknown optimizer hook kind {which!r}; expected one of {OPTIMIZER_HOOKS}")
    hooks = getattr(optimizer, f"_optimizer_{which}_hooks", None)
    return list(hooks.values()) if isinstance(hooks, Mapping) else []


def set_amp_scaling_step(optimizer: torch.optim.Optimizer, enabled: bool) -> None:
    """Declare that ``optimizer.step`` takes ``grad_scaler=`` (``GradScaler.step`` reads ``_step_supports_amp_scaling``).

    Where torch's GradScaler does not read it, the flag does nothing and
    GradScaler unscales ``param.grad`` itself (offloaded gradients then
    need :meth:`tierstore.TieredAdamW.unscale_`).
    """
    optimizer._step_supports_amp_scaling = bool(enabled)


def grad_scaler_state(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """The per-optimizer state GradScaler keeps for ``optimizer`` (its stage, its inf flags).

    Raises
    ------
    ConfigError
        Where this torch's GradScaler keeps it elsewhere.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _missing("GradScaler._per_optimizer_states", "unscale with scaler.unscale_ on gradients that stay on the GPU (attach(offload_grads=False))")
    return states[id(optimizer)]


def grad_scaler_scale(scaler: Any) -> Tensor | None:
    """GradScaler's current scale tensor (None before the first ``scaler.scale(loss)``).

    Raises
    ------
    ConfigError
        Where this torch's GradScaler keeps it elsewhere.
    """
    if not hasattr(scaler, "_scale"):
        raise _missing("GradScaler._scale", "unscale with scaler.unscale_ on gradients that stay on the GPU (attach(offload_grads=False))")
    return scaler._scale


def amp_opt_state() -> Any:
    """``torch.amp.grad_scaler.OptState``, GradScaler's per-optimizer stage (READY, UNSCALED, STEPPED).

    Raises
    ------
    ConfigError
        Where this torch has no such enum.
    """
    try:
        from torch.amp.grad_scaler import OptState
    except ImportError:
        raise _missing("torch.amp.grad_scaler.OptState", "unscale with scaler.unscale_ on gradients that stay on the GPU (attach(offload_grads=False))") from None
    return OptState


def amp_unscale_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply every gradient by ``inv_scale`` in
    place and set ``found_inf`` to 1 if any holds an inf or NaN (all of one dtype and device).

    Falls back to the same check and multiply per tensor (the same values:
    torch's kernel multiplies in fp32 and rounds to the gradient's dtype, as
    ``mul_`` does).
    """
    unscale = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if unscale is not None:
        unscale(list(grads), found_inf, inv_scale)
        return
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            found_inf.fill_(1.0)
        g.mul_(inv_scale)


# -- devices and DTensors ---------------------------------------------------------------


def privateuse1_backend_name() -> str:
    """The name of torch's custom ("privateuse1") device backend; ``"privateuseone"`` where torch cannot say."""
    get = getattr(getattr(torch, "_C", None), "_get_privateuse1_backend_name", None)
    return "privateuseone" if get is None else str(get())


def local_shape_and_offset(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's part of a DTensor of global ``shape``: its local shape and its offset in the global tensor.

    Raises
    ------
    ConfigError
        Where this torch has no ``compute_local_shape_and_global_offset``.
    """
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        raise _missing("torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
                       "use plain (non-DTensor) parameters or install torch 2.13") from None  # fmt: skip
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def make_wrapper_subclass(cls: type, shape: Sequence[int], *, dtype: torch.dtype, device: Any) -> Tensor:
    """``torch.Tensor._make_wrapper_subclass``: a tensor of class ``cls`` with this metadata and no storage.

    Raises
    ------
    ConfigError
        Where this torch has no ``_make_wrapper_subclass``.
    """
    make = getattr(Tensor, "_make_wrapper_subclass", None)
    if make is None:
        raise _missing("torch.Tensor._make_wrapper_subclass", "save with save_checkpoint instead of DCP")
    return make(cls, tuple(shape), dtype=dtype, device=device)
