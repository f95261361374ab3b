"""Named crash points for fault-injection tests (inert unless a test arms one).

The durability tests kill a training process at precise instants (between a
shard's write requests, between the manifest's temporary file and its
rename, ...). Library code marks those instants with :func:`crash_point`;
a test process arms one with :func:`arm`, and when the point is reached the
given number of times the process kills itself with ``SIGKILL``, exactly as
an OOM-killer would.

Most points are reached while the optimizer is built (its first commits) as
well as in every step. A harness says what the process is doing with
:func:`set_phase` (``"construct"``, ``"step 3"``, ``"close"``: names are the
harness's); ``arm(..., during=...)`` then counts only the hits in those
phases, and ``on_fire`` learns the point and phase right before the kill, so
a test can assert where its kill landed. Unarmed, a crash point costs one
dictionary lookup.

Example
-------
>>> crash_point("manifest-renamed")  # unarmed: does nothing
>>> arm("manifest-renamed", after=3, during={"step 2", "step 3"}); disarm()
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Collection

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

OnFire = Callable[[str, str], None]


class _Armed:
    __slots__ = ("left", "during", "on_fire")

    def __init__(self, left: int, during: frozenset[str] | None, on_fire: OnFire | None) -> None:
        self.left = left
        self.during = during
        self.on_fire = on_fire


_armed: dict[str, _Armed] = {}
_lock = threading.Lock()
_phase = ""


def set_phase(name: str) -> None:
    """Say what this process is doing now (a harness's phase name, e.g. ``"step 3"``)."""
    global _phase
    _phase = name


def current_phase() -> str:
    """The phase last given to :func:`set_phase` (``""`` if none)."""
    return _phase


def arm(
    point: str,
    *,
    after: int = 1,
    during: str | Collection[str] | None = None,
    on_fire: OnFire | None = None,
) -> None:
    """Kill this process with SIGKILL the ``after``-th time ``point`` is reached.

    Parameters
    ----------
    point
        One of :data:`POINTS`.
    after
        Which hit kills (1: the first).
    during
        A phase name or a collection of them: only hits while
        :func:`current_phase` is one of these count. ``None``: every hit.
    on_fire
        Called as ``on_fire(point, phase)`` right before the kill (from the
        thread that reached the point): record where the kill landed.

    Raises
    ------
    ValueError
        If ``point`` is unknown or ``after`` < 1.
    """
    if point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}; known points: {POINTS}")
    if after < 1:
        raise ValueError(f"after={after} must be >= 1")
    phases = None if during is None else frozenset([during] if isinstance(during, str) else during)
    _armed[point] = _Armed(after, phases, on_fire)


def disarm() -> None:
    """Remove every armed crash point."""
    _armed.clear()


def crash_point(point: str) -> None:
    """Die here if ``point`` is armed, counts in this phase, and its count ran out."""
    if not _armed or point not in _armed:
        return
    with _lock:
        armed = _armed[point]
        phase = _phase
        if armed.during is not None and phase not in armed.during:
            return
        armed.left -= 1
        if armed.left > 0:
            return
        if armed.on_fire is not None:
            armed.on_fire(point, phase)
    os.kill(os.getpid(), signal.SIGKILL)
