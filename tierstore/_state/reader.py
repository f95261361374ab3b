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

A state over several directories (drives) is read from its home (the
directory holding the manifest): its other directories are found at the
paths the manifest recorded when the state was last opened, or given
explicitly (``StateReader([home, drive1, ...])``, in the state's order, when
a drive is mounted elsewhere now). Each is opened by descriptor and must
hold this state's member record with its index
(:mod:`tierstore._state.drives`), or the read is refused naming it.

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
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._layout.layout import Layout, ShardSpec
from .._platform.hostmem import HostBuffer
from .._storage.integrity import checksum_mismatch, shard_checksum
from .._storage.placement import drive_offsets
from .._storage.store import STATE_FILES
from ..backends import ShardFile, open_backend
from ..backends.base import O_CLOEXEC
from ..errors import (
    BackendError,
    CorruptStateError,
    DriveSetError,
    StateDirError,
    StateDirInUseError,
)
from . import manifest as manifest_mod
from .drive_record import MEMBER
from .drives import read_member_at, state_dir_paths
from .manifest_file import read_manifest_file
from .statedir import INFLIGHT, MANIFEST, read_holder

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
        The state directory: its home (the directory holding the manifest), or
        the list of all of its directories, home first.
    progress
        Called with the bytes of every shard copy read (for a progress bar).
    lock
        Take each directory's lock, as an optimizer does (``tierstore move``:
        no optimizer may commit while the state is copied); released by
        :meth:`close`. No holder record is written: the directories stay as
        they were.

    Raises
    ------
    ConfigTypeError, ConfigError
        If ``path`` is not a path (a ``str`` or ``os.PathLike``) or is empty.
    StateDirError
        If it is not a directory that can be opened.
    StateDirInUseError
        With ``lock``, if an open optimizer holds one of the directories.
    DriveSetError
        If another drive of the state is missing, holds no member record of
        this state, is another drive of it, or the list's length differs from
        the state's count.
    CorruptStateError
        If the manifest is missing, not a regular file, too large, corrupt, or
        holds a value of the wrong type or out of bounds. A state left dirty by a
        ``durable=False`` run is readable but unreliable: check :attr:`clean`.
    FormatVersionError
        If the manifest was written by another format version.
    """

    def __init__(
        self,
        path: str | os.PathLike | list[str | os.PathLike],
        *,
        progress: Callable[[int], object] | None = None,
        lock: bool = False,
    ) -> None:
        given = state_dir_paths(path, name="path")
        if given is None:
            raise StateDirError("StateReader needs the path of a state directory, got None")
        self.path = given[0]
        self.progress = progress
        self._files: dict[tuple[int, int], ShardFile] = {}
        self._buffer: HostBuffer | None = None
        self._wide: torch.Tensor | None = None
        self._dir_fds: list[int] = []
        self._dir_fd: int | None = _open_dir(self.path, missing=CorruptStateError(
            f"{self.path / MANIFEST} is missing; this directory holds no committed state"))  # fmt: skip
        self._dir_fds.append(self._dir_fd)
        self._lock = lock
        try:
            if lock:  # before the manifest is read: no commit replaces it while this reader holds it
                _lock_dir(self._dir_fd, self.path)
            self.manifest = read_manifest_file(self.path / MANIFEST, dir_fd=self._dir_fd)
            self.layout: Layout = manifest_mod.saved_layout(self.manifest, str(self.path))
            #: Every directory of the state, the home first.
            self.paths: list[Path] = self._open_drives(given)
        except BaseException:
            self.close()
            raise
        self.clean = bool(self.manifest.get("clean", True))
        self.records: list[dict] = self.manifest["shards"]
        sizes = [self.layout.shard_nbytes(shard) for shard in self.layout.shards]
        record = self.manifest.get("drives")
        #: The drive of each shard (all 0 in a one-directory state).
        self.placement: list[int] = list(record["placement"]) if record else [0] * len(sizes)
        self._offsets, self._drive_nbytes = drive_offsets(sizes, self.placement, drives=len(self.paths))

    def _open_drives(self, given: list[Path]) -> list[Path]:
        """Open the state's other directories (given, else recorded) and check their member records."""
        record = self.manifest.get("drives")
        count = 1 if record is None else int(record["count"])
        if len(given) > 1 and len(given) != count:
            spans = "one directory" if count == 1 else f"{count} directories ({record['paths']!r})"
            raise DriveSetError(
                f"path lists {len(given)} directories, the state in {str(self.path)!r} spans {spans}; pass its "
                "home alone, or all of its directories in order, home first"
            )
        if count == 1:
            return [self.path]
        paths = given if len(given) > 1 else [self.path] + [Path(p) for p in record["paths"][1:]]
        for k in range(1, count):
            how = "given" if len(given) > 1 else "recorded in its manifest"
            fd = _open_dir(paths[k], missing=DriveSetError(
                f"drive {k} of the state in {str(self.path)!r} is missing: {str(paths[k])!r} ({how}) does not "
                "exist. Mount the drive, or pass all of the state's directories where they are now, home first"))  # fmt: skip
            self._dir_fds.append(fd)
            if self._lock:
                _lock_dir(fd, paths[k])
            member = read_member_at(fd, paths[k] / MEMBER)
            if member is None or member.state != record["id"] or member.index != k:
                what = "holds no member record" if member is None else (
                    f"belongs to another state (id {member.state})" if member.state != record["id"]
                    else f"is drive {member.index} of this state, not drive {k}")  # fmt: skip
                raise DriveSetError(
                    f"{str(paths[k])!r} ({how} as drive {k} of the state in {str(self.path)!r}) {what}; pass all "
                    "of the state's directories where they are now, in the state's order, home first"
                )
        return paths

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
        """Bytes on disk (allocated) of each state file present: the home's by name, another drive's
        as ``drive{k}/name``."""
        sizes = {}
        for k in range(len(self.paths)):
            for name in STATE_FILES:
                try:
                    st = os.stat(name, dir_fd=self._drive_fd(k), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                sizes[name if k == 0 else f"drive{k}/{name}"] = st.st_blocks * 512
        return sizes

    def drive_shares(self) -> list[dict[str, Any]]:
        """What each drive holds: its directory, the shards placed there and their bytes (one copy).

        Example
        -------
        >>> import tempfile, torch
        >>> from tierstore import TieredAdamW
        >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
        >>> with TieredAdamW([w], state_dir=d) as opt:
        ...     _ = opt.step()
        >>> with StateReader(d) as r:
        ...     [(s["shards"], s["bytes"]) for s in r.drive_shares()]
        [(1, 8192)]
        """
        counts = [0] * len(self.paths)
        for drive in self.placement:
            counts[drive] += 1
        return [{"index": k, "path": str(p), "shards": counts[k], "bytes": self._drive_nbytes[k]} for k, p in enumerate(self.paths)]

    def file_path(self, index: int, copy: int) -> Path:
        """The state file holding copy ``copy`` of shard ``index`` (on the shard's drive)."""
        return self.paths[self.placement[index]] / STATE_FILES[copy]

    # -- shard access -------------------------------------------------
    def _drive_fd(self, k: int) -> int:
        self._open_dir()
        return self._dir_fds[k]

    def _file(self, drive: int, copy: int) -> ShardFile:
        if (drive, copy) not in self._files:
            path = self.paths[drive] / STATE_FILES[copy]
            for backend in READ_BACKENDS:
                try:
                    self._files[drive, copy] = open_backend(
                        backend, path, self._drive_nbytes[drive], create=False, readonly=True, dir_fd=self._drive_fd(drive)
                    )
                    break
                except BackendError:  # O_DIRECT refused here (tmpfs on older kernels): read through the cache
                    if backend == READ_BACKENDS[-1]:
                        raise
        return self._files[drive, copy]

    def _offset(self, index: int) -> int:
        return self._offsets[index]

    def _read(self, index: int, copy: int) -> tuple[torch.Tensor, str, int, int]:
        nbytes = self.layout.shard_nbytes(index)
        offset = self._offset(index)
        if self._buffer is None:
            self._buffer = HostBuffer(self.layout.slot_nbytes, pin=False)
        view = self._buffer.view[:nbytes]
        try:
            self._file(self.placement[index], copy).read_into(view, offset)
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
            raise checksum_mismatch(index, self.file_path(index, rec["copy"]), offset, nbytes, rec["checksum"], got)
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
                name = str(self.file_path(shard.index, self.records[shard.index]["copy"]))
                problems.append(Problem(shard.index, name, self._offset(shard.index), self.layout.shard_nbytes(shard), _uncommitted(shard.index, self.path), "error"))
            for copy, expected, severity in self._checks(shard):
                name = str(self.file_path(shard.index, copy))
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
        self._dir_fd = None
        fds, self._dir_fds = self._dir_fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:  # a reader used without ``with`` or close() must not leak descriptors
        if getattr(self, "_dir_fds", None):
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> StateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_dir(path: Path, *, missing: Exception) -> int:
    """A directory's descriptor (a link the caller named is followed, once); ``missing`` if it does not exist."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
    except FileNotFoundError:
        raise missing from None
    except OSError as exc:
        raise StateDirError(f"cannot open the state directory {path}: {exc.strerror}; pass a directory you can read") from exc



def _lock_dir(fd: int, path: Path) -> None:
    """Take the directory's lock as an optimizer does (flock on its descriptor), or say who holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StateDirInUseError(
                f"state_dir={str(path)!r} is in use by an open optimizer ({read_holder(fd)}); close() it first"
            ) from None
        raise StateDirError(f"cannot lock {str(path)!r}: {exc.strerror}; put the state on a local filesystem") from exc
