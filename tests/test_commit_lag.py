"""``describe()`` shows the committed step and the lag, and warns (once, in the log too) when the lag grows.

Commits run behind the loop; when each takes longer than the last (a drive
that cannot keep up), the step a crash resumes at falls further behind at
every commit. The commit thread is slowed by a growing sleep so the loop
runs ahead by more and more steps.
"""

from __future__ import annotations

import logging
import re
import time

import torch
from torch import nn

from tierstore import TieredAdamW
from tierstore._storage.store import ShardStore


def _commits_sleeping(monkeypatch, seconds) -> None:
    real = ShardStore.commit
    calls = iter(seconds)

    def slow(store, step, **kw):
        if not kw.get("persist", True):  # the commit thread's half (Journal._finish)
            time.sleep(next(calls, 0.0))
        return real(store, step, **kw)

    monkeypatch.setattr(ShardStore, "commit", slow)


def _run(tmp_path, steps: int, *, commit_every, until: str | None = None) -> TieredAdamW:
    """Train up to ``steps`` steps (stopping early once ``describe()`` contains ``until``)."""
    p = nn.Parameter(torch.randn(20000, generator=torch.Generator().manual_seed(0)))
    opt = TieredAdamW([p], lr=1e-3, state_dir=tmp_path / "s", ram_budget="48KiB", shard_numel=1024, commit_every=commit_every)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
        time.sleep(0.002)  # the loop's forward and backward
        if until is not None and until in opt.describe():
            break
    return opt


def test_describe_warns_when_commits_fall_further_behind(tmp_path, monkeypatch, caplog) -> None:
    # Each commit three times as long as the last (to 2 s): the lag triples at every commit, far above
    # the noise a busy drive adds to a commit (fsyncs of 50-100 ms when other tests share the machine).
    _commits_sleeping(monkeypatch, [min(2.0, 0.004 * 3**k) for k in range(100)])
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        # "auto" spaces commits by their cost: slower and slower commits, further and further apart.
        opt = _run(tmp_path, 4000, commit_every="auto", until="WARNING")
        text = opt.describe()
        lag_seen = opt.step_count - opt.committed_step
        opt.close()
    assert re.search(r"committed step \d+ \(\d+ behind, at most \d+ so far\)", text), text
    assert lag_seen > 0
    assert "WARNING: the lag grows at every commit" in text, text
    warnings = [r for r in caplog.records if "fall behind the loop" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # once per open, not per commit


def test_describe_shows_a_steady_lag_without_warning(tmp_path, monkeypatch, caplog) -> None:
    _commits_sleeping(monkeypatch, [0.01] * 1000)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        opt = _run(tmp_path, 30, commit_every=1)  # every step: a commit in flight holds the next write back
        text = opt.describe()
        opt.close()
    m = re.search(r"committed step (\d+) \((\d+) behind", text)
    assert m, text
    assert int(m.group(2)) <= 2, text
    assert "WARNING" not in text
    assert not [r for r in caplog.records if "fall behind the loop" in r.getMessage()]


def test_describe_has_no_commit_text_without_durable_commits(tmp_path) -> None:
    p = nn.Parameter(torch.randn(4096))
    opt = TieredAdamW([p], lr=1e-3, ram_budget="1GiB")
    p.grad = torch.ones_like(p)
    opt.step()
    assert "committed step" not in opt.describe()
