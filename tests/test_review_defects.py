"""The review's defects in the optimizer's front and runtime (issue 21, part 5), each pinned by a test.

- A failed step leaves every step count where it was (``state[p]["step"]``
  and ``step_count``), and the optimizer refuses further use.
- The first ``synchronize()`` after a failure behind the loop raises
  ``StepFailedError`` (the cause chained), as every later call does.
- ``repr(opt)`` and ``describe()`` never build the compiled kernel.
- The user's intra-op thread count is never changed, not even for a
  moment, by steps behind the loop or by the workers of a compressed format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

import tierstore._runtime.update
from tierstore import StepFailedError, TieredAdamW
from tierstore._runtime.overlap import Attachment

ROOT = Path(__file__).resolve().parent.parent


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))


def _backward(model: nn.Module, step: int) -> None:
    model(torch.full((2, 32), 0.1 * (step + 1))).square().sum().backward()


def _steps(opt: TieredAdamW) -> list[float]:
    return [float(opt.state[p]["step"]) for p in opt.param_groups[0]["params"] if "step" in opt.state[p]]


def _fail_the_second_shard(monkeypatch) -> None:
    """The first shard of the next step is updated, then the step fails (as a crash point would)."""
    hits = []

    def crash(name: str) -> None:
        if name == "mid-update":
            hits.append(name)
            if len(hits) == 2:
                raise OSError(5, "injected: Input/output error")

    monkeypatch.setattr(tierstore._runtime.update, "crash_point", crash)


@pytest.mark.parametrize("behind", [False, True], ids=["synchronous", "behind-the-loop"])
def test_a_failed_step_leaves_every_step_count_where_it_was(monkeypatch, behind: bool) -> None:
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024)  # 4 shards
    if behind:
        opt.attach(model, overlap=True)
    for step in range(2):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert opt.step_count == 2 and _steps(opt) == [2.0] * 4
    _fail_the_second_shard(monkeypatch)
    _backward(model, 2)
    if behind:
        opt.step()  # scheduled; it fails behind the loop
        with pytest.raises(StepFailedError, match="injected"):
            opt.synchronize()
    else:
        with pytest.raises(OSError, match="injected"):
            opt.step()
    assert opt.step_count == 2, "a failed step was counted"
    assert _steps(opt) == [2.0] * 4, "a failed step moved the per-parameter step counts"
    with pytest.raises(StepFailedError, match=r"resume=True"):
        opt.step()
    assert opt.step_count == 2
    opt.close()


def test_a_failed_first_step_gives_no_parameter_a_step(monkeypatch) -> None:
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024)
    _fail_the_second_shard(monkeypatch)
    _backward(model, 0)
    with pytest.raises(OSError, match="injected"):
        opt.step()
    assert opt.step_count == 0 and _steps(opt) == []
    opt.close()


def test_a_failing_kernel_moves_no_count(monkeypatch) -> None:
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    opt.step()
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    _backward(model, 1)
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        opt.step()
    assert calls and opt.step_count == 1 and _steps(opt) == [1.0] * 4
    opt.close()


def test_a_step_behind_the_loop_counts_when_step_returns() -> None:
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2).attach(model, overlap=True)
    _backward(model, 0)
    opt.step()
    assert opt.step_count == 1  # counted at once (what a schedule or a log reads), before it finished
    opt.synchronize()
    assert opt.step_count == 1 and _steps(opt) == [1.0] * 4
    opt.close()


def test_the_first_synchronize_after_a_background_failure_raises_step_failed_error(monkeypatch) -> None:
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024).attach(model, overlap=True)

    def broken(*args, **kwargs):
        raise OSError(5, "injected")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    _backward(model, 0)
    opt.step()
    with pytest.raises(StepFailedError, match=r"OSError: \[Errno 5\] injected.*resume=True") as first:
        opt.synchronize()
    assert isinstance(first.value.__cause__, OSError) and "injected" in str(first.value.__cause__)
    with pytest.raises(StepFailedError) as again:  # the same error every time
        opt.synchronize()
    assert isinstance(again.value.__cause__, OSError)
    with pytest.raises(StepFailedError, match="resume=True"):
        opt.step()
    opt.close()


def test_an_interrupted_wait_keeps_the_step_in_flight(monkeypatch) -> None:
    """Ctrl-C while waiting for the step behind the loop must not forget that step (nor mark it failed)."""
    model = _model()
    attachment = Attachment(model, list(model.parameters()), TieredAdamW(model.parameters()).layout)
    future: Future = Future()
    attachment._future = future

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        attachment.wait()
    assert attachment._future is future, "the step in flight was dropped"
    monkeypatch.undo()
    future.set_result(None)
    attachment.wait()
    assert attachment._future is None
    attachment.detach()


def _run(script: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_repr_and_describe_never_build_the_kernel(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    out = _run(
        """
        import json, tierstore._compute.native as native
        native.installed_path = lambda: None  # as after an install without a compiler
        import torch
        from tierstore import TieredAdamW
        w = torch.nn.Parameter(torch.ones(8192))
        opt = TieredAdamW([w], moment_dtype="int8", shard_numel=4096)
        text = repr(opt) + opt.describe()
        print(json.dumps({"text": text, "decided": native.loaded()[0]}))
        """,
        env={"TIERSTORE_CACHE_DIR": str(cache)},
    )
    assert "undecided until the first step" in out["text"]
    assert out["decided"] is False, "repr/describe loaded or built the compiled library"
    assert list(cache.rglob("*")) == [], "repr/describe wrote into the kernel cache"


def test_the_users_thread_count_is_never_changed() -> None:
    """Poll the main thread's torch.get_num_threads() and a new thread's (torch's process default) while
    steps run behind the loop (update_threads=1 lowers the update's own threads) and while a compressed
    format's workers start and run; a streamed synchronous step too. Every torch.set_num_threads call
    is recorded, and the update must still have run on its own lower count."""
    out = _run(
        """
        import json, tempfile, threading, time
        import torch
        torch.set_num_threads(2)
        import tierstore._runtime.update, tierstore._compute.kernel
        from tierstore import TieredAdamW
        calls, seen, in_update = [], set(), set()
        real_set = torch.set_num_threads
        def recording_set(n):
            calls.append((threading.current_thread().name, n))
            real_set(n)
        torch.set_num_threads = recording_set
        real_adamw = tierstore._compute.kernel.adamw
        def adamw(*args, **kwargs):
            in_update.add(torch.get_num_threads())
            return real_adamw(*args, **kwargs)
        tierstore._compute.kernel.adamw = adamw
        def probe():
            box = []
            t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
            t.start(); t.join()
            return box[0]
        def poll(seconds):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                seen.add(("main", torch.get_num_threads()))
                seen.add(("new thread", probe()))
        with tempfile.TemporaryDirectory() as tmp:
            for width, kwargs, behind in (
                (128, dict(update_threads=1, shard_numel=8192), True),  # the update's own thread count
                (1024, dict(moment_dtype="int8", update_threads=2, shard_numel=1 << 20), True),  # workers start
                (128, dict(update_threads=1, shard_numel=8192, state_dir=tmp + "/s", ram_budget="1MiB"), False),
            ):
                torch.manual_seed(0)
                model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(2)])
                opt = TieredAdamW(model.parameters(), **kwargs)
                if behind:
                    opt.attach(model, overlap=True)
                for step in range(4):
                    model(torch.ones(4, width)).sum().backward()
                    opt.step()
                    poll(0.05)  # from the main thread, while the update runs behind the loop
                    opt.synchronize(); opt.zero_grad()
                    poll(0.0)
                opt.close()
        workers = sorted({t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("tierstore-w")})
        print(json.dumps({"workers": workers, "calls": calls, "seen": sorted(seen), "in_update": sorted(in_update),
                          "after": torch.get_num_threads(), "new_after": probe()}))
        """
    )
    assert out["calls"] == [], f"tierstore called torch.set_num_threads: {out['calls']}"
    assert out["seen"] == [["main", 2], ["new thread", 2]], out["seen"]
    assert out["after"] == out["new_after"] == 2
    assert 1 in out["in_update"], f"the update did not run on its own lower count: {out}"
    assert out["workers"] == ["tierstore-worker"], "the compressed format's workers never started: the test is vacuous"
