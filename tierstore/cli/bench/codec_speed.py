"""Throughput of the moment codecs beside a raw memory copy and the fused AdamW update.

Every contender works on one shard-sized field of ``numel`` elements and is
timed in rounds, interleaved (round ``r`` times each contender once), so
the ratios hold on a machine whose speed drifts. Reported in elements
(= parameters) per second, median over rounds:

- ``copy``: ``dst.copy_(src)`` of fp32 (what a float32 "codec" costs at best);
- ``adamw``: the fused AdamW kernel on ``numel`` parameters (reads and writes
  param, exp_avg, exp_avg_sq; reads the gradient);
- per format and field: ``decode`` and ``encode`` (``<format>@torch``: in torch
  ops, without the compiled kernel of :mod:`tierstore._compute.native`);
- per format, ``update/<format>``: a whole step of ``TieredAdamW(moment_dtype=...,
  keep_master=True)`` over ``numel`` resident parameters: the one math as the
  optimizer runs it (the compiled fused update of :mod:`tierstore._compute.fused_update`
  where it is used, else decode, fused kernel, encode; ``@torch``: always the
  latter, in torch ops; masters into the parameters; chunk by chunk on
  ``threads`` workers), no I/O.

``summary`` gives per format the params/s of a whole step's codec work (decode
both moments, encode both moments) and its ratio to the fused kernel, the
update's params/s, and the params/s a drive of 0.5, 1 and 2 GB/s allows for
that format's bytes (master fp32 + both moments, read and written), so one can
see whether the CPU or the drive bounds a streamed step. With ``drive`` (a
directory), the drive itself is measured in the same run (raw ``O_DIRECT``
reads and writes of a file of the float32 state's size, :mod:`.floor`) and
each format's drive-bound params/s is given beside its update's.

``seconds`` keeps every contender's time per round (the warm-up round
dropped). The target (``docs/formats.md``, Speed): where the compiled fused
update runs a format, it is faster than the same update in torch ops (params/s
ratio > 1), each round's ratio a repeat (:func:`verdicts`).

Example
-------
>>> result = measure(numel=1 << 14, rounds=1, formats=["bfloat16"], threads=1)
>>> result["summary"]["bfloat16"]["bytes_per_param"]
8.0
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..._compute import codecs, fused_update, native
from ..._compute.formats import FORMATS, MomentFormat, RoundingKey, moment_format
from ..._compute.kernel import adamw

FIELDS = ("exp_avg", "exp_avg_sq")
DRIVE_GBPS = (0.5, 1.0, 2.0)


def _format(name: str) -> MomentFormat:
    """A format name, or ``<name>-<rounding>`` for a rounding variant; ``@torch`` (int8): torch ops only."""
    base, _, rounding = name.partition("@")[0].partition("-")
    fmt = moment_format(base)
    return dataclasses.replace(fmt, name=name, rounding=rounding) if rounding else fmt


def measure(
    *, numel: int, rounds: int, formats: list[str], threads: int | None = None, update: bool = True,
    drive: str | None = None,
) -> dict[str, Any]:
    """Median elements/s of each contender (see the module docstring)."""
    threads = threads or torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen) * 1e-3
    moments = {"exp_avg": torch.randn(numel, generator=gen) * 1e-3, "exp_avg_sq": torch.rand(numel, generator=gen) * 1e-6}
    scratch = torch.empty(numel)
    step = torch.tensor(10.0)
    contenders: dict[str, Callable[[], None]] = {
        "copy": lambda: scratch.copy_(moments["exp_avg"]),
        "adamw": lambda: adamw(
            [param], [grad], [scratch], [moments["exp_avg_sq"]], [], [step],
            lr=1e-9, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
        ),
    }
    encoded: dict[tuple[str, str], torch.Tensor] = {}
    key = RoundingKey(seed=0, step=1, offset=0)
    for name in formats:
        fmt = _format(name)
        impl = "torch" if name.endswith("@torch") else "fast"
        for field in FIELDS:
            buf = encoded[name, field] = torch.empty(fmt.encoded_nbytes(numel), dtype=torch.uint8)
            codecs.encode(fmt, field, moments[field], buf, key=key, threads=threads)
            contenders[f"{name}/{field}/decode"] = (
                lambda fmt=fmt, field=field, buf=buf, impl=impl: codecs.decode(
                    fmt, field, buf, scratch, threads=threads, impl=impl)
            )
            contenders[f"{name}/{field}/encode"] = (
                lambda fmt=fmt, field=field, buf=buf, impl=impl: codecs.encode(
                    fmt, field, moments[field], buf, key=key, threads=threads, impl=impl)
            )
    optimizers = []
    if update:
        from ...optimizer import TieredAdamW

        for name in formats:
            base, _, impl = name.partition("@")
            if FORMATS.get(base) is None:
                continue  # a codec variant is not a state format
            p = torch.nn.Parameter(param.clone())
            p.grad = grad
            # One shard of numel (its chunks run on the threads), as a shard of a large model would.
            opt = TieredAdamW([p], lr=1e-9, keep_master=True, moment_dtype=base, update_threads=threads, shard_numel=numel)
            optimizers.append(opt)
            contenders[f"update/{name}"] = _suspended(opt.step) if impl == "torch" else opt.step
    floor = None
    if drive is not None:
        floor = _drive(drive, numel)
        contenders["drive"] = floor.step
    torch.set_num_threads(threads)  # the fused kernel and copy use the same thread count
    scratch.copy_(moments["exp_avg"])
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    reads, writes = [], []
    try:
        order = list(contenders.items())
        for r in range(rounds + 1):  # round 0 warms up and is dropped
            # A rotating order: no contender always runs right after the same one (caches, clocks).
            for name, call in order[r % len(order):] + order[: r % len(order)]:
                t0 = time.perf_counter()
                out = call()
                seconds[name].append(time.perf_counter() - t0)
                if name == "drive":
                    reads.append(out["read_s"])
                    writes.append(out["write_s"])
    finally:
        for opt in optimizers:
            opt.close()
        if floor is not None:
            floor.close()
    seconds.pop("drive", None)
    per_s = {k: numel / statistics.median(v[1:] if len(v) > 1 else v) for k, v in seconds.items()}
    summary: dict[str, Any] = {}
    for name in formats:
        fmt = _format(name)
        codec_s = sum(1 / per_s[f"{name}/{f}/{op}"] for f in FIELDS for op in ("decode", "encode"))
        state_bytes = 4 + 2 * fmt.bytes_per_element  # fp32 master + both moments
        summary[name] = {
            "codec_params_per_s": 1 / codec_s,
            "codec_over_adamw": (1 / codec_s) / per_s["adamw"],
            "bytes_per_param": state_bytes,
            **{f"drive_{g}GBps_params_per_s": g * 1e9 / (2 * state_bytes) for g in DRIVE_GBPS},
        }
        if f"update/{name}" in per_s:
            summary[name]["update_params_per_s"] = per_s[f"update/{name}"]
    result = {"numel": numel, "rounds": rounds, "threads": threads, "params_per_s": per_s, "summary": summary,
              "seconds": {k: v[1:] if len(v) > 1 else v for k, v in seconds.items()}}
    result["compiled"] = {name: fused_update.kernel(name) is not None for name in COMPILED_TARGETS}
    if floor is not None:
        nbytes = floor.nbytes
        read_gbps = nbytes / statistics.median(reads[1:] or reads) / 1e9
        write_gbps = nbytes / statistics.median(writes[1:] or writes) / 1e9
        result["drive"] = {"dir": drive, "bytes": nbytes, "read_GBps": read_gbps, "write_GBps": write_gbps}
        for row in summary.values():
            # Reads and writes share the drive: a param's bytes read, then written.
            row["drive_measured_params_per_s"] = 1 / (row["bytes_per_param"] / (read_gbps * 1e9)
                                                      + row["bytes_per_param"] / (write_gbps * 1e9))
    return result


COMPILED_TARGETS = ("int8", "bfloat16")  # formats the compiled fused update implements
SOURCE = "docs/formats.md (Speed)"


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per format the compiled update runs: its params/s / the torch-ops update's, round by round, > 1.

    A format measured without its ``@torch`` twin, or on a machine where the
    compiled update does not run it (no compiler, or its self-check refused
    it), has no target here.

    Example
    -------
    >>> r = {"compiled": {"int8": True}, "seconds": {"update/int8": [1.0, 1.0, 1.0],
    ...      "update/int8@torch": [2.0, 2.4, 2.2]}}
    >>> [(v["key"], v["verdict"], v["median"]) for v in verdicts(r)]
    [('compiled_vs_torch[int8]', 'PASS', 2.2)]
    """
    from .verdict import Target, judge

    out = []
    seconds = result.get("seconds", {})
    for name in COMPILED_TARGETS:
        ours, theirs = seconds.get(f"update/{name}"), seconds.get(f"update/{name}@torch")
        if not ours or not theirs or not result.get("compiled", {}).get(name):
            continue
        out.append(judge(Target(f"compiled_vs_torch[{name}]", f"whole {name} update, all in RAM: compiled params/s / "
                                "torch ops' (= torch ops' time / compiled; round by round)", ">", 1.0,
                                source=SOURCE), [t / o for o, t in zip(ours, theirs) if o > 0]))
    return out


def _suspended(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` with the compiled int8 kernel set aside (torch ops), for a same-run comparison."""
    def run() -> Any:
        with native.suspended():
            return call()

    return run


def _drive(directory: str, numel: int) -> Any:
    """A raw floor over a file the size of ``numel`` parameters' float32 state (12 B/param), for bandwidths."""
    import os
    from pathlib import Path

    from ...backends import supports_direct_io
    from .floor import RawFloor

    nbytes = -(-numel * 12 // (8 << 20)) * (8 << 20)
    path = Path(directory) / f".tierstore-codec-drive-{os.getpid()}.bin"
    return RawFloor(path, nbytes, request_bytes=8 << 20, depth=4, mode="serial", direct=supports_direct_io(Path(directory))).open()
