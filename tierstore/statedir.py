"""The state directory: an exclusive lock, a manifest, and the files beside it.

One optimizer at a time may open a directory: ``open()`` takes an exclusive
``flock`` on ``<dir>/.lock`` (released by ``close()`` or by the process
dying, so a crash never leaves a stale lock). The manifest
(``manifest.json``) names the format version and the layout the files
belong to; it is replaced atomically (write a temporary file, ``fsync``,
``rename``, ``fsync`` the directory), so readers see the old or the new one,
never a torn one. A directory it creates is made durable in its parent
before anything is committed in it.

Example
-------
>>> import tempfile
>>> d = StateDir(tempfile.mkdtemp()).open()
>>> d.holds_state()
False
>>> d.write_manifest({"step_count": 0}); d.holds_state()
True
>>> d.close()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import xxhash

from .errors import (
    CorruptStateError,
    DiskFullError,
    FormatVersionError,
    StateDirError,
    StateDirInUseError,
)
from .faults import crash_point

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
INFLIGHT = ".inflight"  # present while a step may be overwriting stale copies
FORMAT_NAME = "tierstore"
FORMAT_VERSION = 1


class StateDir:
    """A directory holding one optimizer's state.

    Parameters
    ----------
    path
        The directory (created if missing). ``None`` makes a private
        temporary directory that :meth:`close` removes.

    Raises
    ------
    StateDirError
        From :meth:`open`, if the directory cannot be created or written.
    StateDirInUseError
        From :meth:`open`, if another open optimizer holds it.
    """

    def __init__(self, path: Path | str | None) -> None:
        self.private = path is None
        self.path: Path | None = None if path is None else Path(path).expanduser()
        self._lock_fd: int | None = None

    def open(self) -> StateDir:
        if self._lock_fd is not None:
            return self
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="tierstore-"))
        path = self.path
        self._created_dir = not path.exists()
        self._created_lock = not (path / LOCK).exists()
        missing = [p for p in (path, *path.parents) if not p.exists()]  # innermost first
        try:
            path.mkdir(parents=True, exist_ok=True)
            # A new directory's name lives in its parent: until the parent is synced a
            # power cut may lose the directory and every commit made inside it.
            for created in reversed(missing):
                fsync_dir(created.parent)
        except FileExistsError:
            raise StateDirError(
                f"state_dir={str(path)!r} exists and is not a directory; pass a directory path"
            ) from None
        except OSError as exc:
            raise StateDirError(
                f"cannot create state_dir={str(path)!r}: {exc.strerror}; pass a writable directory "
                "on a local drive"
            ) from exc
        if not path.is_dir():
            raise StateDirError(f"state_dir={str(path)!r} is not a directory; pass a directory path")
        try:
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateDirError(
                f"state_dir={str(path)!r} is not writable ({exc.strerror}); pass a directory you "
                "can write to, or fix its permissions"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirInUseError(
                    f"state_dir={str(path)!r} is in use by another open optimizer (this or another "
                    "process); close() that one first, or give this one its own state_dir"
                ) from None
            raise StateDirError(f"cannot lock state_dir={str(path)!r}: {exc.strerror}") from exc
        if not os.access(path, os.W_OK):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise StateDirError(
                f"state_dir={str(path)!r} is not writable; pass a directory you can write to"
            )
        self._lock_fd = fd
        return self

    @property
    def is_open(self) -> bool:
        return self._lock_fd is not None

    def file(self, name: str) -> Path:
        assert self.path is not None
        return self.path / name

    def holds_state(self) -> bool:
        """True if a manifest or any state file of a previous run is present."""
        assert self.path is not None
        return (self.path / MANIFEST).exists() or any(self.path.glob("shards*.bin"))

    def read_manifest(self) -> dict:
        """The manifest, checked for integrity, format and version.

        Raises
        ------
        CorruptStateError
            If it is missing, not valid JSON, or fails its checksum.
        FormatVersionError
            If it was written by a newer (or unknown) format version.
        """
        assert self.path is not None
        return read_manifest_file(self.path / MANIFEST)

    def write_manifest(self, data: dict) -> None:
        """Replace the manifest atomically and durably (with its checksum)."""
        body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **data}
        body.pop("manifest_checksum", None)
        body["manifest_checksum"] = _manifest_checksum(body)
        atomic_write(self.file(MANIFEST), json.dumps(body, sort_keys=True, separators=(",", ":")).encode())

    def begin_writes(self) -> None:
        """Durably mark that stale copies are about to be overwritten (once per commit)."""
        path = self.file(INFLIGHT)
        if path.exists():
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(path.parent)
        except OSError as exc:
            raise _dir_error(exc, path) from exc
        crash_point("inflight-marker")

    def end_writes(self) -> None:
        """Remove the in-flight marker after a commit (no sync: a leftover marker is harmless)."""
        with contextlib.suppress(FileNotFoundError):
            self.file(INFLIGHT).unlink()

    def writes_in_flight(self) -> bool:
        """True if a step may have been interrupted while overwriting stale copies."""
        return self.file(INFLIGHT).exists()

    def close(self, *, discard: bool = False) -> None:
        """Release the lock; remove the directory if it was private. Safe twice.

        ``discard=True`` (a failed start) also removes the lock file and the
        directory if this object created them and nothing else was put there.
        """
        fd, self._lock_fd = self._lock_fd, None
        if discard and fd is not None and self.path is not None and not self.private:
            if getattr(self, "_created_lock", False):
                (self.path / LOCK).unlink(missing_ok=True)
            if getattr(self, "_created_dir", False):
                with contextlib.suppress(OSError):
                    self.path.rmdir()  # only if empty
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        if self.private and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def _manifest_checksum(body: dict) -> str:
    content = {k: v for k, v in body.items() if k != "manifest_checksum"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(canonical):016x}"


def read_manifest_file(path: Path) -> dict:
    """Read and check a manifest file (see :meth:`StateDir.read_manifest`)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptStateError(f"{path} is missing; this directory holds no committed state") from None
    except OSError as exc:
        raise CorruptStateError(f"{path} cannot be read ({exc.strerror}); restore it from a checkpoint") from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise CorruptStateError(
            f"{path} is corrupt (not valid JSON: {exc}); restore the state directory from a checkpoint"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CorruptStateError(f"{path} is not a tierstore manifest")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise FormatVersionError(
            f"{path} has format_version {version!r}; this tierstore ({FORMAT_NAME} format "
            f"{FORMAT_VERSION}) cannot read it. "
            + ("Upgrade tierstore to resume it." if newer else "It was not written by a known tierstore.")
        )
    if data.get("manifest_checksum") != _manifest_checksum(data):
        raise CorruptStateError(
            f"{path} fails its checksum: it was modified or corrupted after it was written; "
            "restore the state directory from a checkpoint"
        )
    return data


def _dir_error(exc: OSError, path: Path) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"disk full while writing {path}; free space on that drive. The last committed "
            "state is untouched and resumable"
        )
    return StateDirError(f"cannot write {path}: {exc.strerror}")


def atomic_write(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves the old or the new content.

    Raises
    ------
    DiskFullError
        If the drive is full; the old file is left as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("manifest-tmp")
        os.replace(tmp, path)
        crash_point("manifest-renamed")
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _dir_error(exc, path) from exc


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
