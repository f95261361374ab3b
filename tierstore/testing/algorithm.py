"""The conformance kit every tiered optimizer algorithm passes: one :class:`AlgorithmCase`, five checks.

An algorithm (a front such as ``TieredSGD``, or the generic adapter
``tierstore.tiered`` over a class) is proven against its torch class on a
small deterministic run (parameters of several shapes, some cut across
shards; gradients a pure function of the step; some parameters skipping
some steps):

:func:`check_torch_equality`
    Bitwise equal to the torch class: every parameter, every state tensor and
    scalar of ``state_dict()``, and the param groups' values.
:func:`check_sharding`
    The same bits whatever the sharding: one shard, small shards, state
    streamed from disk through a small ``ram_budget``, one update thread.
:func:`check_state_dict_round_trips`
    A tiered ``state_dict()`` loads into the torch class, and the torch class's
    loads into the front; both continue exactly as the uninterrupted run.
:func:`check_resume_after_kill`
    A child process trains into a durable ``state_dir`` and is ``SIGKILL``-ed
    in the middle of a step (the ``mid-update`` crash point,
    :mod:`tierstore._platform.faults`); a new optimizer resumes the committed
    step and ends bitwise where the uninterrupted run ends.
:func:`check_moment_formats`
    Every compressed moment format runs: finite results that moved, the same
    bits for two shardings, and a state dict of the right keys.

Each check raises :class:`AlgorithmCheckFailed` (an ``AssertionError``)
listing what differs; :func:`check_algorithm` runs them all. A case's
``front`` and ``reference`` take the parameters (hyperparameters bound, e.g.
with :func:`functools.partial`); the front also takes the tier keywords.
They must be picklable (module-level callables and partials of them) for
the kill check's child process.

Example
-------
>>> import functools, torch
>>> from tierstore import TieredAdamW
>>> case = AlgorithmCase("adamw", functools.partial(TieredAdamW, lr=1e-2),
...                      functools.partial(torch.optim.AdamW, lr=1e-2, fused=True))
>>> check_torch_equality(case)
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

__all__ = [
    "AlgorithmCase",
    "AlgorithmCheckFailed",
    "CHECKS",
    "check_algorithm",
    "check_moment_formats",
    "check_resume_after_kill",
    "check_sharding",
    "check_state_dict_round_trips",
    "check_torch_equality",
    "differences",
    "gradients",
    "initial_params",
]

#: The state-dict key of tierstore's fp32 master copy (a torch class has none).
MASTER_KEY = "master_param"


class AlgorithmCheckFailed(AssertionError):
    """An algorithm failed a check of the kit; the message lists what differs."""


@dataclass(frozen=True)
class AlgorithmCase:
    """One algorithm to prove.

    Attributes
    ----------
    name
        What messages and test ids call it.
    front
        ``front(params, **tier_kwargs)``: the tiered optimizer, hyperparameters bound.
    reference
        ``reference(params)``: its torch class with the same hyperparameters.
    formats
        The compressed moment formats :func:`check_moment_formats` runs.
    shapes, steps, skip_every, seed
        The run: parameter shapes, steps, parameter ``k`` has no gradient on
        steps where ``(step + k) % skip_every == 0``, the seed of its values.
    """

    name: str
    front: Callable[..., Any]
    reference: Callable[..., torch.optim.Optimizer]
    formats: tuple[str, ...] = ("bfloat16", "int8")
    shapes: tuple[tuple[int, ...], ...] = ((37, 65), (1000,), (17,), (64, 64), (3000,))
    steps: int = 5
    skip_every: int = 3
    seed: int = 0

    def __str__(self) -> str:
        return self.name


# -- the run ---------------------------------------------------------------------------------


def initial_params(case: AlgorithmCase) -> list[torch.nn.Parameter]:
    """The parameters a run starts from (fresh tensors each call)."""
    gen = torch.Generator().manual_seed(case.seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in case.shapes]


def gradients(case: AlgorithmCase, step: int) -> list[torch.Tensor | None]:
    """The gradients of ``step``: a pure function of the case and the step number."""
    gen = torch.Generator().manual_seed(case.seed * 100_003 + step + 1)
    out: list[torch.Tensor | None] = []
    for k, s in enumerate(case.shapes):
        g = torch.randn(s, generator=gen)
        out.append(None if case.skip_every and (step + k) % case.skip_every == 0 else g)
    return out


def _train(case: AlgorithmCase, opt: Any, params: Sequence[torch.Tensor], start: int, stop: int) -> None:
    for step in range(start, stop):
        for p, g in zip(params, gradients(case, step)):
            p.grad = None if g is None else g.clone()
        opt.step()


@dataclass
class _Snapshot:
    params: list[torch.Tensor]
    state_dict: dict


def _snapshot(opt: Any, params: Sequence[torch.Tensor]) -> _Snapshot:
    sd = opt.state_dict()
    state = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in e.items()}
             for k, e in sd["state"].items()}  # fmt: skip
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return _Snapshot([p.detach().clone() for p in params], {"state": state, "param_groups": groups})


def reference_run(case: AlgorithmCase) -> list[_Snapshot]:
    """The torch class's uninterrupted run: a snapshot after 0, 1, ..., ``case.steps`` steps."""
    params = initial_params(case)
    opt = case.reference(params)
    out = [_snapshot(opt, params)]
    for step in range(case.steps):
        _train(case, opt, params, step, step + 1)
        out.append(_snapshot(opt, params))
    return out


def _tiered_run(case: AlgorithmCase, steps: int | None = None, **tier: Any) -> _Snapshot:
    params = initial_params(case)
    with case.front(params, **tier) as opt:
        _train(case, opt, params, 0, case.steps if steps is None else steps)
        return _snapshot(opt, params)


def differences(want: _Snapshot, got: _Snapshot, *, groups: bool = True) -> list[str]:
    """What differs between two runs' parameters and state dicts (empty: bitwise equal).

    ``master_param`` (tierstore's fp32 copy) is not compared; a tensor
    compares by value and dtype, a number by value. ``groups``: compare the
    hyperparameters both param groups hold too.
    """
    problems = []
    for i, (a, b) in enumerate(zip(want.params, got.params)):
        if not torch.equal(a, b):
            problems.append(f"param {i} differs (max abs {float((a.double() - b.double()).abs().max()):.3g})")
    mine, theirs = got.state_dict["state"], want.state_dict["state"]
    for key in sorted(set(mine) | set(theirs), key=str):
        a, b = theirs.get(key), mine.get(key)
        if a is None or b is None:
            problems.append(f"param {key} has state only in the {'tiered run' if a is None else 'reference'}")
            continue
        names = (set(a) | set(b)) - {MASTER_KEY}
        for name in sorted(names):
            if name not in a or name not in b:
                problems.append(f"param {key} {name!r} is only in the {'tiered run' if name not in a else 'reference'}")
            elif not _same(a[name], b[name]):
                problems.append(f"param {key} {name!r} differs: {_short(b[name])} instead of {_short(a[name])}")
    if groups:
        for gi, (ga, gb) in enumerate(zip(want.state_dict["param_groups"], got.state_dict["param_groups"])):
            for name in sorted(set(ga) & set(gb) - {"params"}):
                if not _same(ga[name], gb[name]):
                    problems.append(f"param group {gi} {name!r} is {gb[name]!r} instead of {ga[name]!r}")
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
        return float(a) == float(b)  # a step torch keeps as a tensor and another as a number
    return bool(a == b)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        return f"tensor of shape {tuple(value.shape)} {value.dtype}"
    return repr(value)


def _fail(case: AlgorithmCase, check: str, problems: Sequence[str]) -> None:
    if problems:
        listed = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise AlgorithmCheckFailed(f"{case.name} fails {check}:\n  {listed}")


def streaming_kwargs(
    case: AlgorithmCase, *, shard_numel: int = 1024, moment_dtype: str = "float32", keep_master: bool | None = None
) -> dict[str, Any]:
    """Tier keywords that stream the case's state from disk (RAM for the arena, the decode scratch and half a shard)."""
    return _streaming(case, shard_numel=shard_numel, moment_dtype=moment_dtype, keep_master=keep_master)[0]


def _streaming(case: AlgorithmCase, **tier: Any) -> tuple[dict[str, Any], Any]:
    with case.front(initial_params(case), **tier) as opt:
        layout = opt.layout
    slot = layout.slot_nbytes
    return {**tier, "ram_budget": (2 + 2) * slot + layout.scratch_nbytes(8) + slot // 2}, layout  # 4 arena slots


# -- the checks ------------------------------------------------------------------------------


def check_torch_equality(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """Bitwise equal to the torch class on the case's run (all state in RAM, parameters cut across shards)."""
    want = reference_run(case)[-1]
    problems = differences(want, _tiered_run(case, shard_numel=1024))
    _fail(case, "equality with its torch class", problems)


def check_sharding(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """The same bits for one shard, small shards, state streamed from disk, and one update thread."""
    configs = {
        "one shard": dict(),
        "1024-element shards": dict(shard_numel=1024),
        "streamed from disk": streaming_kwargs(case),
        "streamed, 2048-element shards, one update thread": {**streaming_kwargs(case, shard_numel=2048),
                                                             "update_threads": 1},
    }  # fmt: skip
    runs = {}
    for name, tier in configs.items():
        if "ram_budget" in tier:
            with case.front(initial_params(case), **tier) as opt:
                if not opt.disk_bytes:
                    raise AlgorithmCheckFailed(f"the kit's {name!r} run of {case.name} keeps no state on disk")
        runs[name] = _tiered_run(case, **tier)
    first = next(iter(runs))
    problems = [f"{name} vs {first}: {p}" for name, run in runs.items() for p in differences(runs[first], run)]
    _fail(case, "sharding invariance", problems)


def check_state_dict_round_trips(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """tiered -> torch class and torch class -> tiered mid-run, both continuing to the uninterrupted end."""
    trajectory = reference_run(case)
    half = case.steps // 2 + 1
    problems = []
    # tiered -> torch
    params = initial_params(case)
    with case.front(params, shard_numel=1024) as opt:
        _train(case, opt, params, 0, half)
        saved = opt.state_dict()
        if half_problems := differences(trajectory[half], _snapshot(opt, params)):
            problems += [f"after {half} steps, before any load: {p}" for p in half_problems]
    ref = case.reference(params)
    ref.load_state_dict(saved)
    _train(case, ref, params, half, case.steps)
    problems += [f"tiered -> torch class: {p}" for p in differences(trajectory[-1], _snapshot(ref, params))]
    # torch -> tiered
    params = initial_params(case)
    ref = case.reference(params)
    _train(case, ref, params, 0, half)
    saved = ref.state_dict()
    with case.front(params, shard_numel=1024) as opt:
        opt.load_state_dict(saved)
        _train(case, opt, params, half, case.steps)
        problems += [f"torch class -> tiered: {p}" for p in differences(trajectory[-1], _snapshot(opt, params))]
    _fail(case, "state-dict round trips", problems)


def _kill_child(case: AlgorithmCase, tier: Mapping[str, Any], after: int) -> None:
    """Train in a durable state directory, dying (SIGKILL) at the ``after``-th ``mid-update`` crash point."""
    from .._platform import faults

    faults.arm("mid-update", after=after)
    params = initial_params(case)
    opt = case.front(params, **tier)
    _train(case, opt, params, opt.step_count, case.steps)
    opt.close()


def check_resume_after_kill(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """SIGKILL a training child mid-step; resume its ``state_dir`` and finish bitwise on the uninterrupted run."""
    from .crash import _context

    trajectory = reference_run(case)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        streaming, layout = _streaming(case, shard_numel=1024, moment_dtype="float32", keep_master=True)
        shards = len(layout.shards)
        tier = {**streaming, "state_dir": str(Path(tmp) / "state"), "durable": True, "commit_every": 1,
                "resume": "auto"}  # fmt: skip
        # Die in the middle of the run: past the first step's commit, some shards into a later step.
        after = shards * max(1, case.steps // 3) + max(1, shards // 2)
        child = _context().Process(target=_kill_child, args=(case, tier, after))
        child.start()
        child.join(120)
        if child.is_alive():
            child.kill()
            child.join()
            raise AlgorithmCheckFailed(f"the kill check's child of {case.name} ran past 120 s")
        if child.exitcode != -signal.SIGKILL:
            try:  # a front that refuses a state_dir says why here
                case.front(initial_params(case), **{**tier, "state_dir": str(Path(tmp) / "again")}).close()
            except ConfigError as exc:
                raise AlgorithmCheckFailed(f"{case.name} fails resume after a kill: it refuses a state_dir: {exc}") from None
            raise AlgorithmCheckFailed(
                f"the kill check's child of {case.name} was not killed mid-step (exit code {child.exitcode}); "
                f"its run reaches the mid-update crash point fewer than {after} times"
            )
        params = [torch.nn.Parameter(torch.zeros(s)) for s in case.shapes]
        with case.front(params, **{**tier, "resume": True}) as opt:
            resumed = opt.step_count
            problems = []
            if not 0 <= resumed < case.steps:
                problems.append(f"resumed at step {resumed}, expected one committed before the kill in 0..{case.steps - 1}")
            else:
                problems += [f"resumed at step {resumed}: {p}" for p in differences(trajectory[resumed], _snapshot(opt, params))]
                _train(case, opt, params, resumed, case.steps)
                problems += [f"after resuming at {resumed}, at the end: {p}"
                             for p in differences(trajectory[-1], _snapshot(opt, params))]  # fmt: skip
    _fail(case, "resume after a kill", problems)


def check_moment_formats(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """Each of ``case.formats`` runs: finite values that moved, the same bits in RAM and streamed, the torch keys.

    A format the front refuses with a :class:`~tierstore.errors.ConfigError` that names it
    (``moment_dtype='bfloat16'``) passes: refusing an option with the reason is allowed.
    """
    start = initial_params(case)
    want_keys = {k: set(e) - {"step"} for k, e in reference_run(case)[-1].state_dict["state"].items()}
    problems = []
    for fmt in case.formats:
        try:
            ram = _tiered_run(case, shard_numel=1024, moment_dtype=fmt)
        except ConfigError as exc:
            if f"moment_dtype={fmt!r}" in str(exc):
                continue  # refused with a message that names the format (centered RMSprop in bfloat16): allowed
            raise
        streamed = _tiered_run(case, **streaming_kwargs(case, shard_numel=2048, moment_dtype=fmt))
        problems += [f"{fmt}: streamed vs in RAM: {p}" for p in differences(ram, streamed)]
        for i, (p, p0) in enumerate(zip(ram.params, start)):
            if not bool(torch.isfinite(p).all()):
                problems.append(f"{fmt}: param {i} is not finite")
            elif torch.equal(p, p0):
                problems.append(f"{fmt}: param {i} never moved")
        for key, entry in ram.state_dict["state"].items():
            have = {n for n, v in entry.items() if n not in ("step", MASTER_KEY)}
            if have != want_keys.get(key, set()):
                problems.append(f"{fmt}: param {key} holds {sorted(have)}, the torch class {sorted(want_keys.get(key, ()))}")
            for name in have:
                if isinstance(entry[name], torch.Tensor) and not bool(torch.isfinite(entry[name]).all()):
                    problems.append(f"{fmt}: param {key} {name!r} is not finite")
    _fail(case, "moment formats", problems)


#: Every check by name, in the order :func:`check_algorithm` runs them.
CHECKS: dict[str, Callable[..., None]] = {
    "torch_equality": check_torch_equality,
    "sharding": check_sharding,
    "state_dict_round_trips": check_state_dict_round_trips,
    "resume_after_kill": check_resume_after_kill,
    "moment_formats": check_moment_formats,
}


def check_algorithm(case: AlgorithmCase, directory: str | Path | None = None) -> None:
    """Run every check of the kit on ``case`` (``directory``: where the kill check's state lives)."""
    for check in CHECKS.values():
        check(case, directory)
