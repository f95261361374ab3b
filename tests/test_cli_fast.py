"""``tierstore --help``, ``--version`` and every subcommand's ``--help`` answer fast: no torch (issue 22, item 4).

The CLI imports only the command it runs, and a command's module imports
torch only inside the functions that need it, so ``tierstore plan --help``
and ``tierstore verify --help`` print their options without it.

The robust check is what a fresh process has imported (torch takes about two
seconds to import, so it must not be imported for ``--help``); the wall-clock
bound is a second, generous check (a median of three runs) so a busy CI
machine does not flake it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

FAST_S = 0.3  # what the issue asks of --help and --version
GENEROUS_S = 1.0  # the bound a loaded 2-core CI machine is held to (torch alone takes ~2 s)

_IMPORTED = textwrap.dedent(
    """
    import json, sys
    import tierstore
    after_import = sorted(m for m in sys.modules if m == "torch" or m.startswith("tierstore"))
    from tierstore.cli import build_parser
    build_parser(sys.argv[1:])
    after_parser = sorted(m for m in sys.modules if m == "torch" or m.startswith("tierstore"))
    print(json.dumps({"import": after_import, "parser": after_parser}))
    """
)


_AFTER_HELP = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from tierstore.cli import main
    code = None
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(sys.argv[1:])
        except SystemExit as exc:
            code = exc.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules, "help": out.getvalue()}))
    """
)


def _imported(*argv: str) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", _IMPORTED, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _median_s(cmd: list[str]) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        times.append(time.perf_counter() - started)
        assert done.returncode == 0, done.stderr
    return statistics.median(times)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_import_and_top_level_parser_do_not_import_torch(argv: list[str]) -> None:
    mods = _imported(*argv)
    assert "torch" not in mods["import"], mods["import"]
    assert "torch" not in mods["parser"], mods["parser"]
    # No command's module: the top-level parser lists the commands without importing them.
    assert not [m for m in mods["parser"] if m.startswith(("tierstore.cli.", "tierstore.planner", "tierstore.diagnose"))]


def test_plan_help_imports_only_what_plan_needs() -> None:
    mods = _imported("plan", "--help")["parser"]
    assert "tierstore.planner" in mods
    others = ("tierstore.cli.bench", "tierstore.cli.demo", "tierstore.cli.inspection", "tierstore.checkpoint",
              "tierstore.diagnose", "tierstore.optimizer")
    assert not [m for m in mods if m.startswith(others)], mods


def test_inspect_help_does_not_import_the_benchmarks() -> None:
    mods = _imported("inspect", "--help")["parser"]
    assert "tierstore.cli.inspection" in mods
    assert not [m for m in mods if m.startswith(("tierstore.cli.bench", "tierstore.cli.demo", "tierstore.planner"))], mods


#: Subcommands whose --help must answer without torch (demo and bench import it at their module's top).
TORCH_FREE_HELP = ["plan", "verify", "inspect", "export", "to-torch", "diagnose"]


@pytest.mark.parametrize("command", TORCH_FREE_HELP)
def test_subcommand_help_imports_no_torch(command: str) -> None:
    """The whole ``tierstore COMMAND --help`` in a fresh process: the help is printed, torch never imported."""
    done = subprocess.run([sys.executable, "-c", _AFTER_HELP, command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["code"] == 0 and f"usage: tierstore {command}" in result["help"], result
    assert result["torch"] is False, f"tierstore {command} --help imported torch: import it inside the function that needs it"


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_subcommand_help_answers_fast(command: str) -> None:
    median = _median_s([sys.executable, "-m", "tierstore.cli", command, "--help"])
    print(f"tierstore {command} --help: median {median:.3f} s over 3 runs (target {FAST_S} s)")
    assert median < GENEROUS_S, f"tierstore {command} --help took {median:.2f} s (median of 3); something imports torch again"


def _entry_points() -> list[list[str]]:
    commands = [[sys.executable, "-m", "tierstore.cli"]]
    script = Path(sys.executable).with_name("tierstore")
    if script.is_file() and os.access(script, os.X_OK):
        commands.append([str(script)])
    return commands


@pytest.mark.parametrize("flag", ["--version", "--help"])
@pytest.mark.parametrize("cmd", _entry_points(), ids=lambda c: "script" if len(c) == 1 else "python-m")
def test_help_and_version_answer_fast_in_a_fresh_process(cmd: list[str], flag: str) -> None:
    median = _median_s([*cmd, flag])
    # Two bounds: the 0.3 s is printed for the record; the assertion allows CI noise.
    print(f"{' '.join(cmd[-1:])} {flag}: median {median:.3f} s over 3 runs (target {FAST_S} s)")
    assert median < GENEROUS_S, f"{cmd} {flag} took {median:.2f} s (median of 3); something imports torch again"
