"""The shard store against a plain dict: reads always return the last write.

Whatever the tier of a shard (resident in RAM or streamed from a file through
the arena), whatever order shards are visited in and however deep the
prefetch queue is, a read of a shard returns the bytes of the last committed
write of that shard. The machine drives :class:`~tierstore._storage.store.ShardStore`
and :class:`~tierstore._storage.pipeline.ShardPipeline` the way the optimizer does:
every mutating pass is followed by ``commit``.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierstore._layout.budget import plan_tiers
from tierstore._layout.layout import FIELD_ORDER, Layout
from tierstore._storage.pipeline import ShardPipeline
from tierstore._storage.store import ShardStore

BACKENDS = ("direct", "buffered", "mmap")


def values_for(shard: int, numel: int, seed: int) -> torch.Tensor:
    """Reproducible fp32 contents of one shard for one write."""
    gen = torch.Generator().manual_seed(seed * 100_003 + shard)
    return torch.randn(numel, generator=gen)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


class StoreMachine(RuleBasedStateMachine):
    """A store plus a dict ``shard -> expected fp32 contents``."""

    def __init__(self) -> None:
        super().__init__()
        self.dir: str | None = None
        self.store: ShardStore | None = None
        self.model: dict[int, torch.Tensor] = {}
        self.step = 0

    # -- set-up ---------------------------------------------------------
    @initialize(
        sizes=st.lists(st.integers(1, 12_000), min_size=1, max_size=5),
        shard_numel=st.integers(1024, 4096),
        fields=st.lists(st.sampled_from(FIELD_ORDER), min_size=1, max_size=4, unique=True),
        budget=st.sampled_from(("arena", "partial", "none")),
        fraction=st.floats(0, 1),
        backend=st.sampled_from(BACKENDS),
        depth=st.integers(1, 4),
        io_workers=st.integers(1, 3),
        request_kib=st.sampled_from((4, 64, 128, 8192)),
        durable=st.sampled_from((True, False)),
    )
    def open_store(self, sizes, shard_numel, fields, budget, fraction, backend, depth, io_workers, request_kib, durable):
        if budget != "none":
            # Make sure the state outgrows the arena, so shards really stream from disk.
            sizes = [*sizes, (depth + 3) * shard_numel]
        params = [torch.zeros(n, requires_grad=True) for n in sizes]
        self.layout = Layout.build([params], shard_numel=shard_numel, fields=fields)
        self.slots = depth + 2
        self.depth = depth
        self.backend = backend
        self.io_workers = io_workers
        self.request_bytes = request_kib << 10
        self.durable = durable
        self.dir = tempfile.mkdtemp(prefix="tierstore-stateful-")
        self._open(self._budget(budget, fraction), committed=None)
        event(f"open: budget={budget}, disk shards: {bool(self.store.plan.disk_shards)}")
        # Give every shard known contents, as the optimizer's first pass does.
        self._write(list(range(len(self.layout.shards))), seed=0, partial=False)

    def _budget(self, kind: str, fraction: float) -> int | None:
        arena = self.slots * self.layout.slot_nbytes
        if kind == "none":
            return None
        if kind == "arena":
            return arena
        return arena + int(fraction * self.layout.state_nbytes)

    def _open(self, budget: int | None, *, committed: list[dict] | None) -> None:
        plan = plan_tiers(self.layout, ram_budget=budget, arena_slots=self.slots)
        self.store = ShardStore(
            self.layout,
            plan,
            directory=self.dir,
            backend=self.backend,
            io_workers=self.io_workers,
            request_bytes=self.request_bytes,
            durable=self.durable,
        ).open(committed=committed)
        self.pipeline = ShardPipeline(self.store, prefetch_depth=min(self.depth, max(1, self.slots - 1)))

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------
    def _nfloats(self, index: int) -> int:
        return self.store.entries[index].nbytes // 4

    def _write(self, order: list[int], *, seed: int, partial: bool) -> None:
        """One mutating pass over ``order``, then commit (what a step does)."""
        written: dict[int, torch.Tensor] = {}

        def update(shard, flat: torch.Tensor) -> None:
            new = values_for(shard.index, flat.numel(), seed)
            if partial:
                # Read-modify-write: change a slice, keep the rest as read.
                lo = (seed + shard.index) % flat.numel()
                hi = min(flat.numel(), lo + 1 + seed % 3000)
                flat[lo:hi] = new[lo:hi]
            else:
                flat.copy_(new)
            written[shard.index] = flat.clone()

        stats = self.pipeline.run(order, update, read=partial)
        assert stats.shards == len(order)
        assert sorted(stats.order) == sorted(order), "every shard is visited exactly once"
        self.step += 1
        self.store.commit(self.step)
        for index in order:
            if partial:
                expected = self.model[index].clone()
                lo = (seed + index) % expected.numel()
                hi = min(expected.numel(), lo + 1 + seed % 3000)
                expected[lo:hi] = values_for(index, expected.numel(), seed)[lo:hi]
            else:
                expected = values_for(index, self._nfloats(index), seed)
            assert same_bits(written[index], expected), f"shard {index} was handed stale bytes to update"
            self.model[index] = expected

    # -- rules -------------------------------------------------------------
    def _draw_order(self, data) -> list[int]:
        n = len(self.layout.shards)
        subset = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n), label="shards")
        return data.draw(st.permutations(subset), label="order")

    @rule(data=st.data(), seed=st.integers(1, 2**20), partial=st.booleans())
    def write(self, data, seed, partial):
        self._write(self._draw_order(data), seed=seed, partial=partial)

    @rule(data=st.data())
    def read(self, data):
        self._read(self._draw_order(data))

    @rule(data=st.data())
    def read_everything(self, data):
        self._read(data.draw(st.permutations(range(len(self.layout.shards))), label="order"))

    def _read(self, order: list[int]) -> None:
        seen: dict[int, torch.Tensor] = {}

        def visit(shard, flat):
            seen[shard.index] = flat.clone()

        stats = self.pipeline.run(order, visit, write=False)
        tiers = sorted({self.store.entries[i].tier for i in order})
        event(f"read: tiers {tiers}, durable={self.durable}, cache hits: {stats.cache_hits > 0}")
        assert sorted(seen) == sorted(order)
        for index in order:
            assert same_bits(seen[index], self.model[index]), (
                f"shard {index} ({self.store.entries[index].tier}) does not hold its last write"
            )

    @rule(data=st.data())
    def read_and_write_back_unchanged(self, data):
        """A pass that reads, touches nothing and writes back must change nothing."""
        order = self._draw_order(data)
        self.pipeline.run(order, lambda shard, flat: None)
        self.step += 1
        self.store.commit(self.step)

    @rule(depth=st.integers(1, 4))
    def new_pipeline(self, depth):
        """A fresh pipeline (another prefetch depth, an empty arena cache) sees the same bytes."""
        self.pipeline = ShardPipeline(self.store, prefetch_depth=min(depth, max(1, self.slots - 1)))

    @rule()
    def forget_arena_cache(self):
        self.pipeline.invalidate()

    @precondition(lambda self: self.store is not None and self.durable)
    @rule(data=st.data(), seed=st.integers(1, 2**20))
    def aborted_write_leaves_committed_disk_state(self, data, seed):
        """Durable: a pass that is aborted instead of committed leaves disk shards as committed."""
        disk = [e.index for e in self.store.entries if e.tier == "disk"]
        if not disk:
            return
        subset = data.draw(st.lists(st.sampled_from(disk), unique=True, min_size=1), label="disk shards")

        def update(shard, flat):
            flat.copy_(values_for(shard.index, flat.numel(), seed))

        self.pipeline.run(subset, update, read=False)
        self.store.abort()
        self.pipeline.invalidate()  # the slots hold the aborted bytes

    @rule(budget=st.sampled_from(("arena", "partial", "none")), fraction=st.floats(0, 1))
    def close_and_reopen(self, budget, fraction):
        """State survives close and reopen, even when the new budget moves shards between tiers."""
        if not self.durable:
            # Without durability, resident shards reach the files at a clean close.
            self.store.flush_resident()
            self.step += 1
            self.store.commit(self.step)
        event("close_and_reopen")
        records = self.store.records()
        self.store.close()
        self.store = None
        self._open(self._budget(budget, fraction), committed=records)

    @invariant()
    def entries_match_plan(self):
        if self.store is None:
            return
        resident = set(self.store.plan.resident)
        assert all((e.tier == "ram") == (e.index in resident) for e in self.store.entries)


StoreMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreMachine = StoreMachine.TestCase


def test_flush_resident_without_files(tmp_path) -> None:
    layout = Layout.build([[torch.zeros(100, requires_grad=True)]], shard_numel=1024, fields=("exp_avg",))
    plan = plan_tiers(layout, ram_budget=None, arena_slots=3)
    with ShardStore(layout, plan, directory=tmp_path, backend="buffered", durable=False) as store:
        store.resident_buffer(0).fill_(1.5)
        store.flush_resident()
        store.commit(1)
        records = store.records()
    again = ShardStore(layout, plan, directory=tmp_path, backend="buffered").open(committed=records)
    try:
        assert bool((again.resident_buffer(0) == 1.5).all())
    finally:
        again.close()
