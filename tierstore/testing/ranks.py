"""Multi-process rank runner: gloo ranks on the CPU, watched, killed together when one dies.

:func:`run_ranks` starts ``world_size`` processes from a fork server that has
already imported torch (and ``torch._dynamo``, which FSDP2 imports), gives
each a gloo process group with a short collective timeout, and watches them:
when one rank dies (a crash point's ``SIGKILL``, a planned kill, or an
exception) the others are killed too after ``kill_grace`` seconds, as a job
scheduler would, instead of waiting in a collective for a peer that is gone.
Given the ``phases`` a target goes through, each rank reports its phase with
:func:`enter` and its committed step with :func:`report_completed`
(:class:`~tierstore.testing.crash.Progress`): a crash point then counts only
in the phases named, ``kill_in`` kills a rank at a random instant inside one
phase, and every :class:`RankResult` says where its rank died.

The rank programs it runs (a deterministic FSDP2 / ZeRO training job and its
reference) are in :mod:`tierstore.testing.distributed`.

Example
-------
>>> import signal, tempfile
>>> from tierstore.testing.distributed import agree_rank
>>> results = run_ranks(agree_rank, world_size=2, args=([[[3], [3]]], tempfile.mkdtemp()))  # doctest: +SKIP
>>> [r.exitcode for r in results]  # doctest: +SKIP
[0, 0]
>>> RankResult(rank=1, exitcode=-signal.SIGKILL, killed_by_harness=False, seconds=0.4).crashed
True
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._platform import faults
from .crash import POLL_SECONDS, Progress

__all__ = ["RankResult", "enter", "report_completed", "run_ranks"]

PRELOAD = (
    "torch",
    "torch._dynamo",  # FSDP2 imports it; seconds when not preloaded
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.optim",  # ZeroRedundancyOptimizer: 0.7 s when not preloaded
    "tierstore",
    "tierstore.dcp",
    "tierstore.testing.crash",
    "tierstore.testing.ranks",
    "tierstore.testing.distributed",  # the rank programs the tests run (train_rank, ...)
)

_CONTEXT: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        # The fork server is shared by the whole process (tierstore.testing.crash
        # uses it too); whichever kit starts it first decides what it preloads.
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


@dataclass
class RankResult:
    """How one rank's process ended, and where."""

    rank: int
    exitcode: int | None
    killed_by_harness: bool  # SIGKILLed by run_ranks because a peer died, or at the timeout
    seconds: float
    phase: str | None = None  # the phase it was in when it ended (None: phases not reported)
    landed_point: str | None = None  # the crash point that killed it
    completed: int = -1  # the step count it last saw committed

    @property
    def crashed(self) -> bool:
        """Died by the planned SIGKILL: an armed crash point, or ``kill_in``."""
        return self.exitcode == -signal.SIGKILL and not self.killed_by_harness


_PROGRESS: Progress | None = None  # this rank's reporter, when run_ranks was given phases


def enter(name: str) -> None:
    """Tell run_ranks (and :mod:`tierstore._platform.faults`) this rank's phase; targets call it."""
    if _PROGRESS is not None:
        _PROGRESS.enter(name)
    else:
        faults.set_phase(name)


def report_completed(steps: int) -> None:
    """Tell run_ranks the step count a crash now would resume at (:attr:`RankResult.completed`); targets call it."""
    if _PROGRESS is not None:
        _PROGRESS.completed.value = steps


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    collective_timeout: float,
    crash: tuple[str, int, Collection[str] | None] | None,
    progress: Progress | None,
    args: tuple,
) -> None:
    import torch.distributed as dist

    global _PROGRESS
    _PROGRESS = progress
    torch.set_num_threads(1)  # ranks share 2 cores; results do not depend on it
    if crash is not None:
        faults.arm(crash[0], after=crash[1], during=crash[2], on_fire=progress.fired if progress else None)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    try:
        target(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., Any],
    *,
    world_size: int,
    args: Sequence[Any] = (),
    phases: Sequence[str] | None = None,
    crash: tuple[int, str, int] | tuple[int, str, int, Collection[str]] | None = None,
    kill_in: tuple[int, str, float] | None = None,
    kill_grace: float = 0.0,
    collective_timeout: float = 20.0,
    timeout: float = 120.0,
) -> list[RankResult]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` gloo ranks and wait for them.

    Parameters
    ----------
    target
        A module-level function (children unpickle it by name).
    world_size
        Number of ranks.
    args
        Further positional arguments for ``target`` (picklable).
    phases
        Every phase ``target`` reports with :func:`enter`, in order (e.g.
        :func:`job_phases`); needed by ``kill_in`` and by ``crash`` with phases.
    crash
        ``(rank, point, after)`` or ``(rank, point, after, during)``: arm
        :mod:`tierstore._platform.faults` crash point ``point`` in ``rank`` (it SIGKILLs
        itself the ``after``-th time it is reached in a phase of ``during``).
    kill_in
        ``(rank, phase, delay)``: SIGKILL ``rank`` ``delay`` seconds after it
        entered ``phase``; it holds at the end of that phase until killed.
    kill_grace
        Seconds the other ranks may run on after one rank died (they may
        finish a step already under way) before they are SIGKILLed.
    collective_timeout
        The process group's timeout: a rank waiting for a dead peer fails
        after this long even if nobody kills it.
    timeout
        Kill every rank still running after this many seconds and raise.

    Raises
    ------
    TimeoutError
        If the ranks ran longer than ``timeout`` (they are killed first).

    Example
    -------
    >>> run_ranks(print, world_size=2, args=("hello",))  # doctest: +SKIP
    """
    ctx = _context()
    if (kill_in is not None or (crash is not None and len(crash) > 3)) and phases is None:
        raise ValueError("kill_in and crash points counted in phases need the target's phases=")
    init_dir = tempfile.mkdtemp(prefix="tierstore-pg-")
    init_file = os.path.join(init_dir, "store")
    procs = []
    progress: list[Progress | None] = []
    for rank in range(world_size):
        arm = None
        if crash is not None and crash[0] == rank:
            arm = (crash[1], crash[2], crash[3] if len(crash) > 3 else None)
        gate = kill_in[1] if kill_in is not None and kill_in[0] == rank else None
        progress.append(None if phases is None else Progress(ctx, list(phases), gate=gate))
        procs.append(
            ctx.Process(
                target=_rank_main,
                args=(target, rank, world_size, init_file, collective_timeout, arm, progress[rank], tuple(args)),
                name=f"rank{rank}",
            )
        )
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    harness_killed: set[int] = set()
    ended: dict[int, float] = {}
    first_failure: float | None = None
    timed_out = False
    try:
        while len(ended) < world_size:
            now = time.perf_counter()
            for rank, p in enumerate(procs):
                if rank not in ended and p.exitcode is not None:
                    ended[rank] = now - t0
                    if p.exitcode != 0 and first_failure is None:
                        first_failure = now
            if kill_in is not None and _kill_if_due(procs[kill_in[0]], progress[kill_in[0]], kill_in[1], kill_in[2]):
                kill_in = None
            if first_failure is not None and now - first_failure >= kill_grace:
                for rank, p in enumerate(procs):
                    if rank not in ended and p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                        harness_killed.add(rank)
            if now - t0 > timeout:
                timed_out = True
                for rank, p in enumerate(procs):
                    if rank not in ended and p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                        harness_killed.add(rank)
            waiting = [p.sentinel for r, p in enumerate(procs) if r not in ended]
            if waiting:
                nap = POLL_SECONDS if kill_in is not None else 0.005 if first_failure is not None else 0.2
                multiprocessing.connection.wait(waiting, timeout=nap)
    finally:
        for p in procs:
            p.join(5)
        for name in os.listdir(init_dir):
            os.unlink(os.path.join(init_dir, name))
        os.rmdir(init_dir)
    if timed_out:
        raise TimeoutError(f"ranks of {getattr(target, '__name__', target)} ran longer than {timeout} s")
    results = []
    for r, p in enumerate(procs):
        result = RankResult(r, p.exitcode, r in harness_killed, ended.get(r, 0.0))
        if progress[r] is not None:
            result.phase = progress[r].phase_name()
            result.completed = progress[r].completed.value
            point = progress[r].landed_point.value
            result.landed_point = faults.POINTS[point] if point >= 0 else None
        results.append(result)
    return results


def _kill_if_due(proc: mp.process.BaseProcess, progress: Progress, phase: str, delay: float) -> bool:
    """SIGKILL ``proc`` once ``delay`` seconds passed since it entered ``phase``; True when done with it."""
    target = progress.names.index(phase)
    if proc.exitcode is not None or progress.phase.value > target:
        return True  # ended, or went past without entering it: nothing to kill
    if progress.phase.value < target or time.monotonic() < progress.entered[target] + delay:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    return True

