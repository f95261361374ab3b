"""The step behind the training loop (``opt.attach(model)``) stays bitwise exact.

Against ``torch.optim.AdamW(fused=True)`` trained on the same batches: every
loss and every final parameter equal, for random models whose forward uses
its modules in another order than they were registered, tied and unused
parameters, gradient accumulation, clipping, GradScaler (with inf steps),
LR schedules, gradients offloaded to the host or not, state in RAM, streamed
from disk or durable, and state-dict, checkpoint, commit and zero_grad calls
while an update is still in flight. Misuse gets an error naming the fix.
"""

from __future__ import annotations

import copy
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tierstore import ConfigError, StepFailedError, TieredAdamW
from tierstore._runtime.overlap import ShardBoard


class Permuted(nn.Module):
    """Linear layers whose forward runs in ``order``, not in registration order; the last may be tied."""

    def __init__(self, widths: list[int], order: list[int], tie: bool, unused: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(widths[0], widths[0]) for _ in widths)
        self.order = order
        self.head = nn.Linear(widths[0], widths[0], bias=False)
        if tie:
            self.head.weight = self.layers[0].weight  # one parameter, two modules
        self.spare = nn.Linear(3, 3) if unused else None  # optimized, never used by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.order:
            x = torch.tanh(self.layers[k](x))
        return self.head(x)


@dataclass(frozen=True)
class Run:
    widths: tuple[int, ...]
    order_seed: int
    tie: bool
    unused: bool
    budget: str  # "ram", "disk" (streamed, private dir), "durable" (a state_dir)
    accumulate: int
    clip: bool
    scaler: bool
    offload: bool
    schedule: bool
    midflight: str  # what to call while an update is in flight
    steps: int


def runs() -> st.SearchStrategy[Run]:
    return st.builds(
        Run,
        widths=st.lists(st.integers(8, 48), min_size=1, max_size=4).map(lambda w: tuple([w[0]] * len(w))),
        order_seed=st.integers(0, 1000),
        tie=st.booleans(),
        unused=st.booleans(),
        budget=st.sampled_from(("ram", "disk", "durable")),
        accumulate=st.integers(1, 3),
        clip=st.booleans(),
        scaler=st.booleans(),
        offload=st.booleans(),
        schedule=st.booleans(),
        midflight=st.sampled_from(("none", "state_dict", "checkpoint", "reload", "zero_grad_keep", "commit", "read")),
        steps=st.integers(2, 4),
    )


def _model(run: Run) -> nn.Module:
    torch.manual_seed(0)
    order = list(range(len(run.widths)))
    torch.Generator().manual_seed(run.order_seed)
    order = [order[i] for i in torch.randperm(len(order), generator=torch.Generator().manual_seed(run.order_seed))]
    return Permuted(list(run.widths), order, run.tie, run.unused)


def _batch(run: Run, step: int, k: int) -> torch.Tensor:
    x = torch.randn(4, run.widths[0], generator=torch.Generator().manual_seed(1000 * step + k))
    if run.scaler and step == 1 and k == 0:
        x[0, 0] = float("inf")  # one overflowing step, which GradScaler skips
    return x


def _train(run: Run, model: nn.Module, opt, scaler, sched, tiered: bool, tmp: Path) -> list[float]:
    losses = []
    for step in range(run.steps):
        for k in range(run.accumulate):
            loss = model(_batch(run, step, k)).square().mean()
            losses.append(loss.item())
            scaler.scale(loss).backward()
        if run.clip:
            if tiered:
                opt.unscale_(scaler)
                opt.clip_grad_norm_(0.5)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if tiered:
            _midflight(run, opt, model, tmp / f"ckpt-{step}.zarr")
    return losses


def _midflight(run: Run, opt: TieredAdamW, model: nn.Module, path: Path) -> None:
    """Calls that must wait for the update in flight, and then see its result."""
    if run.midflight == "state_dict":
        opt.state_dict()
    elif run.midflight == "checkpoint":
        opt.save_checkpoint(str(path))
    elif run.midflight == "reload":
        opt.load_state_dict(opt.state_dict())
    elif run.midflight == "zero_grad_keep":
        opt.zero_grad(set_to_none=False)
    elif run.midflight == "commit":
        opt.commit()
    elif run.midflight == "read":
        opt.synchronize()
        _ = [p.detach().clone() for p in model.parameters()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(run=runs())
def test_attached_training_is_bitwise_equal_to_torch(run: Run, tmp_path_factory) -> None:
    tmp = tmp_path_factory.mktemp("overlap")
    ours, theirs = _model(run), None
    theirs = copy.deepcopy(ours)
    budget = {"ram": None, "disk": "40KiB", "durable": "40KiB"}[run.budget]  # a 4-slot arena and a shard
    state_dir = str(tmp / "state") if run.budget == "durable" else None
    opt = TieredAdamW(ours.parameters(), lr=1e-2, ram_budget=budget, shard_numel=1024, state_dir=state_dir)
    opt.attach(ours, offload_grads=run.offload, overlap=True)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**6, enabled=run.scaler) for _ in range(2)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.7) if run.schedule else None for o in (opt, ref)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # GradScaler hands itself to step(): deprecated but supported
        got = _train(run, ours, opt, scalers[0], scheds[0], True, tmp)
    want = _train(run, theirs, ref, scalers[1], scheds[1], False, tmp)
    opt.synchronize()
    try:
        assert got == want
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), name
    finally:
        opt.close()


def test_step_returns_before_the_update_and_forward_waits_per_module(monkeypatch) -> None:
    """A slow update: step() returns at once; the first module's forward waits only for its own shards."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024).attach(model, overlap=True)
    seen: list[int] = []
    real = ShardBoard.done

    def slow_done(board, shard, upload=None):
        import time

        time.sleep(0.05)
        seen.append(shard)
        real(board, shard, upload)

    monkeypatch.setattr(ShardBoard, "done", slow_done)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    assert len(seen) < 5, "step() waited for the whole update"
    model(torch.ones(2, 64))
    opt.synchronize()
    assert sorted(set(seen)) == list(range(len(opt.layout.shards)))
    opt.close()


def test_update_order_follows_first_use_in_forward() -> None:
    model = Permuted([32, 32, 32], order=[2, 0, 1], tie=False, unused=False)
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024).attach(model, overlap=True)
    model(torch.ones(2, 32)).sum().backward()  # records the first use of each module
    opt.step()
    opt.synchronize()
    model(torch.ones(2, 32)).sum().backward()
    opt.step()
    opt.synchronize()
    order = opt.last_step_stats.order
    layer2 = opt.layout.shards_of([4, 5])  # layers[2]'s weight and bias: used first
    assert order[: len(layer2)] == layer2, order
    opt.close()


def test_scaler_unscale_with_offloaded_grads_names_the_fix() -> None:
    model = nn.Linear(8, 1)
    opt = TieredAdamW(model.parameters()).attach(model, offload_grads=True, overlap=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    assert all(p.grad is None for p in model.parameters()), "gradients were not offloaded"
    scaler.unscale_(opt)
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=r"opt\.unscale_\(scaler\)"):
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(opt)
    opt.close()


def test_attach_a_model_without_the_parameters() -> None:
    model = nn.Linear(4, 4)
    with TieredAdamW(model.parameters()) as opt, pytest.raises(ConfigError, match="owns none"):
        opt.attach(nn.Linear(4, 4))


def test_an_unattached_module_using_pending_parameters_waits_and_warns(monkeypatch) -> None:
    real = ShardBoard.done

    def slow_done(board, shard, upload=None):  # the update is still running when `other` runs
        import time

        time.sleep(0.2)
        real(board, shard, upload)

    monkeypatch.setattr(ShardBoard, "done", slow_done)
    model, twin = nn.Linear(16, 16), None
    twin = copy.deepcopy(model)
    other = nn.Linear(16, 16)
    other.weight = model.weight  # a module outside the attached model shares a parameter
    opt = TieredAdamW(model.parameters(), lr=1e-2).attach(model, overlap=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for m, o in ((model, opt), (twin, ref)):
        m(torch.ones(2, 16)).sum().backward()
        o.step()
        o.zero_grad()
    with pytest.warns(UserWarning, match="not part of the attached model"):
        out = other(torch.ones(2, 16))
    assert torch.equal(out, torch.nn.functional.linear(torch.ones(2, 16), twin.weight, other.bias))
    opt.close()


def test_a_failed_background_step_fails_the_next_call(monkeypatch) -> None:
    model = nn.Linear(64, 64)
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024).attach(model, overlap=True)

    def broken(*args, **kwargs):
        raise OSError("injected")

    model(torch.ones(2, 64)).sum().backward()
    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    opt.step()  # scheduled: the failure happens behind the loop
    with pytest.raises(StepFailedError, match=r"behind the loop failed \(OSError: injected\).*resume=True"):
        model(torch.ones(2, 64))
    with pytest.raises(StepFailedError, match="resume=True"):
        opt.step()
    opt.close()


def test_zero_grad_between_offloaded_backwards_drops_the_first(monkeypatch) -> None:
    """With gradients offloaded to host buckets, zero_grad() must clear those buckets as torch clears .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=512).attach(model, offload_grads=True, overlap=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        for m, o in ((model, opt), (twin, ref)):
            m(torch.full((2, 32), float(step + 1))).sum().backward()  # a backward whose gradients are dropped
            o.zero_grad()
            m(torch.linspace(-1, 1, 64).view(2, 32) * (step + 1)).square().sum().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    opt.close()


class FunctionalHead(nn.Module):
    """The head's weight is read with F.linear in the parent's forward, before any module's
    forward runs: the head's own forward never runs, so only the root's hook can wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(torch.nn.functional.linear(x, self.head.weight, self.head.bias)))


def test_a_parameter_read_functionally_waits_for_its_update(monkeypatch) -> None:
    real = ShardBoard.done

    def slow_done(board, shard, upload=None):  # the update lags far behind the loop
        import time

        time.sleep(0.05)
        real(board, shard, upload)

    monkeypatch.setattr(ShardBoard, "done", slow_done)
    torch.manual_seed(0)
    model = FunctionalHead()
    twin = copy.deepcopy(model)
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=64).attach(model, overlap=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    losses: dict[str, list[float]] = {"tiered": [], "torch": []}
    for step in range(4):
        for name, m, o in (("tiered", model, opt), ("torch", twin, ref)):
            loss = m(torch.ones(2, 16) * (step + 1)).square().mean()
            losses[name].append(loss.item())
            loss.backward()
            o.step()
            o.zero_grad()
    assert losses["tiered"] == losses["torch"]
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    opt.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_attach_runs_behind_the_loop_only_when_something_can_hide(monkeypatch, streamed) -> None:
    """CPU state all in RAM: nothing hides behind a forward that uses every core, so the step runs
    at once (never slower than unattached); with shards streamed from disk it runs behind the loop."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    budget = "40KiB" if streamed else None
    opt = TieredAdamW(model.parameters(), lr=1e-2, shard_numel=1024, ram_budget=budget).attach(model)
    ran_on: list[str] = []
    update = opt._rt.run_step

    def run_step(*args, **kwargs):
        ran_on.append(threading.current_thread().name)
        return update(*args, **kwargs)

    monkeypatch.setattr(opt._rt, "run_step", run_step)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    opt.synchronize()
    assert ran_on and (ran_on[0] != threading.current_thread().name) == streamed, ran_on
    opt.close()
