"""The shard records shared by steps and background commits (``ShardEntry``, store.py), under stress.

Many small shards, half resident and half streamed, a commit after every step
running on the commit thread while the next steps run (the step on the loop's
thread, or behind it with ``attach``): a few hundred steps in a few seconds.
Every committed state read back and the final state must equal
``torch.optim.AdamW(fused=True)`` bit for bit. Plus the written rule's
checks: the commit thread is refused the step side's methods, and the books
are read together.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import TieredAdamW
from tierstore._layout.budget import plan_tiers
from tierstore._layout.layout import Layout
from tierstore._state.reader import StateReader
from tierstore._storage.store import ShardStore

SHAPES = [(1000,), (3000,), (17,), (64, 64), (5000,), (2048,), (300, 7), (9000,), (33, 33), (8000,), (4100,)]
STEPS = 300
CHECK_AT = (97, 211)  # committed state read back here (after waiting for the commit)


class _Model(nn.Module):
    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(params)

    def forward(self, x):  # never run: attach only needs the module tree
        return x


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1000 + step)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    return [None if (step + k) % 5 == 0 else t for k, t in enumerate(out)]  # some skip a step


def _assert_committed_equals(state_dir: Path, ref: torch.optim.AdamW, ref_params: list[nn.Parameter], step: int) -> None:
    with StateReader(state_dir) as reader:
        assert reader.step_count == step
        assert reader.verify() == []
        for i, p in enumerate(ref_params):
            mine = reader.param_state(i)
            theirs = ref.state[p]
            assert reader.param_steps[i] == float(theirs["step"]), i
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mine[key], theirs[key]), f"step {step}, parameter {i}, {key}"


@pytest.mark.parametrize("attached", [False, True], ids=["step-on-loop-thread", "step-behind-the-loop"])
def test_steps_and_background_commits_match_torch_bitwise(ram_tmp_path: Path, attached: bool) -> None:
    state_dir = ram_tmp_path / "state"
    params, ref_params = _params(), _params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=1e-2, fused=True)
    opt = TieredAdamW(params, lr=1e-2, weight_decay=1e-2, state_dir=state_dir, shard_numel=1024,
                      ram_budget="200KiB", backend="buffered", commit_every=1)  # fmt: skip
    try:
        assert len(opt.plan.disk_shards) >= 10 and len(opt.plan.resident) >= 10, opt.plan
        if attached:
            opt.attach(_Model(params), overlap=True)
        for step in range(STEPS):
            for p, r, g in zip(params, ref_params, _grads(step)):
                p.grad = None if g is None else g.clone()
                r.grad = None if g is None else g.clone()
            opt.step()
            ref.step()
            if step + 1 in CHECK_AT:
                opt.commit()  # waits for the commit (and the step behind the loop)
                _assert_committed_equals(state_dir, ref, ref_params, step + 1)
        opt.synchronize()
        stats = opt._rt.journal.stats
        assert stats.commits >= STEPS // 2 and stats.max_lag >= 1, stats  # commits really ran behind
        for p, r in zip(params, ref_params):
            assert torch.equal(p, r)
    finally:
        opt.close()
    _assert_committed_equals(state_dir, ref, ref_params, STEPS)


def _store(tmp_path: Path) -> ShardStore:
    w = torch.zeros(8192, requires_grad=True)
    layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
    plan = plan_tiers(layout, ram_budget=48 << 10, arena_slots=2)
    return ShardStore(layout, plan, directory=tmp_path, backend="buffered", durable=True).open()


def test_the_commit_thread_is_refused_the_step_sides_fields(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        resident = store.plan.resident[0]
        errors: list[BaseException] = []

        def commit_thread() -> None:
            store.commit(0, persist=False)  # adopting a commit makes this the commit thread
            for call in (lambda: store.claim_resident(resident), store.persist_resident):
                try:
                    call()
                except RuntimeError as exc:
                    errors.append(exc)

        t = threading.Thread(target=commit_thread)
        t.start()
        t.join(30)
        assert len(errors) == 2 and all("commit thread" in str(e) for e in errors)
        store.claim_resident(resident)  # the step side may
        assert store.persist_resident()
    finally:
        store.close()


def test_the_books_are_guarded_by_one_lock(tmp_path: Path) -> None:
    """A reader never sees a shard's copy with another copy's checksum: books_of waits for an adoption."""
    store = _store(tmp_path)
    try:
        store.books.acquire()
        got: list[tuple] = []
        reader = threading.Thread(target=lambda: got.append(store.books_of(0)))
        reader.start()
        reader.join(0.2)
        assert reader.is_alive() and got == [], "books_of read the books without the lock"
        store.books.release()
        reader.join(30)
        assert got and got[0][:2] == (store.entries[0].copy, store.entries[0].checksum)
    finally:
        store.close()
