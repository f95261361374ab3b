"""The commit protocol: where a run resumes, how a step's changes become durable, a clean close.

A :class:`Journal` sits over a :class:`~tierstore._state.statedir.StateDir` (the
lock, the manifest), the :class:`~tierstore._storage.store.ShardStore` (which copy of
each shard is committed) and the manifest's content
(:mod:`tierstore._state.manifest`). It answers four questions:

- **Resume point** (:meth:`Journal.open`): what the directory holds, whether
  it may be resumed, and at which committed step (under ``torch.distributed``
  every rank agrees on one).
- **A change** (:meth:`Journal.changing`): with durability the directory is
  marked in flight before any stale copy is overwritten; a change that fails
  part-way forgets its writes, so the committed copies stay authoritative.
- **A commit** (:meth:`Journal.end_step`, :meth:`Journal.commit`): with
  durability, when the commit policy (:mod:`tierstore._state.commit_policy`) says
  so, the resident shards changed since their last write start writing into
  their stale copies, and a background thread waits for them, syncs the
  files, adopts the new copies and replaces the manifest atomically. The
  loop goes on meanwhile: the next step updates a resident shard only after
  its write finished (the store waits per shard), and writes a streamed shard
  only after the commit is durable (:meth:`Journal.before_write`), so no
  copy a commit needs is overwritten. Without durability, the manifest is
  marked dirty once (a crash then leaves a directory that is refused on
  resume).
- **A clean close** (:meth:`Journal.close`): durable, commit the last step
  and wait for it; without durability, write the resident shards out and
  commit a clean manifest, so the directory resumes.

The promise: a kill or power cut at any instant leaves the directory at the
last commit whose manifest was durable (:attr:`Journal.committed_step` says
which), with every committed shard checksummed.

Example
-------
>>> import tempfile
>>> journal = Journal.open(tempfile.mkdtemp(), resume=False, resume_step=None, durable=True)
>>> journal.saved is None, journal.durable, journal.committed_step
(True, True, None)
>>> journal.release()
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._layout.layout import Layout
from .._platform import distributed
from .._platform.faults import crash_point
from .._storage.shard_transfer import ShardTransfer
from .._storage.store import ShardStore
from ..errors import ConfigError, ConfigTypeError, CorruptStateError, NoStateError, StateExistsError
from . import manifest as manifest_mod
from .commit_policy import CommitClock, CommitPolicy, due
from .drives import DriveSet, state_dir_paths
from .statedir import MANIFEST, StateDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What a commit records besides the shards: the optimizer's step bookkeeping, snapshotted.

    Build it with :meth:`capture` when the step ends: a commit finishes in the
    background, after the loop may have moved on.
    """

    step_count: int
    param_steps: tuple[float | None, ...]
    groups: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # Each parameter's scalars besides its step (tierstore._layout.scalar_record), as floats; None for an
    # algorithm without such scalars (its manifests have no such key).
    param_scalars: dict[str, tuple[float | None, ...]] | None = None

    @classmethod
    def capture(
        cls,
        step_count: int,
        param_steps: Sequence[float | None],
        groups: Sequence[dict[str, Any]],
        param_scalars: dict[str, Sequence[float | None]] | None = None,
    ) -> Progress:
        """A snapshot: copies of the steps, of the scalars' record and of the groups' hyperparameters
        (encoded when a manifest is written)."""
        scalars = None if param_scalars is None else {k: tuple(v) for k, v in param_scalars.items()}
        return cls(int(step_count), tuple(param_steps), tuple({k: _frozen(v) for k, v in g.items() if k != "params"} for g in groups),
                   scalars)  # fmt: skip


def _frozen(value: Any) -> Any:
    """A hyperparameter as it is now: LR schedulers update tensor values in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


LAG_WINDOW = 4  # commits over which a growing lag is judged
# A lag of a few steps is what "auto" spacing means on a busy machine (a 2-core host with other
# work on it shows 1/3/4/6), not a drive that cannot keep up: warn only past this many steps.
LAG_WARN_STEPS = 8


@dataclass
class CommitStats:
    """What the commits of a run cost so far (seconds; bytes written for resident shards)."""

    commits: int = 0
    deferred: int = 0  # commits the policy wanted while another was still in flight
    resident_bytes: int = 0
    last_seconds: float = 0.0
    max_lag: int = 0  # largest step_count - committed_step seen at a step's end
    lags: list[int] = field(default_factory=list)  # the lag when each of the last LAG_WINDOW commits started
    last_committed_at: float | None = None  # time.monotonic() when the last commit became durable

    def lag_growing(self) -> bool:
        """True when the lag rose at each of the last :data:`LAG_WINDOW` commits, at least doubled, and reached :data:`LAG_WARN_STEPS`.

        Commits then take longer than the steps between them: the drive (or
        the commit's share of the CPU) cannot keep up with the loop, and a
        crash loses more and more steps.

        >>> CommitStats(lags=[2, 3, 5, 9]).lag_growing(), CommitStats(lags=[2, 3, 2, 3]).lag_growing()
        (True, False)
        >>> CommitStats(lags=[1, 3, 4, 6]).lag_growing()  # growing, but a few steps: a busy machine
        False
        """
        lags = self.lags[-LAG_WINDOW:]
        if len(lags) < LAG_WINDOW:
            return False
        rising = all(a < b for a, b in zip(lags, lags[1:])) and lags[-1] >= 2 * max(1, lags[0])
        return rising and lags[-1] >= LAG_WARN_STEPS


class Journal:
    """The commit protocol of one optimizer's state directory (see the module docs).

    Build with :meth:`open`; :meth:`bind` the store once it exists.
    """

    def __init__(
        self,
        statedir: StateDir | None,
        *,
        durable: bool,
        saved: dict | None = None,
        policy: CommitPolicy | None = None,
        drives: DriveSet | None = None,
    ) -> None:
        self.statedir = statedir  # the home directory (the manifest's)
        self.drives = drives  # every directory of the state, the home first (None: no state_dir)
        self.durable = durable
        self.saved = saved  # the manifest to resume from (None: fresh state)
        self.policy = policy or CommitPolicy()
        self.committed_step: int | None = None if saved is None else int(saved["step_count"])
        self.clock = CommitClock(last_commit_step=self.committed_step or 0)
        self.stats = CommitStats()
        self._warned_lag = False  # the growing-lag warning is logged once per open
        self._last_manifest = saved  # the next commit's "previous"
        self._dirty_marked = False
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._lock = threading.Lock()
        self.store: ShardStore | None = None
        self.layout: Layout | None = None
        self.ram_budget: int | None = None

    # -- resume point -------------------------------------------------
    @staticmethod
    def check_arguments(state_dir: Any, *, durable: bool | None, resume: Any) -> None:
        """Refuse a ``state_dir`` that is not a path, a ``resume`` that is not ``False``/``True``/``"auto"``,
        and durability or a resume without a directory to keep or find the state in.

        Raises
        ------
        ConfigTypeError
            ``state_dir`` is not a ``str``/``os.PathLike`` or a list of them (``42``, ``bytes``),
            or ``resume`` is not a bool or ``"auto"``.
        ConfigError
            ``state_dir=""`` or ``[]``, or the missing ``state_dir`` named.
        """
        state_dir_paths(state_dir)
        resume_mode(resume)
        if durable and state_dir is None:
            raise ConfigError(
                "durable=True needs a state_dir to keep the committed state in; pass "
                "state_dir=... (or leave durable=None)"
            )
        if resume is True and state_dir is None:
            raise ConfigError("resume=True needs the state_dir to resume from; pass state_dir=...")

    @classmethod
    def open(
        cls,
        state_dir: str | os.PathLike | None,
        *,
        resume: bool | str,
        resume_step: int | None,
        durable: bool | None,
        policy: CommitPolicy | None = None,
    ) -> Journal:
        """Lock ``state_dir`` (this rank's, under torch.distributed) and find the resume point.

        ``state_dir`` is one directory, or a list of them (one per drive, the
        home first: :mod:`tierstore._state.drives`).
        ``durable=None`` means durable exactly when there is a ``state_dir``.
        ``resume``: ``False`` (the directory must hold no state), ``True`` (it
        must hold a committed state), ``"auto"`` (resume the committed state
        when there is one, else start fresh).

        Raises
        ------
        StateDirError, StateDirInUseError, NotStateDirError
            The directory cannot be used, another open optimizer holds it, or it
            holds files that are not tierstore's.
        DriveSetError
            The directories are not the drives of one state (missing, another
            state's, swapped, given twice, another count).
        StateExistsError
            It holds state and ``resume`` is false.
        NoStateError
            ``resume=True`` and it is missing or holds no committed state.
        CorruptStateError
            It was written with ``durable=False`` by a run that did not close cleanly,
            its manifest is damaged, or ``resume_step`` is not one it holds.
        """
        mode = resume_mode(resume)
        paths = state_dir_paths(state_dir)
        durable = (paths is not None) if durable is None else bool(durable)
        if paths is None:
            return cls(None, durable=durable, policy=policy)
        drives = DriveSet([distributed.rank_state_dir(os.fspath(p)) for p in paths])
        _, world = distributed.rank_and_world()
        try:
            # One process: a missing directory is not created just to say it holds nothing. Under
            # torch.distributed every rank opens its own first, so that all ranks decide together.
            statedir = drives.open_home(create=not (mode is True and world == 1))
            saved = _resume_point(statedir, mode, resume_step)
            drives.open_members(saved, resume=mode)
        except BaseException:
            drives.close(discard=True)
            raise
        return cls(statedir, durable=durable, saved=saved, policy=policy, drives=drives)

    def use_private_dir(self) -> None:
        """Give state that must stream a private temporary directory (removed on release); never durable."""
        if self.statedir is None:
            self.drives = DriveSet(None)
            self.statedir = self.drives.open_home(create=True)
            self.durable = False

    @property
    def directory(self) -> Path | None:
        return self.statedir.path if self.statedir is not None else None

    @property
    def dir_fd(self) -> int | None:
        """The open state directory's descriptor (files inside are opened relative to it)."""
        return self.statedir.fd if self.statedir is not None else None

    def drive_dirs(self) -> list[tuple[Path | None, int | None]]:
        """``(directory, descriptor)`` of every drive of the state, the home first (the store's ``drives``)."""
        if self.drives is None:
            return [(None, None)]
        return [(d.path, d.fd) for d in self.drives.dirs]

    def placement_for(self, layout: Layout, *, backend: str, bandwidths: Sequence[float] | None = None) -> list[int] | None:
        """The drive of each shard (``None``: one directory); see :meth:`DriveSet.choose_placement
        <tierstore._state.drives.DriveSet.choose_placement>`."""
        if self.drives is None:
            return None
        return self.drives.choose_placement(layout, backend=backend, bandwidths=bandwidths)

    @property
    def persistent(self) -> bool:
        """True when the state lives in a user's ``state_dir`` (not in RAM or a private directory)."""
        return self.statedir is not None and not self.statedir.private

    @property
    def committing(self) -> bool:
        """True when durable commits happen (a user's state_dir, durable mode)."""
        return self.durable and self.persistent

    def bind(self, store: ShardStore, layout: Layout, ram_budget: int | None) -> None:
        """Attach the open store whose shards this journal commits.

        Every streamed write then waits for a commit in flight first (the
        store's write fence): a step, a loaded state dict or checkpoint, any
        writer, so none can overwrite a copy a commit is about to name.
        """
        self.store, self.layout, self.ram_budget = store, layout, ram_budget
        store.write_fence = self.wait

    # -- changes ------------------------------------------------------
    @contextlib.contextmanager
    def changing(self, progress: Callable[[], Progress] | None = None) -> Iterator[None]:
        """Run a change of the state; on failure forget its writes (the committed copies stay).

        Durable: the in-flight marker is made durable first (once: it stays
        until a clean close), so ``verify`` knows stale copies may be
        half-written. Without durability, a user's directory gets a dirty
        manifest (from ``progress()``) before the first write, so a crash
        during the change leaves a directory that is refused on resume.
        """
        try:
            self._mark_in_flight()
            if progress is not None and not self.durable and self.persistent and not self._dirty_marked:
                self.statedir.write_manifest(self._manifest(progress(), clean=False))
                self._dirty_marked = True
            yield
        except BaseException:
            self._settle()  # a commit in flight still adopts its own writes, then ours are forgotten
            if self.store is not None:
                self.store.abort()
            raise

    def _mark_in_flight(self) -> None:
        if self.durable and self.statedir is not None:
            self.statedir.begin_writes()

    def before_write(self) -> float:
        """Wait until no commit in flight needs the copies a streamed write may overwrite; seconds waited.

        (The store's write fence waits too; this measures the wait for the step's stats.)
        """
        t0 = time.perf_counter()
        self.wait()
        return time.perf_counter() - t0

    def start_of_step(self) -> float:
        """Called as a step starts: raises what a finished commit raised; under
        torch.distributed with durability, every rank's last commit is durable
        before any rank changes state. Seconds waited."""
        self.raise_failure()  # a commit that failed in the background fails the next step
        if not self.committing or distributed.rank_and_world()[1] == 1:
            return 0.0
        t0 = time.perf_counter()
        self.wait()
        distributed.barrier()
        return time.perf_counter() - t0

    # -- commits ------------------------------------------------------
    def end_step(
        self, progress: Progress, *, gap: float, step_seconds: float, stall: float, decision: bool | None = None
    ) -> bool:
        """A step ended: start its commit if the policy says so. Returns whether one started.

        ``gap`` is the loop's time between the previous step's end and this
        step's start, ``step_seconds`` this step's time, ``stall`` what it
        waited for the previous commit. ``decision``: taken already by
        :meth:`decide` (under torch.distributed, on the training loop's thread).
        """
        store, statedir = self.store, self.statedir
        if statedir is None or store is None:
            return False
        clock = self.clock
        clock.record(step=progress.step_count, gap=gap, step_seconds=step_seconds, stall=stall)
        if not self.durable or statedir.private:
            self._commit_without_durability(progress)
            return False
        self.raise_failure()  # a failed commit is never replaced by the next one
        in_flight = self._inflight is not None and not self._inflight.done()
        if decision is None:
            decision = self.decide(progress.step_count)
        wanted = decision
        lag = progress.step_count - (self.committed_step or 0)
        self.stats.max_lag = max(self.stats.max_lag, lag)
        if not wanted:
            if in_flight and due(self.policy, clock, step=progress.step_count, now=time.monotonic(), in_flight=False):
                self.stats.deferred += 1
            clock.commit_running = in_flight  # it overlaps the next iteration
            return False
        self.stats.lags = [*self.stats.lags[-(LAG_WINDOW - 1):], lag]
        if self.stats.lag_growing() and not self._warned_lag:
            self._warned_lag = True
            log.warning(
                "commits of %s fall behind the loop: the last %d started %s steps behind it; a crash now "
                "loses more steps each time. Put state_dir on a faster drive, raise ram_budget (fewer "
                "resident shards to write per commit) or set commit_every to a larger step count",
                self.directory, LAG_WINDOW, "/".join(str(x) for x in self.stats.lags),
            )  # fmt: skip
        self._start(progress)
        clock.commit_running = True
        return True

    def decide(self, step: int) -> bool:
        """Whether the policy wants a commit of ``step`` now; under torch.distributed every rank agrees.

        The vote is a collective: call it on the training loop's thread, in
        step, on every rank.
        """
        in_flight = self._inflight is not None and not self._inflight.done()
        wanted = due(self.policy, self.clock, step=step, now=time.monotonic(), in_flight=in_flight)
        if self.committing and distributed.rank_and_world()[1] > 1:
            wanted = distributed.all_agree(wanted)
        return wanted

    def raise_failure(self) -> None:
        """Raise what a finished commit raised (a failed commit fails every later call)."""
        inflight = self._inflight
        if inflight is not None and inflight.done():
            inflight.result()

    def commit(self, progress: Progress, *, wait: bool = True) -> None:
        """Commit ``progress`` now (after any commit in flight), and wait for it unless ``wait=False``.

        Without durability this adopts the writes (and marks the manifest dirty once).
        """
        store, statedir = self.store, self.statedir
        if statedir is None or store is None:
            return
        if not self.durable or statedir.private:
            self._commit_without_durability(progress)
            return
        self.wait()
        if self.committed_step != progress.step_count or store.has_uncommitted():
            self._start(progress)
        if wait:
            self.wait()

    def _start(self, progress: Progress) -> None:
        """Start writing the changed resident shards, and commit them in the background."""
        self._mark_in_flight()
        started = time.monotonic()
        transfers = self.store.persist_resident()
        self.stats.resident_bytes += sum(t.nbytes for t in transfers)
        crash_point("persist-issued")
        self.clock.started(progress.step_count, started)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-commit")
        self._inflight = self._pool.submit(self._finish, progress, transfers, started)

    def _finish(self, progress: Progress, transfers: list[ShardTransfer], started: float) -> None:
        """The background half of a commit: persists done, files synced, manifest replaced."""
        for transfer in transfers:
            transfer.wait()
        self.store.commit(progress.step_count, persist=False)
        body = self._manifest(progress, clean=True)
        self.statedir.write_manifest(body)
        self._last_manifest = body
        with self._lock:
            self.committed_step = progress.step_count
        crash_point("after-commit")
        self.stats.last_committed_at = time.monotonic()
        seconds = self.stats.last_committed_at - started
        self.clock.last_commit_seconds = seconds
        self.stats.commits += 1
        self.stats.last_seconds = seconds

    def wait(self) -> None:
        """Wait for the commit in flight, if any; raise what it raised."""
        inflight = self._inflight
        if inflight is not None:
            inflight.result()

    def _settle(self) -> None:
        with contextlib.suppress(BaseException):  # the caller's error is the one that matters
            self.wait()

    def _commit_without_durability(self, progress: Progress) -> None:
        """Adopt the writes (no sync); a user's directory gets a dirty manifest once."""
        statedir = self.statedir
        if not statedir.private and not self._dirty_marked:
            statedir.write_manifest(self._manifest(progress, clean=False))
            self._dirty_marked = True
        self.store.commit(progress.step_count)

    def _manifest(self, progress: Progress, *, clean: bool) -> dict:
        store = self.store
        body = manifest_mod.build(
            layout=self.layout,
            step_count=progress.step_count,
            param_steps=progress.param_steps,
            param_scalars=progress.param_scalars,
            groups=progress.groups,
            shards=store.records(),
            durable=self.durable,
            clean=clean,
            backend=store.backend_name if store.files else None,
            ram_budget=self.ram_budget,
            previous=self._last_manifest,
        )
        drives = self.drives.manifest_record(store.backend_names) if self.drives is not None else None
        if drives is not None:  # a state over several directories (one directory: no such key)
            body["drives"] = drives
        return body

    def committed_step_text(self) -> int | str:
        """The step a resume would start from, for messages (``"none: ..."`` without a state_dir)."""
        if not self.persistent:
            return "none: no state_dir"
        try:
            return int(self.statedir.read_manifest()["step_count"])
        except Exception:  # a message helper: never fail while reporting another failure
            return "unknown"

    # -- closing ------------------------------------------------------
    def close(self, progress: Progress) -> None:
        """A clean close: durable, commit the last step and wait; else write resident shards and a clean manifest."""
        store, statedir = self.store, self.statedir
        if store is None or statedir is None or statedir.private:
            return
        if self.durable:
            self.commit(progress, wait=True)
            statedir.end_writes()
            return
        store.flush_resident()
        store.commit(progress.step_count, sync=True)  # the data is durable before the clean manifest names it
        statedir.write_manifest(self._manifest(progress, clean=True))

    def stop_commits(self) -> None:
        """Wait for the commit in flight (its error is not raised) and stop the commit thread."""
        pool, self._pool = self._pool, None
        if pool is not None:
            self._settle()
            pool.shutdown(wait=True)

    def release(self, *, discard: bool = False) -> None:
        """Stop the commit thread (after its commit), release the lock; ``discard`` undoes a failed start."""
        self.stop_commits()
        drives, self.drives, self.statedir = self.drives, None, None
        if drives is not None:
            drives.close(discard=discard)


def resume_mode(resume: Any) -> bool | str:
    """``resume`` checked: ``False``, ``True`` or ``"auto"``.

    Raises
    ------
    ConfigTypeError
        For anything else, naming the value.

    Example
    -------
    >>> resume_mode("auto"), resume_mode(False)
    ('auto', False)
    """
    if resume is True or resume is False or resume == "auto" and isinstance(resume, str):
        return resume
    raise ConfigTypeError(
        f"resume={resume!r} must be False (start fresh), True (continue the committed state in "
        "state_dir) or 'auto' (continue it when there is one, else start fresh)"
    )


def _resume_point(statedir: StateDir, resume: bool | str, resume_step: int | None) -> dict | None:
    """The manifest to resume from (``None``: start fresh), after the checks."""
    where = str(statedir.path)
    _, world = distributed.rank_and_world()
    agreed = None
    if resume and world > 1:
        # Every rank resumes at the same step; the ranks ahead roll back one.
        mine = None
        if statedir.exists(MANIFEST):
            mine = manifest_mod.committed_steps(statedir.read_manifest())
        agreed = distributed.agree_on_step(mine)
        if resume_step is None:
            resume_step = agreed
    has_manifest = statedir.exists(MANIFEST)
    if not has_manifest and resume is True and (world == 1 or agreed is None):
        # (Under torch.distributed a rank without state joins the others' resume from a fresh
        # start; only when no rank has any does resume=True fail, on every rank alike.)
        leftovers = statedir.holds_state()
        raise NoStateError(
            f"state_dir={where!r} holds no committed state to resume"
            + (" (only state files of a run that died before its first commit)" if leftovers else " (it is empty)")
            + ". Pass the state_dir of an earlier run, resume='auto' to start fresh when there is "
            "nothing to resume, or resume=False"
        )
    if not statedir.holds_state():
        return None
    if not resume:
        raise StateExistsError(
            f"state_dir={where!r} already holds tierstore state from another run; pass "
            "resume=True to continue it, or choose an empty state_dir (delete the old one if "
            "you no longer need it)"
        )
    if not has_manifest:
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
