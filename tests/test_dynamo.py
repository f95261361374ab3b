"""``tierstore._platform.dynamo.disable_dynamo``: no ``torch._dynamo`` import while nothing compiles, torch's behaviour once something does."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tierstore._platform.dynamo import disable_dynamo

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_optimizer_routed_through_it_never_imports_dynamo():
    """Building, stepping, zeroing and saving an optimizer: torch alone imports dynamo on the first of them."""
    out = run_fresh(
        """
        import sys, torch
        from tierstore._platform.dynamo import disable_dynamo

        class Lazy(torch.optim.Optimizer):  # as TieredAdamW: its own no_grad step
            add_param_group = disable_dynamo(torch.optim.Optimizer.add_param_group)
            zero_grad = disable_dynamo(torch.optim.Optimizer.zero_grad)
            state_dict = disable_dynamo(torch.optim.Optimizer.state_dict)

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.add_(p.grad, alpha=-group["lr"])

        w = torch.nn.Parameter(torch.ones(4))
        opt = Lazy([w], dict(lr=0.1))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        w.grad = torch.ones(4); opt.step(); sched.step(); opt.zero_grad(); opt.state_dict()
        lazy = "torch._dynamo" in sys.modules
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        print(lazy, "torch._dynamo" in sys.modules, w.tolist())
        """
    )
    assert out == "False True [0.8999999761581421, 0.8999999761581421, 0.8999999761581421, 0.8999999761581421]"


def test_once_dynamo_is_imported_calls_go_through_torch_disable_dynamo(monkeypatch):
    import torch._dynamo  # noqa: F401  (what torch.compile does)

    made = []

    def recording(fn):
        made.append(fn)
        return fn

    monkeypatch.setattr(torch, "_disable_dynamo", recording)

    @disable_dynamo
    def add(x, y):
        return x + y

    assert add(1, 2) == 3 and add(3, 4) == 7
    assert len(made) == 1  # torch's wrapper is made once, on the first call


def test_compiled_code_does_not_trace_it():
    seen = []

    @disable_dynamo
    def probe(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    def traced(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    torch.compile(lambda x: probe(x) * 2, backend="eager")(torch.ones(2))
    torch.compile(lambda x: traced(x) * 2, backend="eager")(torch.ones(2))
    assert seen == [False, True]  # the disabled one ran eagerly; the control was traced


def test_only_torch_disable_dynamo_is_unwrapped():
    calls = []

    def logged(fn):
        @functools.wraps(fn)
        def inner(*args):
            calls.append(fn.__name__)
            return fn(*args)

        return inner

    @logged
    def double(x):
        return 2 * x

    assert disable_dynamo(double)(3) == 6 and calls == ["double"]  # the other decorator still runs
    plain = disable_dynamo(torch.optim.Optimizer.zero_grad)
    assert plain.__wrapped__ is torch.optim.Optimizer.zero_grad.__wrapped__
