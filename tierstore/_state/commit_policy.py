"""When a durable optimizer commits: the recovery point objective, as a policy.

A commit makes one step's state the one a crash resumes at. Streamed shards
are written every step anyway, so committing them costs a sync and a
manifest; resident shards cost a write of their bytes. Commits run in the
background while the training loop computes the next forward and backward,
so the question is how often to start one:

- ``"auto"`` (the default): as often as committing does not slow the loop
  by more than :data:`STALL_SHARE`, measured: the loop's iterations (forward,
  backward and step) while a commit runs are compared with iterations
  without one, which shows both waits for resident shards still being
  written and the CPU and memory bandwidth a commit takes from the loop
  (checksums, copies, the drive's interrupts: on a machine with few cores
  that is most of the cost). The first commit starts at the first step's
  end; the step after it runs without one, to measure the loop alone; then
  commits are spaced ``ceil(cost / (STALL_SHARE x iteration))`` steps apart
  (every step when cheap; one iteration in :data:`REPROBE_STEPS` runs
  without a commit to measure again). Never less often than every
  :data:`DEFAULT_MAX_INTERVAL` seconds.
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
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

DEFAULT_MAX_INTERVAL = 300.0  # seconds: "auto" never leaves the recovery point further behind
STALL_SHARE = 0.03  # "auto" spaces commits so they slow the loop by about this share (noise stays under 5%)
REPROBE_STEPS = 64  # committing every step, "auto" measures the loop alone again this often
SAMPLES = 5  # iterations of each kind (with a commit running, without) the cost is the median of
PAUSE = 4.0  # an iteration this many times the typical one is a pause (eval, a checkpoint), not a sample
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
    quiet: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))  # iterations without a commit running
    busy: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))  # iterations with one running
    commit_running: bool = False  # a commit ran at the last step's end (it overlaps the next iteration)
    busy_since_start: int = 0  # busy iterations since the last commit started
    busy_per_commit: int = 1  # how many iterations the last finished commit overlapped
    last_quiet_step: int = 0
    pauses: int = 0  # iterations in a row set aside as pauses

    def record(self, *, step: int, gap: float, step_seconds: float, stall: float) -> None:
        """A step ended: note the loop's rhythm and whether a commit ran through this iteration."""
        if self.last_commit_step == step - 1:
            self.last_stall = stall  # the step right after a commit started shows what it waited
        self.gap, self.step_seconds = gap, step_seconds
        if gap <= 0:  # the first step of a run: no iteration to measure
            return
        iteration = gap + step_seconds
        typical = min((statistics.median(d) for d in (self.busy, self.quiet) if d), default=None)
        if typical is not None and iteration > PAUSE * typical and self.pauses < SAMPLES:
            self.pauses += 1  # the loop paused; several in a row: it changed pace, take them
            return
        self.pauses = 0
        if self.commit_running:
            self.busy.append(iteration)
            self.busy_since_start += 1
        else:
            self.quiet.append(iteration)
            self.last_quiet_step = step

    def started(self, step: int, now: float) -> None:
        """A commit of ``step`` started."""
        if self.busy_since_start:
            self.busy_per_commit = self.busy_since_start
        self.busy_since_start = 0
        self.last_commit_step, self.last_commit_started = step, now

    def commit_cost(self) -> float | None:
        """Seconds of the loop's time one commit costs (``None`` until both kinds of iteration were seen)."""
        if not self.busy or not self.quiet:
            return None
        slower = statistics.median(self.busy) - statistics.median(self.quiet)
        return max(slower * self.busy_per_commit, self.last_stall, 0.0)


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
    cost = clock.commit_cost()
    if cost is None:
        # Not measured yet: the first commit starts now; then one iteration runs without a commit.
        return not clock.busy and not clock.commit_running
    iteration = statistics.median(clock.quiet)
    every = max(1, math.ceil(cost / (STALL_SHARE * iteration))) if iteration > 0 else 1
    if every == 1 and step - clock.last_quiet_step > REPROBE_STEPS:
        return False  # committing every step: let one iteration run alone to measure the loop again
    return step - clock.last_commit_step >= every
