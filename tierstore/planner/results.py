"""What a plan holds: the records :func:`~tierstore.planner.plan_memory` returns (no arithmetic here).

Byte counts are ints, times are seconds, bandwidths GB/s (10^9 B/s) and drive
endurance TB (10^12 B) written. :meth:`MemoryPlan.to_dict` is the ``tierstore
plan --json`` form.

Example
-------
>>> short = Shortfall("host RAM", need=32 << 30, have=24 << 30, fix="add 8 GiB of RAM")
>>> short.resource, short.need - short.have
('host RAM', 8589934592)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = [
    "Bandwidth",
    "GpuTier",
    "HostTier",
    "DiskTier",
    "DriveSpec",
    "DriveShare",
    "StripedStep",
    "Shortfall",
    "Traffic",
    "StepTime",
    "Endurance",
    "TorchBaseline",
    "MemoryPlan",
    "VERDICTS",
    "FITS_IN_RAM",
    "NEEDS_DISK",
    "DOES_NOT_FIT",
    "EXIT_DOES_NOT_FIT",
    "DEFAULT_UPDATE_GPARAMS",
    "DEFAULT_LIFETIME_MONTHS",
    "HOST_RAM_SHARE",
    "GB",
    "TB",
]

FITS_IN_RAM, NEEDS_DISK, DOES_NOT_FIT = "fits in host RAM", "needs the disk tier", "does not fit"
VERDICTS = (FITS_IN_RAM, NEEDS_DISK, DOES_NOT_FIT)
EXIT_DOES_NOT_FIT = 3  # `tierstore plan --fail-if-not-fit` when the verdict is "does not fit"
DEFAULT_UPDATE_GPARAMS = 1.0  # fused CPU AdamW, order of magnitude on a server socket
DEFAULT_LIFETIME_MONTHS = 36.0  # how long a drive should last: a typical warranty
HOST_RAM_SHARE = 0.9  # the default budget leaves 10% of host RAM to the OS, data loading, ...
GB = 10**9  # bandwidths use decimal units
TB = 10**12  # so does drive endurance (TBW)


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
    budget: int  # the ram_budget the arithmetic uses: at least min_budget, at most all_resident
    budget_is_default: bool
    budget_given: int  # what was asked (a share resolved to bytes), or the default (90% of RAM minus the model, >= 0)
    min_budget: int  # arena + staging with this layout's shards (or the whole state, when that is smaller)
    all_resident: int  # state + staging + decode scratch: the ram_budget that keeps every shard in RAM
    proposed_budget: int | None  # the ram_budget to give TieredAdamW; None: keep everything in RAM (it fits)
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
    # The smallest ram_budget that streams, with the shard size TieredAdamW picks for it (smaller shards than
    # an all-resident layout's); None: the whole state is no larger than the streaming arena, so it never streams.
    stream_floor: int | None = None


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
    """Bytes moved per step, and per commit under the commit policy."""

    pcie_down: int
    pcie_up: int
    disk_read: int
    disk_write: int  # per step, on average: streamed shards plus each commit's bytes over the steps between commits
    streamed_write: int  # per step, on the step's critical path: every on-disk shard
    commit_write: int  # per commit, in the background: resident_write + manifest_write (0: not durable)
    resident_write: int  # per commit: the resident shards (each changed since its last write: it has a gradient)
    manifest_write: int  # per commit: the manifest (an estimate from its measured size)
    commit_every: str  # the commit policy as TieredAdamW's commit_every takes it ("'auto'", "100", "'5min'")
    steps_per_commit: float | None  # steps between commits the arithmetic uses (None: not durable, no commits)
    commit_assumption: str | None  # what the arithmetic assumes of the policy ("auto": every step)


@dataclass(frozen=True)
class DriveSpec:
    """One drive a state spreads over (an input): its path or a name, free bytes and speeds (``None``: unknown)."""

    name: str
    free: int | None = None
    read_gbps: float | None = None
    write_gbps: float | None = None


@dataclass(frozen=True)
class DriveShare:
    """What one drive holds under the optimizer's placement, and its share of a streamed step."""

    name: str
    free: int | None
    read_gbps: float | None
    write_gbps: float | None
    bandwidth_gbps: float | None  # 1 / (1/read + 1/write): what placement weighs the drive by
    shards: int  # shards placed on it (each shard's files live on one drive)
    state: int  # bytes of state on it, one copy
    streamed_shards: int  # of those, the shards streamed every step
    streamed: int  # bytes it reads and writes back every step
    files: int  # its state files: two copies of its shards when durable, else one of its streamed shards
    fits: bool | None
    step_seconds: float | None  # streamed / read + streamed / write (None: a speed is unknown)


@dataclass(frozen=True)
class StripedStep:
    """A streamed step's disk time over several drives (seconds; ``None`` where a bandwidth is unknown)."""

    floor_seconds: float | None  # the striped floor: streamed bytes / the drives' combined read+write bandwidth
    placement_seconds: float | None  # the slowest drive's share under the placement: the step's disk time
    fastest_alone_seconds: float | None  # the same bytes on the fastest drive alone
    combined_gbps: float | None
    streamed: int
    placed_by: str  # "bandwidth", or equal shares when a bandwidth is unknown


@dataclass(frozen=True)
class StepTime:
    disk: float | None
    pcie: float | None
    update: float
    memory: float | None
    fixed: float  # a step's fixed cost, whatever the model's size (traffic.FIXED_STEP_SECONDS)
    lower_bound: float
    bound_by: str
    formula: str


@dataclass(frozen=True)
class Endurance:
    """Drive wear: the writes under the commit policy against the drive's rated endurance (TBW)."""

    writes_per_step: int  # Traffic.disk_write
    writes_per_1000_steps: int
    drive_tbw: float | None
    steps_to_exhaust: float | None  # steps until the rated TBW is written (None: TBW unknown, or no writes)
    endurance_days: float | None  # those steps back to back at the step-time lower bound: the shortest life
    lifetime_months: float  # how long the drive should last
    lasts: bool | None  # the drive lasts lifetime_months (None: TBW unknown)
    tbw_for_lifetime: float | None  # TB the lifetime writes at this rate (None: TBW unknown is fine too)
    commit_every_for_lifetime: int | None  # the smallest commit_every (steps) that lasts lifetime_months
    fix: str | None = None  # what makes it last, when it does not


@dataclass(frozen=True)
class TorchBaseline:
    """The plain torch optimizer (the algorithm's torch class, ``torch.optim.AdamW`` by default) with everything on one device."""

    where: str
    weights: int
    grads: int
    optimizer: int
    total: int
    fits: bool | None


@dataclass(frozen=True)
class MemoryPlan:
    """Everything :func:`~tierstore.planner.plan_memory` computed; ``asdict`` gives the ``--json`` form."""

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
    verdict: str  # one of VERDICTS: does it fit
    fits: bool
    wear: str = ""  # the verdict's second half: how long the drive lasts under the commit policy
    shortfalls: tuple[Shortfall, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    drives: tuple[DriveShare, ...] = field(default=())  # several drives (plan_memory(drives=...)): each one's share
    striped: StripedStep | None = None  # and the step's disk time over them
    padded_numel: int = 0  # elements of the flat space per field, padding included (Layout.total_numel)
    param_align: int = 64  # elements every parameter's start is a multiple of (64; 256 with int8 blocks)
    optimizer: str = "adamw"  # the optimizer algorithm's registered name: its fields are the state
    options: tuple[str, ...] = ()  # its options that add a field ("amsgrad", "momentum")

    def to_dict(self) -> dict:
        """A JSON-able dict (all byte counts are ints, times in seconds)."""
        return asdict(self)
