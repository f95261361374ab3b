"""The commit protocol: where a run resumes, how a step's changes become durable, a clean close.

A :class:`Journal` sits over a :class:`~tierstore.statedir.StateDir` (the
lock, the manifest), the :class:`~tierstore.store.ShardStore` (which copy of
each shard is committed) and the manifest's content
(:mod:`tierstore.manifest`). It answers four questions:

- **Resume point** (:meth:`Journal.open`): what the directory holds, whether
  it may be resumed, and at which committed step (under ``torch.distributed``
  every rank agrees on one).
- **A change** (:meth:`Journal.changing`): with durability the directory is
  marked in flight before any stale copy is overwritten; a change that fails
  part-way forgets its writes, so the committed copies stay authoritative.
- **A commit** (:meth:`Journal.commit`): with durability, sync the files,
  adopt the new copies, then replace the manifest atomically; without it,
  mark the manifest dirty once (a crash then leaves a directory that is
  refused on resume).
- **A clean close** (:meth:`Journal.close`): without durability, write the
  resident shards out and commit a clean manifest, so the directory resumes.

The promise: a kill at any instant leaves the directory at the last
committed step (durable mode), with every committed shard checksummed.

Example
-------
>>> import tempfile
>>> journal = Journal.open(tempfile.mkdtemp(), resume=False, resume_step=None, durable=True)
>>> journal.saved is None, journal.durable
(True, True)
>>> journal.release()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import distributed
from . import manifest as manifest_mod
from .errors import ConfigError, CorruptStateError, StateExistsError
from .faults import crash_point
from .layout import Layout
from .statedir import MANIFEST, StateDir
from .store import ShardStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What a commit records besides the shards: the optimizer's step bookkeeping."""

    step_count: int
    param_steps: Sequence[float | None]
    groups: Sequence[dict[str, Any]]


class Journal:
    """The commit protocol of one optimizer's state directory (see the module docs).

    Build with :meth:`open`; :meth:`bind` the store once it exists.
    """

    def __init__(self, statedir: StateDir | None, *, durable: bool, saved: dict | None = None) -> None:
        self.statedir = statedir
        self.durable = durable
        self.saved = saved  # the manifest to resume from (None: fresh state)
        self._last_manifest = saved  # the next commit's "previous"
        self._dirty_marked = False
        self.store: ShardStore | None = None
        self.layout: Layout | None = None
        self.ram_budget: int | None = None

    # -- resume point -------------------------------------------------
    @staticmethod
    def check_arguments(state_dir: str | None, *, durable: bool | None, resume: bool) -> None:
        """Refuse durability or a resume without a directory to keep or find the state in.

        Raises
        ------
        ConfigError
            Naming the missing ``state_dir``.
        """
        if durable and state_dir is None:
            raise ConfigError(
                "durable=True needs a state_dir to keep the committed state in; pass "
                "state_dir=... (or leave durable=None)"
            )
        if resume and state_dir is None:
            raise ConfigError("resume=True needs the state_dir to resume from; pass state_dir=...")

    @classmethod
    def open(cls, state_dir: str | None, *, resume: bool, resume_step: int | None, durable: bool | None) -> Journal:
        """Lock ``state_dir`` (this rank's, under torch.distributed) and find the resume point.

        ``durable=None`` means durable exactly when there is a ``state_dir``.

        Raises
        ------
        StateDirError, StateDirInUseError
            The directory cannot be used, or another open optimizer holds it.
        StateExistsError
            It holds state and ``resume`` is false.
        CorruptStateError
            It was written with ``durable=False`` by a run that did not close cleanly,
            or ``resume_step`` is not one it holds.
        """
        durable = (state_dir is not None) if durable is None else bool(durable)
        if state_dir is None:
            return cls(None, durable=durable)
        statedir = StateDir(distributed.rank_state_dir(state_dir)).open()
        try:
            saved = _resume_point(statedir, resume, resume_step)
        except BaseException:
            statedir.close(discard=True)
            raise
        return cls(statedir, durable=durable, saved=saved)

    def use_private_dir(self) -> None:
        """Give state that must stream a private temporary directory (removed on release); never durable."""
        if self.statedir is None:
            self.statedir = StateDir(None).open()
            self.durable = False

    @property
    def directory(self) -> Path | None:
        return self.statedir.path if self.statedir is not None else None

    @property
    def persistent(self) -> bool:
        """True when the state lives in a user's ``state_dir`` (not in RAM or a private directory)."""
        return self.statedir is not None and not self.statedir.private

    def bind(self, store: ShardStore, layout: Layout, ram_budget: int | None) -> None:
        """Attach the open store whose shards this journal commits."""
        self.store, self.layout, self.ram_budget = store, layout, ram_budget

    # -- changes and commits -------------------------------------------
    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Run a change of the state; on failure forget its writes (the committed copies stay)."""
        try:
            if self.durable and self.statedir is not None:
                self.statedir.begin_writes()
            yield
        except BaseException:
            if self.store is not None:
                self.store.abort()
            raise

    def commit(self, progress: Progress) -> None:
        """Make the last change durable and name it in the manifest (durable mode).

        Without durability only the first change after a clean state marks the
        manifest dirty; :meth:`close` writes the clean one.
        """
        store, statedir = self.store, self.statedir
        if statedir is None or store is None:
            return
        if self.durable:
            store.commit(progress.step_count)
            body = self._manifest(progress, clean=True)
            statedir.write_manifest(body)
            self._last_manifest = body
            crash_point("after-commit")
            statedir.end_writes()
            return
        if statedir.private:
            store.commit(progress.step_count)
            return
        if not self._dirty_marked:
            statedir.write_manifest(self._manifest(progress, clean=False))
            self._dirty_marked = True
        store.commit(progress.step_count)

    def _manifest(self, progress: Progress, *, clean: bool) -> dict:
        store = self.store
        return manifest_mod.build(
            layout=self.layout,
            step_count=progress.step_count,
            param_steps=progress.param_steps,
            groups=progress.groups,
            shards=store.records(),
            durable=self.durable,
            clean=clean,
            backend=store.backend_name if store.files else None,
            ram_budget=self.ram_budget,
            previous=self._last_manifest,
        )

    def committed_step(self) -> int | str:
        """The step a resume would start from, for messages (``"none: ..."`` without a state_dir)."""
        if not self.persistent:
            return "none: no state_dir"
        try:
            return int(self.statedir.read_manifest()["step_count"])
        except Exception:  # a message helper: never fail while reporting another failure
            return "unknown"

    # -- closing ------------------------------------------------------
    def close(self, progress: Progress) -> None:
        """A clean close: without durability, write resident shards and a clean manifest."""
        store, statedir = self.store, self.statedir
        if store is None or statedir is None or statedir.private or self.durable:
            return
        store.flush_resident()
        store.commit(progress.step_count)
        statedir.write_manifest(self._manifest(progress, clean=True))

    def release(self, *, discard: bool = False) -> None:
        """Release the lock (a private directory is removed); ``discard`` undoes a failed start. Safe twice."""
        statedir, self.statedir = self.statedir, None
        if statedir is not None:
            statedir.close(discard=discard)


def _resume_point(statedir: StateDir, resume: bool, resume_step: int | None) -> dict | None:
    """The manifest to resume from (``None``: start fresh), after the checks."""
    where = str(statedir.path)
    _, world = distributed.rank_and_world()
    if resume and resume_step is None and world > 1:
        # Every rank resumes at the same step; the ranks ahead roll back one.
        mine = None
        if statedir.file(MANIFEST).exists():
            mine = manifest_mod.committed_steps(statedir.read_manifest())
        resume_step = distributed.agree_on_step(mine)
    if not statedir.holds_state():
        return None
    if not resume:
        raise StateExistsError(
            f"state_dir={where!r} already holds tierstore state from another run; pass "
            "resume=True to continue it, or choose an empty state_dir (delete the old one if "
            "you no longer need it)"
        )
    if not statedir.file(MANIFEST).exists():
        log.warning("%s holds state files but no manifest (a run died while starting); starting fresh", where)
        return None
    saved = manifest_mod.at_step(statedir.read_manifest(), resume_step, where)
    if not saved.get("clean", True):
        raise CorruptStateError(
            f"state_dir={where!r} was written with durable=False by a run that did not close() "
            "cleanly, so its files mix several steps. Start over with an empty state_dir, and "
            "use durable=True (the default with a state_dir) to be able to resume after a crash"
        )
    return saved
