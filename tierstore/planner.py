"""``tierstore plan``: the memory and I/O arithmetic of a training run, before running it.

:func:`plan_memory` answers "will this model fit on my box, and how fast can a
step be?" for a parameter count or a real ``nn.Module``. It builds the same
:class:`~tierstore.layout.Layout` and :func:`~tierstore.budget.plan_tiers`
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
  compressed); plus the model's weights and grads when it trains on the CPU;
- disk: the on-disk shards once; with durability every shard twice;
- per step: PCIe ``b·P`` down (grads) and ``b·P`` up (params) with a GPU;
  disk reads every on-disk shard once and writes it once; durable, every
  commit also writes the resident shards, in the background (once per
  ``commit_every`` steps, not once per step);
- step time >= max(disk_read/read_bw + disk_write/write_bw,
  max(down, up)/pcie_bw, P/update_rate, state/memory_copy_bw), over the
  terms whose bandwidth is known (the update reads and writes every state
  byte once: the memory traffic of one copy of the state).

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

from .budget import plan_tiers
from .codecs import FORMATS
from .errors import ConfigError
from .factory import resolve
from .knobs import Knobs
from .layout import MOMENT_FIELDS, STATE_ITEMSIZE, Layout
from .sizes import format_size, parse_size
from .spec import decide

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_PREFETCH_DEPTH = Knobs.prefetch_depth  # as TieredAdamW
HOST_RAM_SHARE = 0.9  # the default budget leaves 10% of host RAM to the OS, data loading, ...
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
    budget: int
    budget_is_default: bool
    arena_slots: int
    slot: int
    arena: int
    staging_buffers: int
    staging: int
    resident: int
    resident_shards: int
    tierstore_total: int
    scratch: int  # a compressed moment format's fp32 decode scratch
    model: int  # weights + grads of a model that trains on the CPU
    total: int


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
    verdict: str
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


def _rate(value: float | str | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
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
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"io json file {str(path)!r} does not exist; write one with "
            f"`tierstore bench io --dir DIR --json {path}` or pass --read-gbps/--write-gbps"
        ) from None
    except OSError as exc:
        raise ConfigError(f"io json file {str(path)!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
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
        For invalid values, or when ``host_ram`` cannot hold the model (CPU
        training) or ``ram_budget`` exceeds ``host_ram``.
    BudgetError
        If ``ram_budget`` cannot hold the streaming arena (lower
        ``shard_numel`` or ``prefetch_depth``).

    Example
    -------
    >>> plan = plan_memory(7_000_000_000, host_ram=64 << 30, gpu_memory=80 * 10**9)
    >>> plan.fields, plan.verdict
    (('master', 'exp_avg', 'exp_avg_sq'), 'needs disk tier')
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
        ram_budget = int(host_ram * HOST_RAM_SHARE) - host_model
        if ram_budget <= 0:
            raise ConfigError(
                f"host RAM {format_size(host_ram)} cannot hold the model's weights and grads "
                f"({format_size(host_model)}) for CPU training with room to spare; train on a GPU "
                "(--gpu-memory), use a bigger machine, or give --ram-budget explicitly"
            )
    elif ram_budget > host_ram:
        raise ConfigError(
            f"ram_budget={format_size(ram_budget)} exceeds host_ram={format_size(host_ram)}; "
            "give a budget below the machine's RAM"
        )
    elif ram_budget + host_model > host_ram:
        notes.append(
            f"ram budget + the model's weights and grads on the host ({format_size(ram_budget + host_model)}) "
            f"exceed host RAM ({format_size(host_ram)})"
        )

    # The decision TieredAdamW makes (keep_master=None), for parameters of this precision on this device.
    spec = decide(
        numel=n_train,
        dtypes=[PRECISIONS[precision]],
        cuda=on_gpu,
        amsgrad=amsgrad,
        keep_master=None,
        arena_slots=Knobs(prefetch_depth=prefetch_depth).arena_slots,
        ram_budget=ram_budget,
        shard_numel=shard_numel,
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
    tiers = plan_tiers(
        layout, ram_budget=ram_budget, arena_slots=spec.arena_slots, staging_buffers=staging_buffers, workers=spec.workers
    )

    gpu_total = weights + grads if on_gpu else 0
    gpu_tier = GpuTier(
        used=on_gpu,
        memory=gpu_memory,
        weights=weights if on_gpu else 0,
        grads=grads if on_gpu else 0,
        total=gpu_total,
        fits=None if gpu_memory is None else gpu_total <= gpu_memory,
    )
    host = HostTier(
        ram=host_ram,
        budget=ram_budget,
        budget_is_default=budget_is_default,
        arena_slots=tiers.arena_slots,
        slot=tiers.slot_nbytes,
        arena=tiers.arena_nbytes,
        staging_buffers=staging_buffers,
        staging=tiers.staging_nbytes,
        resident=tiers.resident_nbytes,
        resident_shards=len(tiers.resident),
        tierstore_total=tiers.ram_nbytes,
        scratch=tiers.scratch_nbytes,
        model=host_model,
        total=tiers.ram_nbytes + host_model,
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

    if disk.fits is False:
        verdict = "does not fit on the drive"
    elif tiers.disk_shards:
        verdict = "needs disk tier"
    else:
        verdict = "fits in host RAM"
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
    if gpu_tier.fits is False:
        notes.append("the GPU cannot hold the weights and grads; shard the model (FSDP2) or use a bigger GPU")
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
        notes=tuple(notes),
    )


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
    lines += [
        f"host RAM: {_b(h.ram)}; ram_budget {_b(h.budget)}{budget_how}",
        "  arena                "
        + (f"{h.arena_slots} slots x {format_size(h.slot)} = {_b(h.arena)}" if h.arena_slots else "none (all state resident)"),
        "  staging              "
        + (f"{h.staging_buffers} x {format_size(h.staging // h.staging_buffers)} = {_b(h.staging)}" if h.staging_buffers else "none (fp32 on the CPU)"),
        *([f"  decode scratch       {_b(h.scratch)} ({p.moment_dtype} shards decode into fp32)"] if h.scratch else []),
        f"  resident state       {_b(h.resident)} ({h.resident_shards:,} of {p.shards:,} shards)",
        f"  tierstore total      {_b(h.tierstore_total)}",
    ]
    if h.model:
        lines.append(f"  model (CPU training) {_b(h.model)} (weights + grads)")
        lines.append(f"  total                {_b(h.total)}")
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
    parser.add_argument("--moment-dtype", default="float32", choices=sorted(MOMENT_BYTES), help="how the moments are stored (default float32: bitwise torch AdamW; bfloat16: 2 B, int8: 1.016 B per moment element)")
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
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


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
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierstore.planner ...`` (same as ``tierstore plan ...``)."""
    from .cli import main as cli_main

    return cli_main(["plan", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
