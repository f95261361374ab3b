"""How many bytes a run puts in GPU memory, host RAM and on the drive: :func:`plan_memory`.

It builds the same :class:`~tierstore._layout.layout.Layout` and
:func:`~tierstore._layout.budget.plan_tiers` split that
:class:`~tierstore.TieredAdamW` (or the front of another optimizer
algorithm: ``optimizer="sgd"``) would build, over tensors on the ``meta``
device (no memory is allocated), so the planner and the optimizer never
disagree about bytes; the bytes moved per step, the step-time bound and the
drive's wear come from :mod:`tierstore.planner.traffic`.

Example
-------
>>> plan = plan_memory(125_000_000, host_ram=16 << 30)
>>> plan.verdict, plan.host.proposed_budget  # the whole state fits: keep it all in RAM
('fits in host RAM', None)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch

from .._compute.algorithms import Algorithm, algorithm_named
from .._config.knobs import Knobs
from .._config.registry import KNOBS
from .._layout.budget import OVERHEAD_BYTES, TierPlan, plan_tiers, staging_nbytes, whole_state_text
from .._layout.layout import DEFAULT_SHARD_NUMEL, Layout
from .._layout.spec import StateSpec, decide
from .._runtime.grad_offload import DEFAULT_BUCKET_BYTES
from .._state.commit_policy import CommitPolicy
from ..errors import BudgetError, ConfigError
from ..sizes import budget_request, format_size, resolve_budget
from . import traffic as wear
from .drives import check_drives, drive_shortfalls, plan_drives
from .inputs import PRECISION_DTYPES, parse_rate
from .results import (
    DEFAULT_LIFETIME_MONTHS,
    DOES_NOT_FIT,
    FITS_IN_RAM,
    HOST_RAM_SHARE,
    NEEDS_DISK,
    Bandwidth,
    DiskTier,
    DriveSpec,
    GpuTier,
    HostTier,
    MemoryPlan,
    TorchBaseline,
)
from .shortfalls import find_shortfalls

__all__ = ["plan_memory", "algorithm_options", "PRECISIONS", "DEFAULT_PREFETCH_DEPTH", "HOST_RAM_SHARE", "MAX_SHARDS"]

PRECISIONS = {name: getattr(torch, dtype) for name, dtype in PRECISION_DTYPES.items()}
DEFAULT_PREFETCH_DEPTH = Knobs.prefetch_depth  # as TieredAdamW
MAX_SHARDS = 1 << 20  # beyond this the layout itself gets big; raise shard_numel


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


def _check(host_ram, gpu_memory, disk_free, prefetch_depth, shard_numel, gpu, precision) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is unknown; choose one of {sorted(PRECISIONS)}")
    if isinstance(host_ram, bool) or not isinstance(host_ram, int) or host_ram <= 0:
        raise ConfigError(f"host_ram={host_ram!r} must be a byte count > 0, e.g. 512 << 30")
    for name, value in (("gpu_memory", gpu_memory), ("disk_free", disk_free)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{name}={value!r} must be a byte count >= 0")
    for knob, value in (("prefetch_depth", prefetch_depth), ("shard_numel", shard_numel)):
        KNOBS[knob].validate(value)  # TieredAdamW's check and words
    if gpu is False and gpu_memory is not None:
        raise ConfigError("gpu=False contradicts gpu_memory; drop gpu_memory for CPU training")


@dataclasses.dataclass(frozen=True)
class _Split:
    """One layout and its tier split at a budget (the arithmetic's working state)."""

    spec: StateSpec
    layout: Layout
    tiers: TierPlan
    min_budget: int  # the smallest ram_budget that streams (or holds the whole state)
    all_resident: int  # the ram_budget that keeps every shard resident


def _split(tensors, decide_kw: dict, budget: int | None, shard_numel: int | None) -> _Split:
    """Decide, lay out and split at ``budget`` (``None``: no budget, everything resident)."""
    streams = budget is not None and budget > 0
    spec = decide(
        **decide_kw,
        ram_budget=budget if streams else None,
        shard_numel=shard_numel if shard_numel is not None or streams or budget is None else DEFAULT_SHARD_NUMEL,
    )
    n_train = decide_kw["numel"]
    if n_train / spec.shard_numel > MAX_SHARDS:
        raise ConfigError(
            f"shard_numel={spec.shard_numel} cuts {n_train:,} parameters into more than {MAX_SHARDS:,} shards; "
            "raise shard_numel (e.g. 1 << 22)"
        )
    layout = Layout.build([tensors], shard_numel=spec.shard_numel, fields=spec.fields, moment_dtype=spec.moment_format,
                          algorithm=spec.algorithm)  # fmt: skip
    if shard_numel is None and layout.total_numel < layout.shard_numel:
        # A tiny model: the automatic size (16 Mi when all is resident) is larger than the whole flat
        # space. One shard of the space's size is the same bytes, and a shard_numel that says so.
        spec = dataclasses.replace(spec, shard_numel=layout.total_numel)
        layout = Layout.build([tensors], shard_numel=spec.shard_numel, fields=spec.fields,
                              moment_dtype=spec.moment_format, algorithm=spec.algorithm)  # fmt: skip
    extra = staging_nbytes(layout, spec.staging_buffers) + layout.scratch_nbytes(spec.workers)
    min_budget = min(spec.arena_slots * layout.slot_nbytes, layout.state_nbytes) + extra
    kw = dict(arena_slots=spec.arena_slots, staging_buffers=spec.staging_buffers, workers=spec.workers)
    tiers = None
    if budget is None:
        tiers = plan_tiers(layout, ram_budget=None, **kw)
    elif budget > 0:
        with contextlib.suppress(BudgetError):  # below the arena: shown at the minimum, below
            tiers = plan_tiers(layout, ram_budget=budget, **kw)
    if tiers is None:  # the budget cannot stream: the arithmetic at the smallest one that can
        tiers = plan_tiers(layout, ram_budget=min_budget, **kw)
    return _Split(spec, layout, tiers, min_budget, layout.state_nbytes + extra)


def _floor_probe(tensors: list[torch.Tensor], decide_kw: dict) -> list[torch.Tensor]:
    """Tensors that give the smallest streaming budget's arithmetic as ``tensors`` do, without laying out millions of shards.

    The smallest budget picks the smallest shards, and what it needs (the
    arena's slots, staging, decode scratch) depends on one shard's size, not
    on how many there are. A state of more than ``arena_slots + 1`` such
    shards is therefore stood for by a flat tensor of that many shards: its
    streaming minimum is the same, and it is below the whole state's size,
    as the real one is.
    """
    spec = decide(**decide_kw, ram_budget=1, shard_numel=None)
    enough = spec.shard_numel * (spec.arena_slots + 1)
    if decide_kw["numel"] <= enough:
        return tensors
    dtype = next(iter(decide_kw["dtypes"]))
    return [torch.empty(enough, dtype=dtype, device="meta", requires_grad=True)]


def algorithm_options(optimizer: str | Algorithm, options: Iterable[str] = (), *, amsgrad: bool = False) -> tuple[Algorithm, frozenset[str]]:
    """The registered algorithm called ``optimizer`` and the options that add fields, checked (``amsgrad``: one of them).

    Raises
    ------
    ConfigError
        For an unknown algorithm (naming the registered ones), or an option
        that adds none of its fields (naming those that do).

    Example
    -------
    >>> algorithm_options("adamw", amsgrad=True)
    (<algorithm adamw>, frozenset({'amsgrad'}))
    >>> algorithm_options("adamw", ["momentum"])
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: optimizer 'adamw' (torch.optim.AdamW) has no option 'momentum' that adds a state field; its options are ['amsgrad']
    """
    algorithm = algorithm_named(optimizer)
    if isinstance(options, str):
        options = [options]
    chosen = set(options) | ({"amsgrad"} if amsgrad else set())
    known = sorted({f.option for f in algorithm.fields if f.option is not None})
    for option in sorted(chosen, key=str):
        if option not in known:
            raise ConfigError(
                f"optimizer {algorithm.name!r} ({algorithm.torch_class}) has no option {option!r} that adds a state "
                f"field; its options are {known}"
            )
    return algorithm, frozenset(chosen)


def _stateless(algorithm: Algorithm, options: frozenset[str]) -> ConfigError:
    """A plan of an algorithm that keeps no per-element state with these options (SGD without momentum)."""
    hints = [f"options=[{f.option!r}] (plan --option {f.option}) for its {f.name} ({f.enable or f.option})"
             for f in algorithm.fields if f.option is not None and f.option not in options]  # fmt: skip
    return ConfigError(
        f"{algorithm.torch_class}{' with ' + ', '.join(sorted(options)) if options else ''} keeps no per-element "
        "state on fp32 parameters (no field, no master copy): there is nothing to offload or plan"
        + (f"; pass {' or '.join(hints)}" if hints else "")
    )


def plan_memory(
    params: int | torch.nn.Module | Iterable[torch.Tensor],
    *,
    host_ram: int,
    frozen: int = 0,
    precision: str | None = None,
    optimizer: str | Algorithm = "adamw",
    options: Iterable[str] = (),
    amsgrad: bool = False,
    gpu: bool | None = None,
    gpu_memory: int | None = None,
    ram_budget: int | float | str | Fraction | None = None,
    disk_free: int | None = None,
    durable: bool = False,
    commit_every: Any = "auto",
    shard_numel: int | None = None,
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
    bandwidth: Bandwidth | None = None,
    drive_tbw: float | None = None,
    moment_dtype: str = "float32",
    lifetime_months: float = DEFAULT_LIFETIME_MONTHS,
    drives: Sequence[DriveSpec] | None = None,
) -> MemoryPlan:
    """Bytes per tier, bytes moved per step, a step-time lower bound and the drive's wear.

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
    optimizer
        The optimizer algorithm, by its registered name (``"adamw"``,
        ``"adam"``, ``"sgd"``, ``"adagrad"``, ...): its fields are the state.
    options
        The algorithm's options that add a field (AdamW's ``"amsgrad"``:
        ``max_exp_avg_sq``; SGD's ``"momentum"``: ``momentum_buffer``).
    amsgrad
        Keep ``max_exp_avg_sq`` (+4 B/param): ``options=["amsgrad"]``.
    gpu, gpu_memory
        Whether the model trains on a GPU (implied by ``gpu_memory``), and
        that GPU's memory in bytes (``None``: unknown).
    ram_budget
        The ``ram_budget`` given to ``TieredAdamW``, in any form it takes
        (:func:`tierstore.sizes.parse_budget`: bytes, ``"8GiB"``, or a share of
        the state such as ``"1/8"``, ``"12.5%"``, ``0.125``). ``None``: 90% of
        ``host_ram`` minus the model's weights and grads when it trains on
        the CPU. The plan never uses more than the whole state takes
        (``host.all_resident``); when that fits the host it proposes
        ``ram_budget=None``, everything in RAM.
    disk_free
        Free bytes on the state directory's drive (``None``: unknown).
    durable
        Durability keeps a second copy of every shard on disk; every commit
        writes the resident shards too, in the background. ``TieredAdamW`` is
        durable by default when given a ``state_dir`` (the CLI follows that:
        on with ``--state-dir``).
    commit_every
        The commit policy, as ``TieredAdamW(commit_every=...)`` takes it
        (:class:`~tierstore._state.commit_policy.CommitPolicy`): ``"auto"``
        (assumed to commit every step, which it does when the drive keeps up:
        the most wear), a step count, a duration (``"5min"``: its steps at the
        step-time lower bound) or both.
    shard_numel, prefetch_depth
        As ``TieredAdamW`` (``None`` picks its automatic shard size, never
        larger than the whole state).
    bandwidth
        Drive, PCIe and memory speeds and the CPU update rate.
    drive_tbw
        The drive's rated endurance in TB written (``None``: unknown).
    moment_dtype
        How the moments are stored: ``"float32"``, ``"bfloat16"`` or ``"int8"``
        (as ``TieredAdamW``).
    lifetime_months
        How long the drive should last: the verdict says whether it does, and
        ``endurance.commit_every_for_lifetime`` is the ``commit_every`` that
        makes it (a month is 365.25 / 12 days).
    drives
        A state over several drives (``state_dir`` as a list), one
        :class:`~tierstore.planner.results.DriveSpec` each, in order: the
        plan places the shards as the optimizer does (by each drive's
        read+write bandwidth) and says what each drive holds, whether it fits,
        and the step's disk time over them (:mod:`tierstore.planner.drives`);
        each drive's free space replaces ``disk_free``, its speeds
        ``bandwidth``'s drive speeds.

    Raises
    ------
    ConfigError
        For invalid values only (an unknown optimizer or option, or a
        state with no per-element field). A plan that does not fit (host RAM, GPU
        memory, drive space, a ``ram_budget`` below the streaming arena's
        minimum) is still a plan: ``verdict`` is ``"does not fit"`` and
        ``shortfalls`` says what is missing and what would make it fit. A
        drive that wears out early is in ``wear`` and ``endurance.fix``.

    Example
    -------
    >>> plan = plan_memory(7_000_000_000, host_ram=64 << 30, gpu_memory=80 * 10**9)
    >>> plan.fields, plan.verdict
    (('master', 'exp_avg', 'exp_avg_sq'), 'needs the disk tier')
    >>> small = plan_memory(7_000_000_000, precision="bf16", host_ram=24 << 30)  # CPU training
    >>> small.verdict, [f.resource for f in small.shortfalls]
    ('does not fit', ['host RAM'])
    >>> lion = plan_memory(7_000_000_000, host_ram=64 << 30, optimizer="lion")  # one field: half of AdamW's bytes
    >>> lion.fields, lion.state_bytes_per_param, lion.torch.optimizer // lion.trainable_params
    (('exp_avg',), 4, 4)
    """
    _check(host_ram, gpu_memory, disk_free, prefetch_depth, shard_numel, gpu, precision)
    algorithm, options = algorithm_options(optimizer, options, amsgrad=amsgrad)
    if isinstance(ram_budget, Fraction):  # budget_request's own result: validate it the same way
        ram_budget = f"{ram_budget.numerator}/{ram_budget.denominator}"
    request = budget_request(ram_budget)
    policy = CommitPolicy.parse(commit_every)
    drive_tbw = parse_rate(drive_tbw, "drive_tbw")
    lifetime_months = parse_rate(lifetime_months, "lifetime_months")
    bandwidth = bandwidth or Bandwidth()
    if drives is not None:
        drives = check_drives(drives)
        if disk_free is not None:
            raise ConfigError("disk_free is one drive's free space; with drives= give each DriveSpec its free space")
    on_gpu = bool(gpu) or gpu_memory is not None

    tensors, precision = _tensors(params, frozen, precision)
    n_train = sum(t.numel() for t in tensors if t.requires_grad)
    n_frozen = sum(t.numel() for t in tensors if not t.requires_grad)
    pbytes = PRECISIONS[precision].itemsize
    weights = (n_train + n_frozen) * pbytes
    grads = n_train * pbytes
    host_model = 0 if on_gpu else weights + grads
    knobs = Knobs(prefetch_depth=prefetch_depth)
    decide_kw = dict(numel=n_train, dtypes=[PRECISIONS[precision]], cuda=on_gpu, algorithm=algorithm, options=options,
                     keep_master=None, arena_slots=knobs.arena_slots, moment_dtype=moment_dtype,
                     workers=knobs.max_update_threads)  # fmt: skip
    if not decide(**decide_kw, ram_budget=None, shard_numel=DEFAULT_SHARD_NUMEL).fields:
        raise _stateless(algorithm, options)

    notes = []
    budget_is_default = request is None
    default_room = int(host_ram * HOST_RAM_SHARE) - host_model
    if request is None:
        budget_given = max(default_room, 0)  # a model larger than 90% of RAM leaves nothing
    elif isinstance(request, Fraction):
        # A share of the state's size (its fields as stored, unpadded), as TieredAdamW resolves it.
        fields = decide(**decide_kw, ram_budget=None, shard_numel=DEFAULT_SHARD_NUMEL)
        state_bytes = int(n_train * fields.stored_bytes_per_element)
        budget_given = resolve_budget(request, state_bytes=state_bytes)
    else:
        budget_given = request

    split = _split(tensors, decide_kw, budget_given, shard_numel)
    if budget_given >= split.all_resident and shard_numel is None:
        # All of it fits: TieredAdamW(ram_budget=None) keeps everything resident; lay out as it would.
        unbounded = _split(tensors, decide_kw, None, None)
        if unbounded.all_resident <= budget_given:
            split = unbounded
    spec, layout, tiers = split.spec, split.layout, split.tiers
    budget = min(max(budget_given, split.min_budget), split.all_resident)
    # A state no larger than the streaming arena cannot stream: its smallest budget is the whole state.
    whole = whole_state_text(layout) if split.min_budget >= split.all_resident else None
    if budget_given < split.min_budget:
        why = (f"ram_budget is {format_size(budget_given)}" if not budget_is_default else
               "the default budget, 90% of host RAM minus the model's weights and grads, is "
               + (f"{format_size(budget_given)}" if default_room >= 0 else
                  f"nothing: the weights and grads take {format_size(-default_room)} more than that"))  # fmt: skip
        smallest = (f"{whole}, which is smaller than the streaming arena ({spec.arena_slots} slots x "
                    f"{format_size(layout.slot_nbytes)}) and so stays in RAM" if whole else
                    "the smallest that holds the streaming arena and staging")  # fmt: skip
        notes.append(f"the arithmetic is at ram_budget={format_size(split.min_budget)}, {smallest} ({why})")
    elif budget_given > split.all_resident and not budget_is_default:
        notes.append(
            f"ram_budget={format_size(budget_given)} is more than the whole state takes in RAM "
            f"({format_size(split.all_resident)}, every shard resident): the arithmetic uses "
            f"{format_size(split.all_resident)}"
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
    grad_buckets = 2 * DEFAULT_BUCKET_BYTES if on_gpu else 0  # attach()'s two pinned buckets, inside the overhead
    tierstore_total = tiers.ram_nbytes + OVERHEAD_BYTES
    host_fits = tierstore_total + host_model <= host_ram
    floor = split
    if not tiers.disk_shards and shard_numel is None:  # all resident: a small budget would pick smaller shards
        with contextlib.suppress(ConfigError):  # so small that they would be too many: this layout's floor
            floor = _split(_floor_probe(tensors, decide_kw), decide_kw, 1, None)
    stream_floor = floor.min_budget if floor.min_budget < floor.all_resident else None
    host = HostTier(
        ram=host_ram,
        budget=budget,
        budget_is_default=budget_is_default,
        budget_given=budget_given,
        min_budget=split.min_budget,
        all_resident=split.all_resident,
        proposed_budget=None if budget >= split.all_resident and host_fits else budget,
        arena_slots=tiers.arena_slots,
        slot=tiers.slot_nbytes,
        arena=tiers.arena_nbytes,
        staging_buffers=spec.staging_buffers,
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
        fits=host_fits,
        stream_floor=stream_floor,
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

    shares, striped = ((), None) if drives is None else plan_drives(layout, tiers, drives, durable=durable)
    if drives is not None:
        free = [d.free for d in drives]
        fits = [s.fits for s in shares]
        disk = dataclasses.replace(disk, free=None if None in free else sum(free),
                                   fits=None if None in fits else all(fits))
    manifest = wear.manifest_nbytes(shards=len(layout.shards), params=len(layout.params))
    run = dict(pcie=grads if on_gpu else 0, bandwidth=bandwidth, trainable=n_train, durable=durable, policy=policy,
               manifest=manifest, drive_tbw=drive_tbw, lifetime_months=lifetime_months,
               drives=None if drives is None else (lambda t: plan_drives(layout, t, drives, durable=durable)[1].placement_seconds))  # fmt: skip
    traffic, step_time, endurance = wear.at(tiers, **run)
    room = min(host_ram - host_model - OVERHEAD_BYTES, split.all_resident)  # the largest budget this host holds
    if endurance.lasts is False:
        more = None
        if room > budget and room >= split.min_budget:  # more RAM streams less: what the most this host holds does
            more_tiers = plan_tiers(layout, ram_budget=room, arena_slots=spec.arena_slots,
                                    staging_buffers=spec.staging_buffers, workers=spec.workers)  # fmt: skip
            more = (room, wear.at(more_tiers, **run))
        endurance = dataclasses.replace(endurance, fix=wear.fix(traffic, endurance, durable=durable, more=more))

    # The torch class keeps each field in fp32 (and a mixed-precision run an fp32 master copy beside it).
    optimizer_bytes = n_train * (4 * len(algorithm.fields_for(options)) + (4 if precision != "fp32" else 0))
    torch_total = weights + grads + optimizer_bytes
    torch_limit = gpu_memory if on_gpu else host_ram
    baseline = TorchBaseline(
        where="GPU" if on_gpu else "host RAM",
        weights=weights,
        grads=grads,
        optimizer=optimizer_bytes,
        total=torch_total,
        fits=None if torch_limit is None else torch_total <= torch_limit,
    )

    shortfalls = find_shortfalls(gpu_tier, host, disk if drives is None else dataclasses.replace(disk, fits=None),
                                 durable=durable, streamed=tiers.disk_nbytes, arena_slots=spec.arena_slots,
                                 whole=whole)  # fmt: skip
    shortfalls += drive_shortfalls(shares, durable=durable)
    if any(f.resource in ("host RAM", "ram_budget") for f in shortfalls):
        host = dataclasses.replace(host, fits=False, proposed_budget=host.budget)
    if shortfalls:
        verdict = DOES_NOT_FIT
    elif tiers.disk_shards:
        verdict = NEEDS_DISK
    else:
        verdict = FITS_IN_RAM
    if on_gpu and precision == "fp32":
        notes.append(
            f"fp32 parameters on a GPU: {algorithm.front} keeps an fp32 master copy on the host (+4 B/param), "
            "as the authoritative value the GPU parameters are copied from"
        )
    if moment_dtype != "float32" and spec.moment_format.name != "float32":
        notes.append(
            f"{spec.moment_format.name} moments: each update also decodes and encodes them (CPU work the "
            "update rate must include; measure it with bench/codec.py or tierstore bench step --moment-dtype)"
        )
    if traffic.commit_assumption:
        notes.append(traffic.commit_assumption)
    if not durable and not policy.auto:
        notes.append(f"commit_every={traffic.commit_every} has no effect without durability: nothing commits")
    if disk.total and disk_free is None and drives is None:
        notes.append("free disk space unknown: pass --state-dir to check the drive")
    if striped is not None and striped.floor_seconds is None:
        notes.append("a drive's bandwidth is unknown: the shards are shown in equal shares (the optimizer probes "
                     "each drive when it creates the state) and the step's disk time is unknown")
    bpe = layout.bytes_per_element
    return MemoryPlan(
        trainable_params=n_train,
        frozen_params=n_frozen,
        precision=precision,
        param_bytes=pbytes,
        amsgrad="amsgrad" in options,
        durable=bool(durable),
        moment_dtype=spec.moment_format.name,
        fields=spec.fields,
        state_bytes_per_param=int(bpe) if bpe == int(bpe) else bpe,
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
        wear=wear.summary(endurance, traffic),
        shortfalls=tuple(shortfalls),
        notes=tuple(notes),
        drives=shares,
        striped=striped,
        padded_numel=layout.total_numel,
        param_align=layout.param_align,
        optimizer=algorithm.name,
        options=tuple(sorted(options)),
    )
