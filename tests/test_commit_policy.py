"""The "auto" commit policy measures what a commit costs the loop and spaces commits to keep it small.

A simulated loop drives :class:`~tierstore._state.commit_policy.CommitClock` and
:func:`~tierstore._state.commit_policy.due` as the journal does: each iteration
takes ``quiet`` seconds, or ``busy`` while a commit runs through it (a commit
here lasts one iteration). The slowdown the loop sees is then what the
policy lets through.
"""

from __future__ import annotations

import pytest

from tierstore._state.commit_policy import (
    DEFAULT_MAX_INTERVAL,
    REPROBE_STEPS,
    STALL_SHARE,
    CommitClock,
    CommitPolicy,
    due,
)


def _simulate(quiet: float, busy: float, steps: int, *, policy: str = "auto") -> tuple[list[int], float]:
    """The steps that committed, and the loop's slowdown against never committing."""
    rule, clock, now, committed, spent = CommitPolicy.parse(policy), CommitClock(), 0.0, [], 0.0
    for step in range(1, steps + 1):
        iteration = busy if clock.commit_running else quiet
        gap = 0.0 if step == 1 else iteration  # the first step has no iteration before it
        now += iteration
        spent += iteration
        clock.record(step=step, gap=gap, step_seconds=0.0, stall=0.0)
        if due(rule, clock, step=step, now=now, in_flight=False):
            clock.started(step, now)
            clock.commit_running = True
            committed.append(step)
        else:
            clock.commit_running = False
    return committed, spent / (quiet * steps) - 1


def test_cheap_commits_run_every_step_after_one_measuring_step():
    committed, slowdown = _simulate(quiet=0.2, busy=0.2, steps=40)
    assert committed[:2] == [1, 3]  # step 2's iteration runs without a commit: the loop alone
    assert committed == [1] + list(range(3, 41))
    assert slowdown == pytest.approx(0.0)


@pytest.mark.parametrize("busy_over_quiet", [1.1, 1.3, 2.0])
def test_costly_commits_are_spaced_to_keep_the_slowdown_small(busy_over_quiet):
    committed, slowdown = _simulate(quiet=0.2, busy=0.2 * busy_over_quiet, steps=400)
    gaps = {b - a for a, b in zip(committed[2:], committed[3:])}  # once measured
    every = -(-round((busy_over_quiet - 1) * 1000) // round(STALL_SHARE * 1000))  # ceil, exact
    assert gaps == {every}
    assert slowdown <= STALL_SHARE + 0.005  # the measuring steps at the start cost a little more


def test_committing_every_step_measures_the_loop_again():
    committed, _ = _simulate(quiet=0.2, busy=0.2, steps=3 * REPROBE_STEPS)
    skipped = sorted(set(range(1, 3 * REPROBE_STEPS + 1)) - set(committed))
    assert skipped[0] == 2 and len(skipped) >= 3
    assert all(b - a <= REPROBE_STEPS + 2 for a, b in zip(skipped, skipped[1:]))


def test_the_maximum_interval_wins_over_any_cost():
    committed, _ = _simulate(quiet=DEFAULT_MAX_INTERVAL / 4, busy=DEFAULT_MAX_INTERVAL, steps=40)
    assert all(b - a <= 5 for a, b in zip(committed, committed[1:]))


def test_an_explicit_step_count_is_not_adapted():
    committed, _ = _simulate(quiet=0.2, busy=0.6, steps=20, policy=1)
    assert committed == list(range(1, 21))


def test_pauses_in_the_loop_do_not_hide_what_commits_cost():
    # Every other iteration pauses (waiting for data, say): 30x as long, with or without a commit.
    rule, clock, now, committed = CommitPolicy.parse("auto"), CommitClock(), 0.0, []
    for step in range(1, 201):
        iteration = (0.26 if clock.commit_running else 0.2) * (30 if step % 2 == 0 else 1)
        now += iteration
        clock.record(step=step, gap=0.0 if step == 1 else iteration, step_seconds=0.0, stall=0.0)
        if due(rule, clock, step=step, now=now, in_flight=False):
            clock.started(step, now)
            clock.commit_running = True
            committed.append(step)
        else:
            clock.commit_running = False
    assert len(committed) < 200 / 10  # spaced (a 30% slowdown per commit), not every step
