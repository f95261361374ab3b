"""How TieredAdamW fits ``torch.distributed``: per-rank state directories and a common resume step.

tierstore does not invent a distributed runtime. Under FSDP2 (DTensor
parameters) or DDP with ``ZeroRedundancyOptimizer``, every rank builds its
own ``TieredAdamW`` over the parameters (or local shards) it owns, and keeps
their state in its own directory: ``state_dir/rank{N}`` when the process
group has more than one rank (or wherever ``{rank}`` appears in the path).

Ranks commit their steps independently, so after a crash they may hold
different last commits; they can differ by at most one step, because a rank
cannot finish step N+2's backward (which needs every rank's collectives)
before every rank finished step N+1. On resume, the ranks agree on the
smallest last commit and the ranks ahead roll back one step (a durable
directory keeps the commit before its last).

Example
-------
>>> rank_state_dir("/ckpt/opt")  # without a process group: unchanged
'/ckpt/opt'
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import CorruptStateError


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


def agree_on_step(local_steps: list[int] | None) -> int | None:
    """The committed step every rank can resume at (a collective: all ranks must call it).

    ``local_steps`` are this rank's resumable steps, last first (``None`` or
    empty when it has nothing to resume). Returns ``None`` when no rank has
    state, the common step otherwise.

    Raises
    ------
    CorruptStateError
        If some ranks have state and others none, or a rank cannot reach the
        common step (it is more than one step ahead).
    """
    rank, world = rank_and_world()
    if world == 1:
        return local_steps[0] if local_steps else None
    dist = torch.distributed
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    last = local_steps[0] if local_steps else -1
    stats = torch.tensor([last, -last], dtype=torch.int64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    highest, lowest = int(stats[0]), -int(stats[1])
    if highest == -1:
        return None
    if lowest == -1:
        raise CorruptStateError(
            f"rank {rank}: some ranks have committed state (up to step {highest}) and some have "
            "none; give every rank its state directory (state_dir/rank{N}) or start all ranks fresh"
        )
    if local_steps and lowest not in local_steps:
        raise CorruptStateError(
            f"rank {rank} holds steps {local_steps} but the ranks' common step is {lowest}; "
            "the directories come from different runs"
        )
    return lowest
