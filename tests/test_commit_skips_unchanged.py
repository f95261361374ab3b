"""A commit writes only the resident shards that changed since their last write.

Each shard keeps its own committed copy (the manifest names it per shard), so a
shard whose parameters got no gradient since its last write keeps pointing at
that copy and costs the commit nothing. These tests count the bytes that reach
the state files at the system-call level (:class:`tierstore.testing.fsrecord.Recorder`)
while one step and its commit run, and check that a state resumed from the
committed files, after commits that skipped shards, equals torch's fused AdamW.
"""

from __future__ import annotations

import shutil

import torch

from tierstore import TieredAdamW
from tierstore.testing.fsrecord import Recorder

NUMEL = 4096  # one shard per parameter: each Linear weight is 64 x 64


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]


def _grads(step: int) -> list[torch.Tensor | None]:
    """Step 0 gives both parameters a gradient; later steps only the first, except step 3."""
    g = torch.Generator().manual_seed(step)
    both = [torch.randn(64, 64, generator=g) for _ in range(2)]
    if step == 0:
        return both
    return [None, both[1]] if step == 3 else [both[0], None]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    for p, g in zip(params, _grads(step)):
        p.grad = g
    opt.step()


def _shard_file_bytes(recording, since: str, until: str | None = None) -> int:
    """Bytes written (by descriptor or through a mapping) into shards.*.bin between two phase marks."""
    inodes = {op.inode for op in recording.ops if op.kind == "create" and op.name.startswith("shards.")}
    marks = {op.label: op.begin for op in recording.ops if op.kind == "phase"}
    start, stop = marks[since], marks[until] if until else recording.end
    return sum(len(op.data) for op in recording.ops
               if op.kind == "write" and op.inode in inodes and start < op.begin < stop)


def _open(params, state_dir: str, **kw) -> TieredAdamW:
    return TieredAdamW(params, lr=1e-2, state_dir=state_dir, shard_numel=NUMEL, ram_budget=None,
                       durable=True, commit_every=1, keep_master=True, **kw)


def test_a_commit_writes_only_the_changed_resident_shard(tmp_path):
    state_dir = str(tmp_path / "state")
    params = _params()
    with Recorder(state_dir) as rec, _open(params, state_dir) as opt:
        assert " 0 streamed from disk" in opt.describe(), opt.describe()  # every shard resident
        _step(opt, params, 0)
        opt.commit()
        rec.phase("one changed")  # step 1 changes the first parameter only
        _step(opt, params, 1)
        opt.commit()
        rec.phase("both changed")  # a gradient for each parameter, for scale
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.commit()
        rec.phase("end")
    recording = rec.recording()
    one = _shard_file_bytes(recording, "one changed", "both changed")
    both = _shard_file_bytes(recording, "both changed", "end")
    # One shard holds exp_avg, exp_avg_sq and the fp32 master: 3 x 4096 x 4 bytes.
    shard_bytes = 3 * NUMEL * 4
    assert one == shard_bytes, (one, both)
    assert both == 2 * shard_bytes, (one, both)


def test_a_state_resumed_after_skipping_commits_equals_torch(tmp_path):
    state_dir = str(tmp_path / "state")
    params = _params()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    with _open(params, state_dir) as opt:
        for step in range(5):  # the copies alternate per shard: each shard's committed copy differs
            _step(opt, params, step)
            _step(ref, ref_params, step)
        opt.commit()
        copy = str(tmp_path / "copy")  # the committed files as a crash right now would leave them
        shutil.copytree(state_dir, copy)
    resumed_params = [torch.nn.Parameter(torch.zeros(64, 64)) for _ in range(2)]
    with _open(resumed_params, copy, resume=True) as resumed:
        assert resumed.step_count == 5
        state = resumed.state_dict()["state"]
        for i, p in enumerate(ref_params):
            assert torch.equal(resumed_params[i], p)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][key], ref.state[p][key]), (i, key)
