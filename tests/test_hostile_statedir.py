"""Hostile state directories: every planted file, crafted manifest and bad argument ends in a
tierstore error (or a correct result), never a hang, a write outside the directory, or bytes
no checksum vouches for.

One table, :data:`CASES`: what is done to a committed directory, and what each way of using it
must then do (resume it with an optimizer and step; read it offline with ``StateReader``). Every
case runs under a 10 s alarm, with a sentinel file outside the directory that a planted link
points at: it must be unchanged afterwards, and nothing may appear beside it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import (
    CorruptStateError,
    FormatVersionError,
    StateDirError,
    TieredAdamW,
    TierstoreError,
)
from tierstore._state.manifest_file import MAX_MANIFEST_BYTES
from tierstore._state.manifest_file import manifest_checksum as _manifest_checksum
from tierstore._state.reader import StateReader
from tierstore.errors import ConfigError, ConfigTypeError, NoStateError, NotStateDirError

KW = dict(shard_numel=1024, ram_budget="40KiB", backend="buffered", lr=1e-2)
SENTINEL = b"outside the state directory: never written\n"


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(6000, generator=g)), nn.Parameter(torch.randn(7, 3, generator=g))]


def _step(opt: TieredAdamW, params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


@contextlib.contextmanager
def deadline(seconds: int = 10) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds`` (a blocked open or read is interrupted)."""

    def expired(signum, frame):
        raise TimeoutError(f"hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A durable state directory after two steps, with disk shards (copied per test)."""
    d = tmp_path_factory.mktemp("committed") / "state"
    params = _params()
    with TieredAdamW(params, state_dir=d, **KW) as opt:
        assert opt.plan.disk_shards
        _step(opt, params)
        _step(opt, params)
    return d


@dataclass
class Place:
    """A test's copy of the committed directory, and the outside world a link may point at."""

    state: Path
    outside: Path

    @property
    def sentinel(self) -> Path:
        return self.outside / "sentinel.bin"


@pytest.fixture
def place(committed: Path, tmp_path: Path) -> Place:
    state = tmp_path / "state"
    shutil.copytree(committed, state)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel.bin").write_bytes(SENTINEL * 4096)  # as large as a state file may want
    return Place(state, outside)


# -- what is done to the directory ----------------------------------------------------------


def _link(name: str, to: str = "sentinel") -> Callable[[Place], None]:
    def plant(p: Place) -> None:
        target = p.sentinel if to == "sentinel" else Path(to)
        (p.state / name).unlink(missing_ok=True)
        os.symlink(target, p.state / name)

    return plant


def _fifo(name: str) -> Callable[[Place], None]:
    def plant(p: Place) -> None:
        (p.state / name).unlink(missing_ok=True)
        os.mkfifo(p.state / name)

    return plant


def _device(name: str) -> Callable[[Place], None]:
    """A character device node in the file's place: /dev/zero's numbers (1, 5), endless zeros if read."""

    def plant(p: Place) -> None:
        (p.state / name).unlink(missing_ok=True)
        try:
            os.mknod(p.state / name, 0o666 | stat.S_IFCHR, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")

    return plant


def _directory(name: str) -> Callable[[Place], None]:
    def plant(p: Place) -> None:
        (p.state / name).unlink(missing_ok=True)
        (p.state / name).mkdir()
        (p.state / name / "x").write_bytes(b"x")

    return plant


def _manifest(edit: Callable[[dict], object], *, checksum: bool = True) -> Callable[[Place], None]:
    """Rewrite the manifest through ``edit`` (in place), with a matching checksum: a crafted one."""

    def plant(p: Place) -> None:
        path = p.state / "manifest.json"
        data = json.loads(path.read_bytes())
        edit(data)
        if checksum:
            data["manifest_checksum"] = _manifest_checksum(data)
        path.write_text(json.dumps(data))

    return plant


def _raw_manifest(make: Callable[[bytes], bytes]) -> Callable[[Place], None]:
    def plant(p: Place) -> None:
        path = p.state / "manifest.json"
        path.write_bytes(make(path.read_bytes()))

    return plant


def _huge_manifest(p: Place) -> None:
    with open(p.state / "manifest.json", "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + (16 << 20))  # sparse: costs no disk, must cost no RAM


def _set(*keys: object, value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _drop(*keys: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return edit


# -- the table -------------------------------------------------------------------------------

OK = None  # a correct result: resumed at step 2, stepped, closed; nothing outside touched


@dataclass(frozen=True)
class Case:
    plant: Callable[[Place], None]
    resume: type[BaseException] | None  # what resuming (and one step, and close) raises
    read: type[BaseException] | None | str  # StateReader + verify + param_state; "problem": verify reports it
    says: tuple[str, ...] = ()  # in the message (resume's, else read's)


C, V = CorruptStateError, FormatVersionError
CASES: dict[str, Case] = {
    # planted links, for every name tierstore reads or writes
    "link-manifest": Case(_link("manifest.json"), C, C, ("manifest.json", "symbolic link")),
    "link-manifest-to-dev-zero": Case(_link("manifest.json", "/dev/zero"), C, C, ("symbolic link",)),
    "link-shards0": Case(_link("shards.0.bin"), C, "problem", ("shards.0.bin", "symbolic link")),
    "link-shards1": Case(_link("shards.1.bin"), C, "problem", ("shards.1.bin", "symbolic link")),
    "link-shards0-to-dev-zero": Case(_link("shards.0.bin", "/dev/zero"), C, "problem", ("symbolic link",)),
    "link-manifest-tmp": Case(_link(".manifest.json.tmp"), OK, OK),
    "dangling-link-manifest-tmp": Case(_link(".manifest.json.tmp", "/nonexistent/tierstore"), OK, OK),
    "link-lock": Case(_link(".lock"), OK, OK),
    "link-inflight": Case(_link(".inflight"), StateDirError, OK, (".inflight", "symbolic link")),
    # FIFOs and directories in a file's place: refused at once, never waited on
    "fifo-manifest": Case(_fifo("manifest.json"), C, C, ("manifest.json", "FIFO")),
    "fifo-shards0": Case(_fifo("shards.0.bin"), C, "problem", ("shards.0.bin", "FIFO")),
    "fifo-shards1": Case(_fifo("shards.1.bin"), C, "problem", ("shards.1.bin", "FIFO")),
    "fifo-lock": Case(_fifo(".lock"), OK, OK),
    "fifo-inflight": Case(_fifo(".inflight"), StateDirError, OK, (".inflight", "FIFO")),
    "fifo-manifest-tmp": Case(_fifo(".manifest.json.tmp"), OK, OK),
    "dev-manifest": Case(_device("manifest.json"), C, C, ("manifest.json", "character device")),
    "dev-shards0": Case(_device("shards.0.bin"), C, "problem", ("shards.0.bin", "character device")),
    "dev-shards1": Case(_device("shards.1.bin"), C, "problem", ("shards.1.bin", "character device")),
    "dir-manifest": Case(_directory("manifest.json"), C, C, ("manifest.json", "directory")),
    "dir-shards0": Case(_directory("shards.0.bin"), C, "problem", ("shards.0.bin", "directory")),
    # manifests: missing, truncated, huge, not JSON, deeply nested
    "no-manifest": Case(lambda p: (p.state / "manifest.json").unlink(), NoStateError, C, ("no committed state",)),
    "truncated-manifest": Case(_raw_manifest(lambda b: b[: len(b) // 2]), C, C, ("not valid JSON",)),
    "empty-manifest": Case(_raw_manifest(lambda b: b""), C, C, ("not valid JSON",)),
    "huge-manifest": Case(_huge_manifest, C, C, ("256 MiB",)),
    "nested-manifest": Case(_raw_manifest(lambda b: b"[" * 200_000 + b"]" * 200_000), C, C, ("not valid JSON",)),
    "binary-manifest": Case(_raw_manifest(lambda b: bytes(range(256)) * 4), C, C, ("not valid JSON",)),
    "manifest-not-an-object": Case(_raw_manifest(lambda b: b"[1, 2]"), C, C, ("not a tierstore manifest",)),
    "edited-without-checksum": Case(_manifest(_set("step_count", value=3), checksum=False), C, C, ("checksum",)),
    "newer-format": Case(_manifest(_set("format_version", value=2)), V, V, ("format_version 2", "Upgrade")),
    "format-version-true": Case(_manifest(_set("format_version", value=True)), V, V, ("format_version True",)),
    # crafted manifests with a valid checksum: every field checked
    "negative-step": Case(_manifest(_set("step_count", value=-1)), C, C, ("step_count=-1",)),
    "nan-step": Case(_manifest(_set("step_count", value=math.nan)), C, C, ("step_count=nan",)),
    "float-step": Case(_manifest(_set("step_count", value=2.5)), C, C, ("step_count=2.5",)),
    "integral-float-step": Case(_manifest(_set("step_count", value=2.0)), C, C, ("step_count=2.0",)),
    "bool-step": Case(_manifest(_set("step_count", value=True)), C, C, ("step_count=True",)),
    "huge-step": Case(_manifest(_set("step_count", value=10**400)), C, C, ("step_count=1000",)),
    "infinite-step": Case(_manifest(_set("step_count", value=math.inf)), C, C, ("step_count=inf",)),
    "string-step": Case(_manifest(_set("step_count", value="2")), C, C, ("step_count='2'",)),
    "missing-step": Case(_manifest(_drop("step_count")), C, C, ("'step_count'",)),
    "negative-param-step": Case(_manifest(_set("param_steps", 0, value=-3.0)), C, C, ("param_steps[0]=-3.0",)),
    "nan-param-step": Case(_manifest(_set("param_steps", 1, value=math.nan)), C, C, ("param_steps[1]=nan",)),
    "fractional-param-step": Case(_manifest(_set("param_steps", 0, value=1.5)), C, C, ("param_steps[0]=1.5",)),
    "param-steps-too-short": Case(_manifest(_set("param_steps", value=[2.0])), C, C, ("1 entries in param_steps",)),
    "param-steps-not-a-list": Case(_manifest(_set("param_steps", value={"0": 2})), C, C, ("param_steps=",)),
    "negative-lr": Case(_manifest(_set("param_groups", 0, "lr", value=-0.01)), C, C, ("lr", "-0.01")),
    "nan-lr": Case(_manifest(_set("param_groups", 0, "lr", value=math.nan)), C, C, ("lr", "nan")),
    "string-lr": Case(_manifest(_set("param_groups", 0, "lr", value="0.1")), C, C, ("lr='0.1'",)),
    "huge-int-lr": Case(_manifest(_set("param_groups", 0, "lr", value=10**400)), C, C, ("lr=1000",)),
    "beta-one": Case(_manifest(_set("param_groups", 0, "betas", value=[0.9, 1.0])), C, C, ("beta", "1.0")),
    "three-betas": Case(_manifest(_set("param_groups", 0, "betas", value=[0.9, 0.99, 0.5])), C, C, ("betas=",)),
    "negative-eps": Case(_manifest(_set("param_groups", 0, "eps", value=-1e-8)), C, C, ("epsilon", "-1e-08")),
    "negative-weight-decay": Case(_manifest(_set("param_groups", 0, "weight_decay", value=-1)), C, C, ("weight_decay",)),
    "amsgrad-string": Case(_manifest(_set("param_groups", 0, "amsgrad", value="no")), C, C, ("amsgrad='no'",)),
    "missing-lr": Case(_manifest(_drop("param_groups", 0, "lr")), C, C, ("'param_groups[0].lr'",)),
    "no-groups": Case(_manifest(_set("param_groups", value=[])), C, C, ("0 param groups",)),
    "shard-copy-2": Case(_manifest(_set("shards", 0, "copy", value=2)), C, C, ("shards[0].copy=2",)),
    "shard-copy-negative": Case(_manifest(_set("shards", 1, "copy", value=-1)), C, C, ("shards[1].copy=-1",)),
    "shard-copy-bool": Case(_manifest(_set("shards", 0, "copy", value=True)), C, C, ("shards[0].copy=True",)),
    "shard-checksum-not-hex": Case(_manifest(_set("shards", 0, "checksum", value="../../etc")), C, C, ("checksum",)),
    "shard-checksum-int": Case(_manifest(_set("shards", 0, "checksum", value=12)), C, C, ("shards[0].checksum=12",)),
    "shard-without-checksum": Case(_manifest(_set("shards", 2, "checksum", value=None)), C, "problem", ("shards[2].checksum",)),
    "shard-written-later": Case(_manifest(_set("shards", 0, "written_step", value=99)), C, C, ("written_step=99",)),
    "shard-record-missing": Case(_manifest(lambda d: d["shards"].pop()), C, C, ("entries in shards",)),
    "shard-record-not-object": Case(_manifest(_set("shards", 0, value=[0, "x"])), C, C, ("shards[0]=",)),
    "no-shards-key": Case(_manifest(_drop("shards")), C, C, ("'shards'",)),
    "layout-not-object": Case(_manifest(_set("layout", value=[1])), C, C, ("layout=[1]",)),
    "layout-unreadable": Case(_manifest(_set("layout", value={"x": 1})), C, C, ("no readable layout",)),
    "fingerprint-mismatch": Case(_manifest(_set("fingerprint", value="0" * 32)), C, C, ("fingerprint",)),
    "previous-ahead": Case(_manifest(_set("previous", "step_count", value=5)), C, C, ("previous.step_count=5",)),
    "previous-bad-lr": Case(_manifest(_set("previous", "param_groups", 0, "lr", value=-1.0)), C, C, ("lr", "-1.0")),
    "previous-not-object": Case(_manifest(_set("previous", value="x")), C, C, ("previous='x'",)),
    "durable-string": Case(_manifest(_set("durable", value="yes")), C, C, ("durable='yes'",)),
    "ram-budget-negative": Case(_manifest(_set("ram_budget", value=-5)), C, C, ("ram_budget=-5",)),
    "committed-at-nan": Case(_manifest(_set("committed_at", value=math.nan)), C, C, ("committed_at=nan",)),
    "backend-huge": Case(_manifest(_set("backend", value="x" * 100_000)), C, C, ("backend=",)),
    "user-key-kept": Case(_manifest(_set("param_groups", 0, "my_note", value={"any": [1, 2]})), OK, OK),
    # files tierstore did not write
    "foreign-file": Case(lambda p: (p.state / "notes.txt").write_text("mine"), NotStateDirError, OK, ("notes.txt",)),
    "foreign-dir": Case(lambda p: (p.state / "rank0").mkdir(), NotStateDirError, OK, ("rank0",)),
}


def _resume(p: Place) -> None:
    params = _params()
    with TieredAdamW(params, state_dir=p.state, resume=True, **KW) as opt:
        assert opt.step_count == 2
        _step(opt, params)
        opt.commit()


def _read(p: Place) -> list:
    with StateReader(p.state) as reader:
        problems = reader.verify()
        if not problems:
            for i in range(len(reader.layout.params)):
                for t in reader.param_state(i).values():
                    assert bool(torch.isfinite(t).all())
        return problems


def _outside_untouched(p: Place) -> None:
    assert sorted(os.listdir(p.outside)) == ["sentinel.bin"], "something was written outside the state directory"
    assert p.sentinel.read_bytes() == SENTINEL * 4096, "a planted link was written through"


def _message_has(exc: BaseException, says: tuple[str, ...]) -> None:
    message = str(exc)
    for part in says:
        assert part in message, f"{part!r} not in {message!r}"


# What a refusal tells the user to do: every message names one of these fixes.
FIX = re.compile(r"restore|start over|\bpass\b|\bremove\b|upgrade|move the other files|close\(\)|resume=", re.I)


def _names_the_place_and_a_fix(message: str, p: Place) -> None:
    """The error names the state directory (or a file in it, by its full path) and what to do."""
    assert str(p.state) in message, f"the state directory {str(p.state)!r} is not named in {message!r}"
    assert FIX.search(message), f"no fix named in {message!r}"


@pytest.mark.parametrize("name", CASES)
def test_hostile_directory_resumed(place: Place, name: str) -> None:
    case = CASES[name]
    case.plant(place)
    with deadline():
        if case.resume is None:
            _resume(place)
        else:
            with pytest.raises(case.resume) as info:
                _resume(place)
            assert isinstance(info.value, TierstoreError)
            _message_has(info.value, case.says)
            _names_the_place_and_a_fix(str(info.value), place)
    _outside_untouched(place)


@pytest.mark.parametrize("name", CASES)
def test_hostile_directory_read_offline(place: Place, name: str) -> None:
    case = CASES[name]
    case.plant(place)
    with deadline():
        if case.read is None:
            assert _read(place) == []
        elif case.read == "problem":
            problems = _read(place)  # verify names the damaged copy instead of raising
            assert problems and all(p.severity in ("error", "warning") for p in problems)
            assert any(all(part in p.what or part in p.file for part in case.says) for p in problems), problems
            for problem in problems:
                _names_the_place_and_a_fix(str(problem), place)
        else:
            with pytest.raises(case.read) as info:
                _read(place)
            assert isinstance(info.value, TierstoreError)
            if case.resume is not None:
                _message_has(info.value, case.says)
            _names_the_place_and_a_fix(str(info.value), place)
    _outside_untouched(place)


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, error, says",
    [
        (42, ConfigTypeError, ["state_dir=42", "int", "os.PathLike"]),
        (["a", 7], ConfigTypeError, ["state_dir[1]=7", "int", "os.PathLike"]),
        (["a", None], ConfigTypeError, ["state_dir[1]=None", "one directory per drive"]),
        ([], ConfigError, ["state_dir=[]", "lists no directory", "one per drive"]),
        (["a", ""], ConfigError, ["state_dir[1]=''", "current directory"]),
        (b"/tmp/x", ConfigTypeError, ["state_dir=b'/tmp/x'", "bytes"]),
        (3.5, ConfigTypeError, ["state_dir=3.5"]),
        ("", ConfigError, ["state_dir=''", "current directory"]),
        ("bad\0name", ConfigError, ["NUL"]),
    ],
    ids=["int", "list-of-int", "list-of-none", "empty-list", "list-of-empty", "bytes", "float", "empty", "nul"],
)
def test_state_dir_must_be_a_path(tmp_path: Path, monkeypatch, value, error, says) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as info:
        TieredAdamW(_params(), state_dir=value, **KW)
    _message_has(info.value, tuple(says))
    assert list(tmp_path.iterdir()) == [], "a refused state_dir created something in the current directory"


def test_state_dir_may_be_a_path_like(tmp_path: Path) -> None:
    class Where(os.PathLike):
        def __fspath__(self) -> str:
            return str(tmp_path / "s")

    params = _params()
    with TieredAdamW(params, state_dir=Where(), **KW) as opt:
        _step(opt, params)
    with TieredAdamW(_params(), state_dir=tmp_path / "s", resume=True, **KW) as again:
        assert again.step_count == 1


def test_a_symlinked_state_dir_is_followed_once(tmp_path: Path) -> None:
    """The user may name the directory through a link: it is opened once, then worked through its descriptor."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    params = _params()
    with TieredAdamW(params, state_dir=tmp_path / "link", **KW) as opt:
        _step(opt, params)
        os.rename(tmp_path / "link", tmp_path / "moved-link")  # the path goes away; the descriptor stays
        (tmp_path / "decoy").mkdir()
        os.symlink(tmp_path / "decoy", tmp_path / "link")  # ... and now names another directory
        _step(opt, params)
        opt.commit()
    assert sorted(os.listdir(tmp_path / "decoy")) == []
    assert "manifest.json" in os.listdir(tmp_path / "real")
    with StateReader(tmp_path / "real") as reader:
        assert reader.step_count == 2


def test_a_foreign_directory_is_refused_and_left_untouched(tmp_path: Path, snapshot) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"1234")
    before = snapshot(tmp_path)
    with pytest.raises(NotStateDirError) as info:
        TieredAdamW(_params(), state_dir=tmp_path / "data", **KW)
    _message_has(info.value, (str(tmp_path / "data"), "train.bin", "not a tierstore state directory", "empty"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("exists", [False, True], ids=["missing", "empty"])
def test_resume_true_needs_committed_state(tmp_path: Path, exists: bool) -> None:
    where = tmp_path / "state"
    if exists:
        where.mkdir()
    with pytest.raises(NoStateError) as info:
        TieredAdamW(_params(), state_dir=where, resume=True, **KW)
    assert isinstance(info.value, StateDirError) and isinstance(info.value, FileNotFoundError)
    _message_has(info.value, (str(where), "resume='auto'"))
    assert where.exists() == exists and (not exists or list(where.iterdir()) == [])


def test_resume_true_after_a_run_that_died_before_its_first_commit(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "shards.0.bin").write_bytes(bytes(4096))
    with pytest.raises(NoStateError, match="died before its first commit"):
        TieredAdamW(_params(), state_dir=tmp_path / "s", resume=True, **KW)
    params = _params()
    with TieredAdamW(params, state_dir=tmp_path / "s", resume="auto", **KW) as opt:  # starts fresh
        assert opt.step_count == 0


def test_resume_auto_starts_fresh_then_resumes(tmp_path: Path) -> None:
    params = _params()
    with TieredAdamW(params, state_dir=tmp_path / "s", resume="auto", **KW) as opt:
        assert opt.step_count == 0
        _step(opt, params)
    with TieredAdamW(_params(), state_dir=tmp_path / "s", resume="auto", **KW) as opt:
        assert opt.step_count == 1


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_resume_takes_false_true_or_auto(tmp_path: Path, value) -> None:
    with pytest.raises(ConfigTypeError, match=rf"resume={value!r}.*'auto'"):
        TieredAdamW(_params(), state_dir=tmp_path / "s", resume=value, **KW)
    assert not (tmp_path / "s").exists()


# -- below the optimizer: the store and chunk files ----------------------------------------------


def test_a_shard_never_written_is_never_read(tmp_path: Path) -> None:
    """Bytes no checksum vouches for never reach a caller: a read of a shard with nothing committed is an error."""
    from tierstore._layout.budget import plan_tiers
    from tierstore._layout.layout import Layout
    from tierstore._storage.store import ShardStore

    w = torch.zeros(8192, requires_grad=True)
    layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
    plan = plan_tiers(layout, ram_budget=48 << 10, arena_slots=2)
    with ShardStore(layout, plan, directory=tmp_path, backend="buffered", durable=True) as store:
        disk = plan.disk_shards[0]
        with pytest.raises(CorruptStateError, match=f"shard {disk} has no verified bytes"):
            store.read(disk, 0)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_chunk_files_are_never_opened_through_a_link_or_waited_on(tmp_path: Path, kind: str) -> None:
    import numpy as np

    from tierstore._storage.chunkfile import ChunkFiles

    files = ChunkFiles(tmp_path / "array", chunk_numel=1024, crc32c=True, key=lambda i: f"c/{i}")
    (tmp_path / "array" / "c").mkdir(parents=True)
    target = tmp_path / "target"
    target.write_bytes(SENTINEL)
    if kind == "symlink":
        os.symlink(target, files.path(0))
    else:
        os.mkfifo(files.path(0))
    data = np.arange(1024, dtype=np.float32)
    with deadline():
        with pytest.raises(CorruptStateError, match="chunk file"):
            files.write(0, memoryview(data).cast("B"))
        with pytest.raises(CorruptStateError, match="chunk file"):
            files.read(0, memoryview(np.empty(1024, dtype=np.float32)).cast("B"), valid_nbytes=4096)
    assert target.read_bytes() == SENTINEL
