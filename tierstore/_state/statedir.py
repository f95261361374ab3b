"""The state directory: an exclusive lock, a manifest, and the files beside it.

One optimizer at a time may open a directory. ``open()`` opens the directory
once and works through that descriptor from then on: every file inside is
opened relative to it, never through a symbolic link (``O_NOFOLLOW``), only
if it is a regular file (a FIFO, a device or a directory in a file's place is
refused at once, never read or waited on), and temporaries are created
exclusively (``O_EXCL``). A ``state_dir`` that is itself a symlink is
followed once, when it is opened; the descriptor pins the directory it
pointed to then.

The lock is an exclusive ``flock`` on the directory's own descriptor, so
deleting or replacing a file inside cannot release it; it is released by
``close()`` or by the process dying (a crash never leaves a stale lock).
``.lock`` beside it only says who holds it (pid, host, since when), for the
message another opener gets.

The manifest (``manifest.json``) names the format version and the layout the
files belong to; it is replaced atomically (write a temporary file,
``fsync``, ``rename``, ``fsync`` the directory), so readers see the old or
the new one, never a torn one. It is read only from a regular file of at most
:data:`MAX_MANIFEST_BYTES`, and checked (:func:`tierstore._state.manifest.validate`)
before anything uses it. A directory it creates is made durable in its
parent before anything is committed in it.

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
import datetime
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .._platform.faults import crash_point
from .._storage.store import STATE_FILES
from .._version import __version__
from ..backends import PROBE_PREFIX
from ..backends.base import O_CLOEXEC, O_NOFOLLOW, open_regular
from ..errors import (
    ConfigError,
    ConfigTypeError,
    NoStateError,
    NotStateDirError,
    StateDirError,
    StateDirInUseError,
    TierstoreError,
)
from .atomic_write import atomic_write, fsync_dir, write_all, write_error
from .drive_record import MEMBER
from .manifest import short_repr
from .manifest_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    manifest_checksum,
    read_at_most,
    read_manifest_file,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_TMP = f".{MANIFEST}.tmp"
LOCK = ".lock"  # who holds the directory (the lock itself is on the directory's descriptor)
INFLIGHT = ".inflight"  # present while a step may be overwriting stale copies

MAX_HOLDER_BYTES = 4 << 10  # 4 KiB: the holder record is a few dozen bytes
_HOLDER_TMP = (".lock-", ".tmp")  # a holder record being written: prefix and suffix
#: The names tierstore writes in a state directory (a member record only in a state over several); anything
#: else makes it foreign.
OWN_NAMES = frozenset({MANIFEST, MANIFEST_TMP, LOCK, INFLIGHT, *STATE_FILES, MEMBER, f".{MEMBER}.tmp"})
HARMLESS_NAMES = frozenset({"lost+found"})  # a filesystem's root: a drive given whole
_OPEN_ATTEMPTS = 5  # opens of a directory removed under us before giving up


def state_dir_path(value: Any, *, name: str = "state_dir") -> Path | None:
    """``value`` as a state directory path (``None`` stays ``None``: a private temporary directory).

    Raises
    ------
    ConfigTypeError
        If it is not a ``str`` or ``os.PathLike`` of text (``42``, a list, ``bytes``).
    ConfigError
        If it is empty (``""`` would mean the current directory).

    Example
    -------
    >>> state_dir_path("~/run").name
    'run'
    >>> state_dir_path(42)
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigTypeError: state_dir=42 (int) must be a path: a str or os.PathLike, ...
    """
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ConfigTypeError(
            f"{name}={short_repr(value)} ({type(value).__name__}) must be a path: a str or os.PathLike, e.g. "
            f"{name}='./optimizer-state' (or a list of them, one per drive; or None for a private temporary "
            "directory)"
        )
    if text == "":
        raise ConfigError(
            f"{name}='' is an empty path (it would put the state in the current directory); pass a "
            f"directory such as {name}='./optimizer-state', or None for a private temporary directory"
        )
    if "\0" in text:
        raise ConfigError(f"{name}={short_repr(text)} contains a NUL character; pass a valid directory path")
    return Path(text).expanduser()


class StateDir:
    """A directory holding one optimizer's state.

    Parameters
    ----------
    path
        The directory (created if missing): a ``str`` or ``os.PathLike``.
        ``None`` makes a private temporary directory that :meth:`close` removes.

    Raises
    ------
    ConfigTypeError, ConfigError
        If ``path`` is not a path, or is empty.
    StateDirError
        From :meth:`open`, if the directory cannot be created or written.
    NotStateDirError
        From :meth:`open`, if it holds files that are not tierstore's.
    StateDirInUseError
        From :meth:`open`, if another open optimizer holds it (naming that one).
    """

    def __init__(self, path: Path | str | os.PathLike | None) -> None:
        self.private = path is None
        self.path: Path | None = state_dir_path(path)
        self.fd: int | None = None  # the directory's descriptor, locked, while open
        self._created_dir = False

    def open(self, *, create: bool = True) -> StateDir:
        """Open (``create``: make it if missing), lock, check it is tierstore's, record the holder.

        Raises
        ------
        StateDirError, NotStateDirError, StateDirInUseError
            See the class.
        FileNotFoundError
            (a :class:`StateDirError`) if it is missing and ``create`` is false.
        """
        if self.fd is not None:
            return self
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix="tierstore-"))
        path = self.path
        for _ in range(_OPEN_ATTEMPTS):
            if create:
                self._make(path)
            fd = self._open_dir(path)
            try:
                self._lock(fd, path)
            except BaseException:
                os.close(fd)  # not ours: never remove a directory another opener may hold
                self._created_dir = False
                raise
            if os.fstat(fd).st_nlink > 0:
                break
            # Removed between our open and our lock (a failed opener cleaning up what it made):
            # a lock on a deleted directory guards nothing. Open the path afresh.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        else:
            raise StateDirError(f"state_dir={str(path)!r} keeps being removed while it is opened; retry")
        try:
            holder = self._write_holder_tmp(fd, path)
            try:
                if not self.private:
                    self._refuse_foreign(fd, path, holder)
                os.replace(holder, LOCK, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(holder, dir_fd=fd)
                raise
        except OSError as exc:
            self._abandon(fd)
            if isinstance(exc, TierstoreError):
                raise
            raise StateDirError(
                f"cannot record the holder of state_dir={str(path)!r} in {LOCK}: {exc.strerror}; "
                f"remove {str(path / LOCK)!r} if it is not a regular file, and check the directory's permissions"
            ) from exc
        except BaseException:
            self._abandon(fd)
            raise
        self.fd = fd
        return self

    def _abandon(self, fd: int) -> None:
        """Undo a failed open while holding the lock: remove the directory if this open made it
        (and it is empty), then unlock and close."""
        if self._created_dir and self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self._created_dir = False
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _make(self, path: Path) -> None:
        self._created_dir = not path.exists()
        missing = [p for p in (path, *path.parents) if not p.exists()]  # innermost first
        try:
            path.mkdir(parents=True, exist_ok=True)
            # A new directory's name lives in its parent: until the parent is synced a
            # power cut may lose the directory and every commit made inside it.
            for created in reversed(missing):
                fsync_dir(created.parent)
        except FileExistsError:
            self._created_dir = False
            raise StateDirError(
                f"state_dir={str(path)!r} exists and is not a directory; pass a directory path"
            ) from None
        except OSError as exc:
            self._created_dir = False
            raise StateDirError(
                f"cannot create state_dir={str(path)!r}: {exc.strerror}; pass a writable directory "
                "on a local drive"
            ) from exc

    def _open_dir(self, path: Path) -> int:
        # Followed once if it is a symlink the user gave; the descriptor pins that directory.
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
        except FileNotFoundError:
            raise NoStateError(
                f"state_dir={str(path)!r} does not exist, so it holds no committed state to resume; pass "
                "the state_dir of an earlier run, or resume='auto' to start fresh when there is nothing to resume"
            ) from None
        except NotADirectoryError:
            raise StateDirError(f"state_dir={str(path)!r} is not a directory; pass a directory path") from None
        except OSError as exc:
            raise StateDirError(
                f"cannot open state_dir={str(path)!r}: {exc.strerror}; pass a directory you can read and write"
            ) from exc

    def _lock(self, fd: int, path: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StateDirInUseError(
                    f"state_dir={str(path)!r} is in use by another open optimizer ({read_holder(fd)}); "
                    "close() that one first, or give this one its own state_dir"
                ) from None
            raise StateDirError(
                f"cannot lock state_dir={str(path)!r}: {exc.strerror}; put state_dir on a local "
                "filesystem that supports flock"
            ) from exc

    def _write_holder_tmp(self, fd: int, path: Path) -> str:
        """Write who holds the directory into a new temporary (renamed to ``.lock`` once the directory passed).

        Creating it is also the check that the directory is writable.
        """
        name = f"{_HOLDER_TMP[0]}{os.getpid()}-{secrets.token_hex(4)}{_HOLDER_TMP[1]}"
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "tierstore": __version__}
        try:
            hfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644, dir_fd=fd)
        except OSError as exc:
            raise StateDirError(
                f"state_dir={str(path)!r} is not writable ({exc.strerror}); pass a directory you can "
                "write to, or fix its permissions"
            ) from exc
        try:
            write_all(hfd, json.dumps(record).encode())
        except OSError as exc:
            os.close(hfd)
            os.unlink(name, dir_fd=fd)
            raise write_error(exc, path / LOCK) from exc
        os.close(hfd)
        return name

    def _refuse_foreign(self, fd: int, path: Path, holder: str) -> None:
        foreign = []
        for entry in sorted(os.listdir(fd)):
            if entry in OWN_NAMES or entry in HARMLESS_NAMES or entry.startswith(PROBE_PREFIX):
                continue
            if entry.startswith(_HOLDER_TMP[0]) and entry.endswith(_HOLDER_TMP[1]):
                if entry != holder:  # a holder record left by a process killed while opening
                    with contextlib.suppress(OSError):
                        os.unlink(entry, dir_fd=fd)
                continue
            foreign.append(entry)
        if foreign:
            shown = ", ".join(short_repr(n, 60) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise NotStateDirError(
                f"state_dir={str(path)!r} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that "
                f"tierstore did not write ({shown}): it is not a tierstore state directory, and tierstore "
                "does not mix its state with other files. Pass an empty or new directory, or the state_dir "
                "of an earlier run (move the other files away)"
            )

    @property
    def is_open(self) -> bool:
        return self.fd is not None

    def _fd(self) -> int:
        if self.fd is None:
            raise StateDirError(f"the state directory {self.path} is not open; this is a tierstore bug")
        return self.fd

    def file(self, name: str) -> Path:
        """The path of ``name`` in the directory (for messages: files are opened through :attr:`fd`)."""
        assert self.path is not None
        return self.path / name

    def exists(self, name: str) -> bool:
        """True when ``name`` exists in the directory, whatever it is (a link is not followed)."""
        try:
            os.stat(name, dir_fd=self._fd(), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def holds_state(self) -> bool:
        """True if a manifest, a member record or any state file of a previous run is present."""
        names = os.listdir(self._fd())
        return MANIFEST in names or MEMBER in names or any(n.startswith("shards") and n.endswith(".bin") for n in names)

    def read_manifest(self) -> dict:
        """The manifest, checked for integrity, format, version and content.

        Raises
        ------
        CorruptStateError
            If it is missing, not a regular file, too large, not valid JSON, fails
            its checksum, or holds a value of the wrong type or out of bounds.
        FormatVersionError
            If it was written by a newer (or unknown) format version.
        """
        return read_manifest_file(self.file(MANIFEST), dir_fd=self._fd())

    def write_manifest(self, data: dict) -> None:
        """Replace the manifest atomically and durably (with its checksum).

        Raises
        ------
        StateDirError
            If it would be larger than :data:`MAX_MANIFEST_BYTES` (it could not be read back).
        DiskFullError
            If the drive is full; the old manifest is left as it was.
        """
        body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **data}
        body.pop("manifest_checksum", None)
        body["manifest_checksum"] = manifest_checksum(body)
        payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if len(payload) > MAX_MANIFEST_BYTES:
            raise StateDirError(
                f"the manifest of {self.path} would be {len(payload)} bytes, more than the "
                f"{MAX_MANIFEST_BYTES >> 20} MiB a manifest may be; build the optimizer with a larger "
                "shard_numel (fewer shards)"
            )
        atomic_write(self.file(MANIFEST), payload, dir_fd=self._fd())

    def begin_writes(self) -> None:
        """Durably mark that stale copies are about to be overwritten (once per commit).

        Raises
        ------
        StateDirError
            If something other than a regular file stands at ``.inflight``.
        """
        fd_dir = self._fd()
        path = self.file(INFLIGHT)
        if self.exists(INFLIGHT):
            os.close(open_regular(path, os.O_RDONLY, dir_fd=fd_dir, what="in-flight marker", error=StateDirError))
            return
        try:
            fd = open_regular(path, os.O_WRONLY | os.O_CREAT, dir_fd=fd_dir, what="in-flight marker", error=StateDirError)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(fd_dir)
        except OSError as exc:
            if isinstance(exc, TierstoreError):
                raise
            raise write_error(exc, path) from exc
        crash_point("inflight-marker")

    def end_writes(self) -> None:
        """Remove the in-flight marker after a commit (no sync: a leftover marker is harmless)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(INFLIGHT, dir_fd=self._fd())

    def writes_in_flight(self) -> bool:
        """True if a step may have been interrupted while overwriting stale copies."""
        return self.exists(INFLIGHT)

    def close(self, *, discard: bool = False) -> None:
        """Release the lock (removing the holder record); remove the directory if it was private. Safe twice.

        ``discard=True`` (a failed start) also removes the directory if this
        object created it and nothing else was put there.
        """
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                if not self.private:
                    with contextlib.suppress(OSError):
                        os.unlink(LOCK, dir_fd=fd)
                    if discard and self._created_dir and self.path is not None:
                        with contextlib.suppress(OSError):
                            self.path.rmdir()  # only if empty
            finally:
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)
        if self.private and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


def read_holder(dir_fd: int) -> str:
    """Who holds a locked directory, from its ``.lock`` record, as words for a message.

    The record may be missing (being written), or crafted: only a pid, a host
    name and a time of the expected types are reported; anything else reads
    as unknown.

    Example
    -------
    >>> import tempfile
    >>> d = StateDir(tempfile.mkdtemp()).open()
    >>> read_holder(d.fd).startswith("pid ")
    True
    >>> d.close()
    """
    unknown = "its holder is unknown: no readable holder record"
    try:
        fd = open_regular(Path(LOCK), os.O_RDONLY, dir_fd=dir_fd, what="holder record")
    except (OSError, TierstoreError):
        return unknown
    try:
        raw = read_at_most(fd, MAX_HOLDER_BYTES)
    except OSError:
        return unknown
    finally:
        os.close(fd)
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return unknown
    if not isinstance(record, dict):
        return unknown
    pid, host, since = record.get("pid"), record.get("host"), record.get("since")
    parts = []
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31:
        parts.append(f"pid {pid}")
    if isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable():
        parts.append(f"on host {host!r}")
    if isinstance(since, (int, float)) and not isinstance(since, bool) and 0 <= since < 1 << 36:
        when = datetime.datetime.fromtimestamp(since, tz=datetime.timezone.utc)
        parts.append(f"since {when:%Y-%m-%d %H:%M:%S} UTC")
    return " ".join(parts) if parts else unknown
