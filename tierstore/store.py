"""The shard store: every shard's bytes, in RAM (resident) or in a file (disk tier).

The store owns the memory and the file, and knows where each shard is. It
does not decide the order of work: :mod:`tierstore.pipeline` streams disk
shards through the arena slots the store allocated.

Memory is allocated once in :meth:`ShardStore.open` (resident shards, arena,
staging) and never again while training; :meth:`close` frees it.

Example
-------
>>> import tempfile, torch
>>> from tierstore.layout import Layout
>>> from tierstore.budget import plan_tiers
>>> w = torch.zeros(4096, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> plan = plan_tiers(layout, ram_budget=24 << 10, arena_slots=2)
>>> with ShardStore(layout, plan, directory=tempfile.mkdtemp(), backend="buffered") as store:
...     [e.tier for e in store.entries]
['ram', 'disk', 'disk', 'disk']
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .backends import ShardFile, open_backend, resolve_backend
from .budget import TierPlan
from .errors import ClosedError
from .hostmem import HostBuffer
from .layout import STATE_ITEMSIZE, Layout, ShardSpec
from .transfer import IOQueue, Transfer

log = logging.getLogger(__name__)

STATE_FILE = "shards.bin"


@dataclass
class ShardEntry:
    """Where one shard lives: its tier and, on disk, its byte range in the state file."""

    index: int
    tier: str  # "ram" or "disk"
    nbytes: int
    offset: int  # byte offset in the state file; -1 for resident shards


class ShardStore:
    """All shards of a :class:`~tierstore.layout.Layout`, placed per a :class:`~tierstore.budget.TierPlan`.

    Parameters
    ----------
    layout, plan
        What to store and which shards are resident.
    directory
        Where the state file goes; only needed when the plan has disk shards.
    backend
        ``"auto"``, ``"direct"``, ``"buffered"`` or ``"mmap"``.
    io_workers, request_bytes
        I/O tuning (see :class:`~tierstore.transfer.IOQueue`); never change results.
    pin
        Pin host memory for CUDA copies; ``None`` pins when CUDA is available.
    """

    def __init__(
        self,
        layout: Layout,
        plan: TierPlan,
        *,
        directory: Path | str | None,
        backend: str = "auto",
        io_workers: int = 4,
        request_bytes: int = 8 << 20,
        pin: bool | None = None,
    ) -> None:
        self.layout = layout
        self.plan = plan
        self.directory = Path(directory) if directory is not None else None
        self.backend_name = backend
        self.io_workers = io_workers
        self.request_bytes = request_bytes
        self.pin = pin
        resident = set(plan.resident)
        self.entries: list[ShardEntry] = []
        file_offset = 0
        resident_offset = 0
        self._resident_offset: dict[int, int] = {}
        for shard in layout.shards:
            nbytes = layout.shard_nbytes(shard)
            if shard.index in resident:
                self.entries.append(ShardEntry(shard.index, "ram", nbytes, -1))
                self._resident_offset[shard.index] = resident_offset
                resident_offset += nbytes
            else:
                self.entries.append(ShardEntry(shard.index, "disk", nbytes, file_offset))
                file_offset += nbytes
        self.file_nbytes = file_offset
        self.file: ShardFile | None = None
        self.io: IOQueue | None = None
        self._resident: HostBuffer | None = None
        self._arena: HostBuffer | None = None
        self._staging: HostBuffer | None = None
        self.is_open = False

    # -- lifecycle ----------------------------------------------------
    def open(self, *, create: bool = True) -> ShardStore:
        """Allocate the memory and open (``create``: create and preallocate) the state file."""
        if self.is_open:
            return self
        try:
            self._resident = HostBuffer(self.plan.resident_nbytes, pin=self.pin)
            self._arena = HostBuffer(self.plan.arena_nbytes, pin=self.pin)
            self._staging = HostBuffer(self.plan.staging_nbytes, pin=self.pin)
            if self.file_nbytes:
                if self.directory is None:
                    raise ValueError("a store with disk shards needs a directory")
                self.backend_name = resolve_backend(self.backend_name, self.directory)
                self.file = open_backend(self.backend_name, self.state_path, self.file_nbytes, create=create)
                self.io = IOQueue(workers=self.io_workers, request_bytes=self.request_bytes)
        except BaseException:
            self.close()
            raise
        self.is_open = True
        return self

    @property
    def state_path(self) -> Path:
        assert self.directory is not None
        return self.directory / STATE_FILE

    def close(self) -> None:
        """Flush nothing, free everything; safe to call twice."""
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.file is not None:
            self.file.close()
            self.file = None
        for name in ("_resident", "_arena", "_staging"):
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
        """The fp32 elements of resident shard ``index`` (all its fields, back to back)."""
        self._require_open()
        start = self._resident_offset[index]
        nbytes = self.entries[index].nbytes
        assert self._resident is not None
        return self._resident.tensor[start : start + nbytes].view(torch.float32)

    def slot_buffer(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """The fp32 elements of arena slot ``slot`` (its first ``nbytes`` bytes)."""
        self._require_open()
        assert self._arena is not None
        start = slot * self.plan.slot_nbytes
        return self._arena.tensor[start : start + (nbytes or self.plan.slot_nbytes)].view(torch.float32)

    def _slot_view(self, slot: int, nbytes: int) -> memoryview:
        assert self._arena is not None
        start = slot * self.plan.slot_nbytes
        return self._arena.view[start : start + nbytes]

    def staging_buffer(self, which: int = 0) -> torch.Tensor:
        """Staging buffer ``which`` as fp32, as large as the largest shard."""
        self._require_open()
        assert self._staging is not None
        size = self.layout.max_capacity * STATE_ITEMSIZE
        return self._staging.tensor[which * size : (which + 1) * size].view(torch.float32)

    def field(self, flat: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        """The ``capacity`` elements of ``field`` inside a shard's flat buffer."""
        k = self.layout.field_index(field)
        return flat[k * shard.capacity : (k + 1) * shard.capacity]

    # -- disk ---------------------------------------------------------
    def read(self, index: int, slot: int) -> Transfer:
        """Start reading disk shard ``index`` into arena slot ``slot``."""
        self._require_open()
        entry = self.entries[index]
        assert entry.tier == "disk" and self.file is not None and self.io is not None
        return self.io.read(self.file, self._slot_view(slot, entry.nbytes), entry.offset)

    def write(self, index: int, slot: int) -> Transfer:
        """Start writing arena slot ``slot`` to disk shard ``index``."""
        self._require_open()
        entry = self.entries[index]
        assert entry.tier == "disk" and self.file is not None and self.io is not None
        return self.io.write(self.file, self._slot_view(slot, entry.nbytes), entry.offset)

    def sync(self) -> None:
        """Make every finished write durable."""
        if self.file is not None:
            self.file.sync()

    # -- accounting ---------------------------------------------------
    @property
    def ram_nbytes(self) -> int:
        return self.plan.ram_nbytes

    @property
    def disk_nbytes(self) -> int:
        return self.file_nbytes
