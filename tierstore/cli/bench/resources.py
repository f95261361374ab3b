"""What a benchmark needs in RAM and free disk, checked before anything is allocated.

The estimates are lower bounds from the benchmark's own arithmetic
(parameters, gradients, budgets, state files), plus the interpreter's own
footprint. A run is refused only when the machine clearly has less:
available RAM (``psutil``) or free space under the directory
(``shutil.disk_usage``) below the estimate. Contenders that size themselves
to the machine (``bench step``'s all-in-RAM runs, skipped when they do not
fit) are not counted.

Example
-------
>>> needs = Needs("bench step --params 2e7", ram=1 << 30, disk=1 << 30)
>>> needs.describe()
'bench step --params 2e7 needs about 1.07 GB of RAM and 1.07 GB of free disk'
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError

PROCESS_BYTES = 512 << 20  # 512 MiB: Python, torch and its allocator before any tensor of the benchmark


@dataclass(frozen=True)
class Needs:
    """Bytes of RAM and of free disk a benchmark run needs at least."""

    what: str
    ram: int
    disk: int

    def describe(self) -> str:
        """One line for the docs and the error message."""
        return f"{self.what} needs about {_gb(self.ram)} of RAM and {_gb(self.disk)} of free disk"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _count(n: int) -> str:
    """``2e+08`` written as people type it: ``2e8``."""
    return f"{n:.3g}".replace("e+0", "e").replace("e+", "e")


def available_ram() -> int | None:
    """Available RAM in bytes (``psutil``), or None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or /proc unreadable: do not refuse on a guess
        return None


def check(needs: Needs, directory: Path | str, *, fix: str) -> None:
    """Raise when the machine clearly has less RAM or free disk than ``needs``.

    Raises
    ------
    ConfigError
        Naming what is needed, what is there, and ``fix``.

    Example
    -------
    >>> check(Needs("a tiny run", ram=1, disk=1), ".", fix="nothing")
    """
    ram = available_ram()
    free = shutil.disk_usage(directory).free
    short = []
    if ram is not None and ram < needs.ram:
        short.append(f"{_gb(ram)} of RAM is available")
    if free < needs.disk:
        short.append(f"{_gb(free)} is free under {directory}")
    if short:
        raise ConfigError(f"{needs.describe()}, but only {' and '.join(short)}; {fix}")


def step_needs(
    *, params: int, fields: int, ram_budget: int, disk_runs: int, durable_runs: int, peer: bool, floors: int
) -> Needs:
    """``bench step``: parameters and gradients, every disk run's budget, state files, peer and floor files.

    ``disk_runs`` TieredAdamW runs on disk, ``durable_runs`` of them durable
    (two full copies of the state each); the peer swaps and every raw floor
    file holds the streamed bytes. The footprint child runs alone, before.

    Example
    -------
    >>> n = step_needs(params=2 * 10**8, fields=2, ram_budget=2 * 10**8, disk_runs=1, durable_runs=0, peer=True, floors=4)
    >>> round(n.ram / 1e9, 1), round(n.disk / 1e9, 1)
    (2.5, 8.4)
    """
    state = params * 4 * fields
    streamed = max(0, state - ram_budget)
    ram = PROCESS_BYTES + 8 * params + ram_budget * (disk_runs + int(peer))
    disk = streamed * (disk_runs - durable_runs + int(peer) + floors) + 2 * state * durable_runs
    return Needs(f"bench step --params {_count(params)}", ram=ram, disk=disk)


def ab_needs(*, params: int, ram_budget: int, configs: int, durable_configs: int) -> Needs:
    """``bench/ab_step.py``: the parameters once, then per configuration a copy, its budget and its files.

    Example
    -------
    >>> n = ab_needs(params=2 * 10**8, ram_budget=2 * 10**8, configs=10, durable_configs=0)
    >>> round(n.ram / 1e9, 1), round(n.disk / 1e9, 1)
    (12.1, 14.0)
    """
    state = params * 8
    streamed = max(0, state - ram_budget)
    ram = PROCESS_BYTES + 8 * params + configs * (4 * params + ram_budget)
    disk = streamed * (configs - durable_configs) + 2 * state * durable_configs
    return Needs(f"ab_step.py --params {_count(params)} with {configs} configurations", ram=ram, disk=disk)


def io_needs(*, size: int, largest_window: int, memory_copy_bytes: int) -> Needs:
    """``bench io``: the test file and its scratch twin on disk; the largest buffer in RAM.

    The largest of: two request windows (capped at the transfer), the
    touched-buffer comparison (at most 1 GiB), and the memory-copy test
    (source and destination).

    Example
    -------
    >>> n = io_needs(size=2 << 30, largest_window=512 << 20, memory_copy_bytes=512 << 20)
    >>> round(n.ram / 1e9, 2), round(n.disk / 1e9, 2)
    (1.61, 4.36)
    """
    buffers = max(2 * min(largest_window, size), min(size, 1 << 30), 2 * memory_copy_bytes)
    return Needs(f"bench io --size {size / 2**30:.3g}GiB", ram=PROCESS_BYTES + buffers, disk=2 * size + (64 << 20))
