"""The command line's exit codes, end to end (issue 21, part 4).

0 ok, 1 a check failed or an input is damaged, 2 a usage error or missing
input; every ``--help`` says so. A damaged or crafted state directory given
to any subcommand ends in one line and an exit code, never a traceback, and
a FIFO in place of a file ends within 10 s (real processes, with timeouts:
a hang fails the test instead of stalling the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TieredAdamW
from tierstore._state.manifest_file import manifest_checksum as _manifest_checksum
from tierstore._state.statedir import MANIFEST
from tierstore.cli import COMMANDS, main

HANG_S = 10  # what "does not hang" means here


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli") / "state"
    w = torch.nn.Parameter(torch.randn(3000))
    frozen = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    with TieredAdamW([w, frozen], state_dir=d, shard_numel=1024) as opt:
        w.grad = torch.ones(3000)
        opt.step()
    return d


def _copy(src: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "state"
    shutil.copytree(src, dst)
    return dst


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        rc = int(exc.code)
    out, err = capsys.readouterr()
    return rc, out, err


def _run_within(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """:func:`_run` in a daemon thread: a command still running after HANG_S fails the test, not the suite."""
    result: list[tuple[int, str, str]] = []
    thread = threading.Thread(target=lambda: result.append(_run(capsys, *argv)), daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert result, f"tierstore {' '.join(argv)} still running after {HANG_S} s"
    return result[0]


def _one_line_error(out: str, err: str) -> str:
    """The error the command printed: exactly one line, and no traceback."""
    text = out + err
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "error" in line]
    assert len(lines) == 1, text
    return lines[0]


# -- help ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["", *sorted(c for c in COMMANDS if " " not in c)])
def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture, command: str) -> None:
    rc, out, _ = _run(capsys, *command.split(), "--help")
    assert rc == 0
    flat = " ".join(out.split())
    assert "exit status" in flat.lower() and "2" in flat and "usage" in flat, flat


# -- usage errors and missing input: 2 ------------------------------------------------------


def test_verify_on_a_missing_directory_exits_2_naming_it(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    rc, out, err = _run(capsys, "verify", str(missing))
    assert rc == 2 and str(missing) in _one_line_error(out, err) and "does not exist" in err


def test_inspect_on_a_file_says_what_to_pass_not_to_restore(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    f = tmp_path / "adamw.pt"
    f.write_bytes(b"not a directory")
    rc, out, err = _run(capsys, "inspect", str(f))
    line = _one_line_error(out, err)
    assert rc == 2 and "is a regular file, not a directory" in line and "torch.load" in line
    assert "restore" not in line


USAGE = [
    pytest.param(lambda s, t: ["export", str(t / "nope"), str(t / "o.zarr")], "does not exist", id="export-missing"),
    pytest.param(lambda s, t: ["to-torch", str(t / "nope"), str(t / "o.pt")], "does not exist", id="to-torch-missing"),
    pytest.param(lambda s, t: ["to-torch", str(s), str(t / "d" / "o.pt")], "does not exist", id="to-torch-no-out-dir"),
    pytest.param(lambda s, t: ["to-torch", "--from-zarr", str(s), str(t / "o.pt")], "drop --from-zarr", id="wrong-kind"),
    pytest.param(lambda s, t: ["to-torch", str(s), str(t / "keep.txt")], "exists; pass --overwrite", id="to-torch-exists"),
    pytest.param(lambda s, t: ["to-torch", str(s), str(t)], "is a directory; to-torch writes one .pt file", id="to-torch-dir"),
    pytest.param(lambda s, t: ["to-torch", "--overwrite", str(s), str(t)], "never replaces a directory", id="to-torch-onto-dir"),
    pytest.param(lambda s, t: ["export", "--overwrite", str(s), str(t)], "a directory that is not a zarr checkpoint", id="export-onto-dir"),
    pytest.param(lambda s, t: ["plan", "--params", "lots", "--host-ram", "1GiB"], "--params", id="bad-value"),
    pytest.param(lambda s, t: ["verify", "--no-such-flag", str(s)], "unrecognized arguments", id="bad-flag"),
]


@pytest.mark.parametrize("argv, message", USAGE)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture, state: Path, tmp_path: Path, argv: Callable[[Path, Path], list[str]], message: str
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    rc, out, err = _run(capsys, *argv(state, tmp_path))
    assert rc == 2 and message in _one_line_error(out, err), out + err
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # nothing written, nothing left


# -- damaged or crafted input: 1, in one line -------------------------------------------------


def _crafted(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Rewrite the manifest as a crafter would: edited, with its checksum made valid again."""

    def damage(d: Path) -> None:
        m = json.loads((d / MANIFEST).read_text())
        edit(m)
        m["manifest_checksum"] = _manifest_checksum(m)
        (d / MANIFEST).write_text(json.dumps(m))

    return damage


CRAFTED = [
    pytest.param(_crafted(lambda m: m["layout"]["params"][1].update(numel=0)), id="numel-not-shape"),
    pytest.param(_crafted(lambda m: m["layout"].update(shard_numel=1 << 62)), id="huge-shard"),
    pytest.param(_crafted(lambda m: m["layout"]["params"][0].update(shape=[1 << 40], numel=1 << 40)), id="huge-param"),
    pytest.param(_crafted(lambda m: m.update(step_count=-1)), id="negative-step"),
    pytest.param(_crafted(lambda m: m["param_groups"][0].update(lr=-0.5)), id="negative-lr"),
    pytest.param(_crafted(lambda m: m["param_groups"][0].update(betas="x")), id="betas-string"),
    pytest.param(_crafted(lambda m: m.update(param_groups=[])), id="no-groups"),
    pytest.param(_crafted(lambda m: m.update(shards=[])), id="no-shard-records"),
    pytest.param(_crafted(lambda m: m["shards"][0].update(copy=7)), id="shard-copy-7"),
    pytest.param(_crafted(lambda m: m.update(committed_at=1e300, ram_budget="lots")), id="odd-summary-values"),
    pytest.param(lambda d: (d / MANIFEST).write_text("[1, 2"), id="manifest-not-json"),
    pytest.param(lambda d: (d / MANIFEST).write_bytes(b"\xff\xfe"), id="manifest-binary"),
    pytest.param(lambda d: (d / MANIFEST).write_text("[" * 100_000), id="manifest-deep"),
    pytest.param(lambda d: os.truncate(d / "shards.0.bin", 10), id="shard-truncated"),
]


@pytest.mark.parametrize("damage", CRAFTED)
def test_crafted_state_dir_ends_in_one_line_and_an_exit_code(
    capsys: pytest.CaptureFixture, state: Path, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    d = _copy(state, tmp_path)
    damage(d)
    for argv in (
        ["inspect", str(d)],
        ["inspect", "--json", str(d)],
        ["verify", "--no-progress", str(d)],
        ["export", "--no-progress", str(d), str(tmp_path / "o.zarr")],
        ["to-torch", str(d), str(tmp_path / "o.pt")],
    ):
        rc, out, err = _run_within(capsys, *argv)
        if rc == 0:  # only a summary value was odd: printed as unknown, never a crash
            assert argv[0] == "inspect" or (argv[0] == "verify" and "ok:" in out), (argv, out, err)
            continue
        assert rc == 1, (argv, rc, out, err)
        if argv[0] == "verify":  # verify lists every damaged shard, one line each
            assert "Traceback" not in out + err and "error: " in out, (out, err)
        else:
            _one_line_error(out, err)
    assert not (tmp_path / "o.zarr").exists() or (tmp_path / "o.zarr" / "zarr.json").exists()


def test_an_unexpected_error_is_one_line_naming_a_bug(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, state: Path) -> None:
    import tierstore.cli.inspection.inspect as inspect_command

    def broken(path: Any) -> dict[str, Any]:
        raise KeyError("fingerprint")

    monkeypatch.setattr(inspect_command, "describe_statedir", broken)
    rc, out, err = _run(capsys, "inspect", str(state))
    assert rc == 1 and "internal error: KeyError: 'fingerprint'; this is a bug" in _one_line_error(out, err)


# -- FIFOs in real processes, with a timeout ------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys, time
    from tierstore.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        started = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        results.append({"argv": argv, "rc": rc, "s": time.monotonic() - started, "out": out.getvalue(), "err": err.getvalue()})
        print(json.dumps(results[-1]), flush=True)
    """
)


def _commands(d: Path, tmp_path: Path) -> list[list[str]]:
    return [
        ["verify", "--no-progress", str(d)],
        ["inspect", str(d)],
        ["export", "--no-progress", str(d), str(tmp_path / "o.zarr")],
        ["to-torch", str(d), str(tmp_path / "o.pt")],
    ]


@pytest.mark.parametrize("fifo", ["shards.0.bin", MANIFEST])
def test_a_fifo_in_a_state_dir_ends_every_command_within_10_s(state: Path, tmp_path: Path, fifo: str) -> None:
    d = _copy(state, tmp_path)
    (d / fifo).unlink()
    os.mkfifo(d / fifo)
    commands = _commands(d, tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(commands)],
            capture_output=True, text=True, timeout=HANG_S * len(commands) + 20,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"a command waited on the FIFO {d / fifo}: {exc.stdout!r}") from None
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(commands), done.stdout + done.stderr
    for r in results:
        assert r["rc"] in (1, 2) and r["s"] < HANG_S, r
        assert "FIFO" in _one_line_error(r["out"], r["err"]), r
    assert not (tmp_path / "o.zarr").exists() and not (tmp_path / "o.pt").exists()


def test_the_installed_command_on_a_fifo_shard(state: Path, tmp_path: Path) -> None:
    """The real entry point, its own process, a 10 s limit: verify ends with 1 and one line."""
    d = _copy(state, tmp_path)
    (d / "shards.0.bin").unlink()
    os.mkfifo(d / "shards.0.bin")
    done = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "verify", "--no-progress", str(d)],
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert done.returncode == 1 and "is a FIFO, not a regular file" in _one_line_error(done.stdout, done.stderr)
