"""The state directory's lock: one holder, whatever happens to the files inside; the holder named.

The lock is a ``flock`` on the directory itself, so deleting or replacing
``.lock`` (which only records who holds it) lets no second writer in; it is
released when its holder closes or dies (SIGKILL included).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from tierstore import StateDirInUseError, TieredAdamW
from tierstore._state.statedir import LOCK, StateDir

KW = dict(shard_numel=1024, backend="buffered")


def _refused(path: Path) -> str:
    with pytest.raises(StateDirInUseError) as info:
        StateDir(path).open()
    return str(info.value)


def test_the_holder_is_named(tmp_path: Path) -> None:
    before = time.time()
    with_holder = StateDir(tmp_path / "s").open()
    try:
        message = _refused(tmp_path / "s")
        assert f"pid {os.getpid()}" in message
        assert f"on host {socket.gethostname()!r}" in message
        assert " since 20" in message and "UTC" in message
        assert str(tmp_path / "s") in message and "close()" in message
        record = json.loads((tmp_path / "s" / LOCK).read_text())
        assert record["pid"] == os.getpid() and before - 1 <= record["since"] <= time.time() + 1
    finally:
        with_holder.close()
    assert not (tmp_path / "s" / LOCK).exists(), "close() leaves the holder record behind"
    StateDir(tmp_path / "s").open().close()  # free again


def test_the_lock_holds_when_its_file_is_deleted(tmp_path: Path) -> None:
    holder = StateDir(tmp_path / "s").open()
    try:
        (tmp_path / "s" / LOCK).unlink()
        message = _refused(tmp_path / "s")
        assert "unknown" in message  # nothing says who, but nobody gets in
    finally:
        holder.close()


@pytest.mark.parametrize(
    "record",
    [
        b"",
        b"not json",
        b'{"pid": -1, "host": 7, "since": "yesterday"}',
        b'{"pid": true, "host": "\\u0000evil\\nhost", "since": 1e300}',
        json.dumps({"pid": 10**30, "host": "h" * 100_000, "since": float("nan")}).encode(),
        b"[" * 100_000,
        b"\xff\xfe" * 3000,
    ],
    ids=["empty", "garbage", "wrong-types", "control-chars", "huge", "nested", "binary"],
)
def test_a_replaced_or_crafted_holder_record_neither_unlocks_nor_breaks_the_message(tmp_path: Path, record: bytes) -> None:
    holder = StateDir(tmp_path / "s").open()
    try:
        (tmp_path / "s" / LOCK).unlink()
        (tmp_path / "s" / LOCK).write_bytes(record)  # a new inode under the lock file's name
        message = _refused(tmp_path / "s")
        assert "unknown" in message and len(message) < 1000
    finally:
        holder.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_holder_record_that_is_not_a_file_is_never_followed_or_waited_on(tmp_path: Path, kind: str) -> None:
    holder = StateDir(tmp_path / "s").open()
    lock = tmp_path / "s" / LOCK
    try:
        lock.unlink()
        if kind == "symlink":
            (tmp_path / "elsewhere").write_text(json.dumps({"pid": 1, "host": "planted", "since": 0}))
            os.symlink(tmp_path / "elsewhere", lock)
        elif kind == "fifo":
            os.mkfifo(lock)
        else:
            lock.mkdir()
        t0 = time.monotonic()
        message = _refused(tmp_path / "s")
        assert time.monotonic() - t0 < 5 and "planted" not in message and "unknown" in message
    finally:
        holder.close()
    if kind == "directory":
        lock.rmdir()
    StateDir(tmp_path / "s").open().close()  # a link or FIFO there is replaced by the next holder


@pytest.mark.parametrize("round_", range(5))
def test_concurrent_openers_of_a_new_directory_one_wins(tmp_path: Path, round_: int) -> None:
    """Eight openers race to create and lock one new directory: one wins and keeps a live directory
    (a loser never removes what the winner holds), the other seven are refused."""
    target = tmp_path / "new" / "s"
    barrier = threading.Barrier(8)
    won: list[StateDir] = []
    refused: list[str] = []
    other: list[BaseException] = []
    lock = threading.Lock()

    def opener() -> None:
        barrier.wait()
        try:
            d = StateDir(target).open()
        except StateDirInUseError as exc:
            with lock:
                refused.append(str(exc))
        except BaseException as exc:  # reported below
            with lock:
                other.append(exc)
        else:
            with lock:
                won.append(d)

    threads = [threading.Thread(target=opener) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert other == [] and len(won) == 1 and len(refused) == 7, (won, refused, other)
        won[0].write_manifest({"step_count": 0})  # the winner's directory is the one at the path
        assert (target / "manifest.json").exists() and (target / LOCK).exists()
    finally:
        for d in won:
            d.close()


def _hold(path: str, ready) -> None:
    StateDir(path).open()
    ready.set()
    time.sleep(120)  # until killed (no Event to wait on: one a killed process waits on deadlocks set())


def test_another_process_is_refused_until_the_holder_dies_by_sigkill(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_hold, args=(str(tmp_path / "s"), ready))
    child.start()
    try:
        assert ready.wait(60)
        (tmp_path / "s" / LOCK).unlink()  # deleting the record does not free it ...
        message = _refused(tmp_path / "s")
        assert "in use" in message
        os.kill(child.pid, signal.SIGKILL)  # ... its holder's death does
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
    d = StateDir(tmp_path / "s").open()
    d.close()


def _train_then_hang(path: str, ready) -> None:
    w = torch.nn.Parameter(torch.ones(2048))
    opt = TieredAdamW([w], state_dir=path, ram_budget="40KiB", **KW)
    w.grad = torch.ones(2048)
    opt.step()
    opt.commit()
    ready.set()
    time.sleep(120)


def test_an_optimizer_killed_by_sigkill_leaves_its_directory_resumable(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_train_then_hang, args=(str(tmp_path / "s"), ready))
    child.start()
    try:
        assert ready.wait(120)
        with pytest.raises(StateDirInUseError, match=f"pid {child.pid} "):
            TieredAdamW([torch.nn.Parameter(torch.ones(2048))], state_dir=tmp_path / "s", resume=True, **KW)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    with TieredAdamW([torch.nn.Parameter(torch.ones(2048))], state_dir=tmp_path / "s", resume=True,
                     ram_budget="40KiB", **KW) as opt:  # fmt: skip
        assert opt.step_count == 1
