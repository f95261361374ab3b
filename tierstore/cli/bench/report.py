"""Benchmark output: terminal tables, JSON documents and PNG plots.

Every benchmark produces one JSON document: ``{"tool", "version", "argv",
"machine", "config", ..., "summary"}``. ``summary`` holds the headline
numbers other tools read (the memory/I/O planner reads ``bench io``'s
``summary.best_read_GBps``, ``best_write_GBps`` and ``memory_GBps``).

Example
-------
>>> print(format_table([{"a": 1, "b": 2.5}], [("a", "A", "{}"), ("b", "B", "{:.1f}")]))
A  B
-  ---
1  2.5
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._version import __version__

Column = tuple[str, str, str]  # (key, header, format)


def median(values: Sequence[float]) -> float:
    """The median, ``nan`` for no values."""
    return statistics.median(values) if values else float("nan")


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB per second (``nan`` for a zero time)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Rows as left-aligned text columns; missing values show as ``-``."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            line.append("-" if value is None else fmt.format(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths).rstrip())
    for line in cells[1:]:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    return "\n".join(out)


def machine_info(directory: Path | str | None = None) -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, RAM, the drive behind ``directory``, torch.

    Example
    -------
    >>> info = machine_info(".")
    >>> {"cpu_model", "cpus", "cores_usable", "torch", "cpu_capability"} <= set(info)
    True
    """
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        # The vector instruction set torch's CPU kernels dispatch to (AVX2, AVX512, ...): the fused
        # AdamW and the codecs run at very different speeds on different capabilities.
        "cpu_capability": _cpu_capability(),
        "cpus": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "tierstore": __version__,
        # Threading settings change CPU-bound results a lot (OpenMP spin-waiting competes with I/O threads).
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")},
    }
    try:
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
        info["ram_available_bytes"] = psutil.virtual_memory().available
        if directory is not None:
            usage = psutil.disk_usage(str(directory))
            info["disk_free_bytes"] = usage.free
            where = str(Path(directory).resolve())
            best = None
            for part in psutil.disk_partitions(all=True):
                if _under(where, part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
                    best = part
            if best is not None:
                info["filesystem"] = {"device": best.device, "mountpoint": best.mountpoint, "fstype": best.fstype}
                drive = _drive(best.device)
                if drive:
                    info["filesystem"]["drive"] = drive
    except Exception:  # psutil missing or /proc unreadable: the numbers still stand
        pass
    return info


def _under(path: str, mountpoint: str) -> bool:
    """Whether ``path`` lies under ``mountpoint`` (a path prefix by components, not by characters)."""
    try:
        return os.path.commonpath([path, mountpoint]) == mountpoint
    except ValueError:
        return False


def _cpu_capability() -> str | None:
    from ..._platform.torch_private import cpu_capability

    # torch_private checks the private query exists; "unknown" (an older torch) is reported as None.
    capability = cpu_capability()
    return None if capability == "unknown" else capability


def _drive(device: str) -> dict[str, Any] | None:
    """The block device behind ``device`` as sysfs describes it: model (or driver), size, rotational flag."""
    name = os.path.basename(device)
    base = Path("/sys/class/block") / name
    if not device.startswith("/dev/") or not base.exists():
        return None  # tmpfs, overlay, a network filesystem: no local block device to name
    node = base.resolve()
    if not (node / "device").exists() and (node.parent / "device").exists():
        node = node.parent  # a partition: the drive is its parent
    out: dict[str, Any] = {"name": node.name}

    def read(rel: str) -> str | None:
        try:
            return (node / rel).read_text().strip() or None
        except OSError:
            return None

    out["model"] = read("device/model")
    driver = node / "device" / "driver"
    out["driver"] = driver.resolve().name if driver.exists() else None
    size = read("size")
    out["size_bytes"] = int(size) * 512 if size and size.isdigit() else None  # sysfs counts 512-byte sectors
    rotational = read("queue/rotational")
    # The kernel's flag; virtual disks often claim to rotate whatever backs them.
    out["rotational"] = None if rotational is None else rotational == "1"
    return out


def hardware_line(info: dict[str, Any]) -> str:
    """The hardware of a run in one line, for the top of every benchmark report.

    Example
    -------
    >>> hardware_line({"cpu_model": "AMD EPYC", "cpus": 2, "cores_usable": 2, "ram_bytes": 2**34,
    ...                "torch": "2.13.0+cpu", "cpu_capability": "AVX2"})
    'hardware: AMD EPYC, 2 cores (2 usable), 16.00 GiB RAM; torch 2.13.0+cpu, CPU capability AVX2'
    """
    from ...sizes import format_size

    parts = [f"{info.get('cpu_model') or 'unknown CPU'}, {info.get('cpus')} cores"]
    if info.get("cores_usable") is not None:  # (JSON from before it was recorded has none)
        parts[0] += f" ({info['cores_usable']} usable)"
    if info.get("ram_bytes"):
        parts[0] += f", {format_size(info['ram_bytes'])} RAM"
    fs = info.get("filesystem")
    if fs:
        text = f"--dir on {fs['fstype']} ({fs['device']} at {fs['mountpoint']}"
        drive = fs.get("drive") or {}
        what = drive.get("model") or (drive.get("driver") and f"{drive['driver']} device")
        if what:
            text += f", {what}"
        if drive.get("size_bytes"):
            text += f", {format_size(drive['size_bytes'])}"
        if drive.get("rotational") is not None:
            text += ", the kernel says " + ("rotational" if drive["rotational"] else "non-rotational")
        parts.append(text + ")")
    parts.append(f"torch {info.get('torch')}, CPU capability {info.get('cpu_capability') or 'unknown'}")
    return "hardware: " + "; ".join(parts)


def _cpu_model() -> str | None:
    """The CPU's name as ``/proc/cpuinfo`` gives it (None elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def _clean(value: Any) -> Any:
    """JSON cannot hold nan/inf: write them as null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path | str, document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON (creating parent folders); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(document), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def new_figure(
    ncols: int, *, width: float = 6.0, height: float = 4.2, nrows: int = 1, height_ratios: list[float] | None = None
):
    """A matplotlib figure with ``nrows`` x ``ncols`` axes (a flat list), on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    grid = {"height_ratios": height_ratios} if height_ratios else None
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, gridspec_kw=grid)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig: Any, path: Path | str) -> Path:
    """Save ``fig`` as a PNG (creating parent folders) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # Legends sit outside the axes (where they hide no data): "tight" keeps them in the picture.
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
