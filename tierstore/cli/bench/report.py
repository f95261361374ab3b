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
    """What the numbers were measured on."""
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
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
            best = None
            for part in psutil.disk_partitions(all=True):
                if str(Path(directory).resolve()).startswith(part.mountpoint) and (
                    best is None or len(part.mountpoint) > len(best.mountpoint)
                ):
                    best = part
            if best is not None:
                info["filesystem"] = {"device": best.device, "mountpoint": best.mountpoint, "fstype": best.fstype}
    except Exception:  # psutil missing or /proc unreadable: the numbers still stand
        pass
    return info


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


def new_figure(ncols: int, *, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure with ``ncols`` axes, on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Any, path: Path | str) -> Path:
    """Save ``fig`` as a PNG (creating parent folders) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
