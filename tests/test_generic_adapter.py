"""tierstore.tiered: any elementwise torch optimizer class, its state in tiers; classes that are not are refused.

The bitwise runs, sharding, round trips, kill-and-resume and formats of the
adapter are the conformance kit's (tests/test_algorithm_kit.py); here: what
the probe finds, what it refuses and why, and what a state records.
"""

from __future__ import annotations

import pytest
import torch

from tierstore import LayoutMismatchError, TieredAdamW, tiered
from tierstore._layout.layout import Layout
from tierstore.errors import ConfigError, ConfigTypeError

po = pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer is not installed (the test extra)")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _params(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _train(opt, params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(po.Lion, dict(lr=1e-3, weight_decay=0.1)), (po.AdaBelief, dict(lr=1e-2)), (po.Tiger, {}), (po.Yogi, {})],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_an_elementwise_class_is_bitwise_its_own_run_on_whole_tensors(cls, kwargs, tmp_path) -> None:
    shapes = ((96, 80), (1000,), (3,))
    want = _params(*shapes)
    ref = cls(want, **kwargs)
    _train(ref, want, 4)
    got = _params(*shapes)
    with tiered(cls, got, **kwargs, shard_numel=1024, ram_budget="96KiB", state_dir=str(tmp_path / "s")) as opt:
        assert opt.disk_bytes > 0  # streamed
        _train(opt, got, 4)
        sd = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for key, entry in ref.state_dict()["state"].items():
        assert set(entry) == set(sd["state"][key])
        assert all(torch.equal(v, sd["state"][key][n]) for n, v in entry.items())
    assert sd["param_groups"][0]["step"] == ref.state_dict()["param_groups"][0]["step"] == 4  # the class's group step


@pytest.mark.parametrize(
    ("cls", "kwargs", "why"),
    [
        (po.AdaFactor, {}, r"AdaFactor: it is not elementwise: it keeps state 'exp_avg_sq_col' as a tensor of shape "
                           r"\(100,\) .* a state of another shape than the parameter's \(factored"),
        (torch.optim.Muon, {}, r"torch.optim.Muon: it is not elementwise: it refuses a flat \(1-D\) parameter "
                               r"\(ValueError: Muon only supports 2D parameters"),
        (po.SCION, {}, r"SCION: it is not elementwise: run on flat pieces of its parameters .* parameter 0 "
                       r"\(shape \(6, 100\)\) differs .* after step 1 .*orthogonalisation"),
        (po.Lamb, {}, r"Lamb: it is not elementwise: it keeps state 'weight_norm' as a 0-d tensor .* a per-parameter "
                      r"scalar besides step"),
        (torch.optim.NAdam, {}, r"NAdam: .* 'mu_product' .* a per-parameter scalar besides step"),
        (po.LARS, {}, r"LARS: it is not elementwise: .* differs"),
    ],
    ids=["Adafactor", "Muon", "SCION", "Lamb", "NAdam", "LARS"],
)
def test_a_class_that_is_not_elementwise_is_refused_with_the_reason(cls, kwargs, why) -> None:
    with pytest.raises(ConfigError, match=r"tierstore.tiered cannot run \S*" + why):
        tiered(cls, [torch.nn.Parameter(torch.ones(8, 8))], **kwargs)


def test_arguments_the_class_refuses_come_back_as_its_message() -> None:
    with pytest.raises(ConfigError, match=r"Invalid learning rate: -1"):
        tiered(torch.optim.Adam, [torch.nn.Parameter(torch.ones(3))], lr=-1)
    with pytest.raises(ConfigTypeError, match=r"torch.optim.adam.Adam refuses it"):
        opt = tiered(torch.optim.Adam, [torch.nn.Parameter(torch.ones(3))], lr=0.1)
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "betas": "x"})
        finally:
            opt.close()


def test_what_is_not_an_optimizer_class_or_clashes_with_a_tier_argument_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"takes a torch.optim.Optimizer subclass, not <class 'dict'>"):
        tiered(dict, [torch.nn.Parameter(torch.ones(3))])

    class Odd(torch.optim.SGD):
        def __init__(self, params, lr=0.1, backend="x"):
            super().__init__(params, lr=lr)

    with pytest.raises(ConfigError, match=r"Odd takes backend=, which tierstore.tiered also takes for the store"):
        tiered(Odd, [torch.nn.Parameter(torch.ones(3))], backend="auto")


def test_fields_a_format_may_store_are_those_the_codecs_know_with_the_sign_seen() -> None:
    with tiered(po.Adan, _params((64,)), moment_dtype="int8") as opt:
        algorithm = opt.algorithm
        assert algorithm.field_names == ("exp_avg", "exp_avg_sq", "exp_avg_diff", "previous_grad")
        # exp_avg: signed by name and seen negative; exp_avg_sq: non-negative; the others unknown to the codecs.
        assert opt.layout.encoded_fields == ("exp_avg", "exp_avg_sq")
        assert {f.name for f in algorithm.fields if f.signed} == {"exp_avg", "exp_avg_diff", "previous_grad"}


def test_the_state_records_the_class_and_resumes_only_with_it(tmp_path) -> None:
    state_dir = str(tmp_path / "s")
    params = _params((300,))
    with tiered(po.Lion, params, lr=1e-3, state_dir=state_dir, keep_master=True) as opt:
        _train(opt, params, 2)
        layout = opt.layout.to_dict()
    assert layout["algorithm"] == "generic:pytorch_optimizer.optimizer.lion.Lion"
    # Read without the class, the name imports nothing: the state's fields can be read, and nothing runs.
    read = Layout.from_dict(layout).algorithm
    assert read.name == layout["algorithm"] and read.field_names == ("exp_avg",)
    with pytest.raises(ConfigError, match=r"runs only with its class: tierstore.tiered\(pytorch_optimizer.optimizer"):
        read.snapshot({}, ())
    with pytest.raises(LayoutMismatchError, match=r"generic:pytorch_optimizer.optimizer.lion.Lion"):
        tiered(po.Tiger, _params((300,)), state_dir=state_dir, resume=True).close()
    with pytest.raises(LayoutMismatchError, match=r"generic:pytorch_optimizer.optimizer.lion.Lion"):
        TieredAdamW(_params((300,)), state_dir=state_dir, resume=True).close()
    again = _params((300,))
    with tiered(po.Lion, again, lr=1e-3, state_dir=state_dir, resume=True) as opt:
        assert opt.step_count == 2 and opt.param_groups[0]["step"] == 2
        assert torch.equal(again[0], params[0])


def test_a_parameter_cut_into_pieces_counts_its_step_once() -> None:
    want, got = _params((4096,)), _params((4096,))
    ref = torch.optim.Adam(want, lr=0.1)
    _train(ref, want, 3)
    with tiered(torch.optim.Adam, got, lr=0.1, shard_numel=1024) as opt:
        assert len(opt.layout.shards) == 4
        _train(opt, got, 3)
        assert float(opt.state_dict()["state"][0]["step"]) == 3.0
    assert torch.equal(want[0], got[0])


def test_the_bench_runs_and_finds_the_adapter_bitwise(tmp_path) -> None:
    import json
    import runpy
    import sys
    from pathlib import Path

    out = tmp_path / "out.json"
    argv = ["generic_adapter.py", "--params", "3e5", "--rounds", "1", "--warmup", "0", "--bitwise-steps", "1",
            "--dir", str(tmp_path), "--json", str(out)]  # fmt: skip
    script = Path(__file__).resolve().parent.parent / "bench" / "generic_adapter.py"
    saved, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    assert ended.value.code == 0
    document = json.loads(out.read_text())
    assert document["bitwise"]["bitwise"] and document["bitwise"]["state_disk_bytes"] > 0
    assert len(document["streamed"]["ratios"]) == 1 and {v["key"] for v in document["verdicts"]} >= {"generic_bitwise"}
