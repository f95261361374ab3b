"""How TieredAdamW fits ``torch.distributed``: per-rank state directories and a common resume step.

tierstore does not invent a distributed runtime. Under FSDP2 (DTensor
parameters) or DDP with ``ZeroRedundancyOptimizer``, every rank builds its
own ``TieredAdamW`` over the parameters (or local shards) it owns, and keeps
their state in its own directory: ``state_dir/rank{N}`` when the process
group has more than one rank (or wherever ``{rank}`` appears in the path).

Ranks agree at every step's end whether to commit it (:func:`all_agree`),
so they commit the same steps; a commit runs in the background, so after a
crash they may hold different last commits, but at most one commit apart:
no rank starts a new commit, or overwrites a stale copy, before every rank's
last commit is durable (the ranks meet at the start of each step,
:func:`barrier`). On resume, the ranks agree on the smallest last commit and
the ranks ahead roll back one commit (a durable directory keeps the commit
before its last). A rank killed before its
first commit has no state; it counts as step 0, which its fresh start
reproduces exactly. ``docs/distributed.md`` has the whole story.

Example
-------
>>> rank_state_dir("/ckpt/opt")  # without a process group: unchanged
'/ckpt/opt'
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CorruptStateError


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_state_dir(state_dir: str | Path) -> str:
    """This rank's own state directory for a user-given ``state_dir``.

    ``{rank}`` in the path is replaced by the rank; otherwise, with more
    than one rank, ``rank{N}`` is appended.
    """
    text = str(state_dir)
    rank, world = rank_and_world()
    if "{rank}" in text:
        return text.replace("{rank}", str(rank))
    if world > 1:
        return str(Path(text) / f"rank{rank}")
    return text


def _device() -> torch.device:
    """Where the default group's collectives take their tensors (NCCL: the current GPU)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_agree(mine: bool) -> bool:
    """True when every rank says true (a collective: all ranks must call it; without a group: ``mine``).

    Ranks decide together when to commit, so that every rank commits the same steps.

    Example
    -------
    >>> all_agree(True)
    True
    """
    if rank_and_world()[1] == 1:
        return mine
    vote = torch.tensor([0 if mine else 1], dtype=torch.int64, device=_device())
    torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    return int(vote[0]) == 0


def barrier() -> None:
    """Wait until every rank got here (a collective; nothing without a process group)."""
    if rank_and_world()[1] > 1:
        all_agree(True)  # a tiny all-reduce works on every backend, NCCL included


def agree_on_step(local_steps: list[int] | None) -> int | None:
    """The committed step every rank can resume at (a collective: all ranks must call it).

    ``local_steps`` are this rank's resumable steps, last first (``None`` or
    empty when it has nothing to resume). Returns ``None`` when no rank has
    state, the common step otherwise: the smallest last commit. A rank
    without state counts as being at step 0 (its fresh start is exactly what
    every rank commits first, so this covers a rank killed before its first
    commit); every rank decides the same way, and either all return or all
    raise.

    Raises
    ------
    CorruptStateError
        If some rank cannot reach the common step: it is more than one step
        ahead, or it has no state while others are past step 0 (its state
        directory is missing or wrong).

    Example
    -------
    >>> agree_on_step([7, 6])  # without a process group: this rank's last commit
    7
    """
    rank, world = rank_and_world()
    if world == 1:
        return local_steps[0] if local_steps else None
    dist = torch.distributed
    device = _device()
    last = local_steps[0] if local_steps else -1
    stats = torch.tensor([last, -max(last, 0)], dtype=torch.int64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    highest, lowest = int(stats[0]), -int(stats[1])
    if highest == -1:
        return None
    reachable = lowest in local_steps if local_steps else lowest == 0
    verdict = torch.tensor([0 if reachable else 1], dtype=torch.int64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # one rank's refusal stops them all
    if int(verdict[0]):
        if reachable:
            mine = f"rank {rank} could resume at step {lowest}, but another rank cannot"
        elif local_steps:
            mine = f"rank {rank} holds steps {local_steps} and cannot go back to step {lowest}"
        else:
            mine = f"rank {rank} has no state while other ranks committed up to step {highest}"
        raise CorruptStateError(
            f"the ranks cannot resume at a common step ({mine}; the last commits range from "
            f"{lowest} to {highest}): a durable directory keeps only its last commit and the one "
            "before. Give every rank the state directory of the same run (state_dir/rank{N}), "
            "or start all ranks fresh in new directories"
        )
    return lowest
