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

from tierstore import StateDirError, StateDirInUseError, TieredAdamW
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


# -- the race between creating a directory and locking it (the review's defect), step by step ----------


class _Paused:
    """Pauses one opener inside ``open()`` at a chosen call, until the test lets it go on.

    ``reached`` is set when the opener gets there; ``go`` lets it continue. Only the first
    call pauses; ``calls`` counts them all.
    """

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self.calls = 0

    def wrap(self, real, *, then=None):
        def paused(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                self.reached.set()
                assert self.go.wait(30), "the test never let the opener go on"
                if then is not None:
                    return then(*args, **kwargs)
            return real(*args, **kwargs)

        return paused


def _in_thread(call) -> tuple[threading.Thread, list]:
    """Run ``call`` in a thread; the list gets its result or the exception it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_an_opener_whose_directory_is_removed_before_it_locks_opens_the_new_one(tmp_path: Path) -> None:
    """A creates the directory, locks it, then fails and removes it; B opened it in between and locks
    the removed directory: B notices (``st_nlink == 0``), opens the path afresh and holds a live directory."""
    target = tmp_path / "new" / "s"
    a, b = StateDir(target), StateDir(target)

    a_locked = _Paused()  # A stops after it created, opened and locked the directory, then fails

    def fail(fd, path):
        raise OSError(5, "Input/output error (injected)")

    a._write_holder_tmp = a_locked.wrap(a._write_holder_tmp, then=fail)
    b_opened = _Paused()  # B stops after it opened the directory A made, before its lock
    b._lock = b_opened.wrap(b._lock)

    thread_a, out_a = _in_thread(a.open)
    assert a_locked.reached.wait(30)
    thread_b, out_b = _in_thread(b.open)
    assert b_opened.reached.wait(30)
    a_locked.go.set()  # A fails: it removes the directory it made (empty) and unlocks
    thread_a.join(30)
    assert out_a and isinstance(out_a[0], StateDirError), out_a
    assert not target.exists(), "A did not remove the directory it made: the race is not set up"
    b_opened.go.set()  # B's lock now succeeds, on a directory that is gone
    thread_b.join(30)
    try:
        assert out_b == [b], out_b
        assert b_opened.calls == 2, "B kept the lock on the removed directory instead of opening the path again"
        assert os.fstat(b.fd).st_nlink > 0 and os.fstat(b.fd).st_ino == os.stat(target).st_ino
        b.write_manifest({"step_count": 0})
        assert (target / "manifest.json").exists() and (target / LOCK).exists()
        assert _refused(target)  # and B's lock is the one on the path
    finally:
        b.close()


def test_an_opener_refused_never_removes_the_directory_it_made(tmp_path: Path) -> None:
    """R creates the directory and opens it; H locks it first (and its holder record is then deleted, so
    the directory is empty); R is refused and must leave the directory H holds where it is."""
    target = tmp_path / "new" / "s"
    r = StateDir(target)
    r_opened = _Paused()
    r._lock = r_opened.wrap(r._lock)
    thread_r, out_r = _in_thread(r.open)
    assert r_opened.reached.wait(30)
    assert r._created_dir, "R did not create the directory: the case is not set up"
    h = StateDir(target).open()
    try:
        (target / LOCK).unlink()  # empty now: a removal by R would succeed
        r_opened.go.set()
        thread_r.join(30)
        assert out_r and isinstance(out_r[0], StateDirInUseError), out_r
        assert target.is_dir() and os.fstat(h.fd).st_nlink > 0, "the refused opener removed the held directory"
        h.write_manifest({"step_count": 0})
        assert (target / "manifest.json").exists()
    finally:
        h.close()
