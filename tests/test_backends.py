"""Every I/O backend passes the conformance kit; ``auto`` picks one and falls back with a reason."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.backends import BACKENDS, open_backend, resolve_backend, supports_direct_io
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
