"""Kill a ``tierstore move`` in a child process at a named crash point, and say where it died.

A move writes nothing the source needs and commits the destination with one
manifest: a kill at any instant must leave the source resumable as it was
and the destination without a state. :func:`run_move_child` runs the
command (:func:`tierstore.cli.main`) in a child of the crash harness's fork
server (torch already imported), arms a crash point
(:mod:`tierstore._platform.faults`) there, and reports the exit code and the
point that fired, so a test asserts that the kill landed where it meant.

Example
-------
>>> result = run_move_child(["move", "/no/such/state", "--to", "/tmp/x"])  # doctest: +SKIP
>>> result.exitcode, result.killed  # doctest: +SKIP
(2, False)
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from .crash import _context

__all__ = ["MoveChild", "run_move_child"]


@dataclass(frozen=True)
class MoveChild:
    """How a child running ``tierstore move`` ended."""

    exitcode: int | None
    killed: bool  # died of SIGKILL
    landed_point: str | None  # the crash point that killed it (None: none fired)


def _move(argv: list[str], crash: tuple[str, int] | None, landed) -> None:  # noqa: ANN001 - a shared value
    import sys

    from .._platform import faults
    from ..cli import main

    if crash is not None:
        def fired(point: str, phase: str) -> None:
            landed.value = faults.POINTS.index(point) + 1

        faults.arm(crash[0], after=crash[1], on_fire=fired)
    sys.exit(main(argv))


def run_move_child(argv: Sequence[str], *, crash: tuple[str, int] | None = None, timeout: float = 120.0) -> MoveChild:
    """Run ``tierstore <argv>`` in a child; with ``crash=(point, after)`` it SIGKILLs itself there.

    Raises
    ------
    TimeoutError
        If the child runs longer than ``timeout``.
    """
    from .._platform import faults

    ctx = _context()
    landed = ctx.Value("i", 0, lock=False)
    proc = ctx.Process(target=_move, args=(list(argv), crash, landed))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"tierstore {' '.join(argv)} ran longer than {timeout} s")
    point = faults.POINTS[landed.value - 1] if landed.value else None
    return MoveChild(proc.exitcode, proc.exitcode == -signal.SIGKILL, point)
