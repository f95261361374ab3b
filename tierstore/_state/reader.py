"""Read a state directory's committed state without an optimizer or the model.

:class:`StateReader` is what ``tierstore inspect``, ``verify``, ``export`` and
``to-torch`` stand on: it reads the manifest, rebuilds the layout, and reads
each shard's committed copy (verifying its checksum) into one reusable
buffer, one shard at a time, so it needs about one shard of RAM (two in a
compressed moment format: the stored extent, and the fp32 values it decodes
to). :meth:`StateReader.read_extent` gives the stored bytes,
:meth:`StateReader.read_shard` the fp32 values in every format.

A directory is read as a state directory is written
(:mod:`tierstore._state.statedir`): opened once, every file relative to its
descriptor, never through a symlink, only regular files; the manifest
bounded in size and validated (:func:`tierstore._state.manifest.validate`) before
anything uses it. Every byte handed out was read from a shard that passed its
checksum, or decoded from one.

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

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._layout.layout import Layout, ShardSpec
from .._platform.hostmem import HostBuffer
from .._storage.integrity import checksum_mismatch, shard_checksum
from .._storage.store import STATE_FILES
from ..backends import ShardFile, open_backend
from ..backends.base import O_CLOEXEC
from ..errors import BackendError, CorruptStateError, StateDirError
from . import manifest as manifest_mod
from .manifest_file import read_manifest_file
from .statedir import INFLIGHT, MANIFEST, state_dir_path

#: Offline reads bypass the page cache where the filesystem allows it (a verify of a
#: large state must not fill the page cache with it); ``buffered`` where it does not.
READ_BACKENDS = ("direct", "buffered")


def _uncommitted(index: int, path: object) -> str:
    return (
        f"shard {index} has no committed checksum in {path}/{MANIFEST} (shards[{index}].checksum is null): "
        "it was never written, so the state is incomplete and its bytes cannot be verified. Restore the "
        "state directory from a checkpoint"
    )


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
    progress
        Called with the bytes of every shard copy read (for a progress bar).

    Raises
    ------
    ConfigTypeError, ConfigError
        If ``path`` is not a path (a ``str`` or ``os.PathLike``) or is empty.
    StateDirError
        If it is not a directory that can be opened.
    CorruptStateError
        If the manifest is missing, not a regular file, too large, corrupt, or
        holds a value of the wrong type or out of bounds. A state left dirty by a
        ``durable=False`` run is readable but unreliable: check :attr:`clean`.
    FormatVersionError
        If the manifest was written by another format version.
    """

    def __init__(self, path: str | os.PathLike, *, progress: Callable[[int], object] | None = None) -> None:
        checked = state_dir_path(path, name="path")
        if checked is None:
            raise StateDirError("StateReader needs the path of a state directory, got None")
        self.path = checked
        self.progress = progress
        self._files: dict[int, ShardFile] = {}
        self._buffer: HostBuffer | None = None
        self._wide: torch.Tensor | None = None
        try:
            self._dir_fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptStateError(f"{self.path / MANIFEST} is missing; this directory holds no committed state") from None
        except OSError as exc:
            raise StateDirError(
                f"cannot open the state directory {self.path}: {exc.strerror}; pass a directory you can read"
            ) from exc
        try:
            self.manifest = read_manifest_file(self.path / MANIFEST, dir_fd=self._dir_fd)
            self.layout: Layout = manifest_mod.saved_layout(self.manifest, str(self.path))
        except BaseException:
            self.close()
            raise
        self.clean = bool(self.manifest.get("clean", True))
        self.records: list[dict] = self.manifest["shards"]
        self._offsets = [0]
        for shard in self.layout.shards:
            self._offsets.append(self._offsets[-1] + self.layout.shard_nbytes(shard))

    def _lstat(self, name: str) -> os.stat_result | None:
        """``name`` in the directory, not followed if it is a link (``None``: absent)."""
        try:
            return os.stat(name, dir_fd=self._open_dir(), follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _open_dir(self) -> int:
        if self._dir_fd is None:
            raise StateDirError(f"the reader of {self.path} is closed; open a new StateReader")
        return self._dir_fd

    # -- summary ------------------------------------------------------
    @property
    def step_count(self) -> int:
        return int(self.manifest["step_count"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [manifest_mod.decode_group(g, self.layout.algorithm) for g in self.manifest["param_groups"]]

    @property
    def param_steps(self) -> list[float | None]:
        return list(self.manifest["param_steps"])

    def file_sizes(self) -> dict[str, int]:
        """Bytes on disk (allocated) of each state file present."""
        sizes = {}
        for name in STATE_FILES:
            st = self._lstat(name)
            if st is not None:
                sizes[name] = st.st_blocks * 512
        return sizes

    # -- shard access -------------------------------------------------
    def _file(self, copy: int) -> ShardFile:
        if copy not in self._files:
            path = self.path / STATE_FILES[copy]
            for backend in READ_BACKENDS:
                try:
                    self._files[copy] = open_backend(
                        backend, path, self._offsets[-1], create=False, readonly=True, dir_fd=self._open_dir()
                    )
                    break
                except BackendError:  # O_DIRECT refused here (tmpfs on older kernels): read through the cache
                    if backend == READ_BACKENDS[-1]:
                        raise
        return self._files[copy]

    def _offset(self, index: int) -> int:
        return self._offsets[index]

    def _read(self, index: int, copy: int) -> tuple[torch.Tensor, str, int, int]:
        nbytes = self.layout.shard_nbytes(index)
        offset = self._offset(index)
        if self._buffer is None:
            self._buffer = HostBuffer(self.layout.slot_nbytes, pin=False)
        view = self._buffer.view[:nbytes]
        try:
            self._file(copy).read_into(view, offset)
        finally:
            if self.progress is not None:
                self.progress(nbytes)
        return self._buffer.tensor[:nbytes].view(torch.float32), shard_checksum(view), offset, nbytes

    def read_extent(self, index: int) -> torch.Tensor:
        """The committed, verified extent of shard ``index``: its stored bytes as 32-bit words
        (see :meth:`~tierstore._layout.layout.Layout.stored_field`; valid until the next read).

        Raises
        ------
        CorruptStateError
            If it fails its checksum, naming the shard and the file.
        """
        rec = self.records[index]
        if rec["checksum"] is None:
            raise CorruptStateError(_uncommitted(index, self.path))
        flat, got, offset, nbytes = self._read(index, rec["copy"])
        if got != rec["checksum"]:
            raise checksum_mismatch(index, self.path / STATE_FILES[rec["copy"]], offset, nbytes, rec["checksum"], got)
        return flat

    def read_shard(self, index: int) -> torch.Tensor:
        """The committed fp32 values of shard ``index``, every field back to back (decoded in a
        compressed moment format; valid until the next read).

        Raises
        ------
        CorruptStateError
            If it fails its checksum, naming the shard and the file.
        """
        extent = self.read_extent(index)
        if not self.layout.encoded:
            return extent
        shard = self.layout.shards[index]
        if self._wide is None:  # scratch: decode_shard writes every element of the part used
            self._wide = torch.empty(self.layout.max_capacity * len(self.layout.fields))
        wide = self._wide[: self.layout.wide_nbytes(shard) // 4]
        self.layout.decode_shard(shard, extent, wide)
        return wide

    def iter_shards(self) -> Iterator[tuple[ShardSpec, torch.Tensor]]:
        """Every shard with its verified committed fp32 values, in order."""
        for shard in self.layout.shards:
            yield shard, self.read_shard(shard.index)

    def iter_extents(self) -> Iterator[tuple[ShardSpec, torch.Tensor]]:
        """Every shard with its verified committed extent (stored bytes), in order."""
        for shard in self.layout.shards:
            yield shard, self.read_extent(shard.index)

    def param_state(self, index: int) -> dict[str, torch.Tensor]:
        """Full fp32 tensors of one parameter's state (``exp_avg``, ..., ``master_param``).

        Raises
        ------
        CorruptStateError
            If a shard fails its checksum, or the layout's segments do not
            cover the parameter exactly once (no element is left unread).
        """
        meta = self.layout.params[index]
        self._check_covered(index)
        # Every element is overwritten below from verified shards: _check_covered saw to that.
        out = {f: torch.empty(meta.numel, dtype=torch.float32) for f in self.layout.fields}
        for shard_index in self.layout.shards_of([index]):
            self.layout.copy_out(self.layout.shards[shard_index], self.read_shard(shard_index), {index: out})
        return {self.layout.state_key(f): t.view(meta.shape) for f, t in out.items()}

    def _check_covered(self, index: int) -> None:
        """The segments of parameter ``index`` tile its elements ``[0, numel)``: none missing, none twice."""
        meta = self.layout.params[index]
        segments = sorted((seg for _, seg in self.layout.segments_of(index)), key=lambda seg: seg.param_offset)
        cursor = 0
        for seg in segments:
            if seg.param_offset != cursor or seg.length <= 0:
                break
            cursor += seg.length
        if cursor != meta.numel or (meta.numel and not meta.trainable):
            raise CorruptStateError(
                f"the layout in {self.path / MANIFEST} does not place parameter {index} ({meta.numel} elements) "
                f"exactly once in its shards (covered up to element {cursor}); restore the state directory "
                "from a checkpoint"
            )

    # -- checks -------------------------------------------------------
    def _checks(self, shard: ShardSpec) -> list[tuple[int, str, str]]:
        """``(copy, expected checksum, severity)`` of every copy :meth:`verify` reads for a shard.

        Committed copies always; stale copies when the directory is durable,
        they are recorded intact and no crashed step may have been overwriting them.
        """
        rec = self.records[shard.index]
        checks = []
        if rec["checksum"] is not None:
            checks.append((rec["copy"], rec["checksum"], "error"))
        stale_readable = self.manifest.get("durable") and self._lstat(INFLIGHT) is None
        if rec.get("stale_checksum") and stale_readable:
            checks.append((1 - rec["copy"], rec["stale_checksum"], "warning"))
        return checks

    def verify_nbytes(self) -> int:
        """Bytes :meth:`verify` reads (for a progress bar's total)."""
        return sum(len(self._checks(s)) * self.layout.shard_nbytes(s) for s in self.layout.shards)

    def verify(self) -> list[Problem]:
        """Check every committed copy (errors) and every intact stale copy (warnings).

        Stale copies that a crashed step may have been overwriting (the
        in-flight marker is present) are skipped.
        """
        problems = []
        for shard in self.layout.shards:
            if self.clean and self.records[shard.index]["checksum"] is None:
                name = str(self.path / STATE_FILES[self.records[shard.index]["copy"]])
                problems.append(Problem(shard.index, name, self._offset(shard.index), self.layout.shard_nbytes(shard), _uncommitted(shard.index, self.path), "error"))
            for copy, expected, severity in self._checks(shard):
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
        """Close the files and the directory, free the buffer; safe twice."""
        for file in self._files.values():
            file.close()
        self._files.clear()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        self._wide = None
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a reader used without ``with`` or close() must not leak descriptors
        if getattr(self, "_dir_fd", None) is not None:
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> StateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
