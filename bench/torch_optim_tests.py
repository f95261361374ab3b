"""PyTorch's own optimizer tests (``test/test_optim.py``) run against ``TieredAdamW``.

torch's ``test_optim.py`` is parametrized over the ``OptimizerInfo`` database
of ``torch.testing._internal.common_optimizers`` (which ships in the wheel).
This script adds one entry for ``TieredAdamW``, modelled on ``AdamW``'s, runs
pytest on the file with a filter for that entry, and reports every test:
passed, failed (with the error) or skipped (with the reason).

The file itself is torch's, from the torch source at the installed version;
it is not part of this repository (the suite cannot download it). Fetch it
once, for example ``git show v2.13.0:test/test_optim.py`` in a torch
checkout, and pass its path. It imports three sibling test modules
(``optim/test_lrscheduler.py`` and others) that test torch itself, not an
optimizer: they are replaced by empty stand-ins.

What ``TieredAdamW``'s entry declares, and why (docs/compatibility.md lists
every test that does not apply):

- ``supported_impls=()``: TieredAdamW has one implementation (torch's fused
  CPU kernel over shards), so it has no ``foreach``/``fused``/
  ``differentiable`` switches; the tests that compare those variants with
  each other do not apply to it.
- ``supports_complex=False``: torch's fused AdamW has no complex kernel.
- the error inputs are AdamW's, minus those that pass ``foreach=True``.
- two design limits are skips with their reason (:data:`REFUSED`): TieredAdamW
  refuses non-contiguous parameters and ``copy.deepcopy`` with an error that
  names the fix.

Tests of the file that are not instantiated for this entry at all are listed
in the report with the reason (:data:`NOT_INSTANTIATED`), so the report
accounts for every test of the file.

Usage::

    python bench/torch_optim_tests.py /path/to/test_optim.py --json bench/results/torch-optim-tests.json
    python bench/torch_optim_tests.py /path/to/test_optim.py -k state_dict   # a subset
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The sibling modules ``test_optim.py`` imports from torch's ``test/optim/``, with the class
#: each provides: torch's own scheduler, differentiable-optimizer and SWA tests, not ours.
SIBLINGS = {
    "optim.test_lrscheduler": "TestLRScheduler",
    "optim.test_optim": "TestDifferentiableOptimizer",
    "optim.test_swa_utils": "TestSWAUtils",
}


#: Tests TieredAdamW refuses on purpose: (test, when, the error it must raise, a pattern of its
#: message naming the fix, why). Each still runs: it is reported skipped only when it raises exactly
#: that error, and fails if it passes or raises anything else.
REFUSED = (
    ("test_forloop_goes_right_direction", lambda kwargs: not kwargs["contiguous"], "ConfigError",
     r"is not contiguous; make it contiguous \(param.data = param.data.contiguous\(\)\)",
     "TieredAdamW refuses non-contiguous parameters; torch 2.13's own fused CPU AdamW updates them wrongly, "
     "and every kernel here reads dense runs"),
    ("test_deepcopy_copies_all_public_attrs", None, "TypeError",
     r"cannot be deep-copied.*Use state_dict\(\).*load it into a new TieredAdamW",
     "TieredAdamW refuses copy.deepcopy: its state lives in files and buffers it owns, and a state directory "
     "has one owner"),
)  # fmt: skip


def _refused(error: str, pattern: str, why: str) -> Any:
    """A test decorator: the test must raise ``error`` matching ``pattern``; it is then a skip saying why."""
    import builtins
    import functools
    import re
    import unittest

    import tierstore.errors

    kind = getattr(tierstore.errors, error, None) or getattr(builtins, error)

    def decorate(test: Any) -> Any:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                test(*args, **kwargs)
            except kind as exc:
                if not re.search(pattern, str(exc)):
                    raise AssertionError(f"refused, but the message does not name the fix: {exc}") from exc
                raise unittest.SkipTest(f"does not apply (refused as documented: {error}): {why}") from None
            raise AssertionError(f"expected TieredAdamW to refuse this with {error} ({why}), but it passed")

        return run

    return decorate

#: Tests of test_optim.py that torch's parametrization does not instantiate for TieredAdamW, and why.
NOT_INSTANTIATED = {
    "test_rosenbrock_sparse": "sparse gradients: AdamW does not take them (supports_sparse=False, as AdamW's entry)",
    "test_complex": "complex parameters: torch's fused AdamW kernel has none (supports_complex=False)",
    "test_complex_2d": "complex parameters: torch's fused AdamW kernel has none (supports_complex=False)",
    "test_foreach_matches_forloop": "compares foreach=True with False; TieredAdamW has one implementation",
    "test_mixed_device_dtype": "foreach/fused variants on two GPUs; TieredAdamW has one implementation",
    "test_set_default_dtype_works_with_foreach": "CUDA foreach variant; TieredAdamW has one implementation",
    "test_foreach_large_tensor": "CUDA foreach variant; TieredAdamW has one implementation",
    "test_peak_memory_foreach": "CUDA foreach variant's peak memory; TieredAdamW has one implementation",
    "test_fused_matches_forloop": "compares fused=True with False; TieredAdamW has one implementation (always torch's "
                                  "fused CPU kernel, bitwise: tests/test_optimizer_equivalence.py)",
    "test_fused_error_on_params_on_meta": "the fused=True switch on meta tensors; TieredAdamW has no switch",
    "test_fused_large_tensor": "the fused=True switch with 2**32 elements on a device; TieredAdamW has no switch",
    "test_fused_does_not_step_if_foundinf": "CUDA fused grad_scale/found_inf attributes; TieredAdamW takes the "
                                            "GradScaler in step(grad_scaler=...)",
    "test_cpu_load_state_dict": "loads CPU state into fused/capturable optimizers on another device",
    "test_second_order_optims_return_consistent_types": "second-order optimizers (LBFGS) only",
    "test_fused_cpu_matches_cuda": "compares fused CPU and CUDA kernels of one class; TieredAdamW updates on the CPU",
    "test_defaults_changed_to_foreach": "CUDA default-implementation switch; TieredAdamW has one implementation",
}


def _stand_in_siblings() -> None:
    """Empty stand-ins for the sibling test modules (plain classes: pytest collects nothing)."""
    package = types.ModuleType("optim")
    package.__path__ = []  # a package, so "optim.x" imports resolve from sys.modules
    sys.modules.setdefault("optim", package)
    for name, cls in SIBLINGS.items():
        module = types.ModuleType(name)
        setattr(module, cls, type(cls.replace("Test", "Skipped"), (), {}))
        sys.modules[name] = module


def tiered_optim_info() -> Any:
    """An ``OptimizerInfo`` for ``TieredAdamW``, modelled on torch's for ``AdamW``."""
    from torch.testing._internal import common_optimizers as co

    from tierstore import TieredAdamW

    def error_inputs(device: Any, dtype: Any) -> list:
        # AdamW's error inputs; those passing foreach=True test a switch TieredAdamW does not have.
        return [e for e in co.optim_error_inputs_func_adamw(device, dtype)
                if "foreach" not in e.optimizer_error_input.kwargs]  # fmt: skip

    # torch's tests key a few AdamW-specific branches on the class name (test_step_is_noop_for_zero_grads
    # lowers AdamW's lr because its weight decay moves parameters without a gradient): TieredAdamW
    # runs under AdamW's name, its test ids keep "TieredAdamW".
    as_adamw = type("AdamW", (TieredAdamW,), {"__module__": __name__, "__qualname__": "AdamW"})

    class TieredInfo(co.OptimizerInfo):
        @property
        def name(self) -> str:
            return "TieredAdamW"

    from torch.testing._internal.common_methods_invocations import DecorateInfo

    adamw = next(info for info in co.optim_db if info.optim_cls.__name__ == "AdamW")
    skips = tuple(DecorateInfo(_refused(error, pattern, why), "TestOptimRenewed", test, active_if=when or True)
                  for test, when, error, pattern, why in REFUSED)  # fmt: skip
    return TieredInfo(
        as_adamw,
        optim_inputs_func=co.optim_inputs_func_adamw,
        optim_error_inputs_func=error_inputs,
        scheduler_inputs=adamw.scheduler_inputs,
        supported_impls=(),
        not_og_supported_flags=adamw.not_og_supported_flags,
        supports_fused_on=(),
        has_capturable_arg=False,
        supports_complex=False,
        skips=skips,
    )


class _Collector:
    """A pytest plugin that records each test's outcome and reason."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.split("::")[-1]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            entry = {"outcome": report.outcome, "seconds": round(report.duration, 3)}
            if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                entry["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
            elif report.outcome == "failed":
                entry["reason"] = _last_error(report)
            self.results[name] = entry
        elif report.when == "teardown" and report.outcome == "failed":
            self.results.setdefault(name, {})["outcome"] = "failed"
            self.results[name]["reason"] = "teardown: " + _last_error(report)


def _last_error(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip()[-600:]


def run(test_file: Path, *, select: str | None = None, verbose: bool = False) -> dict[str, Any]:
    """Run ``test_file``'s tests of TieredAdamW; returns the report (per test: outcome, reason)."""
    import pytest

    sys.argv = sys.argv[:1]  # torch's common_utils parses sys.argv when it is imported
    _stand_in_siblings()
    import torch
    from torch.testing._internal import common_optimizers

    info = tiered_optim_info()
    common_optimizers.optim_db.append(info)  # the test module reads this list when it is imported
    collector = _Collector()
    expression = "TieredAdamW" if not select else f"TieredAdamW and ({select})"
    args = [str(test_file), "-k", expression, "-p", "no:cacheprovider", "-q" if not verbose else "-v",
            "--rootdir", str(test_file.parent), "-W", "ignore::DeprecationWarning"]  # fmt: skip
    started = time.monotonic()
    code = pytest.main(args, plugins=[collector])
    counts: dict[str, int] = {}
    for entry in collector.results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    methods = test_methods(test_file)
    ran = {_method_of(name, methods) for name in collector.results}
    not_instantiated = {m: NOT_INSTANTIATED.get(m, "not instantiated for TieredAdamW by torch's parametrization")
                        for m in methods if m not in ran and (not select or m in NOT_INSTANTIATED)}  # fmt: skip
    counts["not instantiated"] = len(not_instantiated)
    return {
        "test_file": str(test_file),
        "test_file_sha256": hashlib.sha256(test_file.read_bytes()).hexdigest(),  # which copy of torch's file ran
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "select": select,
        "pytest_exit_code": int(code),
        "seconds": round(time.monotonic() - started, 1),
        "counts": counts,
        "tests": dict(sorted(collector.results.items())),
        "not_instantiated": not_instantiated,
    }


def test_methods(test_file: Path) -> list[str]:
    """The test methods of ``TestOptimRenewed`` in ``test_file`` (read, not imported)."""
    import ast

    tree = ast.parse(test_file.read_text())
    return [f.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "TestOptimRenewed"
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]  # fmt: skip


def _method_of(test_id: str, methods: list[str]) -> str | None:
    """The method a parametrized test id belongs to (the longest method name it starts with)."""
    owners = [m for m in methods if test_id.startswith(m + "_")]
    return max(owners, key=len) if owners else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="torch's test/test_optim.py at the installed version")
    parser.add_argument("-k", dest="select", default=None, help="a pytest -k expression within TieredAdamW's tests")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"{args.test_file} is not a file; pass the path of torch's test/test_optim.py")
    report = run(args.test_file.resolve(), select=args.select, verbose=args.verbose)
    for name, entry in report["tests"].items():
        if entry["outcome"] != "passed":
            print(f"{entry['outcome']:8} {name}: {entry.get('reason', '')[:200]}")
    counts = report["counts"]
    print(f"TieredAdamW under torch {report['torch']}'s test_optim.py: "
          + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped", "not instantiated"))
          + f" ({report['seconds']} s)")  # fmt: skip
    if args.json is not None:
        from tierstore.cli.bench.report import write_json

        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0 if not counts.get("failed") else 1


if __name__ == "__main__":
    sys.exit(main())
