"""Every private API tierstore calls goes through ``tierstore._platform.torch_private``, which checks it exists (issue 21).

Each wrapper is tested twice: it does what the private API does, and with the
API taken away (monkeypatched) it falls back to a public equivalent with the
same result, or raises a ``ConfigError`` that names the API, the installed
torch and the fix. A scan of the package's code (strings and comments
stripped) checks that nothing else calls a private name.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
import types
from pathlib import Path

import pytest
import torch

from tierstore import ConfigError, TieredAdamW
from tierstore._platform import dynamo, torch_private

PACKAGE = Path(__file__).resolve().parent.parent / "tierstore"

#: Private names the code may not use outside torch_private.py (a module name such as
#: "torch._dynamo" in sys.modules is a string, which the scan strips).
PRIVATE = re.compile(
    r"\btorch(\.\w+)*\._[a-zA-Z]\w*"  # torch._fused_adamw_, torch._C._..., torch.distributed.tensor._utils
    r"|\bthreading\._\w+|\bsys\._\w+"  # threading._register_atexit, sys._getframe
    r"|\._optimizer_\w+_hooks\b|\._per_optimizer_states\b|\bscaler\._scale\b"  # Optimizer, GradScaler internals
    r"|\._step_supports_amp_scaling\b|\._parameters\b|\._make_wrapper_subclass\b"
    r"|\btorch\.backends\.cpu\.get_cpu_capability\b"  # public-looking, but undocumented: torch_private.cpu_capability
)
#: Files owned elsewhere that still call a private API directly, each with the wrapper to use.
PENDING: dict[str, str] = {}  # module -> the wrapper it is waiting for (none now)


def _code_only(path: Path) -> str:
    """The file's code with strings and comments blanked (docstrings and messages may name private APIs)."""
    lines = path.read_text().splitlines(keepends=True)
    spans = [(tok.start, tok.end) for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
             if tok.type in (tokenize.STRING, tokenize.COMMENT)]  # fmt: skip
    for (r0, c0), (r1, c1) in reversed(spans):
        if r0 == r1:
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + " " * (c1 - c0) + line[c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
            lines[r1 - 1] = " " * c1 + lines[r1 - 1][c1:]
    return "".join(lines)


def test_no_private_api_is_called_outside_torch_private() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_platform/torch_private.py" or rel in PENDING:
            continue
        found = sorted({m.group(0) for m in PRIVATE.finditer(_code_only(path))})
        if found:
            offenders[rel] = found
    assert offenders == {}, f"private APIs called directly (add a wrapper to torch_private.py): {offenders}"


def test_the_scan_sees_a_private_call_and_ignores_strings(tmp_path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text('"""torch._fused_adamw_ in a docstring\n\nis fine"""\nx = torch._foreach_add_(s)  # torch._x\n'
                      'y = f"{threading._shutdown} no"\nz = opt._optimizer_state_dict_pre_hooks\n')  # fmt: skip
    assert sorted(m.group(0) for m in PRIVATE.finditer(_code_only(sample))) == [
        "._optimizer_state_dict_pre_hooks", "torch._foreach_add_"]  # fmt: skip


# -- the AdamW kernel ---------------------------------------------------------------


def test_fused_adamw_is_torchs_and_its_absence_fails_at_construction(monkeypatch) -> None:
    assert torch_private.fused_adamw_kernel() is torch._fused_adamw_
    monkeypatch.delattr(torch, "_fused_adamw_")
    with pytest.raises(ConfigError, match=r"torch \S+ has no torch\._fused_adamw_.*install torch 2\.13.*2\.13"):
        torch_private.fused_adamw_kernel()
    with pytest.raises(ConfigError, match="_fused_adamw_"):
        TieredAdamW([torch.nn.Parameter(torch.ones(4))])


def test_foreach_add_falls_back_to_a_loop(monkeypatch) -> None:
    steps = [torch.tensor(1.0), torch.tensor(5.0)]
    torch_private.foreach_add_(steps, 1)
    monkeypatch.delattr(torch, "_foreach_add_")
    torch_private.foreach_add_(steps, 1)
    assert [float(s) for s in steps] == [3.0, 7.0]


# -- dynamo -------------------------------------------------------------------------


def test_disable_dynamo_wraps_and_falls_back_to_the_function(monkeypatch) -> None:
    def f(x):
        return x + 1

    wrapped = torch_private.disable_dynamo(f)
    assert wrapped is not f and wrapped(1) == 2
    assert wrapped.__code__ is torch_private.disable_dynamo_wrapper_code()
    monkeypatch.delattr(torch, "_disable_dynamo")
    assert torch_private.disable_dynamo(f) is f
    assert torch_private.disable_dynamo_wrapper_code() is None
    # tierstore._platform.dynamo still works: a function calls through, torch's wrapper is not recognised.
    monkeypatch.setattr(dynamo, "_TORCH_WRAPPER_CODE", None)
    assert dynamo.disable_dynamo(f)(2) == 3


# -- the standard library -------------------------------------------------------------


def test_register_atexit_falls_back_to_atexit(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(torch_private, "threading", types.SimpleNamespace(_register_atexit=seen.append))
    assert torch_private.register_atexit(print) == "threading" and seen == [print]

    def shutting_down(fn):
        raise RuntimeError("can't register atexit after shutdown")

    registered = []
    monkeypatch.setattr(torch_private.atexit, "register", registered.append)
    monkeypatch.setattr(torch_private, "threading", types.SimpleNamespace(_register_atexit=shutting_down))
    assert torch_private.register_atexit(print) == "atexit"
    monkeypatch.setattr(torch_private, "threading", types.SimpleNamespace())  # another Python
    assert torch_private.register_atexit(len) == "atexit" and registered == [print, len]


def test_caller_frame_falls_back_to_inspect(monkeypatch) -> None:
    def inner():
        return torch_private.caller_frame(1)

    def outer():
        return inner()

    assert outer().f_code is outer.__code__
    monkeypatch.setattr(torch_private, "sys", types.SimpleNamespace())  # no _getframe
    assert outer().f_code is outer.__code__
    assert torch_private.caller_frame(10_000) is None


# -- torch.optim.Optimizer and GradScaler internals ----------------------------------------


def test_optimizer_hooks_in_torch_order_or_none() -> None:
    opt = TieredAdamW([torch.nn.Parameter(torch.ones(4))])
    first, second = (lambda o: None), (lambda o: None)
    opt.register_state_dict_pre_hook(first)
    opt.register_state_dict_pre_hook(second, prepend=True)
    assert torch_private.optimizer_hooks(opt, "state_dict_pre") == [second, first]
    assert torch_private.optimizer_hooks(types.SimpleNamespace(), "load_state_dict_post") == []
    with pytest.raises(ValueError, match="unknown optimizer hook kind"):
        torch_private.optimizer_hooks(opt, "step_pre")
    torch_private.set_amp_scaling_step(opt, True)
    assert opt._step_supports_amp_scaling is True
    opt.close()


def test_grad_scaler_internals_or_a_clear_error() -> None:
    scaler = torch.amp.GradScaler("cpu")
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w])
    scaler.scale(w.sum())
    assert torch_private.grad_scaler_state(scaler, opt)["stage"] is torch_private.amp_opt_state().READY
    assert torch.equal(torch_private.grad_scaler_scale(scaler), scaler._scale)
    bare = types.SimpleNamespace()
    with pytest.raises(ConfigError, match=r"has no GradScaler\._per_optimizer_states.*offload_grads=False"):
        torch_private.grad_scaler_state(bare, opt)
    with pytest.raises(ConfigError, match=r"has no GradScaler\._scale"):
        torch_private.grad_scaler_scale(bare)


def test_opt_state_missing_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.amp.grad_scaler", types.ModuleType("torch.amp.grad_scaler"))
    with pytest.raises(ConfigError, match=r"has no torch\.amp\.grad_scaler\.OptState"):
        torch_private.amp_opt_state()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amp_unscale_fallback_gives_torchs_values(monkeypatch, dtype) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(37).to(dtype) * 1000, torch.randn(5).to(dtype)]
    grads[1][2] = float("inf")
    inv_scale = torch.tensor(1 / 1024.0)
    theirs, found_theirs = [g.clone() for g in grads], torch.zeros(())
    torch_private.amp_unscale_(theirs, found_theirs, inv_scale)
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    ours, found_ours = [g.clone() for g in grads], torch.zeros(())
    torch_private.amp_unscale_(ours, found_ours, inv_scale)
    assert float(found_ours) == float(found_theirs) == 1.0
    for a, b in zip(ours, theirs):
        assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    clean, found = [torch.ones(3)], torch.zeros(())
    torch_private.amp_unscale_(clean, found, inv_scale)
    assert float(found) == 0.0


# -- devices and DTensors --------------------------------------------------------------


def test_privateuse1_backend_name_falls_back(monkeypatch) -> None:
    assert torch_private.privateuse1_backend_name() == torch._C._get_privateuse1_backend_name()
    monkeypatch.delattr(torch._C, "_get_privateuse1_backend_name")
    assert torch_private.privateuse1_backend_name() == "privateuseone"


def test_local_shape_and_offset_missing_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor._utils", None)  # import fails
    with pytest.raises(ConfigError, match=r"compute_local_shape_and_global_offset.*non-DTensor"):
        torch_private.local_shape_and_offset((4,), None, ())


def test_make_wrapper_subclass_or_a_clear_error(monkeypatch) -> None:
    class Lazy(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    t = torch_private.make_wrapper_subclass(Lazy, (2, 3), dtype=torch.float32, device="cpu")
    assert type(t) is Lazy and t.shape == (2, 3)
    monkeypatch.setattr(torch_private, "Tensor", types.SimpleNamespace())  # a torch without it
    with pytest.raises(ConfigError, match=r"_make_wrapper_subclass.*save_checkpoint"):
        torch_private.make_wrapper_subclass(Lazy, (2,), dtype=torch.float32, device="cpu")


def test_cpu_capability_unknown_without_torchs_query(monkeypatch) -> None:
    known = torch_private.cpu_capability()
    assert known == torch.backends.cpu.get_cpu_capability()
    torch_private.cpu_capability.cache_clear()
    monkeypatch.delattr(torch.backends.cpu, "get_cpu_capability")
    try:
        assert torch_private.cpu_capability() == "unknown"
    finally:
        torch_private.cpu_capability.cache_clear()
