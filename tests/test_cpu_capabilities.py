"""The same bits on every CPU capability torch dispatches to (``ATEN_CPU_CAPABILITY``).

torch compiles each CPU kernel once per capability (``DEFAULT``: no FMA;
``AVX2``; ``AVX512``: 16-wide vectors and a vectorised scalar tail), and the
machines that run this suite differ: an AVX2 machine tests its two paths, an
AVX-512 machine its three. Each capability runs in a subprocess with
``ATEN_CPU_CAPABILITY`` set (torch reads it once, at start), and is skipped
where the CPU lacks it (torch then reports a lower one).

In each: the compiled fused update picks that capability's recipe and passes
its self-check for every format; a recipe known to be wrong there fails it
(the check tells the capabilities apart); and ``TieredAdamW`` equals its
oracle bit for bit, with the fused kernel for ``bfloat16`` and ``int8``
moments and against ``torch.optim.AdamW(fused=True)`` for ``float32``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tierstore._compute import native

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from tierstore import TieredAdamW
    from tierstore._compute import formats, fused_update, native
    from tierstore._platform import torch_private
    from tierstore._compute.fused_update import RECIPES, Recipe
    from tierstore.testing.formats import FormatOracle

    out = {"capability": torch_private.cpu_capability()}
    lib = native.library()
    out["library"] = native.status()
    if lib is None:
        print(json.dumps(out)); sys.exit(0)
    out["status"] = {f: fused_update.status(f) for f in fused_update.FORMAT_CODES}
    k = fused_update.kernel("int8")
    out["recipe"] = k.recipe.name if k is not None else None
    wrong = {  # recipes that must fail here, by capability
        "DEFAULT": [RECIPES["AVX2"], RECIPES["AVX512"]],
        "AVX2": [RECIPES["DEFAULT"]],
        # the recipe before the tail's vectorised part was known (the bug CI met on AVX-512)
        "AVX512": [RECIPES["DEFAULT"], Recipe("AVX512 scalar tail", vec=16, fused=True, tail_vec=0)],
    }.get(out["capability"], [])
    out["wrong_recipes_refused"] = {
        r.name: any(fused_update._self_check(lib, r, formats.FORMATS[f]) for f in fused_update.FORMAT_CODES)
        for r in wrong
    }
    # TieredAdamW end to end, odd sizes (every tail length), every hyperparameter rule.
    results = {}
    gen = torch.Generator().manual_seed(5)
    shapes = [(37, 29), (1001,), (5,), (16,), (23,), (64, 31)]
    for fmt in ("float32", "bfloat16", "int8"):
        calls = []
        real = fused_update.update_chunk
        fused_update.update_chunk = lambda *a: (calls.append(1), real(*a))
        mine = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
        groups = lambda ps: [{"params": ps[:3]},
                             {"params": ps[3:], "lr": 0.05, "betas": (0.3, 0.9), "maximize": True}]
        kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
        oracle = (torch.optim.AdamW(groups(ref), fused=True, **kw) if fmt == "float32"
                  else FormatOracle(groups(ref), moment_dtype=fmt, **kw))
        equal = True
        with TieredAdamW(groups(mine), moment_dtype=fmt, state_dir=None, **kw) as opt:
            for step in range(4):
                for a, b in zip(mine, ref):
                    g = torch.randn(a.shape, generator=gen)
                    if step == 3:
                        g.view(-1)[-1] = float("nan")
                    a.grad, b.grad = g.clone(), g.clone()
                opt.step(); oracle.step()
                equal = equal and all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                      for a, b in zip(mine, ref))
        fused_update.update_chunk = real
        results[fmt] = {"equal": equal, "fused_calls": len(calls)}
    out["tiered"] = results
    print(json.dumps(out))
    """
)


#: The CPU flags torch requires before it dispatches to a capability (ATen's ``compute_cpu_capability``).
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"}}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def _run(capability: str, tmp_path) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TIERSTORE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_the_compiled_update_is_bitwise_on_each_capability(capability, tmp_path):
    # torch believes ATEN_CPU_CAPABILITY without asking the CPU: forced past what the CPU has, its
    # own kernels die of SIGILL. So the CPU's flags decide what runs here, not torch's report.
    missing = NEEDS[capability] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {capability} (lacks {', '.join(sorted(missing))})")
    got = _run(capability, tmp_path)
    if got["capability"].lower() != capability:
        pytest.skip(f"this CPU has no {capability} (torch runs {got['capability']})")
    if "status" not in got:
        pytest.skip(f"no compiled kernel here: {got['library']}")
    assert got["status"] == {"bfloat16": "fused kernel", "int8": "fused kernel"}, got
    assert got["recipe"] == got["capability"]
    assert all(got["wrong_recipes_refused"].values()), got["wrong_recipes_refused"]
    for fmt, row in got["tiered"].items():
        assert row["equal"], f"{fmt} on {capability}: TieredAdamW differs from its oracle"
    assert got["tiered"]["float32"]["fused_calls"] == 0
    assert got["tiered"]["int8"]["fused_calls"] > 0 and got["tiered"]["bfloat16"]["fused_calls"] > 0


def test_an_unknown_capability_tries_every_recipe():
    from tierstore._compute import fused_update

    assert [r.name for r in fused_update.candidates("SVE256")] == list(fused_update.RECIPES)
    assert fused_update.candidates("AVX2")[0].name == "AVX2"


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")
def test_a_recipe_other_than_the_capabilitys_is_chosen_when_only_it_matches(fresh, monkeypatch, caplog):
    """A torch build whose kernel is another capability's (here: the capability is misreported)."""
    import logging

    from tierstore._compute import fused_update
    from tierstore._platform import torch_private

    real = torch_private.cpu_capability()
    if real not in fused_update.RECIPES:
        pytest.skip(f"capability {real} has no known recipe")
    liar = "DEFAULT" if real != "DEFAULT" else "AVX2"
    monkeypatch.setattr(torch_private, "cpu_capability", lambda: liar)
    with caplog.at_level(logging.INFO, logger="tierstore._compute.fused_update"):
        k = fused_update.kernel("int8")
    assert k is not None, fused_update.status("int8")
    assert k.recipe.name != liar
    assert any(f"recipe on capability {liar}" in r.getMessage() for r in caplog.records)
