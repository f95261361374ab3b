"""Named crash points for fault-injection tests (inert unless a test arms one).

The durability tests kill a training process at precise instants (between a
shard's write requests, between the manifest's temporary file and its
rename, ...). Library code marks those instants with :func:`crash_point`;
a test process arms one with :func:`arm`, and when the point is reached the
given number of times the process kills itself with ``SIGKILL``, exactly as
an OOM-killer or a power cut would. Unarmed, a crash point costs one
dictionary lookup.

Example
-------
>>> crash_point("manifest-renamed")  # unarmed: does nothing
>>> arm("manifest-renamed", after=3); disarm()
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "inflight-marker",  # the in-flight marker is durable, no shard written yet
    "after-read",  # a shard was read and verified, not yet updated
    "mid-update",  # a shard's moments are updated, parameters not yet written
    "mid-write",  # one request of a shard's write reached the file, others may not
    "persist-issued",  # a commit's resident-shard writes are issued; it finishes in the background
    "before-sync",  # all writes issued and finished, not yet fsynced
    "manifest-tmp",  # the new manifest is durable under its temporary name
    "manifest-renamed",  # renamed over the old one, directory not yet fsynced
    "after-commit",  # committed: the manifest is durable
)

_armed: dict[str, int] = {}
_lock = threading.Lock()


def arm(point: str, *, after: int = 1) -> None:
    """Kill this process with SIGKILL the ``after``-th time ``point`` is reached."""
    if point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}; known points: {POINTS}")
    if after < 1:
        raise ValueError(f"after={after} must be >= 1")
    _armed[point] = after


def disarm() -> None:
    """Remove every armed crash point."""
    _armed.clear()


def crash_point(point: str) -> None:
    """Die here if ``point`` is armed and its count ran out."""
    if not _armed or point not in _armed:
        return
    with _lock:
        _armed[point] -= 1
        if _armed[point] > 0:
            return
    os.kill(os.getpid(), signal.SIGKILL)
