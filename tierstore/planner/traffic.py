"""Bytes moved per step, the step-time lower bound, and the drive's wear under a commit policy.

What a step and a commit write (as the store does it):

- streamed (on-disk) shards are written every step: each step's update
  writes them back, on the step's critical path;
- a durable commit writes the resident shards that changed since their last
  write (the store keeps a dirty flag per shard; every shard with a gradient
  changes every step, so that is every resident shard), and the manifest,
  in the background while the loop computes;
- so the drive takes, per step, ``streamed + (resident + manifest) /
  steps_per_commit``. ``commit_every="auto"`` is assumed to commit every
  step (it does when the drive keeps up: the most wear); a duration commits
  every ``duration / step time`` steps at the step-time lower bound.

Days to the drive's rated endurance count back-to-back steps at the
lower-bound step time: the shortest life the drive can have at this write
volume. The ``commit_every`` for a lifetime is the smallest step count whose
writes the rating affords for that long.

Example
-------
>>> commit_interval(CommitPolicy.parse((100, "10min")), step_seconds=30.0)  # 10 min is 20 steps of 30 s
20.0
>>> lifetime_commit_every(streamed=0, commit=1000, affordable=10.0)  # 1000 B per commit, 10 B a step
100
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .._layout.budget import TierPlan
from .._state.commit_policy import CommitPolicy
from ..sizes import format_size
from .report import both_units, days_text
from .results import GB, TB, Bandwidth, Endurance, StepTime, Traffic

__all__ = [
    "STEP_TIME_FORMULA",
    "SECONDS_PER_DAY",
    "FIXED_STEP_SECONDS",
    "DAYS_PER_MONTH",
    "AUTO_ASSUMPTION",
    "manifest_nbytes",
    "commit_interval",
    "describe_policy",
    "step_time",
    "lifetime_commit_every",
    "at",
    "fix",
    "summary",
]

SECONDS_PER_DAY = 86_400
DAYS_PER_MONTH = 365.25 / 12
STEP_TIME_FORMULA = (
    "max(disk_read/read_bw + disk_write/write_bw, max(pcie_down, pcie_up)/pcie_bw, "
    "trainable/update_rate, state/memory_copy_bw, fixed)"
)
# A step's fixed cost, whatever the model's size: Python, the update threads' hand-offs, the
# step's bookkeeping. Measured at 5-10 ms for a 1,000-parameter TieredAdamW on the 2-core dev
# machine; 100 us is well below that, a floor that keeps a tiny model's bound (and its drive
# wear, counted in back-to-back steps) from claiming nanosecond steps.
FIXED_STEP_SECONDS = 100e-6
AUTO_ASSUMPTION = (
    "commit_every='auto' is assumed to commit every step for drive wear (it does when the drive keeps up "
    "with the loop, and commits less often when it does not)"
)
# The manifest, measured (a state directory per case): about 1 KiB, plus 190 B per shard
# (its copy and checksum) and 110 B per parameter tensor (its layout entry and step).
# Rounded up: the wear estimate errs on the side of more writes.
_MANIFEST_BASE, _MANIFEST_PER_SHARD, _MANIFEST_PER_PARAM = 1024, 192, 128


def manifest_nbytes(*, shards: int, params: int) -> int:
    """Bytes one commit's manifest takes, estimated from measured ones.

    >>> manifest_nbytes(shards=1669, params=1)
    321600
    """
    return _MANIFEST_BASE + _MANIFEST_PER_SHARD * shards + _MANIFEST_PER_PARAM * params


def commit_interval(policy: CommitPolicy, *, step_seconds: float) -> float:
    """Steps between two commits under ``policy`` at ``step_seconds`` a step (at least 1).

    ``"auto"``: 1 (assumed; see :data:`AUTO_ASSUMPTION`). A step count and a
    duration: whichever comes first. A commit never comes more than once a step.
    """
    if policy.auto:
        return 1.0
    intervals = []
    if policy.steps is not None:
        intervals.append(float(policy.steps))
    if policy.seconds is not None:
        intervals.append(max(1.0, policy.seconds / step_seconds))
    return min(intervals)


def describe_policy(policy: CommitPolicy) -> str:
    """``policy`` as ``commit_every=`` takes it again.

    >>> describe_policy(CommitPolicy.parse("auto")), describe_policy(CommitPolicy.parse((100, "10min")))
    ("'auto'", "(100, '10min')")
    """
    if policy.auto:
        return "'auto'"
    duration = None
    if policy.seconds is not None:
        s = policy.seconds
        duration = f"'{s / 3600:g}h'" if s % 3600 == 0 else f"'{s / 60:g}min'" if s % 60 == 0 else f"'{s:g}s'"
    if policy.steps is not None and duration is not None:
        return f"({policy.steps}, {duration})"
    return str(policy.steps) if duration is None else duration


def step_time(
    *, disk_read: int, disk_write: int, pcie_down: int, pcie_up: int, bandwidth: Bandwidth, trainable: int, state: int,
    drives_seconds: float | None | bool = False,
) -> StepTime:
    """The step-time lower bound :data:`STEP_TIME_FORMULA` over the terms whose bandwidth is known.

    Reads and writes share the drive (their times add); PCIe is full duplex
    (the larger direction counts); the CPU update and memory streaming
    overlap the I/O; no step is faster than :data:`FIXED_STEP_SECONDS`.
    ``disk_write`` is the streamed shards only: commits write in the
    background. A term whose bandwidth is unknown is ``None``. Over several
    drives (:mod:`tierstore.planner.drives`) ``drives_seconds`` is the disk
    term (the slowest drive's share; ``None``: unknown) instead of ``bandwidth``'s.
    """
    bw = bandwidth
    disk = None
    if disk_read == 0 and disk_write == 0:
        disk = 0.0
    elif drives_seconds is not False:
        disk = drives_seconds  # type: ignore[assignment]
    elif bw.read_gbps and bw.write_gbps:
        disk = disk_read / (bw.read_gbps * GB) + disk_write / (bw.write_gbps * GB)
    pcie = None
    if pcie_down == 0 and pcie_up == 0:
        pcie = 0.0
    elif bw.pcie_gbps:
        pcie = max(pcie_down, pcie_up) / (bw.pcie_gbps * GB)
    update = trainable / (bw.update_gparams * GB)
    memory = state / (bw.memory_gbps * GB) if bw.memory_gbps else None
    terms = {"disk": disk, "pcie": pcie, "update": update, "memory": memory, "fixed cost": FIXED_STEP_SECONDS}
    bound_by, lower = max(((k, v) for k, v in terms.items() if v is not None), key=lambda kv: kv[1])
    return StepTime(disk=disk, pcie=pcie, update=update, memory=memory, fixed=FIXED_STEP_SECONDS, lower_bound=lower,
                    bound_by=bound_by, formula=STEP_TIME_FORMULA)  # fmt: skip


def lifetime_commit_every(*, streamed: int, commit: int, affordable: float) -> int | None:
    """The smallest ``commit_every`` N whose writes a step, ``streamed + commit / N``, are at most ``affordable``.

    ``None`` when the streamed shards alone write what the drive affords or more.
    """
    room = affordable - streamed  # bytes a step may spend on commits
    if room <= 0:
        return None
    n = max(1, math.ceil(commit / room))
    # The same expression decides whether a plan at N lasts (_endurance): make N exact against it.
    while streamed + commit / n > affordable:
        n += 1
    while n > 1 and streamed + commit / (n - 1) <= affordable:
        n -= 1
    return n


def at(
    tiers: TierPlan,
    *,
    pcie: int,
    bandwidth: Bandwidth,
    trainable: int,
    durable: bool,
    policy: CommitPolicy,
    manifest: int,
    drive_tbw: float | None,
    lifetime_months: float,
    drives: Callable[[TierPlan], float | None] | None = None,
) -> tuple[Traffic, StepTime, Endurance]:
    """Traffic, step time and drive wear for the tier split ``tiers`` (``pcie``: bytes each way per step).

    ``drives``: over several drives, the step's disk seconds for a tier split
    (the slowest drive's share of its streamed shards).
    """
    streamed = tiers.disk_nbytes
    times = step_time(disk_read=streamed, disk_write=streamed, pcie_down=pcie, pcie_up=pcie, bandwidth=bandwidth,
                      trainable=trainable, state=tiers.state_nbytes,
                      drives_seconds=False if drives is None else drives(tiers))  # fmt: skip
    seconds = times.lower_bound
    resident = tiers.resident_nbytes if durable else 0
    commit = resident + manifest if durable else 0
    every = commit_interval(policy, step_seconds=seconds) if durable else None
    per_step = streamed + (commit / every if durable else 0)  # exact: a commit's share may be below a byte
    traffic = Traffic(
        pcie_down=pcie,
        pcie_up=pcie,
        disk_read=streamed,
        disk_write=math.ceil(per_step),
        streamed_write=streamed,
        commit_write=commit,
        resident_write=resident,
        manifest_write=manifest if durable else 0,
        commit_every=describe_policy(policy),
        steps_per_commit=every,
        commit_assumption=AUTO_ASSUMPTION if durable and policy.auto else None,
    )
    return traffic, times, _endurance(traffic, per_step, drive_tbw, seconds, lifetime_months, durable)


def _endurance(
    traffic: Traffic, write: float, drive_tbw: float | None, seconds: float, months: float, durable: bool
) -> Endurance:
    lifetime = months * DAYS_PER_MONTH * SECONDS_PER_DAY
    steps = days = need = every = None
    lasts = True if write == 0 else None
    if drive_tbw is not None and write > 0:
        steps = drive_tbw * TB / write
        days = steps * seconds / SECONDS_PER_DAY
        affordable = drive_tbw * TB * seconds / lifetime  # bytes a step the rating affords for the lifetime
        lasts = write <= affordable
        need = write * (lifetime / seconds) / TB
        if durable:
            every = lifetime_commit_every(streamed=traffic.streamed_write, commit=traffic.commit_write,
                                          affordable=affordable)  # fmt: skip
    return Endurance(
        writes_per_step=traffic.disk_write,
        writes_per_1000_steps=math.ceil(1000 * write),
        drive_tbw=drive_tbw,
        steps_to_exhaust=steps,
        endurance_days=days,
        lifetime_months=months,
        lasts=lasts,
        tbw_for_lifetime=need,
        commit_every_for_lifetime=every,
    )


def fix(
    traffic: Traffic, endurance: Endurance, *, durable: bool,
    more: tuple[int, tuple[Traffic, StepTime, Endurance]] | None = None,
) -> str:  # fmt: skip
    """What makes a drive that wears out early last: a larger commit_every, more RAM, a better drive.

    ``more`` is the largest ``ram_budget`` the host holds and the arithmetic at it.
    """
    e, months = endurance, f"{endurance.lifetime_months:g} months"
    fixes = []
    n = e.commit_every_for_lifetime
    if durable and n is not None and traffic.steps_per_commit is not None and n > traffic.steps_per_commit:
        fixes.append(f"commit_every={n} (a crash then loses up to {n} steps)")
    elif durable and traffic.resident_write:
        fixes.append(f"no commit_every helps: the streamed shards alone write {both_units(traffic.streamed_write)} "
                     "a step, more than the drive affords")  # fmt: skip
    if more is not None:
        budget, (t2, _, e2) = more
        what = f"ram_budget={format_size(budget)} ({budget} bytes) " + (
            "keeps all state resident and streams nothing" if t2.streamed_write == 0 else
            f"(the most this host holds) streams {both_units(t2.streamed_write)} a step")  # fmt: skip
        if e2.lasts:
            fixes.append(f"{what}: the drive lasts {months}")
        elif durable and e2.commit_every_for_lifetime is not None:
            fixes.append(f"{what}: with commit_every={e2.commit_every_for_lifetime} the drive lasts {months}")
    fixes.append(f"a drive rated {e.tbw_for_lifetime:,.0f} TBW or more (or the writes spread over several drives)")
    return "; or ".join(fixes)


def summary(endurance: Endurance, traffic: Traffic) -> str:
    """The verdict's drive-wear half, one phrase.

    >>> summary(Endurance(0, 0, 600.0, None, None, 36.0, True, None, None), None)
    'no drive writes while training'
    """
    e, months = endurance, f"{endurance.lifetime_months:g}-month"
    if e.writes_per_step == 0:
        return "no drive writes while training"
    if e.drive_tbw is None:
        return f"the drive takes {both_units(e.writes_per_step)} a step; its wear is unknown without its rated TBW (--drive-tbw)"
    policy = "" if traffic.steps_per_commit is None else f" at commit_every={traffic.commit_every}"
    life = days_text(e.endurance_days)
    if e.lasts:
        return f"the drive's {e.drive_tbw:g} TBW last {life}{policy}, beyond the {months} lifetime"
    return f"the drive WEARS OUT: its {e.drive_tbw:g} TBW last {life}{policy}, short of the {months} lifetime"
