"""The verdict of a diagnosis: which part to attack, the advice in words, and the estimates behind it.

The parts a user can change are compared: the **optimizer state** (offloading
pays: :class:`~tierstore.TieredAdamW` moves it off the GPU, or on the CPU
keeps a ``ram_budget`` of it in RAM and streams the rest from disk) and the
**activations** (activation checkpointing or a smaller batch pays). When
weights and gradients outweigh both, neither remedy helps much and the
advice says so.

What offloading saves is estimated, never measured (nothing is offloaded
here): TieredAdamW's own host RAM at the suggested ``ram_budget`` comes from
the planner's arithmetic over the same parameters (its streaming arena,
staging, resident shards and the fixed overhead
:data:`~tierstore._layout.budget.OVERHEAD_BYTES`), and the peak's drop is the
optimizer state minus that. A state smaller than TieredAdamW's own RAM is
reported as too small to offload. Every number in the advice carries its
kind (measured, counted, estimated).

Example
-------
>>> v = verdict(device_type="cpu", params=100, grads=100, state=40, activations=50,
...             activations_kind="counted", peak=1000, limit=None, tiered=lambda b: (b, 0))
>>> v.dominant, v.advice.split(":")[0]
('parameters', 'Weights and gradients, 200 B (counted), outweigh the optimizer state, 40 B (counted), and activations, 50 B (counted)')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..sizes import format_size
from .report import COUNTED, ESTIMATED, MEASURED, Figure, tagged

__all__ = ["Verdict", "Tiered", "verdict", "HEADROOM_SHARE", "DOMINANT"]

DOMINANT = ("optimizer_state", "activations", "parameters")
HEADROOM_SHARE = 20  # a memory limit keeps 1/20 (5%) of itself free: an assumption, stated where it is used
#: ``tiered(ram_budget) -> (the ram_budget the tiered front takes, the host RAM it holds then)``; ``None``: no budget,
#: all state in RAM. The ram_budget returned is raised to the smallest that holds the streaming arena.
Tiered = Callable[[int | None], tuple[int | None, int]]


@dataclass(frozen=True)
class Verdict:
    """Which part to attack (one of :data:`DOMINANT`), the advice, a ``ram_budget`` (or None), the estimates."""

    dominant: str
    advice: str
    suggested_ram_budget: int | None
    estimates: tuple[Figure, ...] = ()


def _round_mib(n: int) -> int:
    mib = 1 << 20  # 1 MiB
    return max(mib, (n // mib) * mib)


def _call(budget: int | None, front: str) -> str:
    if budget is None:
        return f"{front}(model.parameters(), ...)"
    text = f'"{budget >> 20}MiB"' if budget % (1 << 20) == 0 else str(budget)
    return f'{front}(model.parameters(), ram_budget={text}, state_dir="/nvme/opt")'


def verdict(
    *,
    device_type: str,
    params: int,
    grads: int,
    state: int,
    activations: int,
    activations_kind: str,
    peak: int,
    limit: int | None,
    tiered: Tiered,
    front: str = "TieredAdamW",
    torch_class: str = "torch.optim.AdamW",
) -> Verdict:
    """Which part to attack, the advice in words, a ``ram_budget`` for the tiered front (or None), the estimates.

    ``params``, ``grads`` and ``state`` are counted bytes, ``activations`` is
    ``activations_kind`` (measured growth or counted saved bytes), ``peak``
    is measured, ``limit`` is the memory the user has where the peak happens.
    ``front`` and ``torch_class`` name the optimizer the advice is about
    (its algorithm's tiered front, and the torch class it replaces).
    """
    fixed = params + grads
    st, acts = tagged(state, COUNTED), tagged(activations, activations_kind)
    if max(state, activations) * 2 < fixed:
        return Verdict(
            "parameters",
            f"Weights and gradients, {tagged(fixed, COUNTED)}, outweigh the optimizer state, {st}, and "
            f"activations, {acts}: neither offloading nor checkpointing helps much. Shard the model across "
            "GPUs (FSDP2) or train in bf16.",
            None,
        )
    if activations > state:
        half = Figure("halving the batch saves", activations // 2, ESTIMATED,
                      "half the activations: assumes they grow with the batch size")  # fmt: skip
        return Verdict(
            "activations",
            f"Activations, {acts}, outweigh the optimizer state, {st}: activation checkpointing pays "
            "(torch.utils.checkpoint.checkpoint around each block, or model.gradient_checkpointing_enable() "
            "for Hugging Face models), or a smaller batch with gradient accumulation: halving the batch saves "
            f"about {half.tag}, assuming activations grow with the batch. Offloading the optimizer state "
            f"would save at most {st}.",
            None,
            (half,),
        )
    # The layout imports torch: imported once there is a verdict to give.
    from .._layout.budget import OVERHEAD_BYTES

    if device_type == "cuda":
        return _on_gpu(state=state, activations=acts, tiered=tiered, overhead=OVERHEAD_BYTES, front=front)
    return _on_cpu(state=state, activations=acts, peak=peak, limit=limit, tiered=tiered, overhead=OVERHEAD_BYTES,
                   front=front, torch_class=torch_class)  # fmt: skip


def _on_gpu(*, state: int, activations: str, tiered: Tiered, overhead: int, front: str) -> Verdict:
    import psutil

    st = tagged(state, COUNTED)
    available = psutil.virtual_memory().available
    request = _round_mib(available // 4) if state * 2 > available else None  # host RAM is short: stream
    budget, ram = tiered(request)
    freed = Figure("GPU memory freed", state, ESTIMATED,
                   f"the optimizer state leaves the GPU: assumes {front} keeps none of it there")  # fmt: skip
    where = "with all state resident" if budget is None else f"at ram_budget={format_size(budget)}"
    host = Figure(f"{front}'s host RAM", ram, ESTIMATED,
                  f"the planner's arithmetic {where}, an fp32 master included, + {format_size(overhead)} "
                  "fixed overhead")  # fmt: skip
    estimates = [freed, host]
    short = ""
    if budget is not None:
        estimates.append(Figure("suggested ram_budget", budget, ESTIMATED,
                                "a quarter of the host RAM available now (assumed): host RAM is short"))  # fmt: skip
        short = (f"; host RAM is short, {tagged(available, MEASURED)} available, so give it a ram_budget of "
                 f"{tagged(budget, ESTIMATED)} and a state_dir on local NVMe")  # fmt: skip
    return Verdict(
        "optimizer_state",
        f"The optimizer state, {st}, outweighs activations, {activations}: offloading it pays. {front} keeps "
        f"the state in host RAM, so about {freed.tag} of GPU memory is freed, assuming none of it stays on the "
        f"GPU; it holds {host.tag} of host RAM{short}. Try {_call(budget, front)}.",
        budget,
        tuple(estimates),
    )


def _on_cpu(
    *, state: int, activations: str, peak: int, limit: int | None, tiered: Tiered, overhead: int, front: str,
    torch_class: str,
) -> Verdict:  # fmt: skip
    st, fixed_cost = tagged(state, COUNTED), f"a fixed overhead of {tagged(overhead, ESTIMATED)}"
    room = None
    if limit is not None:
        headroom = limit // HEADROOM_SHARE
        if peak + headroom <= limit:
            return Verdict(
                "optimizer_state",
                f"The optimizer state, {st}, is the largest part you can move, but the peak, "
                f"{tagged(peak, MEASURED)}, already fits under {format_size(limit)} (given) with 5% to spare: "
                f"nothing needs offloading. {front} with a ram_budget would lower it further.",
                None,
            )
        rest = peak - state  # the peak without the state: assumes all of the state is in the peak
        room = limit - rest - headroom - overhead  # what ram_budget may take under the limit
        if room <= 0:
            return Verdict(
                "optimizer_state",
                f"The optimizer state, {st}, is the largest part, but even with all of it on disk the rest of "
                f"the peak, {tagged(max(rest, 0), ESTIMATED)} as the peak minus the state, {front}'s "
                f"fixed overhead of {tagged(overhead, ESTIMATED)} and 5% headroom leave no room under {format_size(limit)} (given); also cut "
                f"activations, {activations}, or the model.",
                None,
            )
        request = _round_mib(room)
        why = (f"the memory limit - the rest of the peak ({format_size(rest)}) - the fixed overhead - 5% "
               "headroom (assumed)")  # fmt: skip
    else:
        request = _round_mib(state // 4)
        why = "a quarter of the optimizer state kept in RAM (assumed: no memory limit given)"
    budget, ram = tiered(request)
    if budget is not None and budget > request:
        why += f"; raised from {format_size(request)} to the smallest that holds the streaming arena"
    drop = state - ram
    at = ("with every shard resident (the suggested budget holds the whole state)" if budget is None
          else "at that ram_budget: arena, staging and resident shards")  # fmt: skip
    estimates = (
        *([Figure("suggested ram_budget", budget, ESTIMATED, why)] if budget is not None else []),
        Figure(f"{front}'s host RAM", ram, ESTIMATED,
               f"the planner's arithmetic {at}, + {format_size(overhead)} fixed overhead"),
        Figure(f"peak drop with {front}", max(drop, 0), ESTIMATED, f"the optimizer state - {front}'s host RAM"),
    )  # fmt: skip
    if drop <= 0 or budget is None or (room is not None and ram - overhead > room):
        need = "is at least as large as the state" if drop <= 0 else f"does not fit under {format_size(limit)} (given)"
        if budget is not None:  # tried, not suggested: name it so
            estimates = (dataclasses.replace(estimates[0], name="ram_budget considered"), *estimates[1:])
        return Verdict(
            "optimizer_state",
            f"The optimizer state, {st}, is the largest movable part, but offloading it does not lower the peak: "
            f"{front} itself holds {tagged(ram, ESTIMATED)} of RAM, its buffers + {fixed_cost}, "
            f"which {need}. Keep {torch_class}, or cut activations, {activations}.",
            None,
            estimates,
        )
    return Verdict(
        "optimizer_state",
        f"The optimizer state, {st}, outweighs activations, {activations}: offloading it pays. {front} with "
        f"the suggested ram_budget, {tagged(budget, ESTIMATED)}, keeps that much of it in RAM and streams the "
        f"rest from a state_dir on local NVMe: the peak drops by about {tagged(drop, ESTIMATED)}, the state minus "
        f"{front}'s own {tagged(ram, ESTIMATED)} of RAM (its buffers and {fixed_cost}). Try {_call(budget, front)}.",
        budget,
        estimates,
    )
