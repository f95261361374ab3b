"""What ``tierstore bench io`` and ``tierstore tune`` share: their options (lists of sizes and counts, the
directories to measure) and the loop that runs their trials under one progress bar (:func:`run_rounds`).

Example
-------
>>> size_list("1MiB,4MiB", "--requests"), int_list("1,2,4", "--workers")
((1048576, 4194304), (1, 2, 4))
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import ConfigError
from ...sizes import parse_size

__all__ = ["size_list", "int_list", "directories_of", "check_directories", "run_rounds"]


def size_list(text: str, name: str) -> tuple[int, ...]:
    """``'1MiB,4MiB'`` as byte counts, each a positive multiple of 4 KiB (``name``: the flag, for the error)."""
    values = tuple(parse_size(part.strip(), name=name) for part in text.split(",") if part.strip())
    if not values or any(v <= 0 or v % 4096 for v in values):
        raise ConfigError(f"{name}={text!r} must list positive multiples of 4 KiB, e.g. '1MiB,4MiB,16MiB'")
    return values


def int_list(text: str, name: str) -> tuple[int, ...]:
    """``'1,2,4'`` as counts, each >= 1 (``name``: the flag, for the error)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r} must list whole numbers, e.g. '1,2,4,8'") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{name}={text!r} must list numbers >= 1, e.g. '1,2,4,8'")
    return values


def directories_of(args: argparse.Namespace) -> list[Path]:
    """The directories ``bench io`` was given: the positional ``DIR``\\ s, then each ``--dir``.

    Raises
    ------
    ConfigError
        When none is given.

    Example
    -------
    >>> directories_of(argparse.Namespace(dirs=["a"], dir=["b"]))
    [PosixPath('a'), PosixPath('b')]
    """
    given = [*(getattr(args, "dirs", None) or []), *(getattr(args, "dir", None) or [])]
    if not given:
        raise ConfigError("give the directory to measure: tierstore bench io DIR [DIR...] (or --dir DIR)")
    return [Path(d).expanduser() for d in given]


def check_directories(directories: list[Path], *, flag: str = "DIR") -> None:
    """Each one an existing, writable directory, none given twice (also through a link or another spelling).

    Raises
    ------
    ConfigError
        Naming the directory and the fix.
    """
    seen: dict[tuple[int, int], Path] = {}
    for directory in directories:
        if not directory.is_dir():
            raise ConfigError(f"{flag} {str(directory)!r} is not a directory; pass an existing directory on the drive to measure")
        if not os.access(directory, os.W_OK):
            raise ConfigError(f"{flag} {str(directory)!r} is not writable; pass a directory you can write to")
        st = directory.stat()
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise ConfigError(f"{flag} {str(directory)!r} is {str(seen[key])!r} given twice; give each directory once "
                              "(two directories on one drive are fine)")
        seen[key] = directory


def run_rounds(
    rounds: Sequence[Sequence[tuple[str, Callable[[], object]]]],
    *,
    desc: str,
    before_round: Callable[[int], object] | None = None,
) -> None:
    """Run each round's ``(label, step)`` pairs in order, under one progress bar that counts the labelled steps.

    ``before_round(r)`` runs before round ``r``'s first step (e.g. a memory bandwidth sample). An empty
    label is a step that is not a trial (setup between trials): it runs, uncounted.

    Example
    -------
    >>> done = []
    >>> run_rounds([[("a", lambda: done.append("a")), ("", lambda: done.append("-"))]], desc="demo",
    ...            before_round=lambda r: done.append(r))
    >>> done
    [0, 'a', '-']
    """
    from tqdm import tqdm

    total = sum(1 for steps in rounds for label, _ in steps if label)
    with tqdm(total=total, desc=desc, unit="trial", disable=None, leave=False) as bar:
        for rnd, steps in enumerate(rounds):
            if before_round is not None:
                before_round(rnd)
            for label, step in steps:
                if label:
                    bar.set_postfix_str(label, refresh=False)
                step()
                if label:
                    bar.update(1)
