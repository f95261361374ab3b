"""Measure the host RAM a real tierstore run holds: peak RSS growth and page cache, in a child process.

``ram_budget`` promises a bound on RSS, so it is checked by running the real
thing in a fresh Python process and reading the Linux kernel's figures, not the
optimizer's own accounting. A child process (``python -m
tierstore.testing.memory CONFIG_JSON``):

1. builds the parameters and their gradients (fp32 or bf16),
2. imports what the scenario needs and pays torch's one-time optimizer cost
   (the first ``torch.optim`` optimizer imports ``torch._dynamo``, about
   70 MiB with torch 2.13, whichever optimizer it is); both are measured and
   reported as ``import_bytes``, outside the growth,
3. takes the **baseline**: RSS once the model and its gradients exist,
4. runs the scenario's phases (construct, steps, checkpoint save, ...); for
   each it records the **peak RSS** (the Linux kernel's high-water mark ``VmHWM``,
   restarted per phase through ``/proc/self/clear_refs``; a 1 ms sampling
   thread where the Linux kernel refuses that), the RSS at its end, where the RSS
   lives (:func:`~tierstore.cli.bench.rss.rss_by_kind`) and the **page
   cache** the state files hold (``mincore`` over each ``shards*.bin``,
   sampled every 20 ms during the phase, so it is per file, not the noisy
   system-wide ``Cached``),
5. prints one JSON line; :func:`run_in_child` returns it as a
   :class:`MemoryReport`.

The promise checked: ``report.peak_growth <= ram_budget + OVERHEAD_BYTES``.
:data:`OVERHEAD_BYTES` is the fixed overhead tierstore documents beyond its
budget (interpreter objects, thread stacks, library code pages, small
temporaries): 16 MiB whatever the model size.

Scenarios (:data:`SCENARIOS`): ``steps`` (build, step, close), ``checkpoint``
(zarr save and load), ``dcp`` (``torch.distributed.checkpoint`` save and
load through ``TieredStateful``), ``verify`` and ``export`` (the ``tierstore
verify``/``export`` commands on an existing state directory).

Example
-------
>>> import tempfile
>>> report = run_in_child("steps", {"params": 200_000, "ram_budget": 256 << 10,
...                                 "state_dir": tempfile.mkdtemp() + "/s", "backend": "buffered"})
>>> [p.name for p in report.phases]
['construct', 'steps', 'close']
>>> report.peak_growth < report.ram_budget + OVERHEAD_BYTES
True
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._layout.budget import OVERHEAD_BYTES
from ..cli.bench import rss
from ..sizes import format_size

__all__ = [
    "PhaseMemory",
    "MemoryReport",
    "MemoryProbe",
    "drop_file_cache",
    "build_params",
    "scenario_steps",
    "scenario_checkpoint",
    "scenario_dcp",
    "scenario_verify",
    "scenario_export",
    "measure",
    "run_in_child",
]

RSS_SAMPLE_S = 0.001  # fallback peak sampling, where VmHWM cannot be restarted
CACHE_SAMPLE_S = 0.02  # page-cache sampling of the state files (mincore of a 200 MiB file: ~0.1 ms)
RESULT_PREFIX = "TIERSTORE-MEMORY "  # marks the child's result line among any log output

# torch's first optimizer (any torch.optim.Optimizer) imports torch._dynamo: a
# one-time process cost, identical for torch.optim.AdamW, paid before the baseline.
WARM_TORCH_OPTIM = True


@dataclass(frozen=True)
class PhaseMemory:
    """What one phase of a scenario did to memory, relative to the baseline (bytes).

    ``peak_growth``: the highest RSS during the phase minus the baseline.
    ``end_growth``: RSS when it ended minus the baseline. ``kinds``: the
    growth of each kind of mapping at its end (``heap``, ``anon``, ``file``,
    ...). ``cache_peak``: the most page cache the watched state files held
    during the phase (``None`` where ``mincore`` is unavailable).
    """

    name: str
    peak_growth: int
    end_growth: int
    kinds: dict[str, int]
    cache_peak: int | None
    seconds: float


@dataclass
class MemoryReport:
    """The figures of one scenario run (see the module docs)."""

    scenario: str
    config: dict[str, Any]
    ram_budget: int
    baseline_rss: int
    import_bytes: int
    peak_method: str
    phases: list[PhaseMemory]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_growth(self) -> int:
        """The highest RSS of any phase minus the baseline."""
        return max((p.peak_growth for p in self.phases), default=0)

    @property
    def overhead(self) -> int:
        """Peak growth beyond the budget (negative: inside it)."""
        return self.peak_growth - self.ram_budget

    @property
    def cache_peak(self) -> int | None:
        """The most page cache the state files held in any phase."""
        values = [p.cache_peak for p in self.phases if p.cache_peak is not None]
        return max(values) if values else None

    def phase(self, name: str) -> PhaseMemory:
        """The phase called ``name`` (``KeyError`` if the scenario had none)."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r}; phases: {[p.name for p in self.phases]}")

    def within(self, overhead: int = OVERHEAD_BYTES) -> bool:
        """True when the peak growth is at most ``ram_budget + overhead``."""
        return self.peak_growth <= self.ram_budget + overhead

    def summary(self) -> str:
        """A table of the phases, for assertion messages and benchmark output."""
        lines = [
            f"{self.scenario} {json.dumps(self.config, sort_keys=True)}",
            f"budget {format_size(self.ram_budget)}, baseline RSS {format_size(self.baseline_rss)} "
            f"(imports and torch.optim warm-up before it: {format_size(self.import_bytes)}), peak by {self.peak_method}",
            f"{'phase':<18}{'peak growth':>14}{'end growth':>14}{'page cache':>14}  end growth by kind",
        ]
        for p in self.phases:
            cache = "-" if p.cache_peak is None else format_size(p.cache_peak)
            kinds = ", ".join(f"{k} {_signed(v)}" for k, v in p.kinds.items() if abs(v) >= 64 << 10)
            lines.append(
                f"{p.name:<18}{_signed(p.peak_growth):>14}{_signed(p.end_growth):>14}{cache:>14}  {kinds}"
            )
        lines.append(
            f"peak growth {format_size(self.peak_growth)} = budget {format_size(self.ram_budget)} "
            f"{'+' if self.overhead >= 0 else '-'} {format_size(abs(self.overhead))}"
        )
        for key, value in self.info.items():
            lines.append(f"{key}: {value}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Every figure, JSON-ready (derived ones included)."""
        out = asdict(self)
        out.update(peak_growth=self.peak_growth, overhead=self.overhead, cache_peak=self.cache_peak)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemoryReport:
        fields = {k: data[k] for k in ("scenario", "config", "ram_budget", "baseline_rss", "import_bytes", "peak_method", "info")}
        return cls(phases=[PhaseMemory(**p) for p in data["phases"]], **fields)


def _signed(nbytes: int) -> str:
    return ("+" if nbytes >= 0 else "-") + format_size(abs(nbytes))


class MemoryProbe:
    """Baseline, then per-phase peak RSS and state-file page cache, in this process.

    Parameters
    ----------
    watch
        A function returning the files whose page cache to sample (called at
        every sample: state files appear during construction).

    Example
    -------
    >>> probe = MemoryProbe()
    >>> _ = probe.baseline()
    >>> import mmap
    >>> with probe.phase("allocate"):
    ...     block = mmap.mmap(-1, 8 << 20)  # 8 MiB of fresh pages (malloc might reuse resident ones)
    ...     block.write(b"x" * len(block))  # touched: now resident
    8388608
    >>> probe.phases[0].peak_growth >= 7 << 20
    True
    """

    def __init__(self, watch: Callable[[], list[Path]] | None = None) -> None:
        self._watch = watch or (lambda: [])
        self.hwm = rss.reset_peak() and rss.peak_rss() is not None
        self.method = "VmHWM reset per phase" if self.hwm else f"RSS sampled every {RSS_SAMPLE_S * 1000:g} ms"
        self.base_rss = 0
        self._base_kinds: dict[str, int] = {}
        self._base_cache: dict[str, int] = {}
        self.phases: list[PhaseMemory] = []

    def _cache(self) -> dict[str, int] | None:
        out = {}
        for path in self._watch():
            with contextlib.suppress(FileNotFoundError):
                got = rss.cached_bytes(path)
                if got is None:
                    return None
                out[str(path)] = got
        return out

    def _cache_growth(self) -> int | None:
        now = self._cache()
        if now is None:
            return None
        return sum(max(0, v - self._base_cache.get(k, 0)) for k, v in now.items())

    def baseline(self, *, drop_cache: bool = True) -> int:
        """Take the baseline (after a garbage collection); return the RSS in bytes.

        ``drop_cache``: first write back and drop the watched files' clean
        pages from the page cache (``posix_fadvise(DONTNEED)``), so what a
        phase reads through the cache shows as growth.
        """
        gc.collect()
        if drop_cache:
            for path in self._watch():
                drop_file_cache(path)
        self.base_rss = _require(rss.rss_now(), "VmRSS")
        self._base_kinds = rss.rss_by_kind() or {}
        self._base_cache = self._cache() or {}
        return self.base_rss

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as the phase ``name``."""
        stop = threading.Event()
        box = {"rss": _require(rss.rss_now(), "VmRSS"), "cache": self._cache_growth()}

        def sample() -> None:
            next_cache = 0.0
            interval = RSS_SAMPLE_S if not self.hwm else CACHE_SAMPLE_S
            while not stop.wait(interval):
                if not self.hwm:
                    box["rss"] = max(box["rss"], rss.rss_now() or 0)
                now = time.monotonic()
                if now >= next_cache and box["cache"] is not None:
                    got = self._cache_growth()
                    box["cache"] = None if got is None else max(box["cache"], got)
                    next_cache = now + CACHE_SAMPLE_S

        if self.hwm:
            rss.reset_peak()
        sampler = threading.Thread(target=sample, name="tierstore-memory-probe", daemon=True)
        t0 = time.perf_counter()
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join()
        seconds = time.perf_counter() - t0
        end = _require(rss.rss_now(), "VmRSS")
        peak = max(box["rss"], end, (rss.peak_rss() or 0) if self.hwm else 0)
        cache = box["cache"]
        final_cache = self._cache_growth()
        if cache is not None and final_cache is not None:
            cache = max(cache, final_cache)
        kinds_now = rss.rss_by_kind() or {}
        kinds = {k: v - self._base_kinds.get(k, 0) for k, v in kinds_now.items()}
        self.phases.append(PhaseMemory(name, peak - self.base_rss, end - self.base_rss, kinds, cache, seconds))


def drop_file_cache(path: Path | str) -> None:
    """Write ``path``'s dirty pages back and drop its pages from the page cache (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _require(value: int | None, what: str) -> int:
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {what}; the memory kit needs Linux /proc")
    return value


# -- the child's side --------------------------------------------------------------


def build_params(numel: int, dtype: str = "float32", *, matrix_numel: int | None = None, seed: int = 0) -> list:
    """Parameters of ``numel`` elements in all (``dtype``), each with a gradient, all pages touched.

    Tensors are :func:`~tierstore.cli.bench.workload.param_sizes` (matrices
    of 8 Mi elements, each followed by a small bias), or matrices of
    ``matrix_numel`` elements: a model of many small tensors, as transformers are.
    """
    import torch

    from ..cli.bench.workload import param_sizes

    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    if matrix_numel:
        sizes = [matrix_numel] * (numel // matrix_numel) + ([numel % matrix_numel] if numel % matrix_numel else [])
    else:
        sizes = param_sizes(numel)
    params = []
    for n in sizes:
        p = torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen).to(kind).requires_grad_()
        p.grad = torch.empty(n, dtype=torch.float32).normal_(0.0, 1e-3, generator=gen).to(kind)
        params.append(p)
    return params


def _warm_torch_optim() -> None:
    import torch

    w = torch.zeros(16, requires_grad=True)
    w.grad = torch.ones(16)
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True)
    opt.step()
    opt.zero_grad()


def _state_files(state_dir: str | list[str] | None) -> Callable[[], list[Path]]:
    if state_dir is None:
        return lambda: []
    dirs = [state_dir] if isinstance(state_dir, str) else list(state_dir)  # a state over several drives: a list
    return lambda: sorted(f for d in dirs for f in Path(d).glob("shards*.bin"))


def _optimizer(params: list, config: dict[str, Any]) -> Any:
    from .. import TieredAdamW

    return TieredAdamW(
        params,
        lr=1e-3,
        state_dir=config.get("state_dir"),
        ram_budget=int(config["ram_budget"]),
        backend=config.get("backend", "direct"),
        durable=config.get("durable"),
        io_workers=int(config.get("io_workers", 8)),
        shard_numel=config.get("shard_numel"),
        request_bytes=int(config.get("request_bytes", 1 << 20)),
        prefetch_depth=int(config.get("prefetch_depth", 2)),
        pin_memory=config.get("pin_memory"),
        moment_dtype=config.get("moment_dtype", "float32"),
    )


def _describe(opt: Any) -> dict[str, Any]:
    return {
        "describe": opt.describe(),
        "state_bytes": opt.plan.state_nbytes,
        "optimizer_ram_bytes": opt.ram_bytes,
        "shards": len(opt.layout.shards),
        "backend": opt.backend,
    }


def _steps(opt: Any, count: int) -> None:
    for _ in range(count):
        opt.step()


def scenario_steps(config: dict[str, Any], probe: MemoryProbe, params: list) -> dict[str, Any]:
    """Build the optimizer, take ``steps`` steps, close it.

    ``extra_bytes`` (kit self-test only) allocates and touches that many
    bytes more while building, as a leak would.
    """
    with probe.phase("construct"):
        opt = _optimizer(params, config)
        leak = bytearray(int(config.get("extra_bytes", 0)))  # noqa: F841  (held to the end on purpose)
    info = _describe(opt)
    with probe.phase("steps"):
        _steps(opt, int(config.get("steps", 2)))
    with probe.phase("close"):
        opt.close()
    return info


def scenario_checkpoint(config: dict[str, Any], probe: MemoryProbe, params: list) -> dict[str, Any]:
    """Build, step, then save a zarr checkpoint and load it back (``opt.save_checkpoint``/``load_checkpoint``).

    ``checksum`` (default ``"xxh3"``) is the checkpoint's; with
    ``load_shard_numel`` the optimizer is closed and another one, cut into
    shards of that size (in a state directory of its own), loads it.
    """
    path = str(Path(config["work_dir"]) / "ckpt.zarr")
    with probe.phase("construct"):
        opt = _optimizer(params, config)
    info = _describe(opt)
    with probe.phase("steps"):
        _steps(opt, int(config.get("steps", 1)))
    with probe.phase("save_checkpoint"):
        opt.save_checkpoint(path, checksum=config.get("checksum", "xxh3"))
    if config.get("load_shard_numel"):
        with probe.phase("close"):
            opt.close()
        other = {**config, "shard_numel": int(config["load_shard_numel"]), "state_dir": str(Path(config["work_dir"]) / "state-loader")}
        with probe.phase("construct_loader"):
            opt = _optimizer(params, other)
        info["loader"] = opt.describe()
    with probe.phase("load_checkpoint"):
        opt.load_checkpoint(path)
    opt.close()
    return info


def scenario_dcp(config: dict[str, Any], probe: MemoryProbe, params: list) -> dict[str, Any]:
    """Build, step, then ``dcp.save`` (and, with ``load``, ``dcp.load``) through ``TieredStateful``.

    ``single_file_per_rank`` (default true, DCP's default) and ``tiered_planner``
    (:class:`~tierstore.dcp.TieredSavePlanner`) choose how DCP writes.
    """
    import torch.distributed.checkpoint as dcp

    from ..dcp import TieredSavePlanner, TieredStateful

    path = str(Path(config["work_dir"]) / "dcp")
    with probe.phase("construct"):
        opt = _optimizer(params, config)
    info = _describe(opt)
    with probe.phase("steps"):
        _steps(opt, int(config.get("steps", 1)))
    writer = dcp.FileSystemWriter(path, single_file_per_rank=bool(config.get("single_file_per_rank", True)))
    planner = TieredSavePlanner() if config.get("tiered_planner", False) else None
    with probe.phase("dcp_save"):
        dcp.save({"optim": TieredStateful(opt)}, storage_writer=writer, planner=planner, no_dist=True)
    if config.get("load", False):
        with probe.phase("dcp_load"):
            dcp.load({"optim": TieredStateful(opt)}, checkpoint_id=path, no_dist=True)
    opt.close()
    return info


def _cli(args: list[str]) -> None:
    from ..cli import main

    code = main(args)
    if code != 0:
        raise RuntimeError(f"tierstore {' '.join(args)} exited with {code}")


def scenario_verify(config: dict[str, Any], probe: MemoryProbe, params: list) -> dict[str, Any]:
    """``tierstore verify STATE_DIR`` on an existing state directory."""
    with probe.phase("verify"):
        _cli(["verify", config["state_dir"], "--no-progress"])
    return {}


def scenario_export(config: dict[str, Any], probe: MemoryProbe, params: list) -> dict[str, Any]:
    """``tierstore export STATE_DIR OUT.zarr`` on an existing state directory."""
    out = str(Path(config["work_dir"]) / "export.zarr")
    with probe.phase("export"):
        _cli(["export", config["state_dir"], out, "--no-progress"])
    return {}


Scenario = Callable[[dict[str, Any], MemoryProbe, list], dict[str, Any]]

#: name -> (function, modules imported before the baseline)
SCENARIOS: dict[str, tuple[Scenario, tuple[str, ...]]] = {
    "steps": (scenario_steps, ("tierstore", "tierstore.optimizer", "tierstore.diagnose", "tierstore._runtime.startup")),
    "checkpoint": (scenario_checkpoint, ("tierstore", "tierstore.optimizer", "tierstore.checkpoint")),
    "dcp": (scenario_dcp, ("tierstore", "tierstore.optimizer", "tierstore.dcp", "torch.distributed.checkpoint")),
    "verify": (scenario_verify, ("tierstore", "tierstore.optimizer", "tierstore.cli", "tierstore.cli.inspection")),
    "export": (scenario_export, ("tierstore", "tierstore.optimizer", "tierstore.cli", "tierstore.cli.inspection")),
}


def measure(scenario: str, config: dict[str, Any]) -> MemoryReport:
    """Run ``scenario`` in *this* process and measure it (:func:`run_in_child` is the usual entry).

    ``config`` keys: ``ram_budget`` (bytes), ``params`` (elements; 0 for
    ``verify``/``export``), ``dtype`` (``"float32"``, ``"bfloat16"``),
    ``state_dir``, ``work_dir``, ``backend``, ``durable``, ``io_workers``,
    ``request_bytes``, ``prefetch_depth``, ``shard_numel``, ``matrix_numel``, ``steps``, ``pin_memory``, ``warm_torch_optim``, ``checksum`` and ``load_shard_numel`` (``checkpoint``)
    (default true: pay torch's one-time ``torch._dynamo`` import before the
    baseline), ``load`` (``dcp``: load too).
    """
    try:
        fn, modules = SCENARIOS[scenario]
    except KeyError:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {sorted(SCENARIOS)}") from None
    start = _require(rss.rss_now(), "VmRSS")
    params = []
    if config.get("params"):
        params = build_params(int(config["params"]), config.get("dtype", "float32"), matrix_numel=config.get("matrix_numel"))
    with_params = _require(rss.rss_now(), "VmRSS")
    for name in modules:
        importlib.import_module(name)
    if config.get("warm_torch_optim", WARM_TORCH_OPTIM):
        _warm_torch_optim()
    probe = MemoryProbe(_state_files(config.get("state_dir")))
    baseline = probe.baseline()
    info = fn(config, probe, params)
    info["model_bytes"] = with_params - start
    ram_budget = int(config.get("ram_budget") or 0)
    return MemoryReport(
        scenario=scenario,
        config=config,
        ram_budget=ram_budget,
        baseline_rss=baseline,
        import_bytes=baseline - with_params,
        peak_method=probe.method,
        phases=probe.phases,
        info=info,
    )


def run_in_child(scenario: str, config: dict[str, Any], *, timeout: float = 600.0, env: dict[str, str] | None = None) -> MemoryReport:
    """Run ``scenario`` with ``config`` in a fresh Python process; return its :class:`MemoryReport`.

    ``state_dir`` and ``work_dir`` default to new temporary directories
    (removed afterwards unless given). ``env`` adds environment variables
    (e.g. ``MALLOC_ARENA_MAX``) for the child.

    Raises
    ------
    RuntimeError
        If the child fails (its output is in the message).
    """
    import shutil

    config = dict(config)
    made: list[str] = []
    for key in ("state_dir", "work_dir"):
        if key not in config:
            if key == "state_dir" and scenario in ("verify", "export"):
                raise ValueError(f"scenario {scenario!r} needs config['state_dir'] (an existing state directory)")
            config[key] = tempfile.mkdtemp(prefix=f"tierstore-memory-{key}-")
            made.append(config[key])
    if "state_dir" in made:
        os.rmdir(config["state_dir"])  # TieredAdamW creates it
    root = str(Path(__file__).resolve().parents[2])
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    child_env.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tierstore.testing.memory", json.dumps({"scenario": scenario, "config": config})],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env,
        )
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"memory scenario {scenario!r} failed in its child process (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return MemoryReport.from_json(json.loads(lines[-1][len(RESULT_PREFIX) :]))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tierstore.testing.memory '{\"scenario\": ..., \"config\": {...}}'", file=sys.stderr)
        return 2
    request = json.loads(argv[1])
    report = measure(request["scenario"], request["config"])
    print(RESULT_PREFIX + json.dumps(report.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
