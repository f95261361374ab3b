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
from dataclasses import dataclass, fields

from .registry import BACKEND_NAMES, KNOBS, check_int

__all__ = ["Knobs", "BACKEND_NAMES", "check_int", "default_update_threads", "DEFAULT_PREFETCH_DEPTH",
           "DEFAULT_IO_WORKERS", "DEFAULT_REQUEST_BYTES"]

# The int knobs' defaults as the fronts' signatures take them: the registry's Default objects, so a
# knobs file (TieredAdamW(knobs=...)) fills exactly the knobs a caller left at their defaults.
DEFAULT_PREFETCH_DEPTH = KNOBS["prefetch_depth"].default
DEFAULT_IO_WORKERS = KNOBS["io_workers"].default
DEFAULT_REQUEST_BYTES = KNOBS["request_bytes"].default  # 1 MiB


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

    # The defaults and checks are the registry's (tierstore._config.registry): declared once.
    backend: str = KNOBS["backend"].default
    prefetch_depth: int = KNOBS["prefetch_depth"].default
    io_workers: int = KNOBS["io_workers"].default
    request_bytes: int = KNOBS["request_bytes"].default  # 1 MiB
    update_threads: int | None = KNOBS["update_threads"].default  # None: all cores but one while shards stream
    pin_memory: bool | None = KNOBS["pin_memory"].default  # None: pin exactly when CUDA is available

    def __post_init__(self) -> None:
        for f in fields(self):
            KNOBS[f.name].validate(getattr(self, f.name))

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
        # Note: on few cores, OpenMP threads spin-waiting at the AdamW kernel's barrier
        # starve the I/O workers (measured: the update ran 10x slower).
        return self.update_threads or default_update_threads()
