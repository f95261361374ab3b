"""Shared test setup: Hypothesis profiles and a snapshot of a directory's files.

Every property test sets its own ``max_examples``, sized so the whole suite
stays within its time budget on a 2-core machine; the profile here only
turns off per-example deadlines (disk noise makes step times vary) and the
"too slow" health check.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
