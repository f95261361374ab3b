"""What a plan lacks, and what would make it fit: one :class:`~tierstore.planner.results.Shortfall` per resource.

GPU memory, host RAM, the ``ram_budget`` given and drive space are checked
against what the arithmetic (:mod:`tierstore.planner.memory`) needs; each
shortfall names what is needed, what there is, and the fixes that would work
(more of the resource, a smaller budget, FSDP2, ``durable=False``, ...).

Example
-------
>>> from tierstore.planner import plan_memory
>>> [(f.resource, f.have) for f in plan_memory(7_000_000_000, host_ram=24 << 30).shortfalls]
[('host RAM', 25769803776)]
"""

from __future__ import annotations

import math

from ..sizes import format_size
from .report import both_units
from .results import HOST_RAM_SHARE, DiskTier, GpuTier, HostTier, Shortfall

__all__ = ["find_shortfalls"]


def find_shortfalls(
    gpu: GpuTier, host: HostTier, disk: DiskTier, *, durable: bool, streamed: int, arena_slots: int, whole: str | None
) -> list[Shortfall]:
    """Every resource the plan lacks, each with what would make it fit.

    ``whole`` names the whole state when it is no larger than the streaming
    arena of ``arena_slots`` slots (it cannot stream: its smallest budget is all of it).
    """
    out = []
    b = both_units
    if gpu.fits is False and gpu.memory is not None:
        gpus = -(-gpu.total // max(gpu.memory, 1))
        out.append(Shortfall(
            "GPU memory", gpu.total, gpu.memory,
            f"the weights and grads need {b(gpu.total)} of GPU memory (activations not included), the GPU has "
            f"{b(gpu.memory)}: use a GPU with at least {b(gpu.total)}, or shard the model over {gpus} or more "
            "GPUs with FSDP2 (fully_shard), each rank with its own TieredAdamW",
        ))
    asked = host.budget_given
    room = host.ram - host.model - host.overhead  # the largest ram_budget this host holds
    too_small = asked < host.min_budget
    if too_small and not host.budget_is_default and whole:
        out.append(Shortfall(
            "ram_budget", host.min_budget, asked,
            f"ram_budget={format_size(asked)} cannot hold the state, and {whole} is smaller than the streaming "
            f"arena ({arena_slots} slots x {format_size(host.slot)}), so it cannot stream either: give at least "
            f"{format_size(host.min_budget)} ({host.min_budget} bytes"
            + (f", {format_size(host.staging)} of it staging" if host.staging else "")
            + ") so it stays in RAM, or ram_budget=None",
        ))
    elif too_small and not host.budget_is_default:
        out.append(Shortfall(
            "ram_budget", host.min_budget, asked,
            f"ram_budget={format_size(asked)} cannot hold the streaming arena and staging "
            f"({arena_slots} slots x {format_size(host.slot)}"
            + (f" + {format_size(host.staging)} of staging" if host.staging else "")
            + (f" + {format_size(host.scratch)} of decode scratch" if host.scratch else "")
            + f"): raise it to at least {format_size(host.min_budget)} ({host.min_budget} bytes)"
            + (f", at most {format_size(room)} on this host" if room >= host.min_budget else "")
            + ", or lower shard_numel or prefetch_depth",
        ))
    need = host.total
    if host.budget_is_default and too_small:  # the default is 90% of RAM minus the model: too little is left
        need = max(need, math.ceil((host.model + host.min_budget) / HOST_RAM_SHARE))
    if need > host.ram:
        fixes = [f"add {b(need - host.ram)} of RAM (a host of {b(need)} or more)"]
        if host.model:
            fixes.append(f"train on a GPU (--gpu-memory): the weights and grads ({b(host.model)}) then leave the host")
        if room >= host.min_budget and (host.budget_is_default or not too_small):
            fixes.append(
                f"give ram_budget at most {format_size(room)} ({room} bytes; at least {format_size(host.min_budget)}): "
                "more state streams from the drive"
                + (", and less than 10% of RAM is left to the rest" if host.budget_is_default else "")
            )
        parts = f"tierstore {b(host.tierstore_total)}: ram_budget {format_size(host.budget)} + {format_size(host.overhead)} overhead"
        if host.model:
            parts = f"weights and grads {b(host.model)} + {parts}"
        if need > host.total:
            fixes[0] += "; the default ram_budget leaves 10% of RAM to the OS and data loading"
        out.append(Shortfall(
            "host RAM", need, host.ram,
            f"the host needs {b(host.total)} ({parts}) and has {b(host.ram)}: " + "; or ".join(fixes),
        ))
    if disk.fits is False and disk.free is not None:
        fixes = [f"free {b(disk.total - disk.free)} more on the state directory's drive, or use a drive with {b(disk.total)} free"]
        if durable and streamed <= disk.free:
            fixes.append(f"durable=False keeps one copy of the streamed shards only ({b(streamed)}; no crash consistency)")
        out.append(Shortfall(
            "drive space", disk.total, disk.free,
            f"the state files need {b(disk.total)}, the drive has {b(disk.free)} free: " + "; or ".join(fixes),
        ))
    return out
