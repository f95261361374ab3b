"""Bad inputs (issue 2, point 7): each gets a clear error naming the value and the fix,
and leaves existing files untouched.

"Untouched" is checked on a snapshot of every file under the test's directory:
names, sizes, modification times and bytes.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import (
    BudgetError,
    ClosedError,
    ConfigError,
    LayoutMismatchError,
    ParamsChangedError,
    StateDirError,
    StateDirInUseError,
    StateExistsError,
    TieredAdamW,
    TierstoreError,
)

NUMEL = 20_000
SMALL_BUDGET = "96KiB"  # with shard_numel=1024: a 4-slot arena plus a few resident shards


def params(numel: int = NUMEL, seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(numel)), nn.Parameter(torch.randn(7, 3))]


def build(ps=None, **kwargs) -> TieredAdamW:
    kwargs.setdefault("shard_numel", 1024)
    kwargs.setdefault("backend", "buffered")
    return TieredAdamW(params() if ps is None else ps, **kwargs)


def assert_untouched(before: dict, after: dict) -> None:
    """Every file that existed is still there, unchanged."""
    for name, (size, mtime, data) in before.items():
        assert name in after, f"{name} was removed"
        assert after[name][0] == size, f"{name} changed size"
        assert after[name][1] == mtime, f"{name} was modified (mtime)"
        assert after[name][2] == data, f"{name} changed content"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory with a user's file and a finished run's state beside the test's (empty) state_dir.

    (A state_dir holding a user's file is refused: tests/test_hostile_statedir.py.)
    """
    (tmp_path / "notes.txt").write_text("not tierstore's\n")
    ps = params(seed=1)
    with build(ps, state_dir=tmp_path / "old-run", ram_budget=SMALL_BUDGET) as opt:
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    (tmp_path / "state").mkdir()
    return tmp_path


# -- constructor arguments ---------------------------------------------------------------

HYPERPARAMETERS = [
    (dict(lr=-1e-3), "-0.001"),
    (dict(lr=float("nan")), "nan"),
    (dict(eps=-1e-8), "-1e-08"),
    (dict(betas=(1.0, 0.999)), "1.0"),
    (dict(betas=(0.9, 1.0)), "1.0"),
    (dict(betas=(-0.1, 0.999)), "-0.1"),
    (dict(betas=(0.9, 1.5)), "1.5"),
    (dict(weight_decay=-0.01), "-0.01"),
]


@pytest.mark.parametrize("kwargs, says", HYPERPARAMETERS, ids=[f"{k}" for k, _ in HYPERPARAMETERS])
def test_invalid_hyperparameters_raise_value_error_like_torch(kwargs, says, workdir: Path, snapshot) -> None:
    with pytest.raises(ValueError):
        torch.optim.AdamW(params(), **kwargs)
    before = snapshot(workdir)
    with pytest.raises(ValueError) as info:
        build(state_dir=workdir / "state", **kwargs)
    assert isinstance(info.value, TierstoreError)
    assert says in str(info.value), str(info.value)
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    "key, value, says",
    [("lr", -1.0, "-1.0"), ("eps", -1.0, "-1.0"), ("weight_decay", -0.5, "-0.5"), ("betas", (0.9, 1.0), "1.0")],
)
def test_invalid_hyperparameter_in_a_param_group(key, value, says, workdir: Path, snapshot) -> None:
    # Note: torch.optim.AdamW checks only its defaults; TieredAdamW checks every group.
    a, b = params()
    before = snapshot(workdir)
    with pytest.raises(ValueError, match="group 1") as info:
        build([{"params": [a]}, {"params": [b], key: value}], state_dir=workdir / "state")
    assert says in str(info.value)
    assert snapshot(workdir) == before


# Values torch.optim.AdamW refuses when it is built; TieredAdamW refuses them too, with torch's
# message (plus the fix) and the same exception type.
T = torch.tensor
TORCH_REFUSES = [
    (dict(betas=(0.9, T(0.999))), ValueError, "betas must be either both floats or both Tensors"),
    (dict(betas=(T(0.9), 0.999)), ValueError, "betas must be either both floats or both Tensors"),
    (dict(betas=(0, 0.999)), ValueError, "betas must be either both floats or both Tensors"),
    (dict(lr=T([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element"),
    (dict(lr=T(-1.0)), ValueError, "Invalid learning rate"),
    (dict(betas=(T(1.0), T(0.999))), ValueError, "Invalid beta parameter at index 0"),
    (dict(lr="0.1"), TypeError, None),
]


@pytest.mark.parametrize("kwargs, kind, says", TORCH_REFUSES, ids=[str(k) for k, _, _ in TORCH_REFUSES])
def test_construction_validation_matches_torch(kwargs, kind, says, workdir: Path, snapshot) -> None:
    with pytest.raises(kind) as theirs:
        torch.optim.AdamW(params(), **kwargs)
    before = snapshot(workdir)
    with pytest.raises(kind) as ours:
        build(state_dir=workdir / "state", **kwargs)
    assert isinstance(ours.value, TierstoreError) and isinstance(ours.value, type(theirs.value)), (ours, theirs)
    if says is not None:
        assert says in str(theirs.value) and says in str(ours.value), (str(theirs.value), str(ours.value))
    assert snapshot(workdir) == before


def test_multi_element_tensor_beta_is_named() -> None:
    # Note: torch fails here with "Boolean value of Tensor with more than one value is
    # ambiguous" (RuntimeError); TieredAdamW names the value and the fix instead.
    with pytest.raises(ConfigError, match=re.escape("Tensor betas[0] must be 1-element")):
        build(betas=(T([0.9, 0.8]), T(0.999)))


def test_tensor_betas_train_like_torch() -> None:
    ours, theirs = params(), params()
    kwargs = dict(lr=T(1e-2), betas=(T(0.8), T(0.95)), weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, fused=True, **kwargs)
    with build(ours, **kwargs) as opt:
        for step in range(3):
            for a, b in zip(ours, theirs):
                a.grad = b.grad = torch.full_like(a, 0.1 * (step + 1))
            opt.step()
            ref.step()
        assert isinstance(opt.param_groups[0]["betas"][0], torch.Tensor)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


BAD_KNOBS = [
    # (kwargs, exception, substrings of the message)
    (dict(ram_budget="12 parsecs"), ConfigError, ["ram_budget", "'12 parsecs'", "MiB"]),
    (dict(ram_budget=-1), ConfigError, ["ram_budget", "-1"]),
    (dict(ram_budget="lots"), ConfigError, ["ram_budget", "'lots'", "512MiB"]),
    (dict(ram_budget=True), ConfigError, ["ram_budget", "True"]),
    (dict(ram_budget=-0.5), ConfigError, ["ram_budget", "-0.5"]),
    (dict(ram_budget=[1 << 20]), ConfigError, ["ram_budget", "list"]),
    (dict(backend="nvme"), ConfigError, ["backend", "'nvme'", "mmap"]),
    (dict(backend="DIRECT"), ConfigError, ["backend", "'DIRECT'", "direct"]),
    (dict(backend=3), ConfigError, ["backend", "3"]),
    (dict(backend=None), ConfigError, ["backend", "None"]),
    (dict(prefetch_depth=0), ConfigError, ["prefetch_depth", "0", ">= 1"]),
    (dict(prefetch_depth=-2), ConfigError, ["prefetch_depth", "-2"]),
    (dict(prefetch_depth=1.5), ConfigError, ["prefetch_depth", "1.5"]),
    (dict(prefetch_depth=True), ConfigError, ["prefetch_depth", "True"]),
    (dict(prefetch_depth="2"), ConfigError, ["prefetch_depth", "'2'"]),
    (dict(io_workers=0), ConfigError, ["io_workers", "0", ">= 1"]),
    (dict(io_workers=2.5), ConfigError, ["io_workers", "2.5"]),
    (dict(io_workers=False), ConfigError, ["io_workers", "False"]),
    (dict(request_bytes=0), ConfigError, ["request_bytes", "0"]),
    (dict(request_bytes=1000), ConfigError, ["request_bytes", "1000"]),
    (dict(request_bytes=4097), ConfigError, ["request_bytes", "4097", "4096"]),
    (dict(request_bytes=-4096), ConfigError, ["request_bytes", "-4096"]),
    (dict(request_bytes=8.0 * 4096), ConfigError, ["request_bytes", "32768.0"]),
    (dict(shard_numel=0), ConfigError, ["shard_numel", "0"]),
    (dict(shard_numel=-1024), ConfigError, ["shard_numel", "-1024"]),
    (dict(shard_numel=1.5), ConfigError, ["shard_numel", "1.5"]),
    (dict(shard_numel=True), ConfigError, ["shard_numel", "True"]),
    (dict(update_threads=0), ConfigError, ["update_threads", "0", ">= 1"]),
    (dict(update_threads=-1), ConfigError, ["update_threads", "-1"]),
    (dict(update_threads=1.5), ConfigError, ["update_threads", "1.5"]),
    (dict(update_threads=True), ConfigError, ["update_threads", "True"]),
    (dict(ram_budget=1), BudgetError, ["ram_budget", "(1 bytes)", "at least", "shard_numel"]),
    (dict(ram_budget="1KiB"), BudgetError, ["ram_budget", "1024", "at least", "prefetch_depth"]),
    (dict(ram_budget="1KiB", resume=False), BudgetError, ["ram_budget", "at least"]),
]


@pytest.mark.parametrize("kwargs, error, says", BAD_KNOBS, ids=[f"{k}" for k, _, _ in BAD_KNOBS])
def test_bad_arguments_name_the_value_and_the_fix(kwargs, error, says, workdir: Path, snapshot) -> None:
    before = snapshot(workdir)
    with pytest.raises(error) as info:
        build(state_dir=workdir / "state", **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TierstoreError)
    message = str(info.value)
    for part in says:
        assert part in message, f"{part!r} not in {message!r}"
    assert_untouched(before, snapshot(workdir))


def test_budget_error_minimum_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(BudgetError) as info:
        build(ram_budget=1)
    minimum = int(re.search(r"at least (\d+) bytes", str(info.value)).group(1))
    with build(ram_budget=minimum, state_dir=tmp_path / "s") as opt:
        assert opt.plan.disk_shards and opt.ram_bytes <= minimum


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=-1.0),
        dict(backend="nvme"),
        dict(ram_budget="12 parsecs"),
        dict(prefetch_depth=0),
        dict(ram_budget=1),
    ],
    ids=["lr", "backend", "ram_budget", "prefetch_depth", "budget_too_small"],
)
def test_a_rejected_configuration_creates_nothing(kwargs, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build(state_dir=tmp_path / "new-state", **kwargs)
    assert list(tmp_path.iterdir()) == [], "a rejected configuration created files"


def test_resume_without_state_dir() -> None:
    with pytest.raises(ConfigError, match="state_dir"):
        build(resume=True)


def test_durable_without_state_dir_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        build(durable=True)
    assert "durable" in str(info.value) and "state_dir" in str(info.value)


def test_unsupported_parameter_dtype() -> None:
    w = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ConfigError) as info:
        TieredAdamW([w])
    assert "float64" in str(info.value) and "requires_grad=False" in str(info.value)


def test_non_contiguous_parameter() -> None:
    w = nn.Parameter(torch.zeros(8, 6).t())
    with pytest.raises(ConfigError, match="contiguous") as info:
        TieredAdamW([w])
    assert "(6, 8)" in str(info.value)


# -- the state directory ----------------------------------------------------------


def test_state_dir_under_a_regular_file(workdir: Path, snapshot) -> None:
    blocker = workdir / "notes.txt"
    before = snapshot(workdir)
    with pytest.raises(StateDirError) as info:
        build(state_dir=blocker / "state")
    assert str(blocker / "state") in str(info.value)
    assert snapshot(workdir) == before


def test_state_dir_that_is_a_regular_file(workdir: Path, snapshot) -> None:
    before = snapshot(workdir)
    with pytest.raises(StateDirError, match="not a directory") as info:
        build(state_dir=workdir / "notes.txt")
    assert str(workdir / "notes.txt") in str(info.value)
    assert snapshot(workdir) == before


def test_state_dir_where_nothing_can_be_created() -> None:
    # /proc refuses new entries even to root (chmod-based tests do not work as root).
    with pytest.raises(StateDirError) as info:
        build(state_dir="/proc/tierstore-cannot-be-here")
    assert "/proc/tierstore-cannot-be-here" in str(info.value)
    assert not os.path.exists("/proc/tierstore-cannot-be-here")


@pytest.mark.parametrize("path", ["/proc", "/sys/kernel"])
def test_existing_state_dir_that_is_not_writable(path: str) -> None:
    with pytest.raises(StateDirError, match="not writable") as info:
        build(state_dir=path)
    assert repr(path) in str(info.value)


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize("same_model", [True, False])
def test_state_dir_holding_state_of_another_run(workdir: Path, durable: bool, same_model: bool, snapshot) -> None:
    run = workdir / "run"
    ps = params(seed=2)
    with build(ps, state_dir=run, ram_budget=SMALL_BUDGET, durable=durable) as opt:
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    before = snapshot(workdir)
    other = params(seed=3) if same_model else params(numel=NUMEL + 100, seed=3)
    with pytest.raises(StateExistsError) as info:
        build(other, state_dir=run, ram_budget=SMALL_BUDGET, durable=durable)
    message = str(info.value)
    assert str(run) in message and "resume=True" in message and "state_dir" in message
    assert snapshot(workdir) == before
    with pytest.raises(StateExistsError):  # whatever the budget
        build(params(seed=3), state_dir=run)
    assert snapshot(workdir) == before


def test_resuming_another_models_state(workdir: Path, snapshot) -> None:
    before = snapshot(workdir)
    with pytest.raises(LayoutMismatchError) as info:
        build(params(numel=NUMEL + 64), state_dir=workdir / "old-run", ram_budget=SMALL_BUDGET, resume=True)
    message = str(info.value)
    assert str(workdir / "old-run") in message and "another model" in message
    assert str(NUMEL + 64) in message and str(NUMEL) in message  # names the difference
    assert snapshot(workdir) == before


def test_state_files_without_a_manifest_are_state(workdir: Path, snapshot) -> None:
    """A run that died while starting left only state files: still not silently reused."""
    (workdir / "state" / "shards.0.bin").write_bytes(b"\0" * 4096)
    before = snapshot(workdir)
    with pytest.raises(StateExistsError):
        build(state_dir=workdir / "state")
    assert_untouched(before, snapshot(workdir))  # (a lock file may appear beside them)


@pytest.mark.parametrize("second_kwargs", [dict(), dict(resume=True), dict(ram_budget=None)])
def test_second_optimizer_on_an_open_state_dir(workdir: Path, second_kwargs, snapshot) -> None:
    state = workdir / "state"
    ps = params()
    with build(ps, state_dir=state, ram_budget=SMALL_BUDGET) as first:
        for p in ps:
            p.grad = torch.ones_like(p)
        first.step()
        first.commit()  # commits finish in the background: let this one land before the snapshot
        before = snapshot(workdir)
        kwargs = dict(state_dir=state, ram_budget=SMALL_BUDGET) | second_kwargs
        with pytest.raises(StateDirInUseError) as info:
            build(params(), **kwargs)
        message = str(info.value)
        assert str(state) in message and "close()" in message
        assert snapshot(workdir) == before
        first.step()  # the first one is unaffected
    # Once the first is closed, the directory can be resumed.
    with build(params(), state_dir=state, ram_budget=SMALL_BUDGET, resume=True) as again:
        assert again.step_count == 2


def _open_in_child(state_dir: str, queue) -> None:
    try:
        build(state_dir=state_dir, ram_budget=SMALL_BUDGET, resume=True).close()
        queue.put(("ok", ""))
    except Exception as exc:  # reported to the parent
        queue.put((type(exc).__name__, str(exc)))


def test_second_process_on_an_open_state_dir(workdir: Path, snapshot) -> None:
    state = workdir / "state"
    ctx = multiprocessing.get_context("fork")
    with build(state_dir=state, ram_budget=SMALL_BUDGET) as first:
        before = snapshot(workdir)
        queue = ctx.Queue()
        child = ctx.Process(target=_open_in_child, args=(str(state), queue))
        child.start()
        kind, message = queue.get(timeout=120)
        child.join(timeout=60)
        assert kind == "StateDirInUseError", message
        assert str(state) in message
        assert snapshot(workdir) == before
        first.step()
    # After close() (or the holder's death) another process may resume it.
    queue = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(str(state), queue))
    child.start()
    assert queue.get(timeout=120) == ("ok", "")
    child.join(timeout=60)


# -- parameters that change after construction -------------------------------------


@pytest.fixture
def running(tmp_path: Path):
    """An optimizer with state on disk, a step taken, and its torch twin."""
    ps = params()
    twin = [nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.AdamW(twin, lr=1e-2, fused=True)
    opt = build(ps, lr=1e-2, state_dir=tmp_path / "state", ram_budget=SMALL_BUDGET)
    step_both(opt, ref, ps, twin, seed=0)
    yield opt, ref, ps, twin, tmp_path
    opt.close()


def step_both(opt, ref, ps, twin, *, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p, q in zip(ps, twin):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g, g.clone()
    opt.step()
    opt.commit()  # commits finish in the background: let this one land before a test's snapshot
    ref.step()


def test_add_param_group(running, snapshot) -> None:
    opt, ref, ps, twin, tmp_path = running
    before = snapshot(tmp_path)
    groups_before = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ParamsChangedError) as info:
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(5))]})
    assert "add_param_group" in str(info.value) and "every group from the start" in str(info.value)
    assert [list(g["params"]) for g in opt.param_groups] == groups_before
    assert snapshot(tmp_path) == before
    step_both(opt, ref, ps, twin, seed=1)  # still usable, still exact
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))


def _append_to_group(opt, extra) -> None:
    opt.param_groups[0]["params"].append(extra)


def _append_group(opt, extra) -> None:
    opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [extra]})


def _replace_param(opt, extra) -> None:
    opt.param_groups[0]["params"][1] = extra


@pytest.mark.parametrize(
    "change, says",
    [(_append_to_group, "3 now"), (_append_group, "3 now"), (_replace_param, "2 now")],
    ids=["append_to_group", "append_group", "replace"],
)
def test_parameters_changed_in_param_groups(running, change, says, snapshot) -> None:
    opt, ref, ps, twin, tmp_path = running
    extra = nn.Parameter(torch.zeros(7, 3))
    extra.grad = torch.ones(7, 3)
    groups_before = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    change(opt, extra)
    before = snapshot(tmp_path)
    values = [p.detach().clone() for p in ps]
    with pytest.raises(ParamsChangedError) as info:
        opt.step()
    assert says in str(info.value) and "2 then" in str(info.value) and "new optimizer" in str(info.value)
    assert snapshot(tmp_path) == before
    assert all(torch.equal(p, v) for p, v in zip(ps, values)), "a refused step changed parameters"
    opt.param_groups[:] = groups_before  # undo: the optimizer is still usable and exact
    step_both(opt, ref, ps, twin, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda p: setattr(p, "data", torch.zeros(NUMEL + 1)), f"({NUMEL + 1},)"),
        (lambda p: setattr(p, "data", p.data.to(torch.bfloat16)), "bfloat16"),
    ],
    ids=["shape", "dtype"],
)
def test_parameter_reshaped_or_retyped(running, change, says, snapshot) -> None:
    opt, _, ps, _, tmp_path = running
    change(ps[0])
    ps[0].grad = torch.ones_like(ps[0])
    before = snapshot(tmp_path)
    with pytest.raises(ParamsChangedError) as info:
        opt.step()
    assert says in str(info.value) and "parameter 0" in str(info.value)
    assert snapshot(tmp_path) == before


def test_frozen_parameter_that_gets_a_gradient(tmp_path: Path, snapshot) -> None:
    a, b = params()
    b.requires_grad_(False)
    with build([a, b], state_dir=tmp_path / "state", ram_budget=SMALL_BUDGET) as opt:
        a.grad = torch.ones_like(a)
        opt.step()
        opt.commit()  # commits finish in the background: let this one land before the snapshot
        b.requires_grad_(True)
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        before = snapshot(tmp_path)
        value = a.detach().clone()
        with pytest.raises(ParamsChangedError) as info:
            opt.step()
        message = str(info.value)
        assert "parameter 1" in message and "frozen" in message and ".grad to None" in message
        assert snapshot(tmp_path) == before
        assert torch.equal(a, value)
        b.grad = None  # the fix the message names
        opt.step()


def test_amsgrad_switched_on_after_construction(running, snapshot) -> None:
    opt, _, ps, _, tmp_path = running
    opt.param_groups[0]["amsgrad"] = True
    for p in ps:
        p.grad = torch.ones_like(p)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="amsgrad=True"):
        opt.step()
    assert snapshot(tmp_path) == before


# -- loading a state dict that does not fit --------------------------------------------


def _torch_state(ps) -> dict:
    ref = torch.optim.AdamW(ps, fused=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    ref.step()
    return ref.state_dict()


@pytest.mark.parametrize(
    "mangle, says",
    [
        (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "2 parameter groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "1 parameters"),
        (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(3)), "3 elements"),
        (lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), "-1.0"),
        (lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True), "amsgrad"),
    ],
    ids=["groups", "params", "tensor_size", "bad_lr", "amsgrad"],
)
def test_load_state_dict_that_does_not_fit(running, mangle, says, snapshot) -> None:
    opt, ref, ps, twin, tmp_path = running
    sd = _torch_state([nn.Parameter(p.detach().clone()) for p in ps])
    mangle(sd)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=re.escape(says)):
        opt.load_state_dict(sd)
    assert snapshot(tmp_path) == before
    step_both(opt, ref, ps, twin, seed=1)  # nothing was loaded: still usable, still exact
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))


# -- after close ------------------------------------------------------------------------


def test_step_after_close(running, snapshot) -> None:
    opt, _, ps, _, tmp_path = running
    opt.close()
    before = snapshot(tmp_path)
    for p in ps:
        p.grad = torch.ones_like(p)
    with pytest.raises(ClosedError, match="closed") as info:
        opt.step()
    assert "resume=True" in str(info.value)
    assert snapshot(tmp_path) == before
    opt.close()
