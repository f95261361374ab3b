"""Moving a state onto another set of directories (more drives, fewer, others), shard by shard within a RAM budget.

:func:`move_state` is ``tierstore move SRC... --to DST...``. It locks the
source's directories (as an optimizer does, writing nothing there) and reads
each shard's committed copy, verified against its checksum, into one reader
buffer; copies it into one of a few arena slots and writes it, through a
:class:`~tierstore._storage.store.ShardStore` over the destination, to the
drive the destination's placement gives it (by the destination drives'
bandwidths: given, or probed). A write computes the bytes' checksum again and
must find the source's. Then (unless ``verify=False``) every shard is read
back from the destination and checked, the destination's files (and each
drive's new names) are synced, and the destination's manifest is written: the
one commit point. Until it is, the destination holds no state (a killed move
leaves files a new move overwrites), and the source is never written: a move
killed at any instant leaves the source resumable as it was.

The destination's manifest is the source's (layout and fingerprint, steps,
param groups, durability, the last run's ``ram_budget``) with the
destination's shard records (copy 0 of each shard, its checksum), its own
drive record (a new id and placement) and no previous commit to roll back to.

RAM: the reader's buffer and ``slots`` arena slots, each the size of the
largest shard's extent (:func:`move_slots` from a byte budget).

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> src, a, b = tempfile.mkdtemp(), tempfile.mkdtemp(), tempfile.mkdtemp()
>>> w = torch.nn.Parameter(torch.ones(5000)); w.grad = torch.ones(5000)
>>> with TieredAdamW([w], state_dir=src, shard_numel=1024) as opt:
...     _ = opt.step()
>>> moved = move_state(src, [a, b], ram_budget=1 << 20, bandwidths=[1e9, 1e9])
>>> moved.shards, moved.drive_bytes
(5, [24576, 16384])
>>> with TieredAdamW([w], state_dir=[a, b], shard_numel=1024, resume=True) as opt:
...     opt.step_count
1
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._layout.budget import TierPlan
from .._storage.shard_transfer import ShardTransfer
from .._storage.store import ShardStore
from ..errors import BudgetError, ConfigError, CorruptStateError, StateExistsError
from ..sizes import format_size
from .drives import DriveSet, state_dir_paths
from .reader import StateReader
from .statedir import MANIFEST

__all__ = ["MoveResult", "move_slots", "move_state", "MAX_MOVE_SLOTS"]

MAX_MOVE_SLOTS = 16  # writes in flight: beyond a few per drive they only take RAM


@dataclass(frozen=True)
class MoveResult:
    """What a move did."""

    step_count: int
    shards: int
    nbytes: int  # bytes of state moved (one copy)
    drive_bytes: list[int]  # bytes placed on each destination drive
    slots: int
    seconds: float
    verified: bool


def move_slots(ram_budget: int, slot_nbytes: int) -> int:
    """Arena slots a move may use within ``ram_budget`` bytes: the budget less the reader's buffer, in slots.

    Raises
    ------
    BudgetError
        If the budget cannot hold the reader's buffer and one slot, naming the least.

    Example
    -------
    >>> move_slots(64 << 20, 16 << 20)
    3
    """
    slots = min(MAX_MOVE_SLOTS, ram_budget // max(1, slot_nbytes) - 1)
    if slots < 1:
        need = 2 * slot_nbytes
        raise BudgetError(
            f"--ram-budget {format_size(ram_budget)} cannot hold a move's two buffers of the largest shard "
            f"({format_size(slot_nbytes)} each); give at least {need} bytes ({format_size(need)})"
        )
    return slots


def _refuse_overlap(sources: Sequence[Path], destinations: Sequence[Path]) -> None:
    """A destination may be neither a source's directory nor inside one (the source must stay as it is)."""
    for dst in destinations:
        real = os.path.realpath(dst)
        for src in sources:
            home = os.path.realpath(src)
            if real == home or real.startswith(home.rstrip("/") + "/"):
                raise ConfigError(
                    f"--to {str(dst)!r} is {'the' if real == home else 'inside the'} source directory {str(src)!r}; "
                    "a move leaves the source untouched: pass destination directories outside it"
                )


def move_state(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    destinations: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    ram_budget: int = 256 << 20,
    backend: str = "auto",
    bandwidths: Sequence[float] | None = None,
    io_workers: int = 4,
    verify: bool = True,
    progress: Callable[[int], object] | None = None,
) -> MoveResult:
    """Copy the committed state of ``source`` into ``destinations`` (see the module docs) and commit it there.

    Parameters
    ----------
    source
        The state: its home directory (its other drives found where its
        manifest recorded them), or all of its directories, home first.
    destinations
        The new directories, one per drive, the new home first: each missing,
        empty, or holding only what a killed move left (no manifest).
    ram_budget
        Bytes of RAM for the reader's buffer and the arena slots.
    backend, io_workers
        The destination's I/O (``"auto"`` per drive).
    bandwidths
        Bytes/s per destination directory, for the placement (``None``: a
        quick probe of each drive).
    verify
        Read every shard back from the destination before committing it.
    progress
        Called with the bytes of each shard read (from the source, and back).

    Raises
    ------
    ConfigError
        A destination is the source or inside it; bad bandwidths.
    BudgetError
        ``ram_budget`` below two of the largest shard.
    StateDirInUseError
        An open optimizer holds the source or a destination.
    StateExistsError
        A destination holds a committed state (its manifest) or another run's files.
    DriveSetError
        The source's drives are not all there, or a destination is another state's drive.
    CorruptStateError
        The source fails a checksum, or a destination does not read back what was written.
    """
    t0 = time.perf_counter()
    sources = state_dir_paths(source, name="source")
    targets = state_dir_paths(destinations, name="--to")
    if sources is None or targets is None:
        raise ConfigError("move needs a source state directory and at least one destination (--to DIR ...)")
    _refuse_overlap(sources, targets)
    with StateReader(sources, lock=True) as reader:
        _refuse_overlap(reader.paths, targets)  # the drives found through the manifest too
        if not reader.clean:
            raise CorruptStateError(
                f"{reader.path} was written with durable=False by a run that did not close() cleanly: its files "
                "mix several steps, so there is no consistent state to move"
            )
        layout = reader.layout
        slots = move_slots(ram_budget, layout.slot_nbytes)
        drives = _open_destination(targets)
        try:
            placement = drives.choose_placement(layout, backend=backend, bandwidths=bandwidths)
            durable = bool(reader.manifest.get("durable"))
            every = tuple(range(len(layout.shards)))
            plan = TierPlan((), every, slots, layout.slot_nbytes, 0, 0, layout.state_nbytes, ram_budget)
            store = ShardStore(layout, plan, drives=[(d.path, d.fd) for d in drives.dirs], placement=placement,
                               backend=backend, io_workers=io_workers, pin=False, durable=durable)  # fmt: skip
            with store.open():
                _copy(reader, store, slots, progress)
                if verify:
                    _read_back(store, slots, progress)
                store.commit(reader.step_count, sync=True)
                body = _manifest(reader, store, drives)
                drives.home.write_manifest(body)
                shares = [nbytes for _, _, nbytes, _ in store.drive_shares()]
        except BaseException:
            drives.close(discard=True)
            raise
        drives.close()
    return MoveResult(reader.step_count, len(layout.shards), layout.state_nbytes, shares, slots,
                      time.perf_counter() - t0, verify)  # fmt: skip


def _open_destination(targets: list[Path]) -> DriveSet:
    drives = DriveSet(targets)
    try:
        home = drives.open_home(create=True)
        if home.exists(MANIFEST):
            raise StateExistsError(
                f"--to {str(targets[0])!r} already holds a committed state (its manifest): a move never "
                "overwrites one. Pass empty or new directories (delete that state first if you no longer need it)"
            )
        drives.open_members(None, resume="auto")  # leftovers of a killed move are overwritten, nothing else
    except BaseException:
        drives.close(discard=True)
        raise
    return drives


def _copy(reader: StateReader, store: ShardStore, slots: int, progress: Callable[[int], object] | None) -> None:
    """Every shard's committed extent (verified on read) into its destination drive; each write's checksum
    must be the source's."""
    in_flight: list[tuple[int, ShardTransfer] | None] = [None] * slots

    def settle(slot: int) -> None:
        pending = in_flight[slot]
        if pending is None:
            return
        index, transfer = pending
        transfer.wait()
        _, _, written = store.books_of(index)
        expected = reader.records[index]["checksum"]
        if written is None or written[1] != expected:
            raise CorruptStateError(
                f"shard {index} was written to {store.file_path(written[0] if written else 0, store.entries[index].drive)} "
                f"with checksum {written[1] if written else None}, the source's is {expected}: the bytes changed in "
                "RAM or on the way; nothing was committed. Run the move again"
            )
        in_flight[slot] = None

    try:
        for index in range(len(store.entries)):
            slot = index % slots
            settle(slot)
            extent = reader.read_extent(index)  # verified against the source's committed checksum
            nbytes = store.entries[index].nbytes
            store.slot_buffer(slot, nbytes).copy_(extent[: nbytes // 4])
            in_flight[slot] = (index, store.write(index, slot))
            if progress is not None:
                progress(nbytes)
        for slot in range(slots):
            settle(slot)
    finally:  # no worker may still read a slot once this returns, even on an error
        for pending in in_flight:
            if pending is not None:
                with contextlib.suppress(Exception):  # the first error is the one raised
                    pending[1].wait()


def _read_back(store: ShardStore, slots: int, progress: Callable[[int], object] | None) -> None:
    """Read every shard back from the destination and check it against the checksum its write computed."""
    reads: list[ShardTransfer | None] = [None] * slots
    try:
        for index in range(len(store.entries)):
            slot = index % slots
            if reads[slot] is not None:
                reads[slot].wait()
            reads[slot] = store.read(index, slot)
            if progress is not None:
                progress(store.entries[index].nbytes)
        for slot in range(slots):
            if reads[slot] is not None:
                reads[slot].wait()
                reads[slot] = None
    finally:
        for transfer in reads:
            if transfer is not None:
                with contextlib.suppress(Exception):  # the first error is the one raised
                    transfer.wait()


def _manifest(reader: StateReader, store: ShardStore, drives: DriveSet) -> dict:
    """The source's manifest with the destination's shard records and drives, and no commit to roll back to."""
    from .._version import __version__

    body = {k: v for k, v in reader.manifest.items() if k not in ("format", "format_version", "manifest_checksum")}
    body["shards"] = store.records()
    body["previous"] = None
    body["backend"] = store.backend_name
    body["tierstore_version"] = __version__
    body["committed_at"] = time.time()
    body.pop("drives", None)
    record = drives.manifest_record(store.backend_names)
    if record is not None:
        body["drives"] = record
    return body
