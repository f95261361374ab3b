"""Simulated power cuts (issue 9, item 4): every image resumes at a committed step, bitwise, or refuses clearly.

A run is recorded once (every write, sync, create, rename that reaches its
state directory); then images of what a power cut at many points would
leave are resumed, each in a fresh directory. The harness must also fail:
deliberately broken durability (a sync that does nothing, a manifest renamed
before its data is synced, a rename never made durable) is caught.

A state over two directories (issue 25) is recorded in one log, both
directories in every image: one commit over both drives means every image
resumes at one committed step on both; a second drive whose syncs do nothing,
or whose new files' names are never made durable, is caught.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tierstore._platform.hostmem import HostBuffer
from tierstore._state import statedir
from tierstore._storage.drive_files import DriveFiles
from tierstore.backends import open_backend
from tierstore.backends.direct import BufferedFile
from tierstore.backends.mmap_file import MmapFile
from tierstore.testing.crash import CrashJob
from tierstore.testing.fsimage import Op, Recording
from tierstore.testing.fsrecord import Recorder
from tierstore.testing.powercut import record_after_cut, record_run, run_powercuts

IMAGES = 12  # per scenario: 6 scenarios, 72 images in all


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cut_after(recording: Recording, label: str) -> int:
    """The cut right after the phase mark ``label``."""
    return next(op.begin for op in recording.ops if op.kind == "phase" and op.label == label) + 1


def _write(fd: int, data: bytes, offset: int = 0) -> None:
    os.pwrite(fd, data, offset)


# -- the model itself ---------------------------------------------------------------------


def test_synced_data_survives_unsynced_is_kept_dropped_or_torn_by_page(ram_tmp_path):
    root = ram_tmp_path / "d"
    root.mkdir()
    synced, unsynced = b"s" * (3 * 4096), b"u" * (3 * 4096)
    with Recorder(root) as rec:
        fd = os.open(root / "f", os.O_RDWR | os.O_CREAT)
        dfd = os.open(root, os.O_RDONLY)
        os.fsync(dfd)  # the name is durable
        os.close(dfd)
        _write(fd, synced)
        os.fsync(fd)
        _write(fd, unsynced, 3 * 4096)
        os.close(fd)
        rec.phase("end")
    recording = rec.recording()
    cut = _cut_after(recording, "end")
    assert recording.image(cut, seed=0, style="kept").files["f"] == synced + unsynced
    assert recording.image(cut, seed=0, style="dropped").files["f"] == synced
    seen = {recording.image(cut, seed=s, style="mixed").files["f"] for s in range(40)}
    assert all(f[: len(synced)] == synced for f in seen)
    torn = [f for f in seen if len(f) > len(synced) and f.count(b"u") % 4096 == 0 and f.count(b"u") < len(unsynced)]
    assert torn, "no image kept part of the unsynced write"
    # Before the sync returned, even the first write may be lost.
    sync = next(op for op in recording.ops if op.kind == "sync")
    assert recording.image(sync.begin, seed=0, style="dropped").files["f"] == b""


def test_creates_and_renames_are_durable_only_after_their_directory_is_synced(ram_tmp_path):
    root = ram_tmp_path / "d"
    with Recorder(root) as rec:
        os.mkdir(root)
        fd = os.open(root / "tmp", os.O_WRONLY | os.O_CREAT)
        _write(fd, b"new")
        os.fsync(fd)
        os.close(fd)
        rec.phase("written")
        os.replace(root / "tmp", root / "name")
        rec.phase("renamed")
        dfd = os.open(root, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        rec.phase("dir synced")
    recording = rec.recording()
    worst = recording.image(_cut_after(recording, "renamed"), seed=0, style="dropped")
    assert worst.files is None  # the directory itself was never made durable in its parent
    kept = recording.image(_cut_after(recording, "renamed"), seed=0, style="kept")
    assert kept.files == {"name": b"new"}
    assert recording.image(_cut_after(recording, "written"), seed=0, style="kept").files == {"tmp": b"new"}
    for style in ("kept", "dropped", "mixed"):
        image = recording.image(_cut_after(recording, "dir synced"), seed=1, style=style)
        assert image.files is None or image.files == {"name": b"new"}  # the parent was never synced


def test_a_sync_covers_only_writes_that_ended_before_it_began():
    def ops(write_end: int) -> list[Op]:
        return [
            Op(1, 2, "create", inode=1, name="f"),
            Op(3, write_end, "write", inode=1, data=b"x" * 10),
            Op(5, 7, "sync", inode=1),
        ]

    for write_end, durable in ((4, True), (6, False)):  # 6: still in flight when the sync began
        recording = Recording(ops(write_end), {}, {}, True, [], 10)
        image = recording.image(10, seed=0, style="dropped")
        assert image.files == {}  # the name was never made durable
        data = [op for op, after in zip(recording.ops, recording._durable) if op.kind == "write" and after < 10]
        assert bool(data) == durable


def test_mapped_stores_count_only_once_an_msync_covers_them(ram_tmp_path):
    root = ram_tmp_path / "d"
    root.mkdir()
    buf = HostBuffer(4096)
    buf.tensor.fill_(9)
    with Recorder(root) as rec:
        f = open_backend("mmap", root / "m.bin", 8192, create=True)
        dfd = os.open(root, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        f.write_from(buf.view, 4096)
        os.fsync(f.fd)  # an fsync is not a flush of the mapping, as the model says
        rec.phase("fsynced")
        f.sync()
        rec.phase("flushed")
        f.close()
    buf.close()
    recording = rec.recording()
    assert b"\x09" not in recording.image(_cut_after(recording, "fsynced"), seed=0, style="dropped").files["m.bin"]
    assert recording.image(_cut_after(recording, "flushed"), seed=0, style="dropped").files["m.bin"] == bytes(4096) + b"\x09" * 4096


def test_writes_from_worker_threads_are_all_recorded_in_one_order(ram_tmp_path):
    root = ram_tmp_path / "d"
    root.mkdir()
    with Recorder(root) as rec:
        f = open_backend("direct", root / "s.bin", 64 * 4096, create=True)
        bufs = [HostBuffer(4096) for _ in range(64)]
        for k, b in enumerate(bufs):
            b.tensor.fill_(k)
        threads = set()

        def put(k: int) -> None:
            threads.add(threading.get_ident())
            f.write_from(bufs[k].view, k * 4096)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, range(64)))
        f.sync()
        f.close()
        for b in bufs:
            b.close()
    writes = [op for op in rec.recording().ops if op.kind == "write"]
    assert len(writes) == 64 and len(threads) > 1
    assert len({op.begin for op in rec.recording().ops} | {op.end for op in rec.recording().ops}) == 2 * len(rec.recording().ops)
    assert sorted(op.offset // 4096 for op in writes) == list(range(64))
    assert all(op.data == bytes([op.offset // 4096]) * 4096 for op in writes)


def test_a_new_state_dir_survives_a_power_cut(ram_tmp_path):
    """StateDir.open syncs the parent of a directory it creates (found by this harness)."""
    root = ram_tmp_path / "new" / "state"
    with Recorder(root) as rec:
        d = statedir.StateDir(root).open()
        d.write_manifest({"step_count": 0})
        d.close()
        rec.phase("committed")
    image = rec.recording().image(_cut_after(rec.recording(), "committed"), seed=0, style="dropped")
    assert image.files is not None and "manifest.json" in image.files


# -- training runs: every backend, masters and amsgrad, streamed and resident ---------------

SCENARIOS = {
    "direct-streamed-masters": dict(backend="direct", ram_budget="112KiB"),
    "direct-resident-amsgrad": dict(backend="direct", ram_budget=None, amsgrad=True),
    "buffered-streamed-amsgrad": dict(backend="buffered", ram_budget="200KiB", amsgrad=True),
    "buffered-resident-no-masters": dict(backend="buffered", ram_budget=None, keep_master=False),
    "mmap-streamed-amsgrad": dict(backend="mmap", ram_budget="200KiB", amsgrad=True),
    "mmap-resident-masters": dict(backend="mmap", ram_budget=None),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_power_cut_image_resumes_at_a_committed_step_bitwise(ram_tmp_path, name):
    # A forward/backward stand-in between steps: each step's commit finishes in the background.
    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=4, forward_seconds=0.01, **SCENARIOS[name])
    result = run_powercuts(job, images=IMAGES, seed=len(name), workdir=ram_tmp_path)
    assert result.violations == []
    assert result.images == IMAGES and result.outcomes["resumed"] == IMAGES
    # The images spread over the run: construction, several steps, and states between steps.
    assert {"construct", "step", "forward"} <= set(result.phases)
    assert len(result.resumed_steps) >= 3, result.resumed_steps


def test_a_directory_resumed_after_a_power_cut_survives_another(ram_tmp_path):
    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=4, backend="direct", ram_budget="200KiB", amsgrad=True)
    recording = record_after_cut(job, seed=5, workdir=ram_tmp_path / "first")
    result = run_powercuts(job, images=IMAGES, seed=5, workdir=ram_tmp_path, recording=recording)
    assert result.violations == [] and result.outcomes["resumed"] == IMAGES


@pytest.mark.parametrize("backend", ["buffered", "mmap"])
def test_non_durable_power_cut_images_resume_only_after_a_clean_close(ram_tmp_path, backend):
    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=3, backend=backend, durable=False)
    result = run_powercuts(job, images=10, seed=3, workdir=ram_tmp_path)
    assert result.violations == []
    assert result.outcomes["refused"] > 0  # a cut before the clean close: CorruptStateError, nothing committed


# -- the harness fails on broken durability ---------------------------------------------------


def _manifest_without_file_fsync(path: Path, payload: bytes, *, dir_fd: int) -> None:
    tmp = f".{path.name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    os.write(fd, payload)
    os.close(fd)
    os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _manifest_without_dir_fsync(path: Path, payload: bytes, *, dir_fd: int) -> None:
    tmp = f".{path.name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    os.write(fd, payload)
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


BREAKAGES = {
    "direct-sync-does-nothing": ("direct", BufferedFile, "sync", lambda self: None),
    "buffered-sync-does-nothing": ("buffered", BufferedFile, "sync", lambda self: None),
    "mmap-sync-does-nothing": ("mmap", MmapFile, "sync", lambda self: None),
    "manifest-renamed-before-its-data-is-synced": ("buffered", statedir, "atomic_write", _manifest_without_file_fsync),
    "manifest-rename-never-made-durable": ("mmap", statedir, "atomic_write", _manifest_without_dir_fsync),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_durability_is_caught(ram_tmp_path, monkeypatch, name):
    backend, owner, attr, broken = BREAKAGES[name]
    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=3, backend=backend)
    monkeypatch.setattr(owner, attr, broken)
    recording = record_run(job)
    monkeypatch.undo()
    result = run_powercuts(job, images=IMAGES, seed=0, workdir=ram_tmp_path, recording=recording)
    assert result.violations, f"{name} went unnoticed: {result.summary()}"
    assert all("reported" in v for v in result.violations)


def test_the_reported_step_comes_from_the_callback(ram_tmp_path):
    """A run that claims a step committed before its commit is caught (the future committed_step plugs in here)."""
    job = CrashJob(state_dir=str(ram_tmp_path / "state"), steps=3, backend="buffered")
    result = run_powercuts(job, images=IMAGES, seed=0, workdir=ram_tmp_path, committed=lambda opt: opt.step_count + 1)
    assert any("before the reported step" in v for v in result.violations), result.summary()


def test_the_soak_writes_its_json(tmp_path, capsys):
    import runpy

    soak = runpy.run_path(str(Path(__file__).parents[1] / "bench" / "powercut_soak.py"))
    out = tmp_path / "soak.json"
    args = ["--images", "4", "--seeds", "1", "--backends", "mmap", "--scenarios", "resumed-streamed-amsgrad-masters"]
    assert soak["main"]([*args, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["images"] == 4 and summary["violations"] == 0 and summary["per_backend"]["mmap"]["images"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["soak.json"]  # the runs cleaned up


# -- a state over two directories (issue 25) ---------------------------------------------------


def test_a_name_in_the_second_directory_is_durable_only_by_that_directorys_sync(ram_tmp_path):
    a, b = ram_tmp_path / "a", ram_tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with Recorder([a, b]) as rec:
        for d in (a, b):
            fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT)
            os.write(fd, d.name.encode())
            os.fsync(fd)
            os.close(fd)
        dfd = os.open(a, os.O_RDONLY)
        os.fsync(dfd)  # the first directory's names only
        os.close(dfd)
        rec.phase("a synced")
        dfd = os.open(b, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        rec.phase("b synced")
    recording = rec.recording()
    early = recording.image(_cut_after(recording, "a synced"), seed=0, style="dropped")
    assert early.files == {"f": b"a"} and early.members == [{}]
    late = recording.image(_cut_after(recording, "b synced"), seed=0, style="dropped")
    assert late.files == {"f": b"a"} and late.members == [{"f": b"b"}]
    late.materialize(ram_tmp_path / "x", [ram_tmp_path / "y"])
    assert (ram_tmp_path / "y" / "f").read_bytes() == b"b"


def _two_drive_job(root: Path, **changes) -> CrashJob:
    """A run over two directories in ``root``, its shards placed by a knobs file's figures (no probe recorded)."""
    from tierstore._config.knobs_file import (
        DriveFigure,
        device_of,
        encode_knobs_file,
        knobs_document,
    )

    knobs = root / "knobs.json"
    knobs.write_bytes(encode_knobs_file(knobs_document({}, drives=[DriveFigure(str(root), device_of(root), 2e9)])))
    return CrashJob(state_dir=(str(root / "state"), str(root / "state-drive1")), steps=4, forward_seconds=0.01,
                    extra={"knobs": str(knobs)}, **changes)  # fmt: skip


TWO_DRIVES = {
    "direct-streamed-masters": dict(backend="direct", ram_budget="112KiB"),
    "mmap-resident-amsgrad": dict(backend="mmap", ram_budget=None, amsgrad=True),
}


@pytest.mark.parametrize("name", TWO_DRIVES)
def test_every_power_cut_image_over_two_directories_resumes_at_one_committed_step_bitwise(ram_tmp_path, name):
    job = _two_drive_job(ram_tmp_path, **TWO_DRIVES[name])
    recording = record_run(job)
    # Both directories took writes, syncs and names: the cuts fall between the drives' operations.
    assert any(op.name.startswith("1/shards") for op in recording.ops if op.kind == "create")
    assert any(op.kind == "dirsync" and op.where == "root1" for op in recording.ops)
    result = run_powercuts(job, images=IMAGES, seed=len(name), workdir=ram_tmp_path / "images", recording=recording)
    assert result.violations == []
    assert result.images == IMAGES and result.outcomes["resumed"] == IMAGES
    assert {"construct", "step", "forward"} <= set(result.phases)
    assert len(result.resumed_steps) >= 3, result.resumed_steps


def _second_drive_never_syncs(self):
    if self.index == 0:
        return REAL_START_SYNC(self)
    return None


def _second_drive_names_never_synced(self, dirty):
    self._unsynced_names = False  # as if the new files' names were made durable: they were not
    return REAL_SYNC(self, dirty)


REAL_START_SYNC, REAL_SYNC = DriveFiles.start_sync, DriveFiles._sync
TWO_DRIVE_BREAKAGES = {
    "second-drive-sync-does-nothing": ("start_sync", _second_drive_never_syncs),
    "second-drive-file-names-never-synced": ("_sync", _second_drive_names_never_synced),
}


@pytest.mark.parametrize("name", TWO_DRIVE_BREAKAGES)
def test_broken_durability_of_the_second_drive_is_caught(ram_tmp_path, monkeypatch, name):
    job = _two_drive_job(ram_tmp_path, backend="buffered", ram_budget="112KiB")
    attr, broken = TWO_DRIVE_BREAKAGES[name]
    monkeypatch.setattr(DriveFiles, attr, broken)
    recording = record_run(job)
    monkeypatch.undo()
    result = run_powercuts(job, images=2 * IMAGES, seed=1, workdir=ram_tmp_path / "images", recording=recording)
    assert result.violations, f"{name} went unnoticed: {result.summary()}"
    assert all("reported" in v for v in result.violations)
