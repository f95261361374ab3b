"""``tierstore plan``: the memory and I/O arithmetic of a training run, before running it.

:func:`plan_memory` answers "will this model fit on my box, and how fast can a
step be?" for a parameter count or a real ``nn.Module``. It builds the same
:class:`~tierstore._layout.layout.Layout` and :func:`~tierstore._layout.budget.plan_tiers`
split that :class:`~tierstore.TieredAdamW` would build, over tensors on the
``meta`` device (no memory is allocated), so the planner and the optimizer
never disagree about bytes. The CLI (:func:`run`) formats the result.

The formulas, for P trainable parameters with ``b`` bytes each (4 in fp32,
2 in bf16/fp16):

- optimizer state: per field 4 B/param for an fp32 field, the moment
  format's bytes for a moment (``moment_dtype``: float32 4, bfloat16 2, int8
  1.016 with its scales); fields are ``exp_avg`` and ``exp_avg_sq``,
  ``max_exp_avg_sq`` with amsgrad, and an fp32 ``master`` when the
  parameters are bf16/fp16 *or live on a GPU* (float32: 8, +4, +4 B/param);
- GPU: weights ``b·(P + frozen)`` and grads ``b·P`` (activations excluded);
- host: arena ``(prefetch_depth + 2)`` slots of the largest shard, staging
  buffers, a compressed format's decode scratch, resident shards (stored
  compressed): what ``ram_budget`` bounds; plus the fixed overhead
  :data:`~tierstore._layout.budget.OVERHEAD_BYTES` (16 MiB; on a GPU it holds the
  two 4 MiB gradient buckets); plus the model's weights and grads when it
  trains on the CPU. On a GPU the budget's buffers and the buckets are
  pinned;
- disk: the on-disk shards once; with durability every shard twice;
- per step: PCIe ``b·P`` down (grads) and ``b·P`` up (params) with a GPU;
  disk reads every on-disk shard once and writes it once; durable, every
  commit also writes the resident shards, in the background (once per
  ``commit_every`` steps, not once per step);
- step time >= max(disk_read/read_bw + disk_write/write_bw,
  max(down, up)/pcie_bw, P/update_rate, state/memory_copy_bw), over the
  terms whose bandwidth is known (the update reads and writes every state
  byte once: the memory traffic of one copy of the state).

The planner always answers: whatever the host, it shows the arithmetic and a
verdict, ``"fits in host RAM"``, ``"needs the disk tier"`` or ``"does not
fit"``, with one :class:`Shortfall` per missing resource (GPU memory, host
RAM, ``ram_budget``, drive space) naming what would make it fit. When the
budget cannot stream (it is below the arena and staging, or the default
budget is nothing at all), the arithmetic is shown at the smallest budget
that can. Only malformed input is an error.

Example
-------
>>> plan = plan_memory(7_000_000_000, precision="bf16", host_ram=512 << 30, gpu_memory=80 * 10**9)
>>> plan.state_bytes_per_param, plan.torch.total // plan.trainable_params
(12, 16)
>>> plan.verdict
'fits in host RAM'
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ._compute.codecs import FORMATS, moment_format
from ._config.knobs import Knobs
from ._layout.budget import OVERHEAD_BYTES, TierPlan, plan_tiers, staging_nbytes
from ._layout.layout import DEFAULT_SHARD_NUMEL, MOMENT_FIELDS, STATE_ITEMSIZE, Layout
from ._layout.spec import decide
from ._platform.factory import resolve
from ._runtime.grad_offload import DEFAULT_BUCKET_BYTES
from .errors import BudgetError, ConfigError
from .sizes import format_size, parse_size

__all__ = [
    "MemoryPlan",
    "plan_memory",
    "format_plan",
    "Bandwidth",
    "GpuTier",
    "HostTier",
    "DiskTier",
    "Traffic",
    "StepTime",
    "Endurance",
    "TorchBaseline",
    "Shortfall",
    "load_model",
    "read_io_json",
    "VERDICTS",
    "EXIT_DOES_NOT_FIT",
]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_PREFETCH_DEPTH = Knobs.prefetch_depth  # as TieredAdamW
HOST_RAM_SHARE = 0.9  # the default budget leaves 10% of host RAM to the OS, data loading, ...
FITS_IN_RAM, NEEDS_DISK, DOES_NOT_FIT = "fits in host RAM", "needs the disk tier", "does not fit"
VERDICTS = (FITS_IN_RAM, NEEDS_DISK, DOES_NOT_FIT)
EXIT_DOES_NOT_FIT = 3  # `tierstore plan --fail-if-not-fit` when the verdict is "does not fit"
DEFAULT_UPDATE_GPARAMS = 1.0  # fused CPU AdamW, order of magnitude on a server socket
MAX_SHARDS = 1 << 20  # beyond this the layout itself gets big; raise shard_numel
GB = 10**9  # bandwidths and drive endurance use decimal units
MOMENT_BYTES = {name: fmt.bytes_per_element for name, fmt in FORMATS.items()}  # per moment element, scales included
TB = 10**12
SECONDS_PER_DAY = 86_400

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


# -- results ----------------------------------------------------------
@dataclass(frozen=True)
class Bandwidth:
    """Measured or assumed speeds (GB/s = 1e9 bytes/s); ``None``: unknown."""

    read_gbps: float | None = None
    write_gbps: float | None = None
    pcie_gbps: float | None = None
    memory_gbps: float | None = None  # host memory copy: bytes copied per second
    update_gparams: float = DEFAULT_UPDATE_GPARAMS


@dataclass(frozen=True)
class GpuTier:
    used: bool
    memory: int | None
    weights: int
    grads: int
    total: int
    fits: bool | None


@dataclass(frozen=True)
class HostTier:
    ram: int
    budget: int  # the ram_budget the arithmetic uses (the minimum one when the given one cannot run)
    budget_is_default: bool
    budget_given: int  # what was asked, or the default (90% of RAM minus the model); may be <= 0 or below min_budget
    min_budget: int  # arena + staging: the smallest ram_budget that streams
    arena_slots: int
    slot: int
    arena: int
    staging_buffers: int
    staging: int
    resident: int
    resident_shards: int
    ram_nbytes: int  # arena + staging + decode scratch + resident: what ram_budget bounds
    overhead: int  # the fixed overhead beyond ram_budget (budget.OVERHEAD_BYTES)
    grad_buckets: int  # part of the overhead: attach()'s pinned gradient buckets on a GPU
    pinned: int  # page-locked for CUDA copies: the budget's buffers and the gradient buckets
    tierstore_total: int  # ram_nbytes + overhead: the peak RSS growth tierstore promises
    scratch: int  # a compressed moment format's fp32 decode scratch
    model: int  # weights + grads of a model that trains on the CPU
    total: int
    fits: bool


@dataclass(frozen=True)
class Shortfall:
    """One resource the plan lacks: what it needs, what there is, and what would make it fit."""

    resource: str  # "GPU memory", "host RAM", "ram_budget", "drive space"
    need: int
    have: int
    fix: str


@dataclass(frozen=True)
class DiskTier:
    free: int | None
    disk_shards: int
    primary: int  # one copy: the on-disk shards, or every shard when durable
    durability: int  # the second copy of every shard when durable
    total: int
    fits: bool | None


@dataclass(frozen=True)
class Traffic:
    pcie_down: int
    pcie_up: int
    disk_read: int
    disk_write: int  # per step, on average: streamed shards plus a share of each commit's writes
    streamed_write: int  # per step, on the step's critical path
    commit_write: int  # per commit, in the background: the resident shards
    commit_every: int


@dataclass(frozen=True)
class StepTime:
    disk: float | None
    pcie: float | None
    update: float
    memory: float | None
    lower_bound: float
    bound_by: str
    formula: str


@dataclass(frozen=True)
class Endurance:
    writes_per_step: int
    writes_per_1000_steps: int
    drive_tbw: float | None
    steps_to_exhaust: float | None
    days_to_exhaust: float | None
    commit_every_for_a_year: int | None = None  # steps between commits for the drive to last a year (None: any)


@dataclass(frozen=True)
class TorchBaseline:
    """Plain ``torch.optim.AdamW`` with everything on one device."""

    where: str
    weights: int
    grads: int
    optimizer: int
    total: int
    fits: bool | None


@dataclass(frozen=True)
class MemoryPlan:
    """Everything :func:`plan_memory` computed; ``asdict`` gives the ``--json`` form."""

    trainable_params: int
    frozen_params: int
    precision: str
    param_bytes: int
    amsgrad: bool
    durable: bool
    moment_dtype: str
    fields: tuple[str, ...]
    state_bytes_per_param: float
    shard_numel: int
    shards: int
    prefetch_depth: int
    state: int
    gpu: GpuTier
    host: HostTier
    disk: DiskTier
    traffic: Traffic
    bandwidth: Bandwidth
    step_time: StepTime
    endurance: Endurance
    torch: TorchBaseline
    verdict: str  # one of VERDICTS
    fits: bool
    shortfalls: tuple[Shortfall, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        """A JSON-able dict (all byte counts are ints, times in seconds)."""
        return asdict(self)


# -- input parsing ----------------------------------------------------
def parse_count(value: int | float | str, *, name: str = "params") -> int:
    """A parameter count written as ``7e9``, ``7B``, ``70B``, ``125M``, ``1.5B`` or ``350k``.

    Raises
    ------
    ConfigError
        If ``value`` is not a positive count.

    Example
    -------
    >>> parse_count("7B"), parse_count("125M"), parse_count("7e9")
    (7000000000, 125000000, 7000000000)
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a bool; give a parameter count such as 7e9 or '7B'")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        if value.strip().startswith("-"):
            raise ConfigError(f"{name}={value!r} is negative; give a parameter count > 0 such as '7B'")
        match = _COUNT.match(value)
        if match is None:
            raise ConfigError(
                f"{name}={value!r} is not a parameter count; write it like '7e9', '7B', '70B', '125M' or '350k'"
            )
        number = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    else:
        raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; give an int or a string like '7B'")
    if not math.isfinite(number) or number < 1:
        raise ConfigError(f"{name}={value!r} must be a finite parameter count >= 1, e.g. '7B'")
    return round(number)


def _size(value: int | str | None, name: str, *, allow_zero: bool = False) -> int | None:
    """Parse a byte size; negative or (unless allowed) zero sizes are errors."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ConfigError(f"{name}={value!r} is negative; give a size such as '80GB' or '512GiB'")
    nbytes = parse_size(value, name=name)
    if nbytes == 0 and not allow_zero:
        raise ConfigError(f"{name}={value!r} is zero; give a size > 0 such as '80GB' or '512GiB'")
    return nbytes


def _moment_dtype(value: str) -> str:
    """``--moment-dtype``: a format's name or alias (``bf16``), as its canonical name."""
    try:
        return moment_format(value).name
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(value: float | str | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):  # a JSON true is not a speed
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={value!r} is not a number; give a speed such as 2.5") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{name}={value!r} must be a finite number > 0, e.g. 2.5")
    return number


def read_io_json(path: str | Path) -> dict[str, float | None]:
    """The bandwidths in a ``tierstore bench io --json`` file; missing keys are ``None``.

    Reads ``summary.best_read_GBps``, ``summary.best_write_GBps`` and
    ``summary.memory_GBps``.

    Raises
    ------
    ConfigError
        If the file is missing, is not JSON, or holds a non-positive speed.

    Example
    -------
    >>> import json, tempfile
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write(json.dumps({"summary": {"best_read_GBps": 6.5}})); f.close()
    >>> read_io_json(f.name)
    {'read_gbps': 6.5, 'write_gbps': None, 'memory_gbps': None}
    """
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"io json file {str(path)!r} does not exist; write one with "
            f"`tierstore bench io --dir DIR --json {path}` or pass --read-gbps/--write-gbps"
        ) from None
    except OSError as exc:
        raise ConfigError(f"io json file {str(path)!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise ConfigError(
            f"io json file {str(path)!r} is not JSON ({exc}); it should be the output of `tierstore bench io --json`"
        ) from None
    summary = data.get("summary") if isinstance(data, dict) else None
    summary = summary if isinstance(summary, dict) else {}
    keys = {"read_gbps": "best_read_GBps", "write_gbps": "best_write_GBps", "memory_gbps": "memory_GBps"}
    found = {}
    for ours, theirs in keys.items():
        value = summary.get(theirs)
        if isinstance(value, float) and math.isnan(value):
            value = None  # bench io writes NaN for what it could not measure
        found[ours] = _rate(value, f"summary.{theirs} in {path}")
    return found


def load_model(spec: str) -> torch.nn.Module:
    """Import ``module:factory`` (or ``path/to/file.py:factory``) and build the model on ``meta``.

    A factory with a ``device`` parameter gets ``device=torch.device("meta")``;
    any factory runs under ``with torch.device("meta")``, so no weights are
    allocated. The factory returns the ``nn.Module``, or a tuple whose first
    element is one: the ``(model, batch, loss_fn)`` factory of ``tierstore
    diagnose`` works here too (the rest of the tuple is ignored).

    Raises
    ------
    ConfigError
        If the spec is malformed, the import or the call fails, or the factory
        returns neither an ``nn.Module`` nor a tuple starting with one.

    Example
    -------
    >>> model = load_model("torch.nn:PReLU")
    >>> next(model.parameters()).device
    device(type='meta')
    """
    factory = resolve(spec, flag="--model")
    attr = spec.rpartition(":")[2]
    meta = torch.device("meta")
    try:
        takes_device = "device" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_device = False
    try:
        with meta:
            model = factory(device=meta) if takes_device else factory()
    except Exception as exc:
        raise ConfigError(
            f"--model {spec!r}: calling {attr}() on the meta device failed: {exc!r}. "
            "Make the factory work under `with torch.device('meta')`, or pass --params instead"
        ) from None
    if isinstance(model, tuple) and model and isinstance(model[0], torch.nn.Module):
        # The factory `tierstore diagnose` takes returns (model, batch[, loss_fn]): one factory serves both.
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module; return the "
            "model, or a tuple whose first element is the model (such as diagnose's (model, batch, loss_fn))"
        )
    return model


def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent (absolute).

    Example
    -------
    >>> existing_ancestor("/no/such/dir/anywhere")
    PosixPath('/')
    """
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def disk_free(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def _state_dir_note(state_dir: str) -> str | None:
    """Say where the free space was read when ``--state-dir`` does not exist (yet)."""
    target = Path(state_dir).expanduser().absolute()
    measured = existing_ancestor(target)
    if measured == target:
        return None
    return (
        f"--state-dir {state_dir} does not exist: the free space is that of {measured}, its nearest existing "
        "parent; if the drive is not mounted there yet, pass --disk-free instead"
    )


# -- the arithmetic ---------------------------------------------------
def _tensors(params, frozen: int, precision: str | None) -> tuple[list[torch.Tensor], str]:
    """Meta tensors standing for the parameters, and the training precision."""
    if isinstance(params, int) and not isinstance(params, bool):
        if params < 1:
            raise ConfigError(f"params={params} must be >= 1 (trainable parameters)")
        if isinstance(frozen, bool) or not isinstance(frozen, int) or frozen < 0:
            raise ConfigError(f"frozen={frozen!r} must be an int >= 0 (frozen parameters)")
        dtype = PRECISIONS[precision or "fp32"]
        tensors = [torch.empty(params, device="meta", dtype=dtype, requires_grad=True)]
        if frozen:
            tensors.append(torch.empty(frozen, device="meta", dtype=dtype))
        return tensors, precision or "fp32"
    if frozen:
        raise ConfigError("frozen= is only for a parameter count; a model's frozen parameters are counted from it")
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if not isinstance(params, Iterable):
        raise ConfigError(f"params={params!r} must be a parameter count, an nn.Module or an iterable of tensors")
    tensors = list(params)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("params must hold tensors only (param-group dicts are not supported by the planner)")
    if not any(t.requires_grad and t.numel() for t in tensors):
        raise ConfigError("the model has no trainable parameters (requires_grad=True); nothing to plan")
    if precision is None:
        dtypes = {t.dtype for t in tensors if t.requires_grad}
        precision = next((name for name, d in PRECISIONS.items() if d in dtypes and name != "fp32"), "fp32")
    return tensors, precision


def plan_memory(
    params: int | torch.nn.Module | Iterable[torch.Tensor],
    *,
    host_ram: int,
    frozen: int = 0,
    precision: str | None = None,
    amsgrad: bool = False,
    gpu: bool | None = None,
    gpu_memory: int | None = None,
    ram_budget: int | None = None,
    disk_free: int | None = None,
    durable: bool = False,
    commit_every: int = 1,
    shard_numel: int | None = None,
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
    bandwidth: Bandwidth | None = None,
    drive_tbw: float | None = None,
    moment_dtype: str = "float32",
) -> MemoryPlan:
    """Bytes per tier, bytes moved per step and a step-time lower bound.

    Parameters
    ----------
    params
        The trainable parameter count, or the model (``nn.Module`` or tensors,
        best on the ``meta`` device) whose exact layout to plan.
    host_ram
        Bytes of host RAM on the machine.
    frozen
        Frozen parameters (with a count only): weights without state or grads.
    precision
        ``"fp32"``, or ``"bf16"``/``"fp16"`` (mixed precision with an fp32
        master). ``None``: fp32 for a count, the model's dtype otherwise.
    amsgrad
        Keep ``max_exp_avg_sq`` (+4 B/param).
    gpu, gpu_memory
        Whether the model trains on a GPU (implied by ``gpu_memory``), and
        that GPU's memory in bytes (``None``: unknown).
    ram_budget
        The ``ram_budget`` given to ``TieredAdamW``. ``None``: 90% of
        ``host_ram`` minus the model's weights and grads when it trains on
        the CPU.
    disk_free
        Free bytes on the state directory's drive (``None``: unknown).
    durable
        Durability keeps a second copy of every shard on disk; every commit
        writes the resident shards too, in the background. ``TieredAdamW`` is
        durable by default when given a ``state_dir`` (the CLI follows that:
        on with ``--state-dir``).
    commit_every
        Steps between commits (durable). ``TieredAdamW``'s default
        ``commit_every="auto"`` commits every step when the drive keeps up
        with the loop, so 1 is the planning case for drive wear.
    shard_numel, prefetch_depth
        As ``TieredAdamW`` (``None`` picks its automatic shard size).
    bandwidth
        Drive, PCIe and memory speeds and the CPU update rate.
    drive_tbw
        The drive's rated endurance in TB written (``None``: unknown).
    moment_dtype
        How the moments are stored: ``"float32"``, ``"bfloat16"`` or ``"int8"``
        (as ``TieredAdamW``).

    Raises
    ------
    ConfigError
        For invalid values only. A plan that does not fit (host RAM, GPU
        memory, drive space, a ``ram_budget`` below the streaming arena's
        minimum) is still a plan: ``verdict`` is ``"does not fit"`` and
        ``shortfalls`` says what is missing and what would make it fit.

    Example
    -------
    >>> plan = plan_memory(7_000_000_000, host_ram=64 << 30, gpu_memory=80 * 10**9)
    >>> plan.fields, plan.verdict
    (('master', 'exp_avg', 'exp_avg_sq'), 'needs the disk tier')
    >>> small = plan_memory(7_000_000_000, precision="bf16", host_ram=24 << 30)  # CPU training
    >>> small.verdict, [f.resource for f in small.shortfalls]
    ('does not fit', ['host RAM'])
    """
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is unknown; choose one of {sorted(PRECISIONS)}")
    if isinstance(host_ram, bool) or not isinstance(host_ram, int) or host_ram <= 0:
        raise ConfigError(f"host_ram={host_ram!r} must be a byte count > 0, e.g. 512 << 30")
    for name, value in (("gpu_memory", gpu_memory), ("ram_budget", ram_budget), ("disk_free", disk_free)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{name}={value!r} must be a byte count >= 0")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ConfigError(f"prefetch_depth={prefetch_depth!r} must be an int >= 1")
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise ConfigError(f"commit_every={commit_every!r} must be an int >= 1 (steps between commits)")
    if shard_numel is not None and (isinstance(shard_numel, bool) or not isinstance(shard_numel, int) or shard_numel < 1):
        raise ConfigError(f"shard_numel={shard_numel!r} must be an int >= 1, e.g. 1 << 22")
    if drive_tbw is not None:
        drive_tbw = _rate(drive_tbw, "drive_tbw")
    if gpu is False and gpu_memory is not None:
        raise ConfigError("gpu=False contradicts gpu_memory; drop gpu_memory for CPU training")
    bandwidth = bandwidth or Bandwidth()
    on_gpu = bool(gpu) or gpu_memory is not None

    tensors, precision = _tensors(params, frozen, precision)
    trainable = [t for t in tensors if t.requires_grad]
    n_train = sum(t.numel() for t in trainable)
    n_frozen = sum(t.numel() for t in tensors if not t.requires_grad)
    pbytes = PRECISIONS[precision].itemsize


    weights = (n_train + n_frozen) * pbytes
    grads = n_train * pbytes
    host_model = 0 if on_gpu else weights + grads
    notes = []
    budget_is_default = ram_budget is None
    if ram_budget is None:
        ram_budget = int(host_ram * HOST_RAM_SHARE) - host_model  # may be <= 0: then nothing is left for tierstore
    budget_given = ram_budget

    # The decision TieredAdamW makes (keep_master=None), for parameters of this precision on this device.
    spec = decide(
        numel=n_train,
        dtypes=[PRECISIONS[precision]],
        cuda=on_gpu,
        amsgrad=amsgrad,
        keep_master=None,
        arena_slots=Knobs(prefetch_depth=prefetch_depth).arena_slots,
        ram_budget=ram_budget if ram_budget > 0 else None,
        shard_numel=shard_numel if shard_numel is not None or ram_budget > 0 else DEFAULT_SHARD_NUMEL,
        moment_dtype=moment_dtype,
        workers=Knobs(prefetch_depth=prefetch_depth).max_update_threads,
    )
    fields, shard_numel, staging_buffers = spec.fields, spec.shard_numel, spec.staging_buffers
    if n_train / shard_numel > MAX_SHARDS:
        raise ConfigError(
            f"shard_numel={shard_numel} cuts {n_train:,} parameters into more than {MAX_SHARDS:,} shards; "
            "raise shard_numel (e.g. 1 << 22)"
        )
    layout = Layout.build([tensors], shard_numel=shard_numel, fields=fields, moment_dtype=spec.moment_format)
    tiers, min_budget = _tiers(layout, ram_budget, spec.arena_slots, staging_buffers, spec.workers)
    if tiers.ram_budget != ram_budget:
        notes.append(
            f"the arithmetic is at ram_budget={format_size(min_budget)}, the smallest that holds the streaming "
            f"arena and staging ({'the default budget' if budget_is_default else 'ram_budget'} is {_signed_size(ram_budget)})"
        )
        ram_budget = min_budget

    gpu_total = weights + grads if on_gpu else 0
    gpu_tier = GpuTier(
        used=on_gpu,
        memory=gpu_memory,
        weights=weights if on_gpu else 0,
        grads=grads if on_gpu else 0,
        total=gpu_total,
        fits=None if gpu_memory is None else gpu_total <= gpu_memory,
    )
    grad_buckets = 2 * DEFAULT_BUCKET_BYTES if on_gpu else 0  # attach()'s two pinned buckets, inside the overhead
    tierstore_total = tiers.ram_nbytes + OVERHEAD_BYTES
    host = HostTier(
        ram=host_ram,
        budget=ram_budget,
        budget_is_default=budget_is_default,
        budget_given=budget_given,
        min_budget=min_budget,
        arena_slots=tiers.arena_slots,
        slot=tiers.slot_nbytes,
        arena=tiers.arena_nbytes,
        staging_buffers=staging_buffers,
        staging=tiers.staging_nbytes,
        resident=tiers.resident_nbytes,
        resident_shards=len(tiers.resident),
        ram_nbytes=tiers.ram_nbytes,
        overhead=OVERHEAD_BYTES,
        grad_buckets=grad_buckets,
        pinned=tiers.ram_nbytes + grad_buckets if on_gpu else 0,
        tierstore_total=tierstore_total,
        scratch=tiers.scratch_nbytes,
        model=host_model,
        total=tierstore_total + host_model,
        fits=tierstore_total + host_model <= host_ram,
    )
    primary = tiers.state_nbytes if durable else tiers.disk_nbytes
    second = tiers.state_nbytes if durable else 0
    disk = DiskTier(
        free=disk_free,
        disk_shards=len(tiers.disk_shards),
        primary=primary,
        durability=second,
        total=primary + second,
        fits=None if disk_free is None else primary + second <= disk_free,
    )
    traffic = Traffic(
        pcie_down=grads if on_gpu else 0,
        pcie_up=n_train * pbytes if on_gpu else 0,
        disk_read=tiers.disk_nbytes,
        disk_write=tiers.disk_nbytes + ((tiers.resident_nbytes // commit_every) if durable else 0),
        streamed_write=tiers.disk_nbytes,
        commit_write=tiers.resident_nbytes if durable else 0,
        commit_every=commit_every,
    )
    step_time = _step_time(traffic, bandwidth, n_train, tiers.state_nbytes)
    endurance = _endurance(traffic, drive_tbw, step_time.lower_bound)

    optimizer_bytes = n_train * (8 + (4 if amsgrad else 0) + (4 if precision != "fp32" else 0))
    torch_total = weights + grads + optimizer_bytes
    torch_where = "GPU" if on_gpu else "host RAM"
    torch_limit = gpu_memory if on_gpu else host_ram
    baseline = TorchBaseline(
        where=torch_where,
        weights=weights,
        grads=grads,
        optimizer=optimizer_bytes,
        total=torch_total,
        fits=None if torch_limit is None else torch_total <= torch_limit,
    )

    shortfalls = _shortfalls(gpu_tier, host, disk, durable=durable, streamed=tiers.disk_nbytes)
    if any(f.resource in ("host RAM", "ram_budget") for f in shortfalls):
        host = dataclasses.replace(host, fits=False)
    if shortfalls:
        verdict = DOES_NOT_FIT
    elif tiers.disk_shards:
        verdict = NEEDS_DISK
    else:
        verdict = FITS_IN_RAM
    if on_gpu and precision == "fp32":
        notes.append(
            "fp32 parameters on a GPU: TieredAdamW keeps an fp32 master copy on the host (+4 B/param), "
            "as the authoritative value the GPU parameters are copied from"
        )
    if moment_dtype != "float32" and spec.moment_format.name != "float32":
        notes.append(
            f"{spec.moment_format.name} moments: each update also decodes and encodes them (CPU work the "
            "update rate must include; measure it with bench/codec.py or tierstore bench step --moment-dtype)"
        )
    if disk.total and disk_free is None:
        notes.append("free disk space unknown: pass --state-dir to check the drive")
    return MemoryPlan(
        trainable_params=n_train,
        frozen_params=n_frozen,
        precision=precision,
        param_bytes=pbytes,
        amsgrad=bool(amsgrad),
        durable=bool(durable),
        moment_dtype=spec.moment_format.name,
        fields=fields,
        state_bytes_per_param=int(bpe) if (bpe := layout.bytes_per_element) == int(bpe) else bpe,
        shard_numel=layout.shard_numel,
        shards=len(layout.shards),
        prefetch_depth=prefetch_depth,
        state=tiers.state_nbytes,
        gpu=gpu_tier,
        host=host,
        disk=disk,
        traffic=traffic,
        bandwidth=bandwidth,
        step_time=step_time,
        endurance=endurance,
        torch=baseline,
        verdict=verdict,
        fits=not shortfalls,
        shortfalls=tuple(shortfalls),
        notes=tuple(notes),
    )


def _signed_size(nbytes: int) -> str:
    return format_size(nbytes) if nbytes >= 0 else f"-{format_size(-nbytes)}"


def _tiers(layout: Layout, ram_budget: int, arena_slots: int, staging_buffers: int, workers: int) -> tuple[TierPlan, int]:
    """The tier split at ``ram_budget``, or at the minimum budget when that one cannot stream; and the minimum.

    The minimum is the smaller of what streaming needs (arena, staging, decode
    scratch) and what holding the whole state needs (a small state fits a
    budget below the streaming arena).
    """
    extra = staging_nbytes(layout, staging_buffers) + layout.scratch_nbytes(workers)
    min_budget = min(arena_slots * layout.slot_nbytes, layout.state_nbytes) + extra
    kw = dict(arena_slots=arena_slots, staging_buffers=staging_buffers, workers=workers)
    if ram_budget > 0:
        try:
            return plan_tiers(layout, ram_budget=ram_budget, **kw), min_budget
        except BudgetError:
            pass
    return plan_tiers(layout, ram_budget=min_budget, **kw), min_budget


def _shortfalls(gpu: GpuTier, host: HostTier, disk: DiskTier, *, durable: bool, streamed: int) -> list[Shortfall]:
    """Every resource the plan lacks, each with what would make it fit."""
    out = []
    if gpu.fits is False and gpu.memory is not None:
        gpus = -(-gpu.total // max(gpu.memory, 1))
        out.append(Shortfall(
            "GPU memory", gpu.total, gpu.memory,
            f"the weights and grads need {_b(gpu.total)} of GPU memory (activations not included), the GPU has "
            f"{_b(gpu.memory)}: use a GPU with at least {_b(gpu.total)}, or shard the model over {gpus} or more "
            "GPUs with FSDP2 (fully_shard), each rank with its own TieredAdamW",
        ))
    asked = host.budget_given
    room = host.ram - host.model - host.overhead  # the largest ram_budget this host holds
    too_small = asked < host.min_budget
    if too_small and not host.budget_is_default:
        out.append(Shortfall(
            "ram_budget", host.min_budget, asked,
            f"ram_budget={_signed_size(asked)} cannot hold the streaming arena and staging "
            f"({host.arena_slots} slots x {format_size(host.slot)} + {format_size(host.staging)}): raise it to at "
            f"least {format_size(host.min_budget)} ({host.min_budget} bytes)"
            + (f", at most {format_size(room)} on this host" if room >= host.min_budget else "")
            + ", or lower shard_numel or prefetch_depth",
        ))
    need = host.total
    if host.budget_is_default and too_small:  # the default is 90% of RAM minus the model: too little is left
        need = max(need, math.ceil((host.model + host.min_budget) / HOST_RAM_SHARE))
    if need > host.ram:
        fixes = [f"add {_b(need - host.ram)} of RAM (a host of {_b(need)} or more)"]
        if host.model:
            fixes.append(f"train on a GPU (--gpu-memory): the weights and grads ({_b(host.model)}) then leave the host")
        if room >= host.min_budget and (host.budget_is_default or not too_small):
            fixes.append(
                f"give ram_budget at most {format_size(room)} ({room} bytes; at least {format_size(host.min_budget)}): "
                "more state streams from the drive"
                + (", and less than 10% of RAM is left to the rest" if host.budget_is_default else "")
            )
        parts = f"tierstore {_b(host.tierstore_total)}: ram_budget {format_size(host.budget)} + {format_size(host.overhead)} overhead"
        if host.model:
            parts = f"weights and grads {_b(host.model)} + {parts}"
        if need > host.total:
            fixes[0] += "; the default ram_budget leaves 10% of RAM to the OS and data loading"
        out.append(Shortfall(
            "host RAM", need, host.ram,
            f"the host needs {_b(host.total)} ({parts}) and has {_b(host.ram)}: " + "; or ".join(fixes),
        ))
    if disk.fits is False and disk.free is not None:
        fixes = [f"free {_b(disk.total - disk.free)} more on the state directory's drive, or use a drive with {_b(disk.total)} free"]
        if durable and streamed <= disk.free:
            fixes.append(f"durable=False keeps one copy of the streamed shards only ({_b(streamed)}; no crash consistency)")
        out.append(Shortfall(
            "drive space", disk.total, disk.free,
            f"the state files need {_b(disk.total)}, the drive has {_b(disk.free)} free: " + "; or ".join(fixes),
        ))
    return out


STEP_TIME_FORMULA = (
    "max(disk_read/read_bw + disk_write/write_bw, max(pcie_down, pcie_up)/pcie_bw, "
    "trainable/update_rate, state/memory_copy_bw)"
)


def _step_time(traffic: Traffic, bw: Bandwidth, n_train: int, state: int) -> StepTime:
    """Reads and writes share the drive (their times add); PCIe is full duplex (the
    larger direction counts); the CPU update and memory streaming overlap the I/O.
    A term whose bandwidth is unknown is left out (``None``)."""
    disk = None
    if traffic.disk_read == 0 and traffic.streamed_write == 0:
        disk = 0.0
    elif bw.read_gbps and bw.write_gbps:
        # Commits write the resident shards in the background, while the loop computes.
        disk = traffic.disk_read / (bw.read_gbps * GB) + traffic.streamed_write / (bw.write_gbps * GB)
    pcie = None
    if traffic.pcie_down == 0 and traffic.pcie_up == 0:
        pcie = 0.0
    elif bw.pcie_gbps:
        pcie = max(traffic.pcie_down, traffic.pcie_up) / (bw.pcie_gbps * GB)
    update = n_train / (bw.update_gparams * GB)
    memory = state / (bw.memory_gbps * GB) if bw.memory_gbps else None
    terms = {"disk": disk, "pcie": pcie, "update": update, "memory": memory}
    bound_by, lower = max(((k, v) for k, v in terms.items() if v is not None), key=lambda kv: kv[1])
    return StepTime(disk=disk, pcie=pcie, update=update, memory=memory, lower_bound=lower, bound_by=bound_by, formula=STEP_TIME_FORMULA)


def _endurance(traffic: Traffic, drive_tbw: float | None, step_time: float) -> Endurance:
    write = traffic.disk_write
    steps = days = a_year = None
    if drive_tbw is not None and write > 0:
        steps = drive_tbw * TB / write
        days = steps * step_time / SECONDS_PER_DAY
        if traffic.commit_write and step_time > 0:
            # Writes per step the drive affords for 365 days of back-to-back steps.
            affordable = drive_tbw * TB * step_time / (365 * SECONDS_PER_DAY)
            spare = affordable - traffic.streamed_write
            a_year = math.ceil(traffic.commit_write / spare) if spare > 0 else None
    return Endurance(
        writes_per_step=write,
        writes_per_1000_steps=1000 * write,
        drive_tbw=drive_tbw,
        steps_to_exhaust=steps,
        days_to_exhaust=days,
        commit_every_for_a_year=a_year,
    )


# -- formatting -------------------------------------------------------
def _b(nbytes: int) -> str:
    """Binary and decimal units side by side: people check both by hand."""
    if nbytes < 1 << 20:
        return format_size(nbytes)
    return f"{format_size(nbytes)} ({nbytes / GB:,.2f} GB)"


def _count(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _secs(value: float | None) -> str:
    if value is None:
        return "unknown"
    if value >= 1 or value == 0:
        return f"{value:.2f} s"
    return f"{value * 1000:.1f} ms"


def format_plan(plan: MemoryPlan) -> str:
    """The human-readable report ``tierstore plan`` prints.

    Example
    -------
    >>> print(format_plan(plan_memory(125_000_000, host_ram=16 << 30)).splitlines()[0])
    tierstore plan: 125M trainable params (0 frozen), fp32, AdamW
    """
    p, g, h, d, t, s, e, tb = plan, plan.gpu, plan.host, plan.disk, plan.traffic, plan.step_time, plan.endurance, plan.torch
    precision = "fp32" if p.precision == "fp32" else f"{p.precision} mixed precision (fp32 master)"
    moment_bytes = MOMENT_BYTES[p.moment_dtype]
    parts = " + ".join(f"{f} {moment_bytes if f in MOMENT_FIELDS else STATE_ITEMSIZE:.4g}" for f in p.fields)
    moments = "" if p.moment_dtype == "float32" else f", {p.moment_dtype} moments"
    lines = [
        f"tierstore plan: {_count(p.trainable_params)} trainable params ({_count(p.frozen_params)} frozen), "
        f"{precision}, AdamW{' amsgrad' if p.amsgrad else ''}{moments}",
        f"  optimizer state: {p.state_bytes_per_param:.3g} B/param ({parts}) = {_b(p.state)}",
        f"  shards: {p.shards:,} x {p.shard_numel:,} elements ({format_size(h.slot)} each)",
        "",
    ]
    if g.used:
        mem = "memory unknown" if g.memory is None else _b(g.memory)
        fits = "" if g.fits is None else ("  fits" if g.fits else "  DOES NOT FIT")
        lines += [
            f"GPU: {mem}; activations not included",
            f"  weights ({p.precision})       {_b(g.weights)}",
            f"  grads ({p.precision})         {_b(g.grads)}",
            f"  total                {_b(g.total)}{fits}",
        ]
    else:
        lines += ["GPU: none (the model trains on the CPU)"]
    budget_how = " (default: 90% of host RAM" + (" minus the model" if h.model else "") + ")" if h.budget_is_default else ""
    if h.budget != h.budget_given:
        budget_how += f"; asked {_signed_size(h.budget_given)}, below the minimum: shown at the minimum"
    lines += [
        f"host RAM: {_b(h.ram)}; ram_budget {_b(h.budget)}{budget_how}",
        "  arena                "
        + (f"{h.arena_slots} slots x {format_size(h.slot)} = {_b(h.arena)}" if h.arena_slots else "none (all state resident)"),
        "  staging              "
        + (f"{h.staging_buffers} x {format_size(h.staging // h.staging_buffers)} = {_b(h.staging)}" if h.staging_buffers else "none (fp32 on the CPU)"),
        *([f"  decode scratch       {_b(h.scratch)} ({p.moment_dtype} shards decode into fp32)"] if h.scratch else []),
        f"  resident state       {_b(h.resident)} ({h.resident_shards:,} of {p.shards:,} shards)",
        f"  = ram_budget's part  {_b(h.ram_nbytes)} (the smallest ram_budget that streams: {format_size(h.min_budget)})",
        f"  fixed overhead       {format_size(h.overhead)} (interpreter, I/O threads, checkpoint and DCP buffers"
        + (f", {format_size(h.grad_buckets)} of gradient buckets" if h.grad_buckets else "") + ")",
        f"  tierstore total      {_b(h.tierstore_total)} (peak RSS growth, measured by the tests)",
    ]
    if h.pinned:
        lines.append(f"  pinned (page-locked) {_b(h.pinned)} of it: RLIMIT_MEMLOCK (ulimit -l) must allow that much")
    if h.model:
        lines.append(f"  model (CPU training) {_b(h.model)} (weights + grads)")
    lines.append(f"  total                {_b(h.total)}" + ("  fits" if h.fits else "  DOES NOT FIT"))
    free = "free space unknown" if d.free is None else f"{_b(d.free)} free"
    lines += [
        f"disk: {free}; {'durable: two copies of every shard' if p.durable else 'not durable'}",
        f"  state files          {_b(d.primary)} ({'every shard' if p.durable else f'{d.disk_shards:,} shards on disk'})",
        f"  durability copy      {_b(d.durability)}",
        f"  total                {_b(d.total)}" + ("" if d.fits is None else ("  fits" if d.fits else "  DOES NOT FIT")),
        "",
        "per step",
        "  PCIe                 "
        + (f"down {_b(t.pcie_down)} (grads), up {_b(t.pcie_up)} (params)" if g.used else "none (no GPU)"),
        f"  disk                 read {_b(t.disk_read)}, write {_b(t.streamed_write)}",
    ]
    if t.commit_write:
        keep_up = ""
        if p.bandwidth.write_gbps:
            keep_up = f"; keeps up when forward+backward takes >= {_secs(t.commit_write / (p.bandwidth.write_gbps * GB))}"
        lines.append(
            f"  commits              write {_b(t.commit_write)} (resident shards) every {t.commit_every} step(s), "
            f"in the background{keep_up}"
        )
    bw = p.bandwidth
    known = lambda v, unit="GB/s": "?" if v is None else f"{v:.3g} {unit}"  # noqa: E731
    lines += [
        f"  step time >= {_secs(s.lower_bound)} (bound by {s.bound_by})",
        f"    = max(disk {_secs(s.disk)}, PCIe {_secs(s.pcie)}, CPU update {_secs(s.update)}, memory {_secs(s.memory)})",
        f"    disk = read/{known(bw.read_gbps)} + write/{known(bw.write_gbps)}; PCIe = max(down, up)/"
        f"{known(bw.pcie_gbps)}; update = params/{known(bw.update_gparams, 'Gparam/s')}; "
        f"memory = state/{known(bw.memory_gbps)} (copy)",
        "SSD endurance",
        f"  writes               {_b(e.writes_per_step)} per step, {_b(e.writes_per_1000_steps)} per 1,000 steps"
        + (f" (commit_every={t.commit_every})" if t.commit_write else ""),
    ]
    if e.drive_tbw is not None:
        if e.steps_to_exhaust is None:
            lines.append(f"  rated {e.drive_tbw:g} TBW: no writes, no wear")
        else:
            lines.append(
                f"  rated {e.drive_tbw:g} TBW: exhausted after {e.steps_to_exhaust:,.0f} steps = "
                f"{e.days_to_exhaust:,.1f} days of back-to-back steps at {_secs(s.lower_bound)}"
            )
        if e.commit_every_for_a_year is not None and e.days_to_exhaust is not None and e.days_to_exhaust < 365:
            lines.append(f"  commit_every={e.commit_every_for_a_year} (steps) makes it last a year")
    opt_per_param = tb.optimizer // max(p.trainable_params, 1)
    fits = "" if tb.fits is None else (" - fits" if tb.fits else " - does not fit")
    lines += [
        "",
        f"plain torch.optim.AdamW ({tb.where}): weights {_b(tb.weights)} + grads {_b(tb.grads)} + "
        f"optimizer {_b(tb.optimizer)} ({opt_per_param} B/param) = {_b(tb.total)}"
        f" ({tb.total // max(p.trainable_params, 1)} B/param){fits}",
        f"TieredAdamW(..., ram_budget={h.budget}, shard_numel={p.shard_numel}, "
        f"prefetch_depth={p.prefetch_depth}{', durable=True' if p.durable else ''}"
        f"{'' if p.moment_dtype == 'float32' else f', moment_dtype={p.moment_dtype!r}'})"
        f"  # ram_budget = {format_size(h.budget)}",
    ]
    lines += [f"note: {n}" for n in p.notes]
    lines.append(f"verdict: {p.verdict}")
    for short in p.shortfalls:
        lines.append(f"  {short.resource}: need {_b(short.need)}, have {_b(short.have) if short.have >= 0 else _signed_size(short.have)}")
        lines.append(f"    fix: {short.fix}")
    return "\n".join(lines)


# -- CLI --------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore plan``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="trainable parameter count: 7e9, 7B, 70B, 125M")
    what.add_argument("--model", metavar="MODULE:FACTORY", help="a factory returning an nn.Module, or a tuple starting with one (diagnose's (model, batch, loss_fn) works); the model is built on the meta device and its parameters counted")
    parser.add_argument("--frozen", default="0", help="frozen parameters (with --params): weights only")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="fp32, or bf16/fp16 mixed precision with an fp32 master (default: fp32, or the model's dtype)")
    parser.add_argument("--amsgrad", action="store_true", help="AdamW with amsgrad (+4 B/param)")
    parser.add_argument("--moment-dtype", default="float32", type=_moment_dtype, help="how the moments are stored (default float32: bitwise torch AdamW; bfloat16 or bf16: 2 B, int8: 1.016 B per moment element)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="the model trains on a GPU with this much memory, e.g. 80GB")
    parser.add_argument("--gpu", action="store_true", help="the model trains on a GPU of unknown size")
    parser.add_argument("--host-ram", metavar="SIZE", help="host RAM, e.g. 512GiB (default: this machine's)")
    parser.add_argument("--ram-budget", metavar="SIZE", help="host RAM given to tierstore (default: 90%% of host RAM, minus the model for CPU training)")
    parser.add_argument("--state-dir", metavar="PATH", help="where the state would live; its drive's free space is checked (a path that does not exist yet: its nearest existing parent, named in the notes)")
    parser.add_argument("--disk-free", metavar="SIZE", help="free space on the drive (instead of reading --state-dir)")
    parser.add_argument("--durable", action=argparse.BooleanOptionalAction, default=None, help="keep a second copy of every shard on disk (default: on with --state-dir, as TieredAdamW)")
    parser.add_argument("--commit-every", type=int, default=1, help="steps between durable commits, for drive writes (default 1: auto commits every step when the drive keeps up)")
    parser.add_argument("--shard-numel", type=int, help="elements per shard (default: TieredAdamW's automatic choice)")
    parser.add_argument("--prefetch-depth", type=int, default=DEFAULT_PREFETCH_DEPTH, help="shards read ahead; the arena has prefetch_depth + 2 slots")
    parser.add_argument("--io-json", metavar="FILE", help="bandwidths from `tierstore bench io --json`")
    parser.add_argument("--read-gbps", help="drive read bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--write-gbps", help="drive write bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--pcie-gbps", help="host<->GPU bandwidth per direction, GB/s")
    parser.add_argument("--memory-gbps", help="host memory copy bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--update-gparams", default=str(DEFAULT_UPDATE_GPARAMS), help="CPU AdamW update rate, Gparam/s (default 1)")
    parser.add_argument("--drive-tbw", help="the drive's rated endurance, TB written, e.g. 600")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (every number, the verdict and the shortfalls)")
    parser.add_argument(
        "--fail-if-not-fit",
        action="store_true",
        help=f"exit with status {EXIT_DOES_NOT_FIT} when the verdict is 'does not fit' (the plan is printed either way)",
    )
    parser.epilog = (
        "Exit status: 0 for any plan, whatever its verdict ('fits in host RAM', 'needs the disk tier', "
        f"'does not fit'); {EXIT_DOES_NOT_FIT} for 'does not fit' with --fail-if-not-fit; 2 for a usage error "
        "(unknown options, invalid values, a --model or --io-json that cannot be read: the error says which); "
        "1 for other failures."
    )


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore plan``: parse, plan, print."""
    speeds = {"read_gbps": None, "write_gbps": None, "memory_gbps": None}
    if args.io_json:
        speeds.update(read_io_json(args.io_json))
    for key in ("read_gbps", "write_gbps", "memory_gbps"):
        given = _rate(getattr(args, key), "--" + key.replace("_", "-"))
        if given is not None:
            speeds[key] = given
    bandwidth = Bandwidth(
        **speeds,
        pcie_gbps=_rate(args.pcie_gbps, "--pcie-gbps"),
        update_gparams=_rate(args.update_gparams, "--update-gparams"),
    )
    if args.host_ram is not None:
        host_ram = _size(args.host_ram, "--host-ram")
    else:
        import psutil

        host_ram = psutil.virtual_memory().total
    free = _size(args.disk_free, "--disk-free", allow_zero=True)
    if free is None and args.state_dir:
        free = disk_free(args.state_dir)
    if args.model:
        if args.frozen not in (None, "0"):
            raise ConfigError("--frozen is only for --params; --model counts frozen parameters itself")
        params, frozen = load_model(args.model), 0
    else:
        params = parse_count(args.params, name="--params")
        frozen = 0 if args.frozen in (None, "0") else parse_count(args.frozen, name="--frozen")
    plan = plan_memory(
        params,
        host_ram=host_ram,
        frozen=frozen,
        precision=args.precision,
        amsgrad=args.amsgrad,
        gpu=args.gpu or None,
        gpu_memory=_size(args.gpu_memory, "--gpu-memory"),
        ram_budget=_size(args.ram_budget, "--ram-budget"),
        disk_free=free,
        durable=bool(args.state_dir) if args.durable is None else args.durable,
        commit_every=args.commit_every,
        shard_numel=args.shard_numel,
        prefetch_depth=args.prefetch_depth,
        bandwidth=bandwidth,
        drive_tbw=_rate(args.drive_tbw, "--drive-tbw"),
        moment_dtype=args.moment_dtype,
    )
    note = _state_dir_note(args.state_dir) if args.state_dir and args.disk_free is None else None
    if note:
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return EXIT_DOES_NOT_FIT if args.fail_if_not_fit and not plan.fits else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierstore.planner ...`` (same as ``tierstore plan ...``)."""
    from .cli import main as cli_main

    return cli_main(["plan", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
