"""PyTorch's own optimizer database drives TieredAdam, TieredSGD and TieredAdagrad.

``torch.testing._internal.common_optimizers.optim_db`` lists, for each torch
optimizer, the constructor inputs its test suite runs (``optim_inputs_func``)
and the inputs each must refuse with a given error (``optim_error_inputs_func``).
Every CPU input of Adam, SGD and Adagrad runs here on the tiered front and on
the torch class with ``fused=True``, bitwise alike; every CPU error input
raises the same error type with a message matching torch's.

The database is read in a child process: importing it imports
``torch._dynamo`` (about 100 MiB of RSS and 6 s), which this process must not
carry into the RAM tests that may run after it on the same worker.

Skipped, with the reason: none of the CPU inputs. The database's other
inputs are for other devices and are not returned for ``device="cpu"``:
Adam's ``capturable`` configurations (CUDA graph capture, refused by
TieredAdam: ``capturable`` has no CPU meaning), its "Tensor lr" on MPS, and
the ``foreach``+``fused`` and ``fused``+``differentiable`` error inputs on
CUDA (their CPU equivalents are in ``tests/test_fronts_fused.py``). Sparse
gradients (``supports_sparse`` for Adagrad) are not inputs of these functions;
torch's fused Adagrad refuses them, and so does TieredAdagrad.
"""

from __future__ import annotations

import builtins
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TieredAdagrad, TieredAdam, TieredSGD

FRONTS = {"Adam": (TieredAdam, torch.optim.Adam), "SGD": (TieredSGD, torch.optim.SGD),
          "Adagrad": (TieredAdagrad, torch.optim.Adagrad)}  # fmt: skip

_EXTRACT = r"""
import sys
import torch
from torch.testing._internal.common_optimizers import optim_db

out = {}
for info in optim_db:
    name = info.optim_cls.__name__
    if name not in sys.argv[2:]:
        continue
    errors = []
    for e in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        i = e.optimizer_error_input
        errors.append((i.desc, i.params, i.kwargs, e.error_type.__name__, e.error_regex, e.error_on.name))
    out[name] = {"inputs": [(i.desc, i.params, i.kwargs) for i in info.optim_inputs_func(device="cpu")],
                 "errors": errors}
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def optim_db(tmp_path_factory) -> dict[str, Any]:
    path = Path(tmp_path_factory.mktemp("optim_db")) / "inputs.pt"
    done = subprocess.run([sys.executable, "-c", _EXTRACT, str(path), *FRONTS], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, f"reading torch's optim_db failed:\n{done.stderr[-3000:]}"
    return torch.load(path, weights_only=False)  # written just now, by the child above


def inputs_of(db: dict[str, Any], name: str) -> list[tuple[str, Any, dict]]:
    inputs = db[name]["inputs"]
    assert len(inputs) >= 5, f"optim_db has only {len(inputs)} CPU inputs for {name}"
    return inputs


@pytest.mark.parametrize("name", sorted(FRONTS))
def test_every_cpu_input_is_bitwise_torchs_fused_step(optim_db, name: str) -> None:
    tiered_cls, torch_cls = FRONTS[name]
    for desc, params, kwargs in inputs_of(optim_db, name):
        assert params is None, f"{name} {desc}: an input with its own params"
        assert not kwargs.get("capturable") and not kwargs.get("differentiable"), f"{name} {desc}: a CPU input with {kwargs}"
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(10, 5, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        # Two groups, the second with its own lr, as torch's tests build them.
        groups = lambda xs: [{"params": [xs[0]]}, {"params": [xs[1]], "lr": 0.02}]  # noqa: E731
        with tiered_cls(groups(ps), shard_numel=1024, **kwargs) as opt:
            ref = torch_cls(groups(qs), fused=True, **kwargs)
            for _ in range(3):
                for p, q in zip(ps, qs, strict=True):
                    p.grad = torch.randn(p.shape, generator=gen)
                    q.grad = p.grad.clone()
                opt.step()
                ref.step()
                for p, q in zip(ps, qs, strict=True):
                    assert torch.equal(p, q), f"{name} {desc} ({kwargs}): parameters differ from torch's"
            sd, rsd = opt.state_dict(), ref.state_dict()
            assert sd["param_groups"] == rsd["param_groups"], f"{name} {desc}"
            for i, theirs in rsd["state"].items():
                assert list(sd["state"][i]) == list(theirs), f"{name} {desc}"
                assert all(torch.equal(sd["state"][i][k], v) for k, v in theirs.items()), f"{name} {desc}"


@pytest.mark.parametrize("name", sorted(FRONTS))
def test_every_cpu_error_input_is_refused_as_torch_refuses_it(optim_db, name: str) -> None:
    tiered_cls, _ = FRONTS[name]
    errors = optim_db[name]["errors"]
    assert errors, f"optim_db has no CPU error inputs for {name}"
    for desc, params, kwargs, error_name, regex, error_on in errors:
        error = getattr(builtins, error_name)
        params = params if params is not None else [torch.nn.Parameter(torch.randn(2, 2))]
        if issubclass(error, Warning):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                tiered_cls(params, **kwargs).close()
            assert any(issubclass(w.category, error) and re.search(regex, str(w.message)) for w in seen), desc
            continue
        assert error_on == "CONSTRUCTION_ERROR", f"{name} {desc}: a step error input"
        with pytest.raises(error, match=regex):
            tiered_cls(params, **kwargs)
