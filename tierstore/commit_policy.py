"""When a durable optimizer commits: the recovery point objective, as a policy.

A commit makes one step's state the one a crash resumes at. Streamed shards
are written every step anyway, so committing them costs a sync and a
manifest; resident shards cost a write of their bytes. Commits run in the
background while the training loop computes the next forward and backward,
so the question is how often to start one:

- ``"auto"`` (the default): at every step's end at which the previous commit
  has finished, as long as committing does not stall the loop: when the last
  commit took longer than the loop's time between steps (the next step had
  to wait for resident shards still being written), commits are spaced out so
  that such waits cost at most :data:`STALL_SHARE` of the loop's time. Never
  less often than every :data:`DEFAULT_MAX_INTERVAL` seconds.
- ``N`` (an int): every N-th step. A commit that falls due while the
  previous one is still in flight starts at the first step's end after it
  finished: ``committed_step`` then lags ``step_count``; nothing waits.
- ``"30s"``, ``"5min"``, ``"1h"``, or a ``datetime.timedelta``: once that
  much time has passed since the last commit started.
- ``(N, "10min")``: whichever comes first.

Example
-------
>>> policy = CommitPolicy.parse((100, "10min"))
>>> policy.steps, policy.seconds, policy.auto
(100, 600.0, False)
>>> CommitPolicy.parse("auto").auto
True
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

DEFAULT_MAX_INTERVAL = 300.0  # seconds: "auto" never leaves the recovery point further behind
STALL_SHARE = 0.05  # "auto" spaces commits so that waiting for them costs at most this share of the loop
_UNITS = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|sec|min|m|h)\s*$")


@dataclass(frozen=True)
class CommitPolicy:
    """How often to commit (see the module docs). Build it with :meth:`parse`."""

    auto: bool = True
    steps: int | None = None
    seconds: float | None = None
    max_interval: float = DEFAULT_MAX_INTERVAL

    @classmethod
    def parse(cls, value: Any) -> CommitPolicy:
        """A policy from ``commit_every``'s value.

        Raises
        ------
        ConfigError
            For anything but ``"auto"``, a step count >= 1, a duration, or a
            pair of a step count and a duration.
        """
        if isinstance(value, CommitPolicy):
            return value
        if value == "auto":
            return cls()
        fix = "pass 'auto', a step count such as 10, a duration such as '5min', or both: (100, '10min')"
        parts = value if isinstance(value, (tuple, list)) else (value,)
        steps = seconds = None
        for part in parts:
            if isinstance(part, int) and not isinstance(part, bool):
                if part < 1 or steps is not None:
                    raise ConfigError(f"commit_every={value!r}: the step count must be one int >= 1; {fix}")
                steps = part
            elif isinstance(part, (str, datetime.timedelta)) and seconds is None:
                seconds = _seconds(part, value, fix)
            else:
                raise ConfigError(f"commit_every={value!r} is not a commit policy; {fix}")
        if not parts:
            raise ConfigError(f"commit_every={value!r} is empty; {fix}")
        return cls(auto=False, steps=steps, seconds=seconds)


def _seconds(part: str | datetime.timedelta, value: Any, fix: str) -> float:
    if isinstance(part, datetime.timedelta):
        seconds = part.total_seconds()
    else:
        match = _DURATION.match(part)
        if not match:
            raise ConfigError(f"commit_every={value!r}: {part!r} is not a duration; {fix}")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not seconds > 0:
        raise ConfigError(f"commit_every={value!r}: the duration must be > 0; {fix}")
    return seconds


@dataclass
class CommitClock:
    """What a policy decides on: the loop's rhythm and the last commit's cost (seconds)."""

    last_commit_step: int = 0
    last_commit_started: float = -math.inf
    last_commit_seconds: float = 0.0  # from its start to its manifest being durable
    last_stall: float = 0.0  # how long the step after the last commit waited for it (measured)
    gap: float = 0.0  # between a step's end and the next step's start: the loop's forward/backward
    step_seconds: float = 0.0  # the last step's own duration


def due(policy: CommitPolicy, clock: CommitClock, *, step: int, now: float, in_flight: bool) -> bool:
    """Whether to start a commit of ``step`` now (at its end).

    A commit never starts while another is in flight: it is deferred to the
    first step's end after that one finished.

    Example
    -------
    >>> clock = CommitClock(last_commit_step=10, last_commit_started=0.0)
    >>> due(CommitPolicy.parse(5), clock, step=14, now=1.0, in_flight=False)
    False
    >>> due(CommitPolicy.parse(5), clock, step=15, now=1.0, in_flight=False)
    True
    """
    if in_flight or step <= clock.last_commit_step:
        return False
    since = now - clock.last_commit_started
    if not policy.auto:
        by_steps = policy.steps is not None and step - clock.last_commit_step >= policy.steps
        by_time = policy.seconds is not None and since >= policy.seconds
        return by_steps or by_time
    if since >= policy.max_interval:
        return True
    iteration = clock.gap + clock.step_seconds
    stall = clock.last_stall  # measured: what the step after the last commit waited for it
    if stall <= 0 or iteration <= 0:
        return True
    # Each commit costs about `stall` of waiting; space commits so that is a small share of the loop.
    every = math.ceil(stall / (STALL_SHARE * iteration))
    return step - clock.last_commit_step >= every
