"""Faults with nothing lost: each gets a clear error and the committed state stays resumable."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from tierstore import (
    CorruptStateError,
    DiskFullError,
    FormatVersionError,
    LayoutMismatchError,
    StepFailedError,
    TieredAdamW,
)
from tierstore._state.reader import StateReader
from tierstore.testing.crash import CrashJob, compare, gradients, initial_params

STEPS = 6


def _job(tmp_path: Path, **kw) -> CrashJob:
    return CrashJob(state_dir=str(tmp_path / "state"), steps=STEPS, **kw)


def _open(job: CrashJob, params=None, **kw) -> tuple[TieredAdamW, list]:
    params = params if params is not None else initial_params(job)
    opts = {**job.optimizer_kwargs(), **kw}
    return TieredAdamW(params, **opts), params


def _steps(opt: TieredAdamW, params, job: CrashJob, upto: int) -> None:
    for step in range(opt.step_count, upto):
        for p, g in zip(params, gradients(job, step)):
            p.grad = g
        opt.step()
    opt.commit()  # commits finish in the background: wait before looking at the directory


def _finish_and_compare(job: CrashJob, tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes]
    opt, params = _open(job, params)
    _steps(opt, params, job, job.steps)
    out = tmp_path / "final.pt"
    torch.save({"params": [p.detach() for p in params], "state_dict": opt.state_dict()}, out)
    opt.close()
    assert compare(job, out) == []


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("backend", ["direct", "buffered"])
def test_disk_full_while_writing_a_shard(tmp_path, monkeypatch, backend):
    job = _job(tmp_path, backend=backend)
    opt, params = _open(job)
    _steps(opt, params, job, 2)
    manifest = (Path(job.state_dir) / "manifest.json").read_bytes()
    real = os.pwritev
    calls = {"n": 0}

    def full_after_three(fd, buffers, offset, *args):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", full_after_three)
    for p, g in zip(params, gradients(job, 2)):
        p.grad = g
    with pytest.raises(DiskFullError, match="disk full while writing"):
        opt.step()
    # The optimizer refuses to go on from half-updated state and says how to resume.
    with pytest.raises(StepFailedError, match="resume=True"):
        opt.step()
    opt.close()
    monkeypatch.setattr(os, "pwritev", real)
    assert (Path(job.state_dir) / "manifest.json").read_bytes() == manifest
    with StateReader(job.state_dir) as reader:
        assert reader.step_count == 2
        assert [p for p in reader.verify() if p.severity == "error"] == []
    _finish_and_compare(job, tmp_path)


def test_disk_full_while_writing_the_manifest(tmp_path, monkeypatch):
    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, 2)
    before = _snapshot(Path(job.state_dir))
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    for p, g in zip(params, gradients(job, 2)):
        p.grad = g
    opt.step()  # its commit finishes in the background: the error comes when one waits for it
    with pytest.raises(DiskFullError, match="manifest.json"):
        opt.commit()
    with pytest.raises(StepFailedError, match="resume=True"):
        opt.step()
    monkeypatch.setattr(os, "write", real_write)
    opt.close()
    assert (Path(job.state_dir) / "manifest.json").read_bytes() == before["manifest.json"]
    assert not (Path(job.state_dir) / ".manifest.json.tmp").exists()
    _finish_and_compare(job, tmp_path)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small-fs"
    if not _mount_tmpfs(mount, "2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root); the fault-injection tests cover ENOSPC")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_real_full_filesystem_at_construction_and_at_commit(small_fs, tmp_path):
    # Too big for the 1 MiB filesystem: refused at construction with the fix.
    big = [torch.nn.Parameter(torch.zeros(1_000_000))]
    with pytest.raises(DiskFullError, match="no space left"):
        TieredAdamW(big, state_dir=str(small_fs / "big"), shard_numel=1 << 14, ram_budget="1MiB")
    assert not (small_fs / "big").exists()  # the failed start removed what it made
    # Fits; then the drive fills up from elsewhere before a commit.
    job = CrashJob(state_dir=str(small_fs / "state"), steps=STEPS)
    opt, params = _open(job)
    _steps(opt, params, job, 2)
    filler = small_fs / f"filler-{uuid.uuid4().hex}"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    for p, g in zip(params, gradients(job, 2)):
        p.grad = g
    with pytest.raises(DiskFullError):
        opt.step()  # streamed shards are written by the step itself...
        opt.commit()  # ...the manifest by its commit, in the background: waiting raises
    opt.close()
    filler.unlink()
    with StateReader(job.state_dir) as reader:
        assert reader.step_count == 2
    copy = tmp_path / "copy"
    shutil.copytree(job.state_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    _finish_and_compare(CrashJob(state_dir=str(copy), steps=STEPS), tmp_path)


@pytest.mark.parametrize("damage", ["remove", "truncate"])
def test_state_file_removed_or_truncated(tmp_path, damage):
    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, 3)
    opt.close()
    manifest = json.loads((Path(job.state_dir) / "manifest.json").read_text())
    victim = Path(job.state_dir) / f"shards.{manifest['shards'][-1]['copy']}.bin"
    if damage == "remove":
        victim.unlink()
    else:
        os.truncate(victim, victim.stat().st_size // 2)
    before = _snapshot(Path(job.state_dir))
    with pytest.raises(CorruptStateError, match=victim.name):
        opt, params = _open(job)
        try:
            _steps(opt, params, job, 4)
        finally:
            opt.close()
    assert _snapshot(Path(job.state_dir)) == before


def test_manifest_from_another_model(tmp_path):
    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, 2)
    opt.close()
    before = _snapshot(Path(job.state_dir))
    other = [torch.nn.Parameter(torch.zeros(s)) for s in [(300, 7), (1000,)]]
    with pytest.raises(LayoutMismatchError, match="another model"):
        _open(job, other)
    reshaped = [torch.nn.Parameter(torch.zeros(s)) for s in [(33, 257), *job.shapes[1:]]]
    with pytest.raises(LayoutMismatchError, match=r"parameter 0 is \(33, 257\)"):
        _open(job, reshaped)
    assert _snapshot(Path(job.state_dir)) == before
    _finish_and_compare(job, tmp_path)


def test_newer_format_version(tmp_path):
    from tierstore._state import manifest_file

    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, 2)
    opt.close()
    path = Path(job.state_dir) / "manifest.json"
    body = json.loads(path.read_text())
    body["format_version"] = manifest_file.FORMAT_VERSION + 1
    body.pop("manifest_checksum")
    body["manifest_checksum"] = manifest_file.manifest_checksum(body)
    path.write_text(json.dumps(body))
    before = _snapshot(Path(job.state_dir))
    with pytest.raises(FormatVersionError, match="Upgrade tierstore"):
        _open(job)
    assert _snapshot(Path(job.state_dir)) == before


def test_resume_reports_the_committed_step(tmp_path):
    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, 4)
    opt.close()
    opt, params = _open(job, [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes])
    assert opt.step_count == 4
    assert all(float(opt.state[p]["step"]) > 0 for p in params)
    opt.close()


def test_roll_back_one_step(tmp_path):
    """A durable directory keeps its last commit and the one before (for distributed resumes)."""
    job = _job(tmp_path)
    opt, params = _open(job)
    _steps(opt, params, job, job.steps + 1)
    opt.close()
    opt, params = _open(job, [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes], resume_step=job.steps)
    assert opt.step_count == job.steps
    opt.close()
    with pytest.raises(CorruptStateError, match=r"cannot resume at step 2: it holds steps \[7, 6\]"):
        _open(job, resume_step=2)
    # Rolled back, it is exactly the uninterrupted run of job.steps steps.
    opt, params = _open(job, [torch.nn.Parameter(torch.zeros(s)) for s in job.shapes], resume_step=job.steps)
    out = tmp_path / "rolled.pt"
    torch.save({"params": [p.detach() for p in params], "state_dict": opt.state_dict()}, out)
    opt.close()
    assert compare(job, out) == []
