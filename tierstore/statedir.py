"""The state directory: an exclusive lock, a manifest, and the files beside it.

One optimizer at a time may open a directory: ``open()`` takes an exclusive
``flock`` on ``<dir>/.lock`` (released by ``close()`` or by the process
dying, so a crash never leaves a stale lock). The manifest
(``manifest.json``) names the format version and the layout the files
belong to; it is replaced atomically (write a temporary file, ``fsync``,
``rename``, ``fsync`` the directory), so readers see the old or the new one,
never a torn one.

Example
-------
>>> import tempfile
>>> d = StateDir(tempfile.mkdtemp()).open()
>>> d.holds_state()
False
>>> d.write_manifest({"format_version": 1}); d.holds_state()
True
>>> d.close()
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .errors import CorruptStateError, FormatVersionError, StateDirError, StateDirInUseError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
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
        try:
            path.mkdir(parents=True, exist_ok=True)
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
        """The manifest, checked for format and version.

        Raises
        ------
        CorruptStateError
            If it is missing or not valid JSON.
        FormatVersionError
            If it was written by a newer (or unknown) format version.
        """
        path = self.file(MANIFEST)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CorruptStateError(f"{path} is missing; this directory holds no committed state") from None
        except (OSError, ValueError) as exc:
            raise CorruptStateError(f"{path} cannot be read ({exc}); restore it from a checkpoint") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CorruptStateError(f"{path} is not a tierstore manifest")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"{path} has format_version {version!r}; this tierstore reads version {FORMAT_VERSION}. "
                + ("Upgrade tierstore to read it." if isinstance(version, int) and version > FORMAT_VERSION else "")
            )
        return data

    def write_manifest(self, data: dict) -> None:
        """Replace the manifest atomically and durably."""
        data = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **data}
        atomic_write(self.file(MANIFEST), json.dumps(data, indent=1, sort_keys=True).encode())

    def close(self) -> None:
        """Release the lock; remove the directory if it was private. Safe twice."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        if self.private and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def atomic_write(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
