"""Read a state directory's committed state without an optimizer or the model.

:class:`StateReader` is what ``tierstore inspect``, ``verify``, ``export`` and
``to-torch`` stand on: it reads the manifest, rebuilds the layout, and reads
each shard's committed copy (verifying its checksum) into one reusable
buffer, one shard at a time, so it needs about one shard of RAM.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> d = tempfile.mkdtemp()
>>> w = torch.nn.Parameter(torch.ones(10))
>>> with TieredAdamW([w], state_dir=d) as opt:
...     w.grad = torch.ones(10); _ = opt.step()
>>> with StateReader(d) as r:
...     r.step_count, r.param_state(0)["exp_avg"][:2].tolist()
(1, [0.10000000149011612, 0.10000000149011612])
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import manifest as manifest_mod
from .errors import CorruptStateError
from .hostmem import HostBuffer
from .integrity import shard_checksum
from .layout import Layout, ShardSpec
from .optimizer import MASTER_KEY
from .statedir import INFLIGHT, MANIFEST, read_manifest_file
from .store import STATE_FILES


@dataclass(frozen=True)
class Problem:
    """One finding of :meth:`StateReader.verify`."""

    shard: int
    file: str
    offset: int
    nbytes: int
    what: str
    severity: str  # "error": committed state is bad; "warning": a stale copy is

    def __str__(self) -> str:
        return f"{self.severity}: shard {self.shard} in {self.file} (bytes {self.offset}..{self.offset + self.nbytes}): {self.what}"


class StateReader:
    """Read-only view of a state directory's last commit.

    Parameters
    ----------
    path
        The state directory.

    Raises
    ------
    CorruptStateError
        If the manifest is missing or corrupt. A state left dirty by a
        ``durable=False`` run is readable but unreliable: check :attr:`clean`.
    FormatVersionError
        If the manifest was written by another format version.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest_file(self.path / MANIFEST)
        self.layout: Layout = manifest_mod.saved_layout(self.manifest, str(self.path))
        self.clean = bool(self.manifest.get("clean", True))
        self.records: list[dict] = self.manifest["shards"]
        self._offsets = [0]
        for shard in self.layout.shards:
            self._offsets.append(self._offsets[-1] + self.layout.shard_nbytes(shard))
        self._fds: dict[int, int] = {}
        self._buffer: HostBuffer | None = None

    # -- summary ------------------------------------------------------
    @property
    def step_count(self) -> int:
        return int(self.manifest["step_count"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [manifest_mod.decode_group(g) for g in self.manifest["param_groups"]]

    @property
    def param_steps(self) -> list[float | None]:
        return list(self.manifest["param_steps"])

    def file_sizes(self) -> dict[str, int]:
        """Bytes on disk (allocated) of each state file present."""
        sizes = {}
        for name in STATE_FILES:
            p = self.path / name
            if p.exists():
                sizes[name] = p.stat().st_blocks * 512
        return sizes

    # -- shard access -------------------------------------------------
    def _fd(self, copy: int) -> int:
        if copy not in self._fds:
            path = self.path / STATE_FILES[copy]
            try:
                self._fds[copy] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptStateError(
                    f"state file {path} is missing; restore the state directory from a checkpoint"
                ) from None
        return self._fds[copy]

    def _offset(self, index: int) -> int:
        return self._offsets[index]

    def _read(self, index: int, copy: int) -> tuple[torch.Tensor, str, int, int]:
        nbytes = self.layout.shard_nbytes(index)
        offset = self._offset(index)
        if self._buffer is None:
            self._buffer = HostBuffer(self.layout.slot_nbytes, pin=False)
        view = self._buffer.view[:nbytes]
        fd = self._fd(copy)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CorruptStateError(
                    f"state file {self.path / STATE_FILES[copy]} is truncated: shard {index} needs "
                    f"bytes {offset}..{offset + nbytes}; restore the state directory from a checkpoint"
                )
            done += n
        return self._buffer.tensor[:nbytes].view(torch.float32), shard_checksum(view), offset, nbytes

    def read_shard(self, index: int) -> torch.Tensor:
        """The committed fp32 bytes of shard ``index`` (valid until the next read).

        Raises
        ------
        CorruptStateError
            If it fails its checksum, naming the shard and the file.
        """
        rec = self.records[index]
        if rec["checksum"] is None:
            raise CorruptStateError(f"shard {index} was never written to {self.path}; the state is incomplete")
        flat, got, offset, nbytes = self._read(index, rec["copy"])
        if got != rec["checksum"]:
            raise CorruptStateError(
                f"shard {index} in {self.path / STATE_FILES[rec['copy']]} (bytes {offset}..{offset + nbytes}) "
                f"fails its checksum: expected {rec['checksum']}, read {got}; restore the state "
                "directory from a checkpoint"
            )
        return flat

    def iter_shards(self) -> Iterator[tuple[ShardSpec, torch.Tensor]]:
        """Every shard with its verified committed bytes, in order."""
        for shard in self.layout.shards:
            yield shard, self.read_shard(shard.index)

    def field(self, flat: torch.Tensor, shard: ShardSpec, field: str) -> torch.Tensor:
        k = self.layout.field_index(field)
        return flat[k * shard.capacity : (k + 1) * shard.capacity]

    def param_state(self, index: int) -> dict[str, torch.Tensor]:
        """Full fp32 tensors of one parameter's state (``exp_avg``, ..., ``master_param``)."""
        meta = self.layout.params[index]
        out = {f: torch.empty(meta.numel, dtype=torch.float32) for f in self.layout.fields}
        for shard_index, seg in self.layout.segments_of(index):
            shard = self.layout.shards[shard_index]
            flat = self.read_shard(shard_index)
            for f, t in out.items():
                src = self.field(flat, shard, f)
                t[seg.param_offset : seg.param_offset + seg.length].copy_(
                    src[seg.shard_offset : seg.shard_offset + seg.length]
                )
        return {(MASTER_KEY if f == "master" else f): t.view(meta.shape) for f, t in out.items()}

    # -- checks -------------------------------------------------------
    def verify(self) -> list[Problem]:
        """Check every committed copy (errors) and every intact stale copy (warnings).

        Stale copies that a crashed step may have been overwriting (the
        in-flight marker is present) are skipped.
        """
        problems = []
        in_flight = (self.path / INFLIGHT).exists()
        for shard in self.layout.shards:
            rec = self.records[shard.index]
            checks = [(rec["copy"], rec["checksum"], "error")]
            if rec.get("stale_checksum") and not in_flight and self.manifest.get("durable"):
                checks.append((1 - rec["copy"], rec["stale_checksum"], "warning"))
            for copy, expected, severity in checks:
                if expected is None:
                    continue
                name = str(self.path / STATE_FILES[copy])
                try:
                    _, got, offset, nbytes = self._read(shard.index, copy)
                except CorruptStateError as exc:
                    problems.append(Problem(shard.index, name, self._offset(shard.index), self.layout.shard_nbytes(shard), str(exc), severity))
                    continue
                if got != expected:
                    what = "checksum mismatch" + (" in the stale copy (the previous step's)" if severity == "warning" else "")
                    problems.append(Problem(shard.index, name, offset, nbytes, f"{what}: expected {expected}, read {got}", severity))
        return problems

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def __enter__(self) -> StateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
