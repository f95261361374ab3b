"""Shared test setup: Hypothesis profiles, a snapshot of a directory's files, a RAM-backed scratch dir.

Every property test sets its own ``max_examples``, sized so the whole suite
stays within its time budget on a 2-core machine; the profile here only
turns off per-example deadlines (disk noise makes step times vary) and the
"too slow" health check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# One intra-op thread: the tests run many tiny kernels (shards of a few thousand
# elements), where OpenMP's fork/join costs milliseconds per call on a busy 2-core
# machine. Results do not depend on it (the AdamW kernel is elementwise).
torch.set_num_threads(1)

_COMMON = dict(
    deadline=None,  # step times vary with disk noise; correctness is what is checked
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("tierstore", **_COMMON)
settings.load_profile("tierstore")


Snapshot = dict[str, tuple[int, int, bytes]]


def snapshot_files(root: Path | str) -> Snapshot:
    """Every file and directory under ``root``: relative name -> (size, mtime_ns, bytes).

    Directories are listed with size -1 and empty bytes so that a created or
    removed directory shows up too.
    """
    root = Path(root)
    result: Snapshot = {}
    if not root.exists():
        return result
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = Path(dirpath) / name
            result[str(path.relative_to(root)) + "/"] = (-1, 0, b"")
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()
            result[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, path.read_bytes())
    return result


@pytest.fixture
def snapshot() -> Callable[[Path | str], Snapshot]:
    """A function returning :func:`snapshot_files` of a directory."""
    return snapshot_files


def _ram_scratch_root() -> str | None:
    """``/dev/shm`` when it exists and takes ``O_DIRECT`` (tmpfs does on Linux >= 6.6), else ``None``."""
    from tierstore.backends import supports_direct_io

    root = "/dev/shm"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) and supports_direct_io(root) else None


@pytest.fixture
def ram_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory in RAM (tmpfs) where possible, else ``tmp_path``.

    For tests whose subject is not the drive: SIGKILL tests (a killed
    process leaves the page cache, so fsyncs cannot matter to them) and
    simulated power cuts (which model the drive themselves). There fsyncs
    cost nothing, where the shared virtual disk takes ~10 ms each.
    """
    root = _ram_scratch_root()
    if root is None:
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="tierstore-test-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A process that has not built or loaded the compiled kernel yet (:mod:`tierstore._compute.native`), with
    its own cache directory (``tmp_path / "cache"``) and no library from the install (so the kernel
    is built from ``native._source()``, which a test may replace); the next test decides afresh again."""
    from tierstore._compute import native

    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIERSTORE_NATIVE", raising=False)
    monkeypatch.delenv("TIERSTORE_CC", raising=False)
    monkeypatch.setattr(native, "installed_path", lambda: None)  # build on first use, from native._source()
    native.reset()
    yield tmp_path
    native.reset()
