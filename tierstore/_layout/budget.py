"""How a RAM budget splits into the streaming arena and resident shards (pure arithmetic).

The arena comes first: ``arena_slots`` slots, each big enough for the largest
shard's extent (its stored bytes, in the layout's moment format), plus the
staging buffers the update needs and, for a compressed format, the fp32
scratch a shard is decoded into (one, shared by every slot and resident
shard: one shard is updated or visited at a time). What is left of the
budget keeps whole shards resident in RAM, in shard order, stored in their
compressed form (so a compressed format keeps more of them); the rest live
on disk. With no budget, or a budget that holds all the state, everything
is resident and no arena (and no file) is needed.

Example
-------
>>> import torch
>>> from tierstore._layout.layout import Layout
>>> w = torch.zeros(10 * 1024, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> plan = plan_tiers(layout, ram_budget=40 << 10, arena_slots=3)  # 40 KiB
>>> plan.arena_slots, plan.resident, plan.disk_shards
(3, (0, 1), (2, 3, 4, 5, 6, 7, 8, 9))
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BudgetError, ConfigError
from ..sizes import format_size
from .layout import STATE_ITEMSIZE, Layout

MIN_ARENA_SLOTS = 2  # one slot computing while the next one is read

#: The fixed host RAM tierstore holds beyond ``ram_budget``, whatever the model size:
#: interpreter objects and library pages of its modules, thread stacks of the I/O
#: workers, per-shard records, small temporaries, the two gradient buckets of
#: ``attach`` on a GPU (2 x 4 MiB), a checkpoint's 1 MiB scratch, a DCP save's block
#: buffer (2 MiB per writer thread) or a DCP load's chunk in flight; with a compressed
#: format, once per process, the int8 lookup tables (2.3 MiB) and the library pages the
#: compiled kernel's load-time self-checks bring in (about 7 MiB). Measured as peak
#: RSS growth by ``tests/test_ram_budget.py``; the planner adds it to every total.
OVERHEAD_BYTES = 16 << 20  # 16 MiB


@dataclass(frozen=True)
class TierPlan:
    """The outcome: which shards are resident, and what RAM each part takes."""

    resident: tuple[int, ...]
    disk_shards: tuple[int, ...]
    arena_slots: int
    slot_nbytes: int
    staging_nbytes: int
    resident_nbytes: int
    state_nbytes: int
    ram_budget: int | None
    scratch_nbytes: int = 0  # fp32 scratch a compressed format decodes into

    @property
    def arena_nbytes(self) -> int:
        return self.arena_slots * self.slot_nbytes

    @property
    def ram_nbytes(self) -> int:
        """Host RAM the optimizer state uses: arena, staging, decode scratch and resident shards."""
        return self.arena_nbytes + self.staging_nbytes + self.scratch_nbytes + self.resident_nbytes

    @property
    def disk_nbytes(self) -> int:
        """Bytes of state kept on disk (one copy)."""
        return self.state_nbytes - self.resident_nbytes


def whole_state_text(layout: Layout) -> str:
    """How a state too small to stream is named in messages: its size and its shards.

    A state smaller than the streaming arena cannot stream (the arena alone
    would take more RAM than keeping every shard resident), so the smallest
    ``ram_budget`` that works is the whole state; messages say so in these words.

    Example
    -------
    >>> import torch
    >>> from tierstore._layout.layout import Layout
    >>> w = torch.zeros(110, requires_grad=True)
    >>> whole_state_text(Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq")))
    'the whole state (8.00 KiB, one 1,024-element shard)'
    """
    n = len(layout.shards)
    shards = (f"one {layout.max_capacity:,}-element shard" if n == 1 else
              f"{n:,} shards of up to {layout.max_capacity:,} elements")  # fmt: skip
    return f"the whole state ({format_size(layout.state_nbytes)}, {shards})"


def staging_nbytes(layout: Layout, buffers: int) -> int:
    """Bytes of ``buffers`` fp32 staging buffers, each as large as the largest shard."""
    return buffers * layout.max_capacity * STATE_ITEMSIZE


def plan_tiers(
    layout: Layout,
    *,
    ram_budget: int | None,
    arena_slots: int,
    staging_buffers: int = 0,
    workers: int = 1,
) -> TierPlan:
    """Split ``ram_budget`` into arena, staging, decode scratch and resident shards.

    ``workers`` is the most threads a compressed update runs on (its scratch
    holds a chunk per worker, :meth:`~tierstore._layout.layout.Layout.scratch_nbytes`).

    Raises
    ------
    BudgetError
        If the budget cannot hold the arena and staging buffers; the message
        gives the minimum budget and the knobs that lower it.
    ConfigError
        If ``arena_slots`` is below :data:`MIN_ARENA_SLOTS`.
    """
    if isinstance(arena_slots, bool) or not isinstance(arena_slots, int) or arena_slots < MIN_ARENA_SLOTS:
        raise ConfigError(f"arena_slots={arena_slots!r} must be an int >= {MIN_ARENA_SLOTS}")
    state = layout.state_nbytes
    sizes = [layout.shard_nbytes(s) for s in layout.shards]
    staging = staging_nbytes(layout, staging_buffers)
    scratch = layout.scratch_nbytes(workers)
    everything = tuple(range(len(sizes)))
    if ram_budget is None or state + staging + scratch <= ram_budget:
        return TierPlan(everything, (), 0, layout.slot_nbytes, staging, state, state, ram_budget, scratch)
    arena = arena_slots * layout.slot_nbytes
    if arena + staging + scratch > ram_budget:
        extras = (f" + {format_size(staging)} of staging" if staging else "") + (
            f" + {format_size(scratch)} of {layout.format.name} decode scratch" if scratch else "")  # fmt: skip
        if state < arena:  # it cannot stream: the arena alone takes more than keeping it all resident
            need = state + staging + scratch
            raise BudgetError(
                f"ram_budget={format_size(ram_budget)} ({ram_budget} bytes) cannot hold the state, and "
                f"{whole_state_text(layout)} is smaller than the streaming arena ({arena_slots} slots x "
                f"{format_size(layout.slot_nbytes)}), so it cannot stream either: give ram_budget at least "
                f"{need} bytes ({format_size(need)}: the state{extras}) so it stays in RAM, or ram_budget=None"
            )
        need = arena + staging + scratch
        raise BudgetError(
            f"ram_budget={format_size(ram_budget)} ({ram_budget} bytes) cannot hold the streaming "
            f"arena: {arena_slots} slots x {format_size(layout.slot_nbytes)}{extras} = {format_size(need)}. "
            f"Raise ram_budget to at least {need} bytes, or lower "
            f"shard_numel (now {layout.shard_numel}) or prefetch_depth"
        )
    left = ram_budget - arena - staging - scratch
    resident = []
    for index, size in enumerate(sizes):
        if size > left:
            break
        resident.append(index)
        left -= size
    resident_bytes = sum(sizes[i] for i in resident)
    kept = set(resident)
    disk = tuple(i for i in everything if i not in kept)
    return TierPlan(
        tuple(resident), disk, arena_slots, layout.slot_nbytes, staging, resident_bytes, state, ram_budget, scratch
    )
