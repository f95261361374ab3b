"""Every I/O backend passes the conformance kit; ``auto`` picks one and falls back with a reason."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.backends import (
    BACKENDS,
    ShardFile,
    open_backend,
    resolve_backend,
    supports_direct_io,
)
from tierstore.backends.direct import O_DIRECT, BufferedFile
from tierstore.backends.mmap_file import MmapFile
from tierstore.errors import BackendError, ConfigError
from tierstore.testing.backend import BackendTests


class TestDirect(BackendTests):
    backend = "direct"


class TestBuffered(BackendTests):
    backend = "buffered"


class _FailingMap:
    """Stands in for a mapping whose write-back fails (msync reporting a full disk)."""

    def __init__(self, real, err: int) -> None:
        self._real = real
        self._err = err

    def flush(self, *args):
        raise OSError(self._err, os.strerror(self._err))

    def __getattr__(self, name):
        return getattr(self._real, name)


class TestMmap(BackendTests):
    backend = "mmap"

    def inject_write_fault(self, monkeypatch, file, err) -> None:
        # Writes into a shared mapping are memory copies; the drive's errors surface
        # when the pages are written back, i.e. from sync (msync).
        monkeypatch.setattr(file, "_map", _FailingMap(file._map, err))


class _NoSyncFile(BufferedFile):
    """A backend whose sync does nothing (the bug the kit must catch)."""

    name = "nosync"

    def sync(self) -> None:
        pass


class _NoFlushMmap(MmapFile):
    """A mapped backend whose sync never flushes the mapping."""

    name = "noflush"

    def sync(self) -> None:
        pass


@pytest.mark.parametrize("cls", [_NoSyncFile, _NoFlushMmap], ids=["pwrite", "mmap"])
def test_the_kit_fails_a_backend_whose_sync_does_nothing(tmp_path: Path, cls) -> None:
    class Kit(BackendTests):
        backend = cls.name

        def open_file(self, path, nbytes, *, create):
            return cls(path, nbytes, create=create)

    kit = Kit()
    # Reading back after a reopen sees the page cache: that test cannot tell.
    kit.test_sync_then_reopen_sees_the_data(tmp_path / "reopen.bin")
    with pytest.raises(AssertionError, match="power cut right after it would lose written bytes"):
        kit.test_sync_makes_written_ranges_survive_a_power_cut(tmp_path)


def test_every_registered_backend_has_a_conformance_class() -> None:
    tested = {cls.backend for cls in (TestDirect, TestBuffered, TestMmap)}
    assert tested == set(BACKENDS)


# -- choosing a backend --------------------------------------------------


def test_auto_prefers_direct_where_supported(tmp_path: Path) -> None:
    expected = "direct" if supports_direct_io(tmp_path) else "mmap"
    assert resolve_backend("auto", tmp_path) == expected
    assert list(tmp_path.iterdir()) == [], "the O_DIRECT probe left a file behind"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_named_backends_resolve_to_themselves(tmp_path: Path, name: str) -> None:
    assert resolve_backend(name, tmp_path) == name


@pytest.mark.parametrize("name", ["nvme", "DIRECT", "", "o_direct"])
def test_unknown_backend_names_the_choices(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_backend(name, tmp_path)
    assert repr(name) in str(info.value) and "mmap" in str(info.value)
    with pytest.raises(ConfigError):
        open_backend(name, tmp_path / "s.bin", 4096, create=True)


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``os.open`` behave like a filesystem without O_DIRECT (EINVAL)."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if O_DIRECT and flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_auto_falls_back_to_mmap_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _refuse_o_direct(monkeypatch)
    assert supports_direct_io(tmp_path) is False
    with caplog.at_level(logging.INFO, logger="tierstore"):
        assert resolve_backend("auto", tmp_path) == "mmap"
    reasons = [r.getMessage() for r in caplog.records if r.name.startswith("tierstore")]
    assert any("O_DIRECT" in m and str(tmp_path) in m and "mmap" in m for m in reasons), reasons
    assert list(tmp_path.iterdir()) == [], "the O_DIRECT probe left a file behind"


def test_auto_falls_back_when_the_probe_says_no(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("tierstore.backends.supports_direct_io", lambda directory, **kw: False)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        assert resolve_backend("auto", tmp_path) == "mmap"
    assert any("mmap" in r.getMessage() for r in caplog.records)


def test_direct_on_a_filesystem_without_o_direct_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_o_direct(monkeypatch)
    with pytest.raises(BackendError, match="O_DIRECT") as info:
        open_backend("direct", tmp_path / "s.bin", 4096, create=True)
    assert "mmap" in str(info.value) and str(tmp_path) in str(info.value)


def test_optimizer_with_auto_backend_falls_back_and_still_matches_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_o_direct(monkeypatch)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20_000))
    r = torch.nn.Parameter(w.detach().clone())
    ref = torch.optim.AdamW([r], lr=1e-2, fused=True)
    with TieredAdamW([w], lr=1e-2, state_dir=tmp_path / "state", ram_budget="64KiB", shard_numel=1024) as opt:
        assert opt.backend == "mmap" and opt.plan.disk_shards
        for _ in range(3):
            g = torch.randn(w.shape)
            w.grad, r.grad = g, g.clone()
            opt.step()
            ref.step()
    assert torch.equal(w, r)


# -- the O_DIRECT probe does I/O; allocate works for every ShardFile ----------------------------


def _has_o_direct(fd: int) -> bool:
    import fcntl

    return bool(O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("fault", ["write-refused", "read-refused", "read-back-differs"])
def test_the_o_direct_probe_writes_and_reads_an_aligned_block(tmp_path: Path, monkeypatch, fault: str) -> None:
    """Filesystems that accept O_DIRECT at open but refuse (or botch) the I/O are found by the probe."""
    if not supports_direct_io(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT at all")
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def pwritev(fd, buffers, offset, *rest):
        if fault == "write-refused" and _has_o_direct(fd):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwritev(fd, buffers, offset, *rest)

    def preadv(fd, buffers, offset, *rest):
        if fault == "read-refused" and _has_o_direct(fd):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        n = real_preadv(fd, buffers, offset, *rest)
        if fault == "read-back-differs" and _has_o_direct(fd):
            for b in buffers:
                memoryview(b)[:16] = bytes(16)
        return n

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    assert supports_direct_io(tmp_path) is False
    assert resolve_backend("auto", tmp_path) == "mmap"
    assert list(tmp_path.iterdir()) == [], "the O_DIRECT probe left a file behind"


def test_the_o_direct_probe_never_follows_a_planted_name(tmp_path: Path, monkeypatch) -> None:
    """The probe's file is created exclusively under a random name: a planted link is never written through."""
    import tierstore.backends as backends

    target = tmp_path / "target"
    target.write_bytes(b"keep")
    monkeypatch.setattr(backends.secrets, "token_hex", lambda n: "fixed")
    os.symlink(target, tmp_path / f"{backends.PROBE_PREFIX}{os.getpid()}-fixed")
    assert supports_direct_io(tmp_path) is False  # the name is taken: no probe, no write
    assert target.read_bytes() == b"keep"


class _MinimalFile(ShardFile):
    """A backend that keeps no descriptor of its own: it reads and writes through the base class's."""

    name = "minimal"

    def read_into(self, buffer, offset):
        os.preadv(self.fd, [buffer], offset)

    def write_from(self, buffer, offset):
        os.pwritev(self.fd, [buffer], offset)

    def sync(self):
        os.fsync(self.fd)

    def close(self):
        self._close_fd()


def test_allocate_uses_the_base_class_descriptor(tmp_path: Path) -> None:
    f = _MinimalFile(tmp_path / "s.bin", 1 << 20, create=True)
    try:
        before = os.stat(tmp_path / "s.bin").st_blocks
        f.allocate(0, 1 << 20)  # needs no attribute a subclass might not have
        assert os.stat(tmp_path / "s.bin").st_blocks * 512 >= (1 << 20) > before * 512
    finally:
        f.close()
        f.close()  # safe twice
