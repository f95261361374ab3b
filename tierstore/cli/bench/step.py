"""``tierstore bench step``: time per optimizer step in RAM and on disk, against the alternatives.

On the same fp32 parameters and gradients (:mod:`.workload`), in the same
run, interleaved (each round visits every contender once, in a rotating
order; medians over rounds are reported):

- ``tierstore-ram``: :class:`~tierstore.TieredAdamW` with ``ram_budget=None``;
- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` (both skipped when their
  state does not fit in the available RAM);
- ``tierstore-disk``: TieredAdamW under ``--ram-budget`` with its state file
  under ``--dir`` (one per ``--backend``, and per ``--moment-dtype``: a list
  such as ``float32,bfloat16,int8`` runs each format side by side, every one
  under the same budget, and reports each one's step time over float32's,
  paired round by round);
- ``peer-pipelined-swap``: DeepSpeed ZeRO-Infinity's pipelined optimizer
  swapping re-created on the same drive (:mod:`.peer`);
- ``floor-serial``/``floor-stream``: the same on-disk bytes read and written
  with no update (:mod:`.floor`). The floor is the fastest of them; the
  bandwidth floor is ``bytes / read GB/s + bytes / write GB/s`` with the
  bandwidths of the serial floor's phases.

Reported: step time, parameters/s, overlap efficiency (floor / step time),
the disk step's split into read wait, update and write wait, and the peak
RSS and page-cache growth of a disk run measured alone in a child process
(:mod:`.footprint`).

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(); add_arguments(parser)
>>> parser.parse_args(["--params", "2e7", "--ram-budget", "1/8"]).params
'2e7'
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..._config.knobs import Knobs
from ..._config.registry import KNOBS
from ..._layout.layout import layout_format
from ...backends import resolve_backend, supports_direct_io
from ...errors import ConfigError
from ...sizes import format_size, parse_budget, parse_size
from . import resources, rss, workload
from .floor import MODES, RawFloor
from .peer import PipelinedSwapper
from .report import hardware_line, machine_info, median, write_json
from .step_report import durability_line, plot, ratios, render, round_floors, split_of, verdicts
from .verdict import MIN_REPEATS, overall

log = logging.getLogger(__name__)

MiB = 1 << 20
RAM_HEADROOM = 0.8  # RAM contenders are skipped when their state exceeds this share of what is free
SPLIT_KEYS = ("read_wait", "update", "write_wait")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench step``."""
    parser.add_argument("--params", required=True, help="fp32 parameters, e.g. 2e8")
    parser.add_argument(
        "--ram-budget", default="1/8", help="RAM for the disk run's state: a size (200MB) or a share of the state (1/8)"
    )
    parser.add_argument("--dir", default=None, help="where state files go (default: the temp directory)")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--backend", default="auto", help="disk backend(s), e.g. 'auto' or 'direct,mmap'")
    parser.add_argument("--shard-numel", type=float, default=None, help="elements per shard (default: TieredAdamW's)")
    knobs = Knobs()  # TieredAdamW's own defaults
    parser.add_argument("--prefetch-depth", type=int, default=knobs.prefetch_depth)
    parser.add_argument("--io-workers", type=int, default=knobs.io_workers)
    parser.add_argument("--request-bytes", default=format_size(knobs.request_bytes).replace(" ", ""))
    parser.add_argument("--keep-master", action="store_true", help="keep an fp32 master copy (12 B/param)")
    parser.add_argument(
        "--moment-dtype", default="float32",
        help="disk run(s) per moment format: float32 (default), bfloat16, int8, or a list such as float32,bfloat16,int8 "
        "(the budget stays the one --ram-budget gives for float32)",
    )
    parser.add_argument(
        "--durable", choices=("on", "off", "both"), default="on",
        help="disk run(s) durable=True (the default, as TieredAdamW with a state_dir runs: a committed copy "
        "on disk, commits in the background), off (durable=False: nothing survives a crash), or both",
    )
    parser.add_argument(
        "--floor-settings", default="8MiB:4,16MiB:8", help="raw floor request:depth settings (default 8MiB:4,16MiB:8)"
    )
    parser.add_argument("--peer-block", default="1MiB", help="peer aio block size (DeepSpeed default 1MiB)")
    parser.add_argument("--peer-queue-depth", type=int, default=8, help="peer aio queue depth (DeepSpeed default 8)")
    parser.add_argument(
        "--skip", default="", help="contenders to leave out: any of ram,torch,disk,peer,floor,footprint (comma-separated)"
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="write a PNG plot")


SKIPPABLE = ("ram", "torch", "disk", "peer", "floor", "footprint")


def _parse_budget(text: str, state_nbytes: int) -> int:
    # The API's parser and errors (bytes, "8GiB", or a share: "1/8", "12.5%", 0.125), named after the flag.
    return parse_budget(text, state_bytes=state_nbytes, name="--ram-budget")


def _parse_floor(text: str) -> list[tuple[int, int]]:
    settings = []
    for part in text.split(","):
        req, sep, depth = part.strip().partition(":")
        if not sep:
            raise ConfigError(f"--floor-settings {text!r}: write request:depth pairs, e.g. '8MiB:4,16MiB:8'")
        size = parse_size(req, name="--floor-settings request")
        try:
            d = int(depth)
        except ValueError:
            raise ConfigError(f"--floor-settings {text!r}: depth {depth!r} is not a whole number") from None
        if size <= 0 or size % 4096 or d < 1:
            raise ConfigError(f"--floor-settings {text!r}: requests must be multiples of 4 KiB and depths >= 1")
        settings.append((size, d))
    return settings


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the options into one plain dict (also what the JSON records)."""
    try:
        params = int(float(args.params))
    except ValueError:
        raise ConfigError(f"--params {args.params!r} is not a number; write e.g. 2e8") from None
    if params < 4096:
        raise ConfigError(f"--params {params} is too small to shard; use at least 4096 (e.g. 2e7)")
    # The knobs are checked by their one declaration (the registry), in the API's words, naming the flag.
    for name in ("prefetch_depth", "io_workers"):
        KNOBS[name].validate(getattr(args, name), f"--{name.replace('_', '-')}")
    for name, least in (("steps", 1), ("warmup", 0), ("peer_queue_depth", 1)):  # the benchmark's own flags
        value = getattr(args, name)
        if value < least:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be an int >= {least}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SKIPPABLE):
        raise ConfigError(f"--skip lists unknown {sorted(skip - set(SKIPPABLE))}; choose from {SKIPPABLE}")
    directory = Path(args.dir).expanduser() if args.dir else Path(tempfile.gettempdir())
    if not directory.is_dir():
        raise ConfigError(f"--dir {str(directory)!r} is not a directory; pass an existing directory on the drive to use")
    fields = workload.state_fields(keep_master=args.keep_master)
    state = params * 4 * len(fields)
    budget = _parse_budget(args.ram_budget, state)
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    backends = [resolve_backend(b, directory) for b in backends]
    request_bytes = KNOBS["request_bytes"].validate(parse_size(args.request_bytes, name="--request-bytes"), "--request-bytes")
    # Canonical names ("bf16" -> "bfloat16"): an unknown name fails here, naming the known ones.
    formats = [layout_format(f.strip()).name for f in str(args.moment_dtype).split(",") if f.strip()]
    if not formats or len(set(formats)) != len(formats):
        raise ConfigError(f"--moment-dtype {args.moment_dtype!r}: list each format once, e.g. float32,bfloat16,int8")
    return {
        "params": params,
        "state_bytes_estimate": state,
        "ram_budget": budget,
        "dir": str(directory),
        "steps": args.steps,
        "warmup": args.warmup,
        "backends": backends,
        "shard_numel": None if args.shard_numel is None else int(args.shard_numel),
        "prefetch_depth": args.prefetch_depth,
        "io_workers": args.io_workers,
        "request_bytes": request_bytes,
        "keep_master": bool(args.keep_master),
        "moment_dtypes": formats,
        "durable": {"off": [False], "on": [True], "both": [False, True]}[args.durable],
        "floor_settings": _parse_floor(args.floor_settings),
        "peer_block_bytes": parse_size(args.peer_block, name="--peer-block"),
        "peer_queue_depth": args.peer_queue_depth,
        "skip": sorted(skip),
        "direct_io": supports_direct_io(directory),
    }


# -- contenders ----------------------------------------------------------------
class _Tiered:
    def __init__(self, name: str, params: list[torch.Tensor], **kwargs: Any) -> None:
        from ...optimizer import TieredAdamW

        self.name = name
        self.opt = TieredAdamW(params, lr=1e-3, **kwargs)

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.opt.step()
        seconds = time.perf_counter() - t0
        out = {"seconds": seconds}
        st = self.opt.last_step_stats
        if st is not None:
            out.update(read_wait=st.read_wait, update=st.update, write_wait=st.write_wait,
                       commit_wait=st.persist_wait + st.commit_wait,
                       reads=st.reads, cache_hits=st.cache_hits, writes=st.writes,
                       bytes_read=st.bytes_read, drive_bytes=st.drive_bytes)
        return out

    def close(self) -> None:
        self.opt.close()


class _Torch:
    name = "torch-fused"

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.opt.step()
        return {"seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.opt.state.clear()


def _available_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing: assume the RAM contenders fit
        return 1 << 62


def _footprint(cfg: dict[str, Any], folder: Path, backend: str, durable: bool, fmt: str = "float32") -> dict[str, Any]:
    """Run the disk contender alone in a child process for its own peak RSS."""
    child = {
        "params": cfg["params"],
        "ram_budget": cfg["ram_budget"],
        "moment_dtype": fmt,
        "dir": str(folder / f"footprint-{backend}-{durable}-{fmt}"),
        "durable": durable,
        "steps": cfg["steps"],
        "backend": backend,
        "shard_numel": cfg["shard_numel"],
        "prefetch_depth": cfg["prefetch_depth"],
        "io_workers": cfg["io_workers"],
        "request_bytes": cfg["request_bytes"],
        "keep_master": cfg["keep_master"] or None,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tierstore.cli.bench.footprint", json.dumps(child)],
        capture_output=True, text=True, check=False,
    )
    shutil.rmtree(child["dir"], ignore_errors=True)
    if done.returncode != 0:
        log.warning("footprint run failed (exit %s): %s", done.returncode, done.stderr.strip()[-500:])
        return {"error": done.stderr.strip()[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _disk_name(backend: str, durable: bool, cfg: dict[str, Any], fmt: str = "float32") -> str:
    name = "tierstore-disk"
    if len(cfg["backends"]) > 1:
        name += f"-{backend}"
    if not durable:  # durable is TieredAdamW's default with a state_dir: only the exception is named
        name += "-not-durable"
    if fmt != "float32":
        name += f"-{fmt}"
    return name


def _disk_runs(cfg: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(backend, durable, moment_dtype) of every disk contender."""
    return [(b, d, f) for b in cfg["backends"] for d in cfg["durable"] for f in cfg.get("moment_dtypes", ["float32"])]


def _build(cfg: dict[str, Any], params: list[torch.Tensor], folder: Path, notes: list[str]) -> list[Any]:
    skip = set(cfg["skip"])
    contenders: list[Any] = []
    knobs = dict(shard_numel=cfg["shard_numel"], prefetch_depth=cfg["prefetch_depth"], io_workers=cfg["io_workers"],
                 request_bytes=cfg["request_bytes"], keep_master=cfg["keep_master"] or None)
    nfields = len(workload.state_fields(keep_master=cfg["keep_master"]))
    free = _available_ram() * RAM_HEADROOM
    if "ram" not in skip:
        if cfg["params"] * 4 * nfields <= free:
            contenders.append(_Tiered("tierstore-ram", params, ram_budget=None, **knobs))
            free -= cfg["params"] * 4 * nfields
        else:
            notes.append("tierstore-ram skipped: its state does not fit in the available RAM")
    if "torch" not in skip:
        if cfg["params"] * 8 <= free:
            contenders.append(_Torch(params))
        else:
            notes.append("torch-fused skipped: its state does not fit in the available RAM")
    disk = []
    if "disk" not in skip:
        for backend, durable, fmt in _disk_runs(cfg):
            name = _disk_name(backend, durable, cfg, fmt)
            disk.append(_Tiered(name, params, ram_budget=cfg["ram_budget"], backend=backend, durable=durable,
                                moment_dtype=fmt, state_dir=str(folder / f"state-{backend}-{durable}-{fmt}"), **knobs))
        contenders += disk
    reference = disk[0].opt if disk else None
    probe = None
    if reference is None and ("peer" not in skip or "floor" not in skip):
        from ...optimizer import TieredAdamW  # built only for its layout and plan

        probe = TieredAdamW(params, lr=1e-3, ram_budget=cfg["ram_budget"], state_dir=str(folder / "probe"),
                            durable=False, **knobs)
        reference = probe
    if reference is not None and reference.disk_bytes:
        disk_bytes = reference.disk_bytes
        if "peer" not in skip:
            peer = PipelinedSwapper(
                params, directory=folder / "peer", shard_numel=reference.layout.shard_numel,
                resident=reference.plan.resident, fields=reference.layout.fields,
                block_bytes=cfg["peer_block_bytes"], queue_depth=cfg["peer_queue_depth"], direct=cfg["direct_io"],
            )
            contenders.append(peer.open())
        if "floor" not in skip:
            for req, depth in cfg["floor_settings"]:
                for mode in MODES:
                    floor = RawFloor(folder / f"floor-{mode}-{req}-{depth}.bin", disk_bytes, request_bytes=req,
                                     depth=depth, mode=mode, direct=cfg["direct_io"])
                    floor.name = f"floor-{mode} {format_size(req)}x{depth}"
                    contenders.append(floor.open())
    elif reference is not None:
        notes.append("the whole state fits in --ram-budget: nothing on disk, no peer or floor to compare")
    if probe is not None:
        probe.close()
    return contenders


def _run_rounds(contenders: list[Any], *, warmup: int, steps: int) -> dict[str, list[dict[str, float]]]:
    from tqdm import tqdm

    results: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    n = len(contenders)
    with tqdm(total=(warmup + steps) * n, desc="bench step", unit="step", disable=None, leave=False) as bar:
        for r in range(warmup + steps):
            order = contenders[r % n:] + contenders[: r % n] if n else []
            for c in order:
                bar.set_postfix_str(c.name, refresh=False)
                c0 = time.process_time()
                out = c.step()
                out["cpu_s"] = time.process_time() - c0
                if r >= warmup:
                    results[c.name].append(out)
                bar.update(1)
    return results


# -- summary and output ----------------------------------------------------------
def summarize(
    results: dict[str, list[dict[str, float]]],
    *,
    numel: int,
    disk_bytes: int,
    io_bytes: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Medians per contender, the floors, and the ratios the targets name (with their per-round values).

    ``disk_bytes`` is what the floors move each way; ``io_bytes`` gives a
    disk contender's own (read, written) bytes per step when they differ
    (durable steps also write the resident shards their commits persist;
    compressed formats move fewer bytes): its floor is then the bandwidth
    floor of its own bytes. Every ratio also comes per round
    (``*_rounds``): a round runs every contender once, so each round's
    ratio compares times that saw the same machine weather.
    """
    io_bytes = io_bytes or {}
    per: dict[str, dict[str, Any]] = {}
    for name, runs in results.items():
        if not runs:
            continue
        secs = [r["seconds"] for r in runs]
        entry: dict[str, Any] = {"median_s": median(secs), "min_s": min(secs), "max_s": max(secs), "steps_s": secs}
        entry["params_per_s"] = numel / entry["median_s"]
        for key in (*SPLIT_KEYS, "commit_wait", "reads", "cache_hits", "writes", "cpu_s"):
            if key in runs[0]:
                entry[key] = median([r[key] for r in runs])
        for key in ("bytes_read", "drive_bytes"):  # a commit writes once every few steps: the mean per step
            if key in runs[0]:
                entry[key] = sum(r[key] for r in runs) / len(runs)
        if name.startswith("floor-serial"):
            entry["read_GBps_steps"] = [disk_bytes / r["read_s"] / 1e9 for r in runs]
            entry["write_GBps_steps"] = [disk_bytes / r["write_s"] / 1e9 for r in runs]
            entry["read_GBps"] = median(entry["read_GBps_steps"])
            entry["write_GBps"] = median(entry["write_GBps_steps"])
        per[name] = entry
    summary: dict[str, Any] = {"params": numel, "disk_bytes": disk_bytes, "moved_bytes_per_step": 2 * disk_bytes}
    summary["step_seconds"] = {n: e["median_s"] for n, e in per.items()}
    summary["params_per_s"] = {n: e["params_per_s"] for n, e in per.items()}
    if "tierstore-ram" in per and "torch-fused" in per:
        summary["ram_vs_torch"] = per["torch-fused"]["median_s"] / per["tierstore-ram"]["median_s"]
        # Rounds alternate the contenders, so a round's two times saw the same machine
        # weather; the median of per-round ratios shrugs off minutes-long drifts.
        summary["ram_vs_torch_rounds"] = ratios(per["torch-fused"]["steps_s"], per["tierstore-ram"]["steps_s"])
        summary["ram_vs_torch_paired"] = median(summary["ram_vs_torch_rounds"])
    floors = {n: e for n, e in per.items() if n.startswith("floor-")}
    serial = [e for n, e in floors.items() if n.startswith("floor-serial")]
    if floors:
        summary["floor_fastest_measured_seconds"] = min(e["median_s"] for e in floors.values())
        summary["floor_fastest_measured"] = min(floors, key=lambda n: floors[n]["median_s"])
    if serial:
        read_bw = max(e["read_GBps"] for e in serial)
        write_bw = max(e["write_GBps"] for e in serial)
        summary["raw_read_GBps"] = read_bw
        summary["raw_write_GBps"] = write_bw
        summary["floor_bandwidth_seconds"] = disk_bytes / (read_bw * 1e9) + disk_bytes / (write_bw * 1e9)
    candidates = [summary[k] for k in ("floor_fastest_measured_seconds", "floor_bandwidth_seconds") if k in summary]
    floor = min(candidates) if candidates else None
    summary["floor_seconds"] = floor
    peer = per.get(PipelinedSwapper.name)
    disk: dict[str, Any] = {}
    for name, e in per.items():
        if not name.startswith("tierstore-disk"):
            continue
        step = e["median_s"]
        info: dict[str, Any] = {"step_s": step, "params_per_s": e["params_per_s"]}
        read_b, write_b = io_bytes.get(name, (disk_bytes, disk_bytes))
        info["read_bytes"], info["written_bytes"] = read_b, write_b
        own_floor = floor
        if (read_b, write_b) != (disk_bytes, disk_bytes) and "raw_read_GBps" in summary:
            own_floor = read_b / (summary["raw_read_GBps"] * 1e9) + write_b / (summary["raw_write_GBps"] * 1e9)
            info["floor_s"] = own_floor
        split = split_of(e)
        if split:
            info["split_s"] = split
        for key in ("reads", "cache_hits", "writes"):
            if key in e:
                info[key] = e[key]
        if own_floor:
            info["over_floor"] = step / own_floor
            info["overlap_efficiency"] = own_floor / step
            update = split.get("update", 0.0)
            if update > 0:
                # 1.0: the update costs nothing beyond the floor; 0.0: it adds its whole time.
                info["update_hidden_fraction"] = min(1.0, max(0.0, (own_floor + update - step) / update))
            rounds = round_floors(per, summary, disk_bytes=disk_bytes, read_bytes=read_b, written_bytes=write_b)
            if rounds:
                info["over_floor_rounds"] = ratios(e["steps_s"], rounds)
        if "floor_bandwidth_seconds" in summary and own_floor == floor:
            info["overlap_efficiency_bandwidth"] = summary["floor_bandwidth_seconds"] / step
        if peer is not None:
            info["peer_over_ours"] = peer["median_s"] / step
            info["peer_over_ours_rounds"] = ratios(peer["steps_s"], e["steps_s"])
        disk[name] = info
    summary["disk"] = disk
    formats = {}
    for name, info in disk.items():  # each compressed run against the float32 run of its backend and durability
        base = name
        for fmt in ("-bfloat16", "-int8"):
            base = base.removesuffix(fmt)
        if base != name and base in per:
            info["vs_float32_rounds"] = ratios(per[name]["steps_s"], per[base]["steps_s"])
            info["vs_float32_paired"] = median(info["vs_float32_rounds"])
            info["vs_float32"] = per[name]["median_s"] / per[base]["median_s"]
            formats[name] = info["vs_float32_paired"]
    for name, info in disk.items():  # each durable run against its durable=False twin, when both ran
        twin = _not_durable_twin(name)
        if twin in per and twin != name:
            info["vs_not_durable_rounds"] = ratios(per[name]["steps_s"], per[twin]["steps_s"])
            info["vs_not_durable_paired"] = median(info["vs_not_durable_rounds"])
    if formats:
        summary["moment_dtype_vs_float32_paired"] = formats
    if disk:
        first = next(iter(disk.values()))
        for key in ("overlap_efficiency", "over_floor", "peer_over_ours", "update_hidden_fraction"):
            if key in first:
                summary[key] = first[key]
    if peer is not None:
        summary["peer_split_s"] = split_of(peer)
    return {"contenders": per, "summary": summary}


def _not_durable_twin(name: str) -> str:
    """``tierstore-disk[-backend]-not-durable[-format]`` for the durable run ``tierstore-disk[-backend][-format]``."""
    if "-not-durable" in name:
        return name
    for fmt in ("-bfloat16", "-int8"):
        if name.endswith(fmt):
            return name.removesuffix(fmt) + "-not-durable" + fmt
    return name + "-not-durable"


def needs(cfg: dict[str, Any]) -> resources.Needs:
    """The RAM and free disk this configuration needs at least (all-in-RAM contenders size themselves)."""
    skip = set(cfg["skip"])
    runs = _disk_runs(cfg)
    disk_runs = 0 if "disk" in skip else len(runs)  # (compressed runs need less: an upper bound)
    durable_runs = 0 if "disk" in skip else sum(durable for _, durable, _ in runs)
    return resources.step_needs(
        params=cfg["params"],
        fields=len(workload.state_fields(keep_master=cfg["keep_master"])),
        ram_budget=cfg["ram_budget"],
        disk_runs=disk_runs,
        durable_runs=durable_runs,
        peer="peer" not in skip,
        floors=0 if "floor" in skip else len(cfg["floor_settings"]) * len(MODES),
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write JSON and PNG when asked."""
    cfg = _config(args)
    resources.check(needs(cfg), cfg["dir"], fix="lower --params, --skip some contenders, or use a larger machine")
    started = time.time()
    folder = Path(cfg["dir"]) / f".tierstore-bench-step-{os.getpid()}"
    folder.mkdir()
    notes: list[str] = []
    if not cfg["direct_io"]:
        notes.append(f"O_DIRECT is not supported under {cfg['dir']}: peer and floor use buffered I/O")
    footprints: dict[str, Any] = {}
    contenders: list[Any] = []
    try:
        if "footprint" not in cfg["skip"] and "disk" not in cfg["skip"]:
            for backend, durable, fmt in _disk_runs(cfg):
                footprints[_disk_name(backend, durable, cfg, fmt)] = _footprint(cfg, folder, backend, durable, fmt)
        cached_before = rss.meminfo("Cached")
        params = workload.build(cfg["params"])
        gc.collect()
        contenders = _build(cfg, params, folder, notes)
        results = _run_rounds(contenders, warmup=cfg["warmup"], steps=cfg["steps"])
        disk_bytes = 0
        file_cache: dict[str, int | None] = {}
        io_bytes: dict[str, tuple[int, int]] = {}
        state_bytes = cfg["state_bytes_estimate"]
        for c in contenders:
            if c.name.startswith("tierstore-disk"):
                # Bytes one step moves: every streamed shard read and written once
                # (opt.disk_bytes would count both durable copies).
                streamed = c.opt.plan.disk_nbytes
                disk_bytes = disk_bytes or streamed
                state_bytes = c.opt.plan.state_nbytes
                file_cache[c.name] = rss.state_cached_bytes(c.opt.state_dir)
                # Durable steps also write what their commits persist (the resident shards, once
                # per commit): their floor is that of the bytes they were measured writing.
                runs = results.get(c.name) or []
                written = streamed
                if "-not-durable" not in c.name and runs and "drive_bytes" in runs[0]:
                    written = max(streamed, round(sum(r["drive_bytes"] for r in runs) / len(runs)))
                io_bytes[c.name] = (streamed, written)
            elif isinstance(c, PipelinedSwapper):
                disk_bytes = disk_bytes or c.swapped_nbytes
            elif isinstance(c, RawFloor):
                disk_bytes = disk_bytes or c.nbytes
        cached_after = rss.meminfo("Cached")
    finally:
        for c in contenders:
            c.close()
        shutil.rmtree(folder, ignore_errors=True)
    result = summarize(results, numel=cfg["params"], disk_bytes=disk_bytes, io_bytes=io_bytes)
    summary = result["summary"]
    summary["state_bytes"] = state_bytes
    summary["ram_budget"] = cfg["ram_budget"]
    summary["state_file_cached_bytes"] = file_cache
    summary["meminfo_cached_delta_bytes"] = (
        None if cached_before is None or cached_after is None else cached_after - cached_before
    )
    if footprints:
        first = next(iter(footprints.values()))
        if "error" not in first:
            summary["peak_rss_over_baseline_bytes"] = first["peak_over_baseline_bytes"]
            over = first["peak_over_baseline_bytes"]
            summary["rss_within_budget_plus_64MiB"] = None if over is None else over <= cfg["ram_budget"] + 64 * MiB
            summary["footprint_state_file_cached_bytes"] = first["state_file_cached_bytes"]
    for name, entry in result["contenders"].items():
        if name.startswith("tierstore-disk"):
            entry["durable"] = "-not-durable" not in name
    if cfg["steps"] < MIN_REPEATS:
        notes.append(f"--steps {cfg['steps']}: fewer than {MIN_REPEATS} rounds, so no target can be judged "
                     "(the verdicts say UNDECIDED)")
    document = {
        "tool": "tierstore bench step",
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started,
        "machine": machine_info(cfg["dir"]),
        "config": cfg,
        "durability": durability_line(cfg),
        "summary": summary,
        "contenders": result["contenders"],
        "footprint": footprints,
        "notes": notes,
    }
    document["hardware"] = hardware_line(document["machine"])
    document["verdicts"] = verdicts(document)
    document["verdict"] = overall(document["verdicts"])
    print(render(document, document["verdicts"]))
    if args.json:
        print(f"wrote {write_json(args.json, document)}")
    if args.plot:
        print(f"wrote {plot(document, args.plot, title=plot_title(document))}")
    return 0  # a FAIL is a finding, not an error: the verdicts and the JSON's "verdict" say it


def plot_title(document: dict[str, Any]) -> str:
    """The plot's title: size, budget, bytes on disk, where, and the durability of the disk runs."""
    cfg, s = document["config"], document["summary"]
    head = f"tierstore bench step: {cfg['params']:.2g} fp32 params"
    if not s.get("disk_bytes"):  # no disk run: a budget and a drive would describe nothing drawn
        return f"{head}, all state in RAM"
    durable = {(True,): "durable", (False,): "not durable"}.get(tuple(cfg.get("durable", [True])), "durable and not")
    return (f"{head}, ram_budget {format_size(cfg['ram_budget'])}, "
            f"{format_size(s['disk_bytes'])} streamed each way per step ({cfg['dir']}; disk runs {durable})")
