"""Background commits never name a copy something else overwrote, and a failed one is never forgotten.

A commit runs on its own thread after ``step()`` returned; everything that
writes streamed state meanwhile (the next step, ``load_state_dict``, a
checkpoint load) waits for it first, and a commit that failed fails every
later call until the optimizer is reopened with ``resume=True``.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import StepFailedError, TieredAdamW
from tierstore._state.statedir import StateDir
from tierstore._storage.store import ShardStore

KW = dict(lr=1e-2, ram_budget="48KiB", shard_numel=1024, commit_every=1)


def _grads(step: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


def _train(opt, params, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step, [p.shape for p in params])):
            p.grad = g
        opt.step()


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(30000, generator=g)), nn.Parameter(torch.randn(20000, generator=g))]


def _slow_commits(monkeypatch, seconds: float = 0.3) -> None:
    """The background half of every commit sleeps before it syncs: the loop runs ahead."""
    real = ShardStore.commit

    def slow(store, step, **kw):
        if not kw.get("persist", True):  # the commit thread's call (Journal._finish)
            time.sleep(seconds)
        return real(store, step, **kw)

    monkeypatch.setattr(ShardStore, "commit", slow)


def _wait_committed(opt: TieredAdamW, step: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while opt.committed_step != step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"committed_step stayed {opt.committed_step}, wanted {step}")
        time.sleep(0.005)


def test_load_state_dict_during_a_slow_commit_leaves_that_commit_resumable(tmp_path: Path, monkeypatch) -> None:
    """load_state_dict right after step(): the commit in flight still names intact copies of its step.

    The directory is copied the moment step 5's manifest lands (on the commit
    thread): what a power cut right then would leave. It must resume to step 5.
    """
    params = _params()
    opt = TieredAdamW(params, state_dir=tmp_path / "s", **KW)
    _train(opt, params, range(2))
    opt.commit()
    earlier = opt.state_dict()
    _train(opt, params, range(2, 4))
    opt.commit()
    copy = tmp_path / "copy"
    real = StateDir.write_manifest

    def copy_when_step_5_lands(statedir, body):
        real(statedir, body)
        if body["step_count"] == 5 and not copy.exists():
            shutil.copytree(statedir.path, copy, ignore=shutil.ignore_patterns(".lock"))

    monkeypatch.setattr(StateDir, "write_manifest", copy_when_step_5_lands)
    _slow_commits(monkeypatch)
    _train(opt, params, range(4, 5))  # step 5's commit is in flight ...
    assert opt.committed_step == 4, "the commit did not run behind the loop: the test is vacuous"
    after_5 = opt.state_dict()
    opt.load_state_dict(earlier)  # ... while this rewrites every streamed shard
    assert opt.step_count == 2
    opt.close()
    fresh = _params(seed=1)
    with TieredAdamW(fresh, state_dir=copy, resume=True, **KW) as again:
        assert again.step_count == 5
        sd = again.state_dict()
    for a, b in zip(sd["state"].values(), after_5["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("ram_budget", ["48KiB", None], ids=["streamed", "resident"])
def test_a_failed_background_commit_fails_every_later_call_until_resumed(tmp_path: Path, monkeypatch, ram_budget) -> None:
    params = _params()
    opt = TieredAdamW(params, state_dir=tmp_path / "s", **{**KW, "ram_budget": ram_budget})
    _train(opt, params, range(2))
    opt.commit()
    real = StateDir.write_manifest

    failed = threading.Event()

    def broken(self, body):
        failed.set()
        raise OSError(5, "injected: Input/output error")

    monkeypatch.setattr(StateDir, "write_manifest", broken)
    _train(opt, params, range(2, 3))  # returns: the commit fails behind the loop
    assert failed.wait(30)
    time.sleep(0.2)  # the commit thread finishes raising
    with pytest.raises(OSError, match="injected"):
        _train(opt, params, range(3, 4))  # the next step raises the commit's own error
    monkeypatch.setattr(StateDir, "write_manifest", real)  # the drive recovers; the failure stays
    for call in (opt.commit, opt.state_dict, lambda: _train(opt, params, range(3, 4))):
        with pytest.raises(StepFailedError, match=r"injected.*resume=True.*last committed step \(2\)"):
            call()
    assert opt.committed_step == 2
    opt.close()  # releases the directory without committing the half-updated state
    with TieredAdamW(_params(seed=1), state_dir=tmp_path / "s", resume=True, **KW) as again:
        assert again.step_count == 2


def test_hyperparameters_are_recorded_as_they_were_at_the_step(tmp_path: Path, monkeypatch) -> None:
    """A tensor lr changed in place (as schedulers do) after step() does not leak into that step's commit."""
    _slow_commits(monkeypatch)
    params = _params()
    opt = TieredAdamW(params, state_dir=tmp_path / "s", **{**KW, "lr": torch.tensor(0.01)})
    _train(opt, params, range(1))
    opt.param_groups[0]["lr"].fill_(0.5)  # the commit of step 1 is still in flight
    _wait_committed(opt, 1)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["step_count"] == 1
    assert manifest["param_groups"][0]["lr"] == pytest.approx(0.01)
    opt.close()


def test_interpreter_exit_closes_an_unclosed_optimizer(tmp_path: Path) -> None:
    """A script that never calls close(): at exit the last step is committed and the lock released."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from tierstore import StepFailedError, TieredAdamW\n"
        "w = torch.nn.Parameter(torch.randn(50000))\n"
        "opt = TieredAdamW([w], state_dir=sys.argv[1], durable=sys.argv[2] == '1', commit_every=100,\n"
        "                  ram_budget='48KiB', shard_numel=1024)\n"
        "for _ in range(3):\n"
        "    w.grad = torch.ones_like(w); opt.step()\n"
        "print(opt.committed_step)\n"
    )
    for durable in ("1", "0"):
        d = tmp_path / f"s{durable}"
        out = subprocess.run([sys.executable, "-c", script, str(d), durable], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        if durable == "1":
            assert out.stdout.split()[-1] in ("0", "None"), "the last step was committed before exit: test is vacuous"
        with TieredAdamW([nn.Parameter(torch.zeros(50000))], state_dir=d, resume=True, ram_budget="48KiB", shard_numel=1024) as again:
            assert again.step_count == 3, (durable, out.stderr)


def _exit_quietly() -> None:
    """A forked child that uses nothing and exits (a DataLoader worker, say)."""


def test_a_forked_child_exiting_leaves_the_parents_state_alone(tmp_path: Path) -> None:
    """Exit hooks run in forked children too: they must not close (or commit) the parent's optimizer."""
    import multiprocessing

    params = _params()
    opt = TieredAdamW(params, state_dir=tmp_path / "s", **KW)
    _train(opt, params, range(2))
    opt.commit()
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir() if p.is_file()}
    child = multiprocessing.get_context("fork").Process(target=_exit_quietly)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    after = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir() if p.is_file()}
    assert after == before
    _train(opt, params, range(2, 3))  # the parent's optimizer is still open and usable
    opt.close()
