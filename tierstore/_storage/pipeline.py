"""Streaming shards through the arena: read ahead, update, write behind.

:meth:`ShardPipeline.run` visits a list of shards and calls ``update(shard,
buffer)`` on each with its fp32 bytes: resident shards in place, disk shards
after they were read into an arena slot. Up to ``prefetch_depth`` reads are
in flight ahead of the update, and each updated slot is written back behind
it while the next shards are processed. Resident shards are updated while
the first reads are in flight, so their compute hides I/O too.

The arena doubles as a small cache: the shards processed last stay in their
slots after their writes finished, and the next run takes them from there
without reading them again (a step visits them first). The order of visits
never changes results: every shard is updated exactly once per run.

Example
-------
>>> import tempfile, torch
>>> from tierstore._layout.layout import Layout
>>> from tierstore._layout.budget import plan_tiers
>>> from tierstore._storage.store import ShardStore
>>> w = torch.zeros(8192, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg",))
>>> plan = plan_tiers(layout, ram_budget=16 << 10, arena_slots=3)
>>> store = ShardStore(layout, plan, directory=tempfile.mkdtemp(), backend="buffered").open()
>>> pipe = ShardPipeline(store, prefetch_depth=1)
>>> _ = pipe.run(range(8), lambda shard, buf: buf.fill_(shard.index), read=False)
>>> seen = []
>>> _ = pipe.run(range(8), lambda shard, buf: seen.append(int(buf[0])), write=False)
>>> sorted(seen)
[0, 1, 2, 3, 4, 5, 6, 7]
>>> store.close()
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .._layout.layout import ShardSpec
from ..errors import ConfigError
from .shard_transfer import ShardTransfer
from .store import ShardStore

UpdateFn = Callable[[ShardSpec, torch.Tensor], object]


@dataclass
class RunStats:
    """Where one :meth:`ShardPipeline.run` spent its time (seconds, main thread)."""

    shards: int = 0
    reads: int = 0
    cache_hits: int = 0
    writes: int = 0
    read_wait: float = 0.0
    update: float = 0.0
    write_wait: float = 0.0
    persist_wait: float = 0.0  # waiting for a commit to finish writing a resident shard
    commit_wait: float = 0.0  # waiting for a commit to finish before overwriting a stale copy
    bytes_read: int = 0
    bytes_written: int = 0
    total: float = 0.0
    order: list[int] = field(default_factory=list)


class ShardPipeline:
    """Ordered, bounded read-ahead/write-behind over a :class:`ShardStore`.

    Parameters
    ----------
    store
        An open store.
    prefetch_depth
        Reads in flight ahead of the shard being updated (at most
        ``arena_slots - 1``, so one slot stays free for the update).

    Raises
    ------
    ConfigError
        If ``prefetch_depth`` < 1.
    """

    def __init__(self, store: ShardStore, *, prefetch_depth: int) -> None:
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            raise ConfigError(f"prefetch_depth={prefetch_depth!r} must be an int >= 1, e.g. 2")
        self.store = store
        self.depth = prefetch_depth
        slots = store.arena_slots
        self._content: list[int | None] = [None] * slots  # shard whose current bytes a slot holds
        self._slot_of: dict[int, int] = {}

    def invalidate(self) -> None:
        """Forget what the slots hold (after the files changed behind the arena's back)."""
        self._content = [None] * self.store.arena_slots
        self._slot_of.clear()

    def _assign(self, slot: int, shard: int | None) -> None:
        old = self._content[slot]
        if old is not None:
            self._slot_of.pop(old, None)
        self._content[slot] = shard
        if shard is not None:
            self._slot_of[shard] = slot

    def run(
        self,
        shards: Iterable[int],
        update: UpdateFn,
        *,
        read: bool = True,
        write: bool = True,
        before_write: Callable[[], float] | None = None,
    ) -> RunStats:
        """Call ``update(shard, buffer)`` once for every shard index in ``shards``.

        ``read=False`` skips reading disk shards (``update`` fills the slot from
        scratch); ``write=False`` skips writing them back (read-only visits).
        ``before_write`` runs once before the first disk shard is written (it
        returns the seconds it waited): a commit in flight must be durable
        before a stale copy is overwritten. Resident shards are claimed from
        the store before a writing visit (a commit may still be writing them).
        On an error every transfer in flight is awaited before it propagates,
        so no slot is written into after ``run`` returns.
        """
        stats = RunStats()
        t_start = time.perf_counter()
        store = self.store
        layout = store.layout
        order = list(shards)
        ram = [i for i in order if store.is_resident(i)]
        disk = [i for i in order if not store.is_resident(i)]
        if not read:
            for i in disk:  # about to be overwritten from scratch: cached bytes are stale
                if i in self._slot_of:
                    self._assign(self._slot_of[i], None)
        hits = [i for i in disk if i in self._slot_of]
        misses = deque(i for i in disk if i not in self._slot_of)
        n_slots = store.arena_slots
        ready = {self._slot_of[i] for i in hits}  # slots whose bytes are waiting to be updated
        writing: deque[tuple[int, ShardTransfer]] = deque()  # slots being written, oldest first
        reading: deque[tuple[int, int, ShardTransfer | None]] = deque()  # (shard, slot, transfer)
        in_flight: set[int] = set()
        gate = [before_write]  # called once, before the first write

        def take_slot(block: bool) -> int | None:
            for k in range(n_slots):
                if k not in ready and k not in in_flight and all(k != w for w, _ in writing):
                    return k
            if writing and (block or writing[0][1].done()):
                k, transfer = writing.popleft()
                t0 = time.perf_counter()
                transfer.wait()
                stats.write_wait += time.perf_counter() - t0
                return k
            return None

        def issue_reads(block: bool = True) -> None:
            """Start reads up to the depth; ``block=False`` never waits for a write to free a slot."""
            while misses and len(reading) < self.depth:
                k = take_slot(block)
                if k is None:
                    return
                shard = misses.popleft()
                self._assign(k, shard)
                in_flight.add(k)
                transfer = store.read(shard, k) if read else None
                if read:
                    stats.reads += 1
                    stats.bytes_read += store.entries[shard].nbytes
                reading.append((shard, k, transfer))

        def visit(shard: int, buffer: torch.Tensor) -> None:
            t0 = time.perf_counter()
            update(layout.shards[shard], buffer)
            stats.update += time.perf_counter() - t0
            stats.shards += 1
            stats.order.append(shard)

        def finish_slot(shard: int, k: int) -> None:
            if write:
                if gate[0] is not None:
                    stats.commit_wait += gate[0]()
                    gate[0] = None
                writing.append((k, store.write(shard, k)))
                stats.writes += 1
                stats.bytes_written += store.entries[shard].nbytes

        try:
            issue_reads()
            for i in ram:
                if write:
                    t0 = time.perf_counter()
                    buffer = store.claim_resident(i)
                    stats.persist_wait += time.perf_counter() - t0
                else:
                    buffer = store.resident_buffer(i)
                visit(i, buffer)
            for i in hits:
                k = self._slot_of[i]
                stats.cache_hits += 1
                visit(i, store.slot_buffer(k, store.entries[i].nbytes))
                ready.discard(k)
                finish_slot(i, k)
                issue_reads()
            while reading or misses:
                if not reading:
                    issue_reads()
                    if not reading:  # cannot happen: a slot frees once writes drain
                        raise RuntimeError("tierstore pipeline stalled; this is a bug")
                shard, k, transfer = reading.popleft()
                if transfer is not None:
                    t0 = time.perf_counter()
                    transfer.wait()
                    stats.read_wait += time.perf_counter() - t0
                in_flight.discard(k)
                ready.add(k)
                issue_reads(block=False)  # keep the queue full, but never delay a ready shard
                visit(shard, store.slot_buffer(k, store.entries[shard].nbytes))
                ready.discard(k)
                finish_slot(shard, k)
                issue_reads()
            t0 = time.perf_counter()
            while writing:
                _, transfer = writing.popleft()
                transfer.wait()
            stats.write_wait += time.perf_counter() - t0
        except BaseException:
            # Let every request finish before anyone reuses the slots, then forget
            # the cache: a slot's bytes may no longer match its shard's file.
            for _, _, transfer in reading:
                if transfer is not None:
                    _quiet_wait(transfer)
            for _, transfer in writing:
                _quiet_wait(transfer)
            self.invalidate()
            raise
        stats.total = time.perf_counter() - t_start
        return stats


def _quiet_wait(transfer: ShardTransfer) -> None:
    with contextlib.suppress(BaseException):  # the first error is already propagating
        transfer.wait()
