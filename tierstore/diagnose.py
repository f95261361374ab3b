"""``tierstore.diagnose``: where does training memory peak, and what would lower it?

One training iteration is run and measured phase by phase: after the model
is loaded (the call's starting point), after the forward pass, after the
backward pass, at the optimizer step, and over a second, steady iteration
(the optimizer state now exists while activations are alive: what training
really sees). On a GPU the numbers come from ``torch.cuda`` memory stats
(``memory_allocated``, ``max_memory_allocated`` after
``reset_peak_memory_stats``); on the CPU from the process RSS, whose peak is
the kernel's high-water mark (reset through ``/proc/self/clear_refs``)
together with a sampling thread.

The verdict compares the two parts a user can change:

- **optimizer state** (the bytes of every tensor in the optimizer's state
  after a real step of ``torch.optim.AdamW``, or of the optimizer a factory
  builds): offloading pays, :class:`~tierstore.TieredAdamW` with a
  ``ram_budget`` moves it off the GPU and partly onto disk;
- **activations**: the forward pass's memory growth, and at least the bytes
  autograd saved for backward (counted exactly with saved-tensor hooks; on
  the CPU, RSS can under-report because freed heap memory is reused):
  activation checkpointing or a smaller batch pays.

Weights and gradients are reported too; when they outweigh both, neither
remedy helps much and the advice says so.

``loss_fn(model, batch)`` returns the scalar loss. Without it the model is
called with the batch (``model(**batch)`` for a dict, ``model(*batch)`` for
a tuple or list, ``model(batch)`` otherwise) and the loss is the output's
``.loss`` (Hugging Face), its ``"loss"`` key, or the output itself, summed
when it is not a scalar (a stand-in whose backward pass needs the same
memory).

The default optimizer is ``torch.optim.AdamW(params, lr=0.0)``: its state is
real, and a zero learning rate leaves the weights unchanged. Gradients are
set to ``None`` before and after.

Example
-------
>>> import torch
>>> model = torch.nn.Linear(256, 256)
>>> report = diagnose(model, torch.randn(4, 256), lambda m, b: m(b).square().mean())
>>> report.optimizer_state_bytes >= 2 * report.param_bytes, report.dominant
(True, 'optimizer_state')
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._platform.factory import resolve
from .errors import ConfigError
from .sizes import format_size, parse_size

if TYPE_CHECKING:  # torch is imported where it is used: `import tierstore` stays fast (the CLI's --help)
    import torch
    from torch import Tensor, nn

__all__ = [
    "diagnose",
    "MemoryReport",
    "Phase",
    "default_loss",
    "build_from_factory",
    "CudaProbe",
    "RssProbe",
    "probe_for",
]

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.001  # RSS sampling period; the kernel's high-water mark covers what sampling misses
DOMINANT = ("optimizer_state", "activations", "parameters")


# -- probes -------------------------------------------------------------
class CudaProbe:
    """Allocated memory on one CUDA device, from the caching allocator's stats."""

    kind = "torch.cuda memory stats (allocated bytes)"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        import torch
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    @contextlib.contextmanager
    def watch(self) -> Iterator[list[int]]:
        """Yield a one-element list that holds the peak of the block when it ends."""
        import torch
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        box = [0]
        try:
            yield box
        finally:
            torch.cuda.synchronize(self.device)
            box[0] = int(torch.cuda.max_memory_allocated(self.device))


class RssProbe:
    """Resident set size of this process: current, and the peak over a block."""

    kind = "process RSS"

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._status = Path("/proc/self/status")
        self._clear_refs = Path("/proc/self/clear_refs")
        self.high_water = self._can_reset_high_water()
        if self.high_water:
            self.kind = "process RSS (peak: kernel high-water mark + sampling)"
        else:
            self.kind = "process RSS (peak: sampling every 1 ms)"

    def current(self) -> int:
        return int(self._process.memory_info().rss)

    def _hwm(self) -> int | None:
        try:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", self._status.read_text())
        except OSError:
            return None
        return int(match.group(1)) * 1024 if match else None

    def _can_reset_high_water(self) -> bool:
        try:
            self._clear_refs.write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        except OSError:
            return False
        return self._hwm() is not None

    @contextlib.contextmanager
    def watch(self) -> Iterator[list[int]]:
        """Yield a one-element list that holds the peak RSS of the block when it ends."""
        box = [self.current()]
        if self.high_water:
            self._clear_refs.write_text("5")
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_INTERVAL_S):
                box[0] = max(box[0], self.current())

        sampler = threading.Thread(target=sample, name="tierstore-diagnose-rss", daemon=True)
        sampler.start()
        try:
            yield box
        finally:
            stop.set()
            sampler.join()
            box[0] = max(box[0], self.current(), (self._hwm() or 0) if self.high_water else 0)


def probe_for(device: torch.device) -> CudaProbe | RssProbe:
    """The probe that measures memory where ``device``'s tensors live."""
    if device.type == "cuda":
        return CudaProbe(device)
    return RssProbe()


# -- report ---------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """Memory at the end of a phase (``current``) and the most it reached during it (``peak``)."""

    name: str
    current: int
    peak: int | None


@dataclass(frozen=True)
class MemoryReport:
    """What :func:`diagnose` measured, and its verdict.

    Byte counts: ``param_bytes``, ``grad_bytes`` and ``optimizer_state_bytes``
    are exact tensor sizes; ``activation_bytes`` is the larger of the forward
    pass's measured growth (``forward_delta_bytes``, from the steady
    iteration when there is one: the first forward also pays one-time costs)
    and the bytes autograd saved for backward (``saved_for_backward_bytes``). ``dominant`` is one of
    ``"optimizer_state"``, ``"activations"``, ``"parameters"``.
    """

    device: str
    measured_with: str
    optimizer: str
    phases: tuple[Phase, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    forward_delta_bytes: int
    saved_for_backward_bytes: int
    peak_bytes: int
    peak_phase: str
    dominant: str
    advice: str
    suggested_ram_budget: int | None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable values (bytes as ints)."""
        data = asdict(self)
        data["phases"] = [asdict(p) for p in self.phases]
        return data

    def __str__(self) -> str:
        base = self.phases[0].current
        rows = [f"{'phase':<24}{'current':>12}{'peak':>12}{'peak - loaded':>16}"]
        for p in self.phases:
            peak = "" if p.peak is None else format_size(p.peak)
            over = "" if p.peak is None else _signed(p.peak - base)
            rows.append(f"{p.name:<24}{format_size(p.current):>12}{peak:>12}{over:>16}")
        parts = [
            ("parameters", self.param_bytes, ""),
            ("gradients", self.grad_bytes, ""),
            ("optimizer state", self.optimizer_state_bytes, f"({self.optimizer})"),
            (
                "activations",
                self.activation_bytes,
                f"(forward growth {format_size(self.forward_delta_bytes)}, saved for backward "
                f"{format_size(self.saved_for_backward_bytes)})",
            ),
        ]
        lines = [f"tierstore diagnose: {self.device}, measured with {self.measured_with}", "", *rows, ""]
        lines += [f"{name:<24}{format_size(n):>12}  {note}".rstrip() for name, n, note in parts]
        label = self.dominant.replace("_", " ")
        lines += ["", f"peak {format_size(self.peak_bytes)} during {self.peak_phase}; dominated by {label}", self.advice]
        return "\n".join(lines)


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + format_size(abs(n))


# -- measuring ---------------------------------------------------------------
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


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    ram = getattr(optimizer, "ram_bytes", None)  # TieredAdamW: its RAM tier, not the (empty) .state
    if isinstance(ram, int):
        return ram
    return sum(_storages(t for st in optimizer.state.values() for t in _tensors_in(st)).values())


def _close(optimizer: Any) -> None:
    close = getattr(optimizer, "close", None)
    if callable(close):
        close()


def diagnose(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    *,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
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
        ``torch.optim.AdamW(params, lr=0.0)`` (real state, unchanged weights).
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
        ``str(report)`` is a table; ``report.to_dict()`` is JSON-ready.

    Raises
    ------
    ConfigError
        If the model has no trainable parameters, or no loss can be found.

    Example
    -------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    >>> report = diagnose(model, torch.randn(100_000, 8))
    >>> report.dominant
    'activations'
    """
    import torch
    from torch import Tensor
    # Note: loss_fn may be positional (the three-argument form reads naturally); the rest is keyword-only.
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (requires_grad=True); nothing to diagnose")
    limit = None if memory_limit is None else parse_size(memory_limit, name="memory_limit")
    compute_loss = loss_fn or default_loss
    make_opt = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=0.0))
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
        state_bytes = _state_bytes(opt)
        if steady:
            opt.zero_grad(set_to_none=True)
            with probe.watch() as peak:
                before = probe.current()
                loss = compute_loss(model, batch)
                # The second forward's growth: free of one-time costs (lazy init, thread pools).
                forward_delta = max(0, probe.current() - before)
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
    activation_bytes = max(forward_delta, sum(saved.values()))
    top = max((p for p in phases if p.peak is not None), key=lambda p: p.peak)
    dominant, advice, budget = _verdict(
        device=device,
        params=param_bytes,
        grads=grad_bytes,
        state=state_bytes,
        activations=activation_bytes,
        peak=top.peak,
        limit=limit,
    )
    return MemoryReport(
        device=str(device),
        measured_with=probe.kind,
        optimizer=_opt_name(optimizer),
        phases=tuple(phases),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes,
        activation_bytes=activation_bytes,
        forward_delta_bytes=forward_delta,
        saved_for_backward_bytes=sum(saved.values()),
        peak_bytes=top.peak,
        peak_phase=top.name,
        dominant=dominant,
        advice=advice,
        suggested_ram_budget=budget,
    )


def _opt_name(factory: Any) -> str:
    if factory is None:
        return "torch.optim.AdamW(lr=0)"
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def _round_mib(n: int) -> int:
    mib = 1 << 20  # 1 MiB
    return max(mib, (n // mib) * mib)


def _verdict(
    *, device: torch.device, params: int, grads: int, state: int, activations: int, peak: int, limit: int | None
) -> tuple[str, str, int | None]:
    """Which part to attack, the advice in words, and a ``ram_budget`` for TieredAdamW (or None)."""
    fixed = params + grads
    if max(state, activations) * 2 < fixed:
        return (
            "parameters",
            f"Weights and gradients ({format_size(fixed)}) outweigh the optimizer state "
            f"({format_size(state)}) and activations ({format_size(activations)}): neither offloading "
            "nor checkpointing helps much. Shard the model across GPUs (FSDP2) or train in bf16.",
            None,
        )
    if activations > state:
        return (
            "activations",
            f"Activations ({format_size(activations)}) outweigh the optimizer state ({format_size(state)}): "
            "activation checkpointing pays (torch.utils.checkpoint.checkpoint around each block, or "
            "model.gradient_checkpointing_enable() for Hugging Face models), or a smaller batch with "
            f"gradient accumulation: halving the batch saves about {format_size(activations // 2)}. "
            f"Offloading the optimizer state would save at most {format_size(state)}.",
            None,
        )
    if device.type == "cuda":
        budget = None
        where = (
            f"TieredAdamW keeps the state in host RAM, so about {format_size(state)} of GPU memory is "
            "freed (it keeps an fp32 master too when the weights are bf16/fp16 or on the GPU)"
        )
        import psutil

        if state * 2 > psutil.virtual_memory().available:
            budget = _round_mib(psutil.virtual_memory().available // 4)
            where += f"; host RAM is short, so give it ram_budget={format_size(budget)} and a state_dir on local NVMe"
    else:
        if limit is not None:
            budget = limit - (peak - state) - limit // 20  # 5% headroom
            if budget >= state:
                return (
                    "optimizer_state",
                    f"The optimizer state ({format_size(state)}) is the largest part you can move, but the "
                    f"peak ({format_size(peak)}) already fits under {format_size(limit)} with 5% to spare: "
                    "nothing needs offloading. TieredAdamW with a ram_budget would lower it further.",
                    None,
                )
            if budget <= 0:
                return (
                    "optimizer_state",
                    f"The optimizer state ({format_size(state)}) is the largest part, but even with all of it "
                    f"on disk the rest of the peak ({format_size(peak - state)}) leaves no room under "
                    f"{format_size(limit)}; also cut activations ({format_size(activations)}) or the model.",
                    None,
                )
            budget = _round_mib(budget)
        else:
            budget = _round_mib(state // 4)
        where = (
            f"TieredAdamW with ram_budget={format_size(budget)} keeps that much of it in RAM and streams "
            f"the rest from a state_dir on local NVMe: the peak drops by about {format_size(max(0, state - budget))}"
        )
    call = "TieredAdamW(model.parameters(), ...)" if budget is None else (
        f'TieredAdamW(model.parameters(), ram_budget="{budget >> 20}MiB", state_dir="/nvme/opt")'
    )
    return (
        "optimizer_state",
        f"The optimizer state ({format_size(state)}) outweighs activations ({format_size(activations)}): "
        f"offloading it pays. {where}. Try {call}.",
        budget,
    )


# -- CLI -----------------------------------------------------------------------
def build_from_factory(spec: str, *, batch_size: int | None = None) -> tuple[nn.Module, Any, Callable | None]:
    """Call a ``--model`` factory and normalise what it returns to ``(model, batch, loss_fn)``.

    The factory may return ``(model, batch, loss_fn)``, ``(model, batch)``
    (the loss then comes from the model's output, see :func:`default_loss`),
    or a model with an ``example_input_array`` attribute (Lightning's
    convention) used as the batch. With ``batch_size`` the factory is called
    as ``factory(batch_size=N)`` and must accept that keyword.

    Raises
    ------
    ConfigError
        If the factory cannot be called so, fails, or returns something else.
    """
    from torch import nn
    factory = resolve(spec, flag="--model")
    kwargs = {}
    if batch_size is not None:
        try:
            takes = "batch_size" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            takes = True
        if not takes:
            raise ConfigError(f"--batch-size given, but {spec} takes no batch_size argument; add one or drop --batch-size")
        kwargs["batch_size"] = batch_size
    try:
        made = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"--model {spec!r}: calling it failed: {exc!r}") from None
    if isinstance(made, nn.Module):
        if not hasattr(made, "example_input_array"):
            raise ConfigError(
                f"--model {spec!r} returned a model without a batch; return (model, batch, loss_fn) or "
                "(model, batch), or give the model an example_input_array"
            )
        return made, made.example_input_array, None
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        return made[0], made[1], made[2] if len(made) == 3 else None
    raise ConfigError(
        f"--model {spec!r} returned {type(made).__name__}; expected (model, batch, loss_fn), (model, batch) "
        "or a model with example_input_array"
    )


def _to(obj: Any, device: torch.device) -> Any:
    from torch import Tensor
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore diagnose``."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a factory returning (model, batch, loss_fn), (model, batch), or a model with example_input_array; "
        "loss_fn(model, batch) returns the scalar loss",
    )
    parser.add_argument("--batch-size", type=int, help="passed to the factory as batch_size=N")
    parser.add_argument("--device", help="move the model and batch here first (cpu, cuda, cuda:1); default: where the factory put them")
    parser.add_argument("--optimizer", metavar="MODULE:FACTORY", help="optimizer(params) to measure (default: torch.optim.AdamW, lr=0)")
    parser.add_argument("--memory-limit", metavar="SIZE", help="memory you have where the peak happens (GPU memory or RAM), e.g. 24GiB; sizes the suggested ram_budget")
    parser.add_argument("--no-steady", action="store_true", help="skip the second iteration (with the optimizer state alive)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore diagnose``: build, measure, print."""
    import torch
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    model, batch, loss_fn = build_from_factory(args.model, batch_size=args.batch_size)
    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            raise ConfigError(f"--device {args.device!r}: {exc}") from None
        model, batch = model.to(device), _to(batch, device)
    optimizer = resolve(args.optimizer, flag="--optimizer") if args.optimizer else None
    report = diagnose(
        model, batch, loss_fn, optimizer=optimizer, memory_limit=args.memory_limit, steady=not args.no_steady
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0
