"""The algorithm conformance kit (tierstore.testing.algorithm) over every front and the generic adapter,
and proof that it fails algorithms that are wrong in each way it checks."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from tierstore import TieredAdamW
from tierstore._compute.algorithms.adamw import AdamW
from tierstore.fronts.generic import tiered
from tierstore.testing.algorithm import CHECKS, AlgorithmCase, AlgorithmCheckFailed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _front(name: str):
    """A tiered front by name, or None while it has not landed."""
    try:
        return getattr(importlib.import_module("tierstore.fronts"), name)
    except (ImportError, AttributeError):
        return None


def _case(name: str, front, reference, **kwargs) -> AlgorithmCase:
    return AlgorithmCase(name, front, reference, **kwargs)


def _cases() -> list:
    P = functools.partial
    optim = torch.optim
    cases = [
        _case("adamw", P(TieredAdamW, lr=1e-2, weight_decay=0.1), P(optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)),
        _case("adamw-amsgrad", P(TieredAdamW, lr=1e-2, amsgrad=True), P(optim.AdamW, lr=1e-2, amsgrad=True, fused=True)),
        _case("tiered(torch.optim.Adamax)", P(tiered, optim.Adamax, lr=1e-2), P(optim.Adamax, lr=1e-2)),
    ]
    fronts = [
        # (front name, test id, front and torch-class hyperparameters, torch-class-only keywords)
        ("TieredAdam", "adam", dict(lr=1e-2, weight_decay=0.1), dict(fused=True)),
        # torch's fused SGD fails a step where some momentum buffers exist and others not yet (TypeError in
        # _fused_sgd_): every parameter takes every step.
        ("TieredSGD", "sgd-nesterov", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2), dict(fused=True)),
        ("TieredAdagrad", "adagrad", dict(lr=0.1, lr_decay=1e-3, initial_accumulator_value=0.1), dict(fused=True)),
        ("TieredRMSprop", "rmsprop-centered", dict(lr=1e-2, momentum=0.9, centered=True), {}),
        ("TieredAdamax", "adamax", dict(lr=1e-2, weight_decay=0.1), {}),
        ("TieredNAdam", "nadam", dict(lr=1e-2), {}),
        ("TieredRAdam", "radam", dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1), {}),
        ("TieredAdadelta", "adadelta", dict(lr=1.0, weight_decay=1e-2), {}),
    ]
    for name, test_id, hyper, torch_only in fronts:
        front = _front(name)
        torch_cls = getattr(optim, name.removeprefix("Tiered"))
        mark = () if front is not None else (pytest.mark.skip(reason=f"{name} has not landed"),)
        front = front or TieredAdamW
        run = dict(skip_every=0) if name == "TieredSGD" else {}
        cases.append(pytest.param(_case(test_id, P(front, **hyper), P(torch_cls, **hyper, **torch_only), **run), marks=mark))
    try:
        from lion_pytorch import Lion
    except ImportError:
        cases.append(pytest.param(_case("lion", None, None), marks=pytest.mark.skip(reason="lion-pytorch is not installed")))
    else:
        front = _front("TieredLion")
        mark = () if front is not None else (pytest.mark.skip(reason="TieredLion has not landed"),)
        hyper = dict(lr=1e-3, weight_decay=0.1)
        cases.append(pytest.param(_case("lion", P(front or TieredAdamW, **hyper), P(Lion, **hyper)), marks=mark))
    try:
        import pytorch_optimizer as po
    except ImportError:
        skip = pytest.mark.skip(reason="pytorch-optimizer is not installed (the test extra)")
        cases += [pytest.param(_case(n, None, None), marks=skip) for n in ("tiered(Lion)", "tiered(AdaBelief)")]
    else:
        cases += [
            _case("tiered(Lion)", P(tiered, po.Lion, lr=1e-3, weight_decay=0.1), P(po.Lion, lr=1e-3, weight_decay=0.1)),
            _case("tiered(AdaBelief)", P(tiered, po.AdaBelief, lr=1e-2), P(po.AdaBelief, lr=1e-2)),
        ]
    return cases


#: Checks a front knowingly fails, with the reason (strict: the day it passes, the mark must go).
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _params() -> list:
    out = []
    for entry in _cases():
        case, marks = (entry.values[0], entry.marks) if hasattr(entry, "values") else (entry, ())
        for check in CHECKS:
            why = KNOWN_FAILURES.get((case.name, check))
            extra = (pytest.mark.xfail(reason=why, raises=AlgorithmCheckFailed, strict=True),) if why else ()
            out.append(pytest.param(case, check, marks=(*marks, *extra), id=f"{case.name}-{check}"))
    return out


@pytest.mark.parametrize(("case", "check"), _params())
def test_the_algorithm_passes_the_kit(case: AlgorithmCase, check: str, tmp_path) -> None:
    CHECKS[check](case, tmp_path)


# -- algorithms that are wrong, each in one way: the kit must fail them ----------------------------------------


class _NoOp(AdamW):
    """Moves nothing."""

    name = "kit-noop"
    compiled = False  # the compiled update of compressed formats would run AdamW itself

    def update(self, targets, grads, fields, steps, hyper) -> None:
        pass


class _StepPerPiece(AdamW):
    """Counts a parameter's step once per piece it updates (the mistake the sharding check is for)."""

    name = "kit-step-per-piece"
    compiled = False

    def update(self, targets, grads, fields, steps, hyper) -> None:
        super().update(targets, grads, fields, steps, hyper)
        for s in steps:
            s.add_(1)  # a parameter's count is shared by its pieces: one in every shard it spans


class _ForgetsLoadedSteps(AdamW):
    """Loads a state dict's moments but not its step counts."""

    name = "kit-forgets-steps"

    def loaded_step(self, entry):
        return 1.0 if "step" in entry else None


class _NoOpFront(TieredAdamW):
    algorithm = _NoOp()


class _StepPerPieceFront(TieredAdamW):
    algorithm = _StepPerPiece()


class _ForgetsLoadedStepsFront(TieredAdamW):
    algorithm = _ForgetsLoadedSteps()


_REFERENCE = functools.partial(torch.optim.AdamW, lr=1e-2, fused=True)


@pytest.mark.parametrize(
    ("front", "failing"),
    [
        (_NoOpFront, ["torch_equality", "state_dict_round_trips", "resume_after_kill", "moment_formats"]),
        (_StepPerPieceFront, list(CHECKS)),
        (_ForgetsLoadedStepsFront, ["state_dict_round_trips"]),
    ],
    ids=["no-op", "step-per-piece", "forgets-loaded-steps"],
)
def test_the_kit_fails_a_broken_algorithm(front, failing, tmp_path) -> None:
    case = AlgorithmCase(front.algorithm.name, functools.partial(front, lr=1e-2), _REFERENCE)
    for check in failing:
        with pytest.raises(AlgorithmCheckFailed, match=f"{case.name} fails"):
            CHECKS[check](case, tmp_path)


def test_the_kit_fails_a_resume_that_loses_the_moments(tmp_path, monkeypatch) -> None:
    """A state directory whose moments come back zero after a kill: only the resume check can see it."""
    from tierstore._runtime import startup

    real = startup._resume

    def resume_with_zero_moments(runtime, layout, *args, **kwargs):
        real(runtime, layout, *args, **kwargs)

        def zero(shard, flat):
            for name, view in layout.field_views(flat, shard).items():
                if name != "master":
                    view.zero_()

        runtime.pipeline.run(range(len(layout.shards)), zero)

    monkeypatch.setattr(startup, "_resume", resume_with_zero_moments)
    case = AlgorithmCase("adamw-zeroed-on-resume", functools.partial(TieredAdamW, lr=1e-2), _REFERENCE)
    CHECKS["torch_equality"](case, tmp_path)
    with pytest.raises(AlgorithmCheckFailed, match="fails resume after a kill"):
        CHECKS["resume_after_kill"](case, tmp_path)
