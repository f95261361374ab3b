"""The shard store: every shard's bytes, in RAM (resident) or in files (disk tier).

The store owns the memory and the state files, and knows where each shard
is and which copy of it is committed. It does not decide the order of work:
:mod:`tierstore._storage.pipeline` streams disk shards through the arena slots the
store allocated.

Files. Each state file (``shards.0.bin``, and ``shards.1.bin`` when durable)
has one extent per shard at a fixed offset (shards in index order), so the
files do not depend on which shards are resident: a run may resume with
another ``ram_budget``. Only extents that will be written are allocated.
A state over several directories (drives) has these files in each: a
drive's files hold the shards placed on it (``placement``), back to back in
index order, and each drive has its own I/O queue
(:class:`~tierstore._storage.drive_files.DriveFiles`); a commit syncs every
drive's files, in parallel, before the caller publishes the manifest.

Durability. With ``durable=True`` every write goes into the copy that is
*not* committed: a streamed shard's each time it changes, a resident shard's
when a commit wants it (:meth:`persist_resident` writes the resident shards
changed since their last write). A shard written since the last commit is
read back from that newest copy. :meth:`commit` makes the writes durable and
only then adopts them, so the committed copy of every shard is never
overwritten before the manifest moves past it. A resident shard is changed
again only after its write finished (:meth:`claim_resident` waits). Without
durability, disk shards are rewritten in place and resident shards stay in
RAM until :meth:`flush_resident`.

Integrity. Every write computes the extent's checksum on the I/O workers;
every read recomputes it and compares with the committed one before the
bytes are used. A shard with no committed checksum is never read: its bytes
would be unverified.

Threads. A step (the training loop's thread, or the thread a step runs on
behind the loop), the commit thread and the I/O workers share the
:class:`ShardEntry` records; the rule for each field is written where the
fields are declared.

Files are opened relative to the state directory's descriptor, never through
a symbolic link, and only if they are regular files
(:func:`~tierstore.backends.base.open_regular`).

Example
-------
>>> import tempfile, torch
>>> from tierstore._layout.layout import Layout
>>> from tierstore._layout.budget import plan_tiers
>>> w = torch.zeros(4096, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> plan = plan_tiers(layout, ram_budget=24 << 10, arena_slots=2)
>>> with ShardStore(layout, plan, directory=tempfile.mkdtemp(), backend="buffered") as store:
...     [e.tier for e in store.entries]
['ram', 'disk', 'disk', 'disk']
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .._layout.budget import TierPlan
from .._layout.layout import STATE_ITEMSIZE, Layout, round_up
from .._platform.faults import crash_point
from .._platform.hostmem import HostBuffer, PinBudget
from ..backends import ShardFile
from ..errors import ClosedError, ConfigError, CorruptStateError
from .drive_files import STATE_FILES, DriveFiles
from .integrity import CHECKSUM_BLOCK, BlockDigests, checksum_mismatch
from .placement import check_placement, drive_offsets
from .shard_entry import ShardEntry
from .shard_transfer import ShardTransfer
from .transfer import IOQueue

log = logging.getLogger(__name__)

__all__ = ["ShardStore", "STATE_FILES"]
MIN_PIN_SLACK = 3 * 4096  # each of the three buffers is rounded up to whole pages when pinned


class ShardStore:
    """All shards of a :class:`~tierstore._layout.layout.Layout`, placed per a :class:`~tierstore._layout.budget.TierPlan`.

    Parameters
    ----------
    layout, plan
        What to store and which shards are resident.
    directory
        Where the state files go; needed when anything is persisted.
    backend
        ``"auto"``, ``"direct"``, ``"buffered"`` or ``"mmap"``.
    io_workers, request_bytes
        I/O tuning (see :class:`~tierstore._storage.transfer.IOQueue`); never change
        results. Requests are whole 1 MiB checksum blocks.
    pin
        Pin host memory for CUDA copies; ``None`` pins when CUDA is available.
    durable
        Keep two copies of every shard on disk and commit steps atomically.
    dir_fd
        The state directory's open descriptor (:attr:`StateDir.fd
        <tierstore._state.statedir.StateDir.fd>`): files are opened relative to it.
        ``None``: the store opens ``directory`` itself when it needs files.
    drives
        A state over several directories: ``(directory, dir_fd)`` of each, the
        home first (``directory`` and ``dir_fd`` are then ignored).
    placement
        The drive of each shard (``None``: all in the first).
    """

    def __init__(
        self,
        layout: Layout,
        plan: TierPlan,
        *,
        directory: Path | str | None = None,
        dir_fd: int | None = None,
        backend: str = "auto",
        io_workers: int = 8,
        request_bytes: int = 1 << 20,
        pin: bool | None = None,
        durable: bool = False,
        drives: Sequence[tuple[Path | str | None, int | None]] | None = None,
        placement: Sequence[int] | None = None,
    ) -> None:
        self.layout = layout
        self.plan = plan
        if drives is None:
            drives = [(directory, dir_fd)]
        if placement is None:
            placement = [0] * len(layout.shards)
        placement = check_placement(placement, shards=len(layout.shards), drives=len(drives))
        self.directory = Path(drives[0][0]) if drives[0][0] is not None else None  # the home
        self.backend_name = backend
        self.io_workers = io_workers
        self.request_bytes = round_up(request_bytes, CHECKSUM_BLOCK)
        self.pin = pin
        # Pinned memory cannot be paged out: never pin more than the plan's RAM (the budget).
        self.pins = PinBudget(plan.ram_nbytes + MIN_PIN_SLACK)
        self.durable = durable
        #: Guards every entry's books (see :class:`ShardEntry`): the step side and the commit thread share them.
        self.books = threading.Lock()
        self._commit_thread: int | None = None  # the thread that adopts commits (persist=False), once one did
        resident = set(plan.resident)
        self.entries: list[ShardEntry] = []
        self._resident_offset: dict[int, int] = {}
        sizes = [layout.shard_nbytes(shard) for shard in layout.shards]
        offsets, per_drive = drive_offsets(sizes, placement, drives=len(drives))
        resident_offset = 0
        for shard, nbytes, offset, drive in zip(layout.shards, sizes, offsets, placement):
            tier = "ram" if shard.index in resident else "disk"
            self.entries.append(ShardEntry(shard.index, tier, nbytes, offset, drive=drive))
            if tier == "ram":
                self._resident_offset[shard.index] = resident_offset
                resident_offset += nbytes
        #: Each drive's files and I/O queue, the home first (see :mod:`tierstore._storage.drive_files`).
        self.drives = [
            DriveFiles(k, path, fd, nbytes=per_drive[k], backend=backend, io_workers=io_workers,
                       request_bytes=self.request_bytes)
            for k, (path, fd) in enumerate(drives)
        ]  # fmt: skip
        self._resident: HostBuffer | None = None
        self._arena: HostBuffer | None = None
        self._staging: HostBuffer | None = None
        self._scratch: HostBuffer | None = None
        # Called before every write of a streamed shard; the journal sets it to "wait until no
        # commit in flight needs the copies this write may overwrite", so no writer can forget it.
        self.write_fence: Callable[[], object] | None = None
        self.is_open = False

    @property
    def files(self) -> list[ShardFile]:
        """Every open state file, drive by drive (empty while none is open)."""
        return [f for drive in self.drives for f in drive.files]

    @property
    def backend_names(self) -> list[str]:
        """Each drive's backend (``"auto"`` until its files are open)."""
        return [drive.backend_name for drive in self.drives]

    # -- lifecycle ----------------------------------------------------
    @property
    def persists_anything(self) -> bool:
        return any(self.persisted(e.index) for e in self.entries)

    def persisted(self, index: int) -> bool:
        """True when shard ``index`` has bytes in the state files."""
        return self.durable or self.entries[index].tier == "disk"

    @property
    def copies(self) -> int:
        return 2 if self.durable else 1

    def open(self, *, committed: list[dict] | None = None) -> ShardStore:
        """Allocate memory and open the state files.

        Parameters
        ----------
        committed
            ``None`` for fresh state (files created). Otherwise the manifest's
            per-shard records: the files must exist and resident shards are
            read (and verified) from their committed copies.

        Raises
        ------
        CorruptStateError
            A state file is missing or truncated, or a resident shard fails its checksum.
        DiskFullError
            The extents cannot be allocated.
        """
        if self.is_open:
            return self
        try:
            self._resident = HostBuffer(self.plan.resident_nbytes, pin=self.pin, pins=self.pins)
            self._arena = HostBuffer(self.plan.arena_nbytes, pin=self.pin, pins=self.pins)
            self._staging = HostBuffer(self.plan.staging_nbytes, pin=self.pin, pins=self.pins)
            # Decode scratch never crosses to a GPU: not pinned.
            self._scratch = HostBuffer(self.plan.scratch_nbytes, pin=False)
            if committed is not None:
                self._adopt_records(committed)
            if self.persists_anything or committed is not None:
                self._open_files(resume=committed is not None)
            self.is_open = True
            if committed is not None:
                self._load_resident()
        except BaseException:
            for drive in self.drives:  # a failed start leaves no half-made files behind
                with contextlib.suppress(OSError):
                    drive.remove_created()
            self.close()
            raise
        return self

    def _adopt_records(self, committed: list[dict]) -> None:
        """Take the committed books of every shard from a manifest (checked by :func:`tierstore._state.manifest.validate`)."""
        where = self.directory if self.directory is not None else "the state directory"
        if len(committed) != len(self.entries):
            raise CorruptStateError(
                f"the manifest in {where} lists {len(committed)} shards, the layout has {len(self.entries)}; "
                "restore the state directory from a checkpoint"
            )
        with self.books:
            for entry, rec in zip(self.entries, committed):
                if rec.get("checksum") is None:
                    # A resume must never hand out bytes no checksum vouches for.
                    raise CorruptStateError(
                        f"the manifest in {where} commits shard {entry.index} without a checksum "
                        f"(shards[{entry.index}].checksum is null): its bytes cannot be verified. Restore "
                        "the state directory from a checkpoint"
                    )
                entry.copy = int(rec["copy"])
                entry.checksum = rec["checksum"]
                entry.written_step = int(rec.get("written_step", -1))
                entry.stale_checksum = rec.get("stale_checksum")

    def _open_files(self, *, resume: bool) -> None:
        if self.directory is None:
            raise ConfigError("a store with state on disk needs a directory")
        # Borrowed descriptors: the StateDirs that own them are closed only after this store (Runtime.release).
        persists_anything = self.persists_anything
        with self.books:
            used = [{e.copy for e in self.entries if e.drive == k and e.checksum is not None} for k in range(len(self.drives))]
        every = set().union(*used)
        for k, drive in enumerate(self.drives):
            # Copies opened alike on every drive: a drive holding no committed shard still opens
            # the copy another drive's shards are committed in.
            extents = [(e.offset, e.nbytes) for e in self.entries
                       if e.drive == k and (self.persisted(e.index) or not persists_anything)]  # fmt: skip
            drive.open(copies=max(self.copies, max(every, default=0) + 1), allocated=self.copies,
                       must_exist=used[k] if resume else set(), extents=extents)  # fmt: skip
        self.backend_name = self.drives[0].backend_name

    def _load_resident(self) -> None:
        transfers = []
        for entry in self.entries:
            if entry.tier == "ram" and entry.checksum is not None:
                view = self._resident_view(entry.index)
                transfers.append(self._read_into(entry, view))
        for t in transfers:
            t.wait()

    def close(self) -> None:
        """Free memory, stop workers, close files (nothing is flushed); safe to call twice."""
        for drive in self.drives:
            drive.close()
        for name in ("_resident", "_arena", "_staging", "_scratch"):
            buf = getattr(self, name)
            if buf is not None:
                buf.close()
                setattr(self, name, None)
        self.is_open = False

    def __enter__(self) -> ShardStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> None:
        if not self.is_open:
            raise ClosedError("the shard store is closed; the optimizer was closed or never opened")

    # -- memory -------------------------------------------------------
    @property
    def arena_slots(self) -> int:
        return self.plan.arena_slots

    def is_resident(self, index: int) -> bool:
        return self.entries[index].tier == "ram"

    def resident_buffer(self, index: int) -> torch.Tensor:
        """The extent of resident shard ``index`` (all its fields as stored), as 32-bit words.

        In ``"float32"`` these are the fields' fp32 values back to back; in a
        compressed format, see :meth:`~tierstore._layout.layout.Layout.stored_field`.
        """
        self._require_open()
        assert self._resident is not None
        start = self._resident_offset[index]
        return self._resident.tensor[start : start + self.entries[index].nbytes].view(torch.float32)

    def _resident_view(self, index: int) -> memoryview:
        assert self._resident is not None
        start = self._resident_offset[index]
        return self._resident.view[start : start + self.entries[index].nbytes]

    def slot_buffer(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """Arena slot ``slot`` (its first ``nbytes`` bytes) as 32-bit words, like :meth:`resident_buffer`."""
        self._require_open()
        assert self._arena is not None
        start = slot * self.plan.slot_nbytes
        return self._arena.tensor[start : start + (nbytes or self.plan.slot_nbytes)].view(torch.float32)

    def _slot_view(self, slot: int, nbytes: int) -> memoryview:
        assert self._arena is not None
        start = slot * self.plan.slot_nbytes
        return self._arena.view[start : start + nbytes]

    def scratch_buffer(self) -> torch.Tensor:
        """The fp32 scratch a compressed format's shards are decoded into (empty for ``"float32"``)."""
        self._require_open()
        assert self._scratch is not None
        return self._scratch.tensor[: self.plan.scratch_nbytes].view(torch.float32)

    def staging_buffer(self, which: int = 0) -> torch.Tensor:
        """Staging buffer ``which`` as fp32, as large as the largest shard."""
        self._require_open()
        assert self._staging is not None
        size = self.layout.max_capacity * STATE_ITEMSIZE
        return self._staging.tensor[which * size : (which + 1) * size].view(torch.float32)

    # -- disk ---------------------------------------------------------
    @property
    def io(self) -> IOQueue | None:
        """The home drive's I/O queue (``None`` until files are open); each drive has its own."""
        return self.drives[0].io

    def file_path(self, copy: int, drive: int = 0) -> Path:
        return self.drives[drive].file_path(copy)

    def drive_shares(self) -> list[tuple[Path | None, int, int, str]]:
        """Each drive's directory, the shards placed on it, their bytes (one copy) and its backend."""
        counts = [0] * len(self.drives)
        for entry in self.entries:
            counts[entry.drive] += 1
        return [(d.directory, counts[k], d.nbytes, d.backend_name) for k, d in enumerate(self.drives)]

    def books_of(self, index: int) -> tuple[int, str | None, tuple[int, str] | None]:
        """Shard ``index``'s committed copy, its checksum and its pending write, read together."""
        entry = self.entries[index]
        with self.books:
            return entry.copy, entry.checksum, entry.pending

    def _read_into(self, entry: ShardEntry, view: memoryview) -> ShardTransfer:
        drive = self.drives[entry.drive]
        assert drive.io is not None
        digests = BlockDigests(entry.nbytes)
        # The newest bytes: the copy written since the last commit, else the committed one.
        committed, checksum, pending = self.books_of(entry.index)
        copy, expected = pending if pending is not None else (committed, checksum)
        if expected is None:
            # Nothing was ever written or committed here: the bytes would be unverified.
            raise CorruptStateError(
                f"shard {entry.index} has no verified bytes in {drive.file_path(copy)} (never written, "
                "nothing committed); restore the state directory from a checkpoint"
            )
        transfer = drive.io.read(drive.files[copy], view, entry.offset, on_chunk=digests.update)

        def verify() -> None:
            crash_point("after-read")
            got = digests.value()
            if got != expected:
                raise checksum_mismatch(entry.index, drive.file_path(copy), entry.offset, entry.nbytes, expected, got)

        return ShardTransfer(transfer, verify)

    def _write_from(self, entry: ShardEntry, view: memoryview) -> ShardTransfer:
        drive = self.drives[entry.drive]
        assert drive.io is not None
        digests = BlockDigests(entry.nbytes)
        committed, checksum, _ = self.books_of(entry.index)
        # Durable: never overwrite the committed copy. Fresh shards start in copy 0.
        copy = 1 - committed if (self.durable and checksum is not None) else committed
        drive.mark_dirty(copy)
        transfer = drive.io.write(drive.files[copy], view, entry.offset, on_chunk=digests.update)

        def record() -> None:  # runs on whichever thread waits first (the step side or the commit thread)
            value = (copy, digests.value())
            with self.books:
                entry.pending = value

        return ShardTransfer(transfer, record)

    def read(self, index: int, slot: int) -> ShardTransfer:
        """Start reading disk shard ``index`` into arena slot ``slot`` (verified on ``wait``)."""
        self._require_open()
        entry = self.entries[index]
        return self._read_into(entry, self._slot_view(slot, entry.nbytes))

    def write(self, index: int, slot: int) -> ShardTransfer:
        """Start writing arena slot ``slot`` as the new bytes of disk shard ``index``.

        Waits first at the write fence, when one is set (:attr:`write_fence`).
        """
        self._require_open()
        if self.write_fence is not None:
            self.write_fence()
        entry = self.entries[index]
        return self._write_from(entry, self._slot_view(slot, entry.nbytes))

    def write_resident(self, index: int) -> ShardTransfer:
        """Start writing resident shard ``index`` to its (uncommitted) copy on disk."""
        self._require_open()
        return self._write_from(self.entries[index], self._resident_view(index))

    def claim_resident(self, index: int) -> torch.Tensor:
        """Resident shard ``index``'s buffer, about to be changed.

        Waits until a commit's write of its bytes finished (the write reads
        the buffer), then marks it changed since its last write. Step side only.
        """
        self._step_side("claim_resident")
        entry = self.entries[index]
        persist = entry.persist
        if persist is not None:
            persist.wait()
            entry.persist = None
        entry.dirty = True
        return self.resident_buffer(index)

    def persist_resident(self) -> list[ShardTransfer]:
        """Durable: start writing every resident shard changed since its last write.

        Returns the writes; :meth:`commit` makes them durable with the rest.
        Without durability resident shards reach the files only through
        :meth:`flush_resident`, and this does nothing. Step side only.
        """
        self._require_open()
        self._step_side("persist_resident")
        if not self.durable:
            return []
        transfers = []
        for entry in self.entries:
            if entry.tier == "ram" and entry.dirty:
                entry.persist = self._write_from(entry, self._resident_view(entry.index))
                entry.dirty = False
                transfers.append(entry.persist)
        return transfers

    def _step_side(self, what: str) -> None:
        """Refuse the commit thread a step side's method (see :class:`ShardEntry`)."""
        if self._commit_thread == threading.get_ident():
            raise RuntimeError(f"ShardStore.{what} called on the commit thread; this is a tierstore bug")

    def has_uncommitted(self) -> bool:
        """True when some shard changed or was written since the last commit (step side)."""
        with self.books:
            if any(e.pending is not None for e in self.entries):
                return True
        return any(e.dirty or (e.persist is not None and not e.persist.done()) for e in self.entries)

    def commit(self, step: int, *, persist: bool = True, sync: bool | None = None) -> None:
        """Make every write since the last commit durable, then adopt it as committed.

        Durable: first write the resident shards changed since their last
        write (``persist=False``: the caller did, with :meth:`persist_resident`)
        and wait for every resident write in flight; then sync the files. Only
        after the files are synced do the entries point at the new copies; the
        caller then writes the manifest naming them. Without durability the
        writes are adopted without a sync (nothing is promised after a crash),
        unless ``sync=True`` (a clean close, before its clean manifest).

        ``persist=False`` is the commit thread's call: it touches only the
        books (the caller waited for the resident writes it started).
        """
        self._require_open()
        if not persist:
            self._commit_thread = threading.get_ident()
        if persist:  # the step side: its own resident writes, waited for and forgotten here
            if self.durable:
                self.persist_resident()
            for entry in self.entries:
                transfer = entry.persist
                if transfer is not None:
                    transfer.wait()
                    entry.persist = None
        if self.durable if sync is None else sync:
            crash_point("before-sync")
            self._sync_drives()
        with self.books:
            for entry in self.entries:
                if entry.pending is not None:
                    copy, checksum = entry.pending
                    if copy != entry.copy:
                        entry.stale_checksum = entry.checksum
                    entry.copy, entry.checksum = copy, checksum
                    entry.written_step = step
                    entry.pending = None

    def _sync_drives(self) -> None:
        """Sync every drive's files written since their last sync (however many commits ago), the
        drives in parallel; raise the first error once every drive's sync ended."""
        syncs = [f for f in (drive.start_sync() for drive in self.drives if drive.is_open) if f is not None]
        error: BaseException | None = None
        for future in syncs:
            try:
                future.result()
            except BaseException as exc:  # re-raised below, after the other drives' syncs ended
                error = error or exc
        if error is not None:
            raise error

    def abort(self) -> None:
        """Forget writes since the last commit: the committed copies stay authoritative (step side)."""
        for entry in self.entries:
            if entry.persist is not None:
                with contextlib.suppress(BaseException):  # already failing: the caller's error matters
                    entry.persist.wait()
                entry.persist = None
        with self.books:
            for entry in self.entries:
                entry.pending = None

    def flush_resident(self) -> None:
        """Write every resident shard to disk (a non-durable store's clean close)."""
        self._require_open()
        if not self.drives[0].is_open:  # everything was resident: no file was needed until now
            self._open_files(resume=False)
        transfers = [self.write_resident(e.index) for e in self.entries if e.tier == "ram"]
        for t in transfers:
            t.wait()

    def records(self) -> list[dict]:
        """The committed per-shard records, for the manifest (one consistent snapshot of the books)."""
        with self.books:
            return [e.record() for e in self.entries]

    # -- accounting ---------------------------------------------------
    @property
    def pinned_nbytes(self) -> int:
        """Bytes of host memory pinned for CUDA copies (0 without CUDA, or where pinning failed)."""
        return self.pins.stats().pinned_bytes

    @property
    def disk_nbytes(self) -> int:
        """Bytes allocated for state on disk (all copies)."""
        per_copy = sum(e.nbytes for e in self.entries if self.persisted(e.index))
        return per_copy * self.copies
