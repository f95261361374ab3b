"""One drive's part of a shard store: its directory, its state files (one per copy) and its own I/O queue.

A state over several directories keeps, per drive, the files of the shards
placed there (:mod:`tierstore._storage.placement`) and an
:class:`~tierstore._storage.transfer.IOQueue` of its own, so each drive has
its own requests in flight and a slow drive never queues a fast one's
requests behind its own. Its backend is resolved per drive (``"auto"``:
``direct`` where the filesystem takes ``O_DIRECT``, else ``mmap``).

Files are opened relative to the directory's descriptor, never through a
symbolic link, only if they are regular files
(:func:`~tierstore.backends.base.open_regular`). A file created in a drive
that is not the home is a new name in that directory: :meth:`DriveFiles.sync`
makes it durable (``fsync`` of the directory) before a commit's manifest
may name its bytes (the home's own names are synced with the manifest's
rename).

Example
-------
>>> import tempfile
>>> drive = DriveFiles(0, tempfile.mkdtemp(), None, nbytes=1 << 20, backend="buffered", io_workers=2,
...                    request_bytes=1 << 20)
>>> drive.open(copies=2, allocated=2, must_exist=set(), extents=[(0, 1 << 20)])
>>> [f.path.name for f in drive.files], drive.backend_name
(['shards.0.bin', 'shards.1.bin'], 'buffered')
>>> drive.close()
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

from ..backends import ShardFile, open_backend, resolve_backend
from ..backends.base import O_CLOEXEC
from ..errors import ConfigError, CorruptStateError
from .transfer import IOQueue

__all__ = ["STATE_FILES", "DriveFiles"]

STATE_FILES = ("shards.0.bin", "shards.1.bin")


class DriveFiles:
    """One drive's state files and I/O queue (see the module docs).

    Parameters
    ----------
    index
        The drive's index in its state (0: the home).
    directory
        Its directory; ``None`` for a store that never needs files.
    dir_fd
        The directory's open descriptor (borrowed: its owner closes it); ``None``: opened here when needed.
    nbytes
        Bytes of one copy of the shards placed on this drive (each state file's size).
    backend, io_workers, request_bytes
        As :class:`~tierstore._storage.store.ShardStore` takes them.
    """

    def __init__(
        self,
        index: int,
        directory: Path | str | None,
        dir_fd: int | None,
        *,
        nbytes: int,
        backend: str,
        io_workers: int,
        request_bytes: int,
    ) -> None:
        self.index = index
        self.directory = Path(directory) if directory is not None else None
        self.nbytes = nbytes
        self.backend_name = backend
        self.io_workers = io_workers
        self.request_bytes = request_bytes
        self._given_fd = dir_fd
        self._own_fd: int | None = None
        self.files: list[ShardFile] = []
        self.io: IOQueue | None = None
        self.created: list[Path] = []  # files this open created (removed again by a failed start)
        self._unsynced_names = False  # created in a member directory, not yet made durable there
        self._dirty: set[int] = set()  # copies written since their last sync
        self._dirty_lock = threading.Lock()

    # -- the directory ------------------------------------------------
    def fd(self) -> int:
        """The directory's descriptor: the one given, else one opened here (and closed by :meth:`close`)."""
        if self._given_fd is not None:
            return self._given_fd
        if self._own_fd is None:
            if self.directory is None:
                raise ConfigError("a store with state on disk needs a directory")
            try:
                self._own_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
            except OSError as exc:
                raise CorruptStateError(
                    f"cannot open the state directory {self.directory}: {exc.strerror}; pass an "
                    "existing directory you can read and write"
                ) from exc
        return self._own_fd

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd(), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def file_path(self, copy: int) -> Path:
        assert self.directory is not None
        return self.directory / STATE_FILES[copy]

    # -- files --------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.io is not None

    def open(self, *, copies: int, allocated: int, must_exist: set[int], extents: Iterable[tuple[int, int]]) -> None:
        """Open (or create) the state files of copies ``0 .. copies-1``, allocate ``extents`` in the first
        ``allocated`` of them, start the queue.

        ``must_exist``: copies a resume reads (a missing file is an error there).
        """
        if self.directory is None:
            raise ConfigError("a store with state on disk needs a directory")
        dir_fd = self.fd()
        self.backend_name = resolve_backend(self.backend_name, self.directory, dir_fd=dir_fd)
        for c in range(copies):
            path = self.file_path(c)
            if not self._exists(path.name):
                self.created.append(path)
                self._unsynced_names = self.index > 0
            self.files.append(open_backend(self.backend_name, path, self.nbytes, create=c not in must_exist, dir_fd=dir_fd))
        for offset, nbytes in extents:
            for f in self.files[:allocated]:
                f.allocate(offset, nbytes)
        self.io = IOQueue(workers=self.io_workers, request_bytes=self.request_bytes)

    def remove_created(self) -> None:
        """Remove the files this open created (a failed start leaves no half-made files behind)."""
        created, self.created = self.created, []
        if not created:
            return
        dir_fd = self.fd()
        for path in created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dir_fd)

    def mark_dirty(self, copy: int) -> None:
        with self._dirty_lock:
            self._dirty.add(copy)

    def start_sync(self) -> Future | None:
        """Start syncing the copies written since their last sync (and new names), on this drive's queue."""
        with self._dirty_lock:
            dirty = sorted(self._dirty)
        if not dirty and not self._unsynced_names:
            return None
        assert self.io is not None
        return self.io.call(self._sync, dirty)

    def _sync(self, dirty: list[int]) -> None:
        for copy in dirty:
            self.files[copy].sync()
        if self._unsynced_names:
            os.fsync(self.fd())  # the files' names: a power cut must not lose a file a manifest names
            self._unsynced_names = False
        with self._dirty_lock:  # forgotten only once synced: a failed sync is not "done"
            self._dirty.difference_update(dirty)

    def close(self) -> None:
        """Stop the queue's workers and close the files (and a descriptor opened here); safe twice."""
        if self.io is not None:
            self.io.close()
            self.io = None
        for f in self.files:
            f.close()
        self.files = []
        if self._own_fd is not None:
            os.close(self._own_fd)
            self._own_fd = None
