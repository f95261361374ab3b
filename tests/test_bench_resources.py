"""Benchmarks state what they need, refuse clearly smaller machines, and write only where told (issue 12).

Each check runs before anything is allocated, so the refusals here cost
nothing; the scripts in ``bench/`` write no result file unless given a path,
and ``bench/ab_step.py`` removes its state directories even when a
configuration fails.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore._platform.hostmem import HostBuffer
from tierstore.cli import main
from tierstore.cli.bench import resources
from tierstore.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_check_names_what_is_needed_and_what_is_there(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(resources, "available_ram", lambda: 1 << 30)
    needs = resources.Needs("bench step --params 2e8", ram=8 << 30, disk=1)
    with pytest.raises(ConfigError, match=r"needs about 8\.59 GB of RAM.*only 1\.07 GB of RAM is available; lower it"):
        resources.check(needs, tmp_path, fix="lower it")
    resources.check(resources.Needs("small", ram=1 << 20, disk=1), tmp_path, fix="")


def test_check_refuses_too_little_disk(tmp_path) -> None:
    with pytest.raises(ConfigError, match=f"is free under {tmp_path}"):
        resources.check(resources.Needs("huge", ram=0, disk=1 << 62), tmp_path, fix="free space")


def test_step_needs_grow_with_contenders() -> None:
    base = dict(params=10**8, fields=2, ram_budget=10**8, durable_runs=0, floors=0)
    one = resources.step_needs(disk_runs=1, peer=False, **base)
    more = resources.step_needs(disk_runs=2, peer=True, **{**base, "floors": 4})
    assert one.ram == resources.PROCESS_BYTES + 8 * 10**8 + 10**8 and one.disk == 7 * 10**8
    assert more.disk == 7 * 10**8 * (2 + 1 + 4) and more.ram > one.ram


@pytest.fixture
def small_machine(monkeypatch):
    """1 GiB of available RAM; building the workload or the test file means the check came too late."""
    from tierstore.cli.bench import io, workload

    def allocated(*args, **kwargs):
        raise AssertionError("allocated before checking what the machine has")

    monkeypatch.setattr(resources, "available_ram", lambda: 1 << 30)
    monkeypatch.setattr(workload, "build", allocated)
    monkeypatch.setattr(io._Run, "setup", allocated)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "step", "--params", "2e8", "--steps", "1"], "bench step --params 2e8 needs about"),
        (["bench", "io", "--size", "2GiB"], "bench io --size 2GiB needs about"),
    ],
)
def test_bench_commands_refuse_before_allocating(capsys, tmp_path, small_machine, argv, message) -> None:
    rc = main([*argv, "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "but only 1.07 GB of RAM is available" in err, err  # a value the machine cannot serve: usage
    assert list(tmp_path.iterdir()) == []  # nothing was created


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["step", "io"])
def test_bench_scripts_write_no_results_unless_told(monkeypatch, name) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("tierstore.cli.main", lambda argv: seen.append(list(argv)) or 0)
    assert _load_script(name).main(["--dir", "/somewhere"]) == 0
    assert seen == [["bench", name, "--dir", "/somewhere"]]  # no --json, no --plot added


def test_ab_step_removes_its_state_dirs_after_an_error(tmp_path) -> None:
    configs = json.dumps([{}, {"no_such_knob": 1}])
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ab_step.py"), "--params", "1e5", "--dir", str(tmp_path),
         "--rounds", "1", "--configs", configs],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode != 0 and "no_such_knob" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_ab_step_refuses_a_clearly_too_small_machine(monkeypatch, capsys, tmp_path) -> None:
    ab_step = _load_script("ab_step")
    monkeypatch.setattr(resources, "available_ram", lambda: 1 << 30)
    monkeypatch.setattr(ab_step, "build", lambda *a, **k: pytest.fail("allocated before checking"))
    monkeypatch.setattr(sys, "argv", ["ab_step.py", "--params", "2e8", "--dir", str(tmp_path), "--configs", "[{}, {}]"])
    with pytest.raises(SystemExit, match="ab_step.py --params 2e8 with 2 configurations needs about"):
        ab_step.main()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_pinning_without_cuda_warns_once(caplog, monkeypatch) -> None:
    import tierstore._platform.hostmem as hostmem

    monkeypatch.setattr(hostmem, "PROCESS_PINS", hostmem.PinBudget(None))  # a process that has not warned yet
    with caplog.at_level(logging.WARNING, logger="tierstore._platform.hostmem"):
        buffers = [HostBuffer(4096, pin=True) for _ in range(3)]
    for b in buffers:
        assert not b.pinned
        b.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "tierstore._platform.hostmem"]
    assert messages == ["pin_memory=True, but CUDA is not available: host buffers stay pageable"]
