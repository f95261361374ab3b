"""The directories of one state: its home and its other drives, each open and locked, checked against each other.

``state_dir`` names one directory or several (a list: one per drive). The
first is the *home*: it holds the lock and holder record, the manifest and
the in-flight marker, as a single state directory does, plus its own
shards' files. Every directory is a :class:`~tierstore._state.statedir.StateDir`:
opened once by descriptor, locked with ``flock``, refused if it holds files
that are not tierstore's. With two or more, each one (the home too) also
holds a member record (:mod:`tierstore._state.drive_record`): the state's
random id, its index and the count; the manifest records the id, the count
and the placement (the drive of each shard).

:class:`DriveSet` opens them and refuses, with a
:class:`~tierstore.errors.DriveSetError` that names the directory and the fix:

- a directory given twice (the same ``st_dev``/``st_ino``, also through a
  symbolic link or another spelling of the path);
- a count that differs from the state's (the fix: all of its directories,
  or ``tierstore move`` to another set of drives);
- a missing drive (a directory that does not exist when resuming);
- a directory of another state (its member record names another id), or
  one that holds no member record of this state;
- two directories swapped (a member record names another index).

A one-directory state never writes a member record; a path and a
one-element list are the same state directory.

Example
-------
>>> import tempfile
>>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
>>> drives = DriveSet([a, b])
>>> home = drives.open_home(create=True)
>>> drives.open_members(None, resume=False)
>>> [read_member(d).index for d in drives.dirs], drives.count
([0, 1], 2)
>>> drives.close(discard=True)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._config.registry import env
from .._layout.layout import Layout
from .._storage.drive_speed import probe_drives, probe_nbytes
from .._storage.placement import MAX_DRIVES, check_bandwidths, drive_bytes, place
from ..backends.base import open_regular
from ..errors import (
    ConfigError,
    ConfigTypeError,
    CorruptStateError,
    DriveSetError,
    NoStateError,
    StateExistsError,
)
from .atomic_write import atomic_write
from .drive_record import MAX_MEMBER_BYTES, MEMBER, Member, drive_record, new_state_id
from .manifest import short_repr
from .manifest_file import read_at_most
from .statedir import MANIFEST, StateDir, state_dir_path

__all__ = ["DriveSet", "state_dir_paths", "read_member", "read_member_at", "write_member", "refuse_repeats"]

log = logging.getLogger(__name__)

_MOVE = "to put the state on other drives, run `tierstore move` (docs/choosing-budget-and-drive.md)"


def state_dir_paths(value: Any, *, name: str = "state_dir") -> list[Path] | None:
    """``state_dir`` as a list of directories, home first (``None`` stays ``None``: a private temporary directory).

    One path and a one-element list are the same.

    Raises
    ------
    ConfigTypeError
        If it is neither a path (``str``/``os.PathLike``) nor a list or tuple of them,
        naming the entry that is not.
    ConfigError
        If it is an empty list, lists more than 64 directories, or an entry is an empty path.

    Example
    -------
    >>> [p.name for p in state_dir_paths(["/nvme0/run", "/nvme1/run"])]
    ['run', 'run']
    >>> state_dir_paths("/nvme0/run") == state_dir_paths(["/nvme0/run"])
    True
    >>> state_dir_paths(["/nvme0/run", 7])
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigTypeError: state_dir[1]=7 (int) must be a path: a str or os.PathLike, ...
    """
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        return [state_dir_path(value, name=name)]
    if not value:
        raise ConfigError(
            f"{name}={short_repr(value)} lists no directory; pass one directory, or one per drive, e.g. "
            f"{name}=['/nvme0/run', '/nvme1/run'] (or None for a private temporary directory)"
        )
    if len(value) > MAX_DRIVES:
        raise ConfigError(f"{name} lists {len(value)} directories; a state spans at most {MAX_DRIVES} drives")
    paths = []
    for k, item in enumerate(value):
        if item is None:
            raise ConfigTypeError(f"{name}[{k}]=None must be a path: a str or os.PathLike, one directory per drive")
        paths.append(state_dir_path(item, name=f"{name}[{k}]"))
    return paths


def _identity(path: Path) -> tuple:
    """What says two paths are one directory: its device and inode, else (not there yet) its resolved path."""
    try:
        st = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("inode", st.st_dev, st.st_ino)


def refuse_repeats(paths: Sequence[Path], identities: Sequence[tuple] | None = None, *, name: str = "state_dir") -> None:
    """Refuse a directory listed twice (through a link or another spelling too).

    ``identities``: each path's ``("inode", st_dev, st_ino)`` taken from its
    open descriptor (after opening: no race); by default they are looked up.

    Raises
    ------
    DriveSetError
        Naming both entries and the fix.

    Example
    -------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> refuse_repeats([Path(d), Path(d) / "." ])
    Traceback (most recent call last):
    ...
    tierstore.errors.DriveSetError: state_dir[0]=... and state_dir[1]=... are the same directory ...
    """
    ids = list(identities) if identities is not None else [_identity(p) for p in paths]
    seen: dict[tuple, int] = {}
    for k, key in enumerate(ids):
        if key in seen:
            j = seen[key]
            raise DriveSetError(
                f"{name}[{j}]={str(paths[j])!r} and {name}[{k}]={str(paths[k])!r} are the same directory (a "
                "symbolic link or another spelling of one path): each drive of a state is one directory. "
                "Give each drive's directory once"
            )
        seen[key] = k


def read_member(statedir: StateDir) -> Member | None:
    """The member record of an open directory (``None`` when it has none); see :func:`read_member_at`."""
    return read_member_at(statedir.fd, statedir.file(MEMBER))


def read_member_at(dir_fd: int, path: Path) -> Member | None:
    """The member record ``path`` in the directory open as ``dir_fd`` (``None`` when there is none).

    Read as a manifest is: never through a link, only a regular file, bounded.

    Raises
    ------
    CorruptStateError
        If something other than a regular file stands there, or it is too
        large or not a record tierstore wrote.
    """
    try:
        fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd, what="member record")
    except FileNotFoundError:
        return None
    except OSError as exc:
        if isinstance(exc, CorruptStateError):
            raise
        raise CorruptStateError(f"the member record {path} cannot be read ({exc.strerror}); check the drive") from exc
    try:
        raw = read_at_most(fd, MAX_MEMBER_BYTES)
    finally:
        os.close(fd)
    if len(raw) > MAX_MEMBER_BYTES:
        raise CorruptStateError(
            f"the member record {path} is larger than {MAX_MEMBER_BYTES} bytes: tierstore did not write it; "
            "remove it, or restore the state's directories from a checkpoint"
        )
    return Member.parse(raw, str(path))


def write_member(statedir: StateDir, member: Member) -> None:
    """Write a directory's member record atomically and durably (its name synced in the directory)."""
    atomic_write(statedir.file(MEMBER), member.to_bytes(), dir_fd=statedir.fd, crash_points=False)


class DriveSet:
    """The directories of one state, home first, each open and locked (see the module docs).

    Open with :meth:`open_home`, find the resume point in the home, then
    :meth:`open_members` with it; :meth:`close` releases all of them.

    Parameters
    ----------
    paths
        The directories, home first; ``None``: one private temporary directory.
    """

    def __init__(self, paths: Sequence[Path | str] | None) -> None:
        self.paths: list[Path] | None = None if paths is None else [Path(p) for p in paths]
        self.dirs: list[StateDir] = []
        self.state_id: str | None = None
        self.home_member: Member | None = None
        self.record: dict | None = None  # the resumed manifest's "drives" entry
        self.placement: list[int] | None = None
        self.bandwidths: tuple[float, ...] | None = None
        self._wrote_members = False

    @property
    def count(self) -> int:
        """How many directories (drives) the state spans."""
        return 1 if self.paths is None else len(self.paths)

    @property
    def home(self) -> StateDir:
        return self.dirs[0]

    def _label(self, k: int) -> str:
        assert self.paths is not None
        return f"state_dir[{k}]={str(self.paths[k])!r}" if self.count > 1 else f"state_dir={str(self.paths[k])!r}"

    def _recorded(self) -> str:
        """The directories the resumed state was last opened with, for messages."""
        paths = (self.record or {}).get("paths")
        return f"state_dir={paths!r}" if paths else "all of its directories, home first"

    # -- opening ------------------------------------------------------
    def open_home(self, *, create: bool) -> StateDir:
        """Refuse repeats, then open and lock the home (``create``: make it if missing) and read its member record.

        Raises
        ------
        DriveSetError
            A directory is listed twice, or the home is another drive of a state.
        StateDirError, NotStateDirError, StateDirInUseError, NoStateError
            As :meth:`StateDir.open <tierstore._state.statedir.StateDir.open>`.
        """
        if self.paths is not None and self.count > 1:
            refuse_repeats(self.paths)
        home = StateDir(self.paths[0] if self.paths is not None else None).open(create=create)
        self.dirs = [home]
        member = read_member(home) if not home.private else None
        if member is not None and member.index != 0:
            raise DriveSetError(
                f"{self._label(0)} is drive {member.index} of a state over {member.count} directories, not its "
                "home (the directory holding the manifest): the directories are given out of order, or not all "
                "of them. Pass all of the state's directories, its home first"
            )
        self.home_member = member
        return home

    def open_members(self, saved: dict | None, *, resume: bool | str) -> None:
        """Open and lock the other directories and check them against the home.

        ``saved`` is the manifest the home resumes (``None``: a fresh state,
        whose member records are written now).

        Raises
        ------
        DriveSetError
            A count that differs from the state's, a missing drive, a directory
            of another state, or two directories swapped (see the module docs).
        StateExistsError
            A fresh state's directory holds another run's state files.
        """
        if saved is not None:
            self._open_saved(saved)
        else:
            self._open_fresh(resume)
        if self.count > 1:
            ids = []
            for d in self.dirs:  # from the descriptors: the directories actually locked
                st = os.fstat(d.fd)
                ids.append(("inode", st.st_dev, st.st_ino))
            assert self.paths is not None
            refuse_repeats(self.paths, ids)

    def _open_saved(self, saved: dict) -> None:
        record = saved.get("drives")
        recorded = 1 if record is None else int(record["count"])
        self.record = record
        home = self.paths[0] if self.paths else None
        if recorded != self.count:
            spans = "one directory" if recorded == 1 else f"{recorded} directories ({self._recorded()})"
            raise DriveSetError(
                f"state_dir lists {self.count} director{'y' if self.count == 1 else 'ies'}, the state in "
                f"{str(home)!r} spans {spans}. Pass exactly the state's directories, its home first; {_MOVE}"
            )
        if recorded == 1:
            return
        state = record["id"]
        member = self.home_member
        if member is None or member.state != state or member.count != recorded:
            raise DriveSetError(
                f"{self._label(0)} holds the manifest of state {state} over {recorded} directories, but "
                + ("no member record" if member is None else f"the member record of state {member.state}")
                + f" ({MEMBER}): the directory was damaged or mixed with another state's. Restore the state's "
                "directories from a checkpoint"
            )
        assert self.paths is not None
        for k in range(1, self.count):
            d = StateDir(self.paths[k])
            try:
                d.open(create=False)
            except NoStateError:
                raise DriveSetError(
                    f"{self._label(k)} does not exist: drive {k} of the state in {str(home)!r} is missing (it was "
                    f"last opened as {self._recorded()}). Mount the drive, or pass the directory where it is now; "
                    "without it the state cannot resume"
                ) from None
            self.dirs.append(d)
            self._check_member(k, read_member(d), state)
        self.state_id = state
        self.placement = list(record["placement"])  # checked against the layout when the manifest was read
        if record.get("bandwidths") is not None:
            self.bandwidths = tuple(record["bandwidths"])

    def _check_member(self, k: int, member: Member | None, state: str) -> None:
        where = f"the state in {str(self.paths[0])!r}"
        if member is None:
            raise DriveSetError(
                f"{self._label(k)} holds no member record ({MEMBER}): it is not drive {k} of {where} (an empty "
                f"or another directory). Pass the directory that holds drive {k} (last opened as {self._recorded()})"
            )
        if member.state != state:
            raise DriveSetError(
                f"{self._label(k)} belongs to another state (id {member.state}, drive {member.index} of "
                f"{member.count}), not to {where} (id {state}). Pass the directory of drive {k} of this state "
                f"(last opened as {self._recorded()})"
            )
        if member.index != k:
            raise DriveSetError(
                f"{self._label(k)} is drive {member.index} of {where}, given as drive {k}: the directories are "
                f"swapped. Pass them in the state's order ({self._recorded()})"
            )
        if member.count != self.count:
            raise DriveSetError(
                f"{self._label(k)} says its state spans {member.count} directories, the manifest in "
                f"{str(self.paths[0])!r} says {self.count}: restore the state's directories from a checkpoint"
            )

    def _open_fresh(self, resume: bool | str) -> None:
        if self.count == 1:
            home = self.home
            if self.home_member is not None and not home.private:
                # A single directory never holds a member record: this one is left by a several-drive
                # start that died before its first commit, whose leftovers this fresh start overwrites.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(MEMBER, dir_fd=home.fd)
            return
        assert self.paths is not None
        leftover = self.home_member.state if self.home_member is not None else None
        for k in range(1, self.count):
            d = StateDir(self.paths[k]).open(create=True)
            self.dirs.append(d)
            member = read_member(d)
            if d.exists(MANIFEST):
                raise DriveSetError(
                    f"{self._label(k)} holds a manifest: it is the home of another state. A new state needs "
                    "empty directories (or those of a start that died before its first commit); pass another "
                    "directory, or delete that state if you no longer need it"
                )
            if member is not None and member.state != leftover:
                raise DriveSetError(
                    f"{self._label(k)} is drive {member.index} of another state (id {member.state}). A new state "
                    "needs empty directories; pass another directory, or delete that state if you no longer need it"
                )
            if member is None and d.holds_state():
                raise StateExistsError(
                    f"{self._label(k)} already holds tierstore state files from another run; pass an empty "
                    "directory for each drive (delete the old files if you no longer need them)"
                )
        self.state_id = new_state_id()
        self._wrote_members = True
        for k, d in enumerate(self.dirs):
            write_member(d, Member(self.state_id, k, self.count))

    # -- placement ----------------------------------------------------
    def choose_placement(self, layout: Layout, *, backend: str, bandwidths: Sequence[float] | None = None) -> list[int] | None:
        """The drive of each shard (``None`` for one directory: every shard in the home).

        Resuming: the recorded placement. A fresh state over several drives:
        :func:`~tierstore._storage.placement.place` by ``bandwidths`` (bytes/s
        per directory), else by the ``TIERSTORE_DRIVE_BANDWIDTHS`` figures, else
        by a quick probe of each drive with ``backend``
        (:func:`~tierstore._storage.drive_speed.probe_drives`: directories on
        one drive share its figure), with each directory's drive (``st_dev``):
        directories on one drive hold runs of its shards.

        Raises
        ------
        ConfigError
            If the bandwidths are not one positive number per directory.
        CorruptStateError
            If the recorded placement does not cover the layout's shards.
        """
        if self.count == 1:
            return None
        sizes = [layout.shard_nbytes(s) for s in layout.shards]
        if self.record is not None:
            if len(self.record["placement"]) != len(sizes):
                raise CorruptStateError(
                    f"the manifest in {self.paths[0]} places {len(self.record['placement'])} shards, its layout has "
                    f"{len(sizes)}; restore the state's directories from a checkpoint"
                )
            return self.placement
        if bandwidths is not None:
            speeds = check_bandwidths(bandwidths, drives=self.count)
        elif env("TIERSTORE_DRIVE_BANDWIDTHS") is not None:
            speeds = check_bandwidths(env("TIERSTORE_DRIVE_BANDWIDTHS"), drives=self.count, name="TIERSTORE_DRIVE_BANDWIDTHS")
        else:
            speeds = self._probe(layout, backend)
        self.bandwidths = speeds
        # Directories on one drive get runs of its shards, not alternate ones (place's docs say why).
        devices = [os.fstat(d.fd).st_dev for d in self.dirs if d.fd is not None]
        self.placement = place(sizes, speeds, devices=devices)
        shares = drive_bytes(sizes, self.placement, drives=self.count)
        log.info("placed %d shards over %d drives by bandwidth %s: bytes %s", len(sizes), self.count,
                 [f"{b / 1e6:.0f} MB/s" for b in speeds], shares)  # fmt: skip
        return self.placement

    def _probe(self, layout: Layout, backend: str) -> tuple[float, ...]:
        # Each drive (st_dev) is measured once; directories on one drive split its figure equally.
        nbytes = probe_nbytes(layout.state_nbytes, self.count)
        paths = [d.path for d in self.dirs]
        assert all(p is not None for p in paths) and all(d.fd is not None for d in self.dirs)
        return tuple(probe_drives(paths, backend=backend, nbytes=nbytes, dir_fds=[d.fd for d in self.dirs]))

    def manifest_record(self, backends: Sequence[str] | None) -> dict | None:
        """The manifest's ``"drives"`` entry for a commit (``None`` for one directory)."""
        if self.count == 1 or self.state_id is None or self.placement is None:
            return None
        assert self.paths is not None
        return drive_record(
            state=self.state_id,
            placement=self.placement,
            paths=[os.path.abspath(p) for p in self.paths],
            bandwidths=self.bandwidths,
            backends=backends,
        )

    # -- closing ------------------------------------------------------
    def close(self, *, discard: bool = False) -> None:
        """Release every directory (members first); ``discard`` (a failed start) also removes what this
        open made: member records of a state that never committed, and directories it created empty."""
        dirs, self.dirs = self.dirs, []
        if discard and self._wrote_members and dirs and dirs[0].fd is not None and not dirs[0].exists(MANIFEST):
            for d in dirs:
                if d.fd is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(MEMBER, dir_fd=d.fd)
        error: BaseException | None = None
        for d in reversed(dirs):
            try:
                d.close(discard=discard)
            except BaseException as exc:  # release every lock before raising the first error
                error = error or exc
        if error is not None:
            raise error
