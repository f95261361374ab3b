"""The tuning knobs: how fast the state moves, never what it is.

A :class:`Knobs` is validated when it is made and never saved with the state:
changing a knob never changes results (the layout fingerprint does not
include any of them), so a run may resume with other knobs.

Example
-------
>>> Knobs(prefetch_depth=3).arena_slots
5
>>> Knobs(io_workers=0)
Traceback (most recent call last):
...
tierstore.errors.ConfigError: io_workers=0 must be an int >= 1
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError

BACKEND_NAMES = ("auto", "direct", "buffered", "mmap")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``.

    Raises
    ------
    ConfigError
        Naming the value and the minimum.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def default_update_threads() -> int:
    """All the cores this process may use but one, which the I/O threads keep."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True)
class Knobs:
    """Resources of the streaming machinery (see ``TieredAdamW`` for each one's meaning).

    Raises
    ------
    ConfigError
        For a value of the wrong type or range, naming it and the fix.
    """

    backend: str = "auto"
    prefetch_depth: int = 2
    io_workers: int = 8
    request_bytes: int = 1 << 20  # 1 MiB
    update_threads: int | None = None  # None: all cores but one while shards stream
    pin_memory: bool | None = None  # None: pin exactly when CUDA is available

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str):
            raise ConfigError(f"backend={self.backend!r} must be a string such as 'auto', 'direct' or 'mmap'")
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"backend={self.backend!r} is unknown; choose 'auto', 'direct', 'buffered' or 'mmap'")
        check_int("prefetch_depth", self.prefetch_depth, 1)
        if self.update_threads is not None:
            check_int("update_threads", self.update_threads, 1)
        check_int("io_workers", self.io_workers, 1)
        check_int("request_bytes", self.request_bytes, 4096)
        if self.request_bytes % 4096:
            raise ConfigError(f"request_bytes={self.request_bytes} must be a multiple of 4096, e.g. 8 << 20")

    @property
    def arena_slots(self) -> int:
        """Arena slots: the reads in flight, the shard being updated and one being written."""
        return self.prefetch_depth + 2

    @property
    def overlap_threads(self) -> int:
        """Intra-op threads of an update running behind the training loop (which keeps the others)."""
        return self.update_threads or max(1, default_update_threads() // 2)

    @property
    def max_update_threads(self) -> int:
        """The most threads any update uses (what a compressed format's decode scratch is sized for)."""
        return self.update_threads or max(1, len(os.sched_getaffinity(0)))

    def codec_threads(self, *, streaming: bool, behind: bool) -> int:
        """Workers a compressed format's update and conversions run on.

        Behind the training loop: :attr:`overlap_threads`. Otherwise every core
        (or ``update_threads``): the workers block on a queue rather than spin
        at a barrier, so the I/O threads still get a core when they need it.
        """
        del streaming  # measured: all cores also while shards stream (docs/formats.md)
        return self.overlap_threads if behind else self.max_update_threads

    @property
    def streaming_threads(self) -> int:
        """Intra-op threads of the update while shards stream from disk."""
        # Note: on few cores, OpenMP threads spin-waiting at the kernel's barrier
        # starve the I/O workers (measured: the update ran 10x slower).
        return self.update_threads or default_update_threads()
