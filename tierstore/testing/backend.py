"""The conformance tests every I/O backend runs.

A backend is a :class:`~tierstore.backends.ShardFile`: a preallocated file
addressed by byte offset, read into and written from page-aligned host
buffers. Whatever it does underneath (``O_DIRECT``, the page cache, a shared
mapping), it must behave the same: a read returns the last write, offsets are
honoured, ``sync`` makes completed writes survive a power cut (checked on the
recorded system calls, :mod:`tierstore.testing.fsrecord`), ``close`` is safe twice, and
the faults users can act on come back as the tierstore errors that say what
to do (missing or truncated file: :class:`~tierstore.errors.CorruptStateError`;
out of space: :class:`~tierstore.errors.DiskFullError`; a request outside the
file: :class:`~tierstore.errors.BackendError`).

Subclass :class:`BackendTests` in a test module and name the backend; pytest
collects the inherited tests. Override :meth:`BackendTests.open_file` for a
backend not registered in :data:`tierstore.backends.BACKENDS`, and
:meth:`BackendTests.inject_write_fault` when the backend's writes do not go
through ``os`` calls.

Example
-------
>>> from tierstore.testing.backend import BackendTests
>>> class TestBuffered(BackendTests):  # in a test module
...     backend = "buffered"
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .._platform.hostmem import HostBuffer
from .._storage.transfer import IOQueue
from ..backends import BACKENDS, ShardFile, open_backend
from ..errors import BackendError, CorruptStateError, DiskFullError, TierstoreError
from .fsrecord import Recorder

PAGE = 4096

#: ``os`` functions through which file-descriptor backends write and flush.
WRITE_CALLS = ("pwritev", "pwrite", "write", "writev", "fdatasync", "fsync")


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` reproducible random bytes as a ``uint8`` tensor."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def filled(nbytes: int, seed: int) -> HostBuffer:
    """A page-aligned host buffer holding :func:`random_bytes`."""
    buf = HostBuffer(nbytes)
    buf.tensor.copy_(random_bytes(nbytes, seed))
    return buf


class BackendTests:
    """Tests a backend must pass; subclass it and set :attr:`backend`.

    Attributes
    ----------
    backend
        The backend's name in :data:`tierstore.backends.BACKENDS`.
    nbytes
        Size of the file most tests use (a multiple of 4096).
    """

    backend: ClassVar[str]
    nbytes: ClassVar[int] = 64 << 10  # 64 KiB: 16 pages
    #: False for a backend that reaches its file other than through ``os`` calls or
    #: :class:`~tierstore.backends.mmap_file.MmapFile`'s copy and msync: the power-cut
    #: recorder (:mod:`tierstore.testing.fsrecord`) cannot see it, so its sync goes unchecked.
    observable: ClassVar[bool] = True

    # -- hooks a backend's test class may override ----------------------
    def open_file(self, path: Path, nbytes: int, *, create: bool) -> ShardFile:
        """Open ``path`` with the backend under test."""
        return open_backend(self.backend, path, nbytes, create=create)

    def inject_write_fault(self, monkeypatch: pytest.MonkeyPatch, file: ShardFile, err: int) -> None:
        """Make every later write or sync of ``file`` fail with ``OSError(err)``.

        The default wraps the ``os`` calls file-descriptor backends write with.
        """
        for name in WRITE_CALLS:
            real = getattr(os, name, None)
            if real is None:
                continue
            monkeypatch.setattr(os, name, _failing(real, err))

    # -- fixtures ------------------------------------------------------
    @pytest.fixture
    def path(self, tmp_path: Path) -> Path:
        return tmp_path / "shards.bin"

    @pytest.fixture
    def shard_file(self, path: Path) -> Iterator[ShardFile]:
        f = self.open_file(path, self.nbytes, create=True)
        yield f
        f.close()

    # -- identity ------------------------------------------------------
    def test_is_a_registered_shard_file(self, shard_file: ShardFile) -> None:
        assert isinstance(shard_file, ShardFile)
        assert type(shard_file).name == self.backend
        assert BACKENDS.get(self.backend, type(shard_file)) is type(shard_file)
        assert shard_file.nbytes == self.nbytes and not shard_file.closed

    def test_create_sizes_the_file(self, shard_file: ShardFile, path: Path) -> None:
        assert path.stat().st_size == self.nbytes

    def test_new_file_reads_zeros(self, shard_file: ShardFile) -> None:
        out = filled(self.nbytes, seed=1)
        try:
            shard_file.read_into(out.view, 0)
            assert int(out.tensor.count_nonzero()) == 0
        finally:
            out.close()

    # -- reads return the last write -----------------------------------
    @pytest.mark.parametrize("pages, at", [(1, 0), (2, 3), (16, 0), (1, 15), (5, 11)])
    def test_read_after_write(self, shard_file: ShardFile, pages: int, at: int) -> None:
        src = filled(pages * PAGE, seed=pages * 100 + at)
        out = HostBuffer(pages * PAGE)
        try:
            shard_file.write_from(src.view, at * PAGE)
            shard_file.read_into(out.view, at * PAGE)
            assert torch.equal(out.tensor, src.tensor)
        finally:
            src.close()
            out.close()

    def test_offsets_are_honoured(self, shard_file: ShardFile) -> None:
        """Distinct bytes in every page, written in a scrambled order, read back each and whole."""
        pages = self.nbytes // PAGE
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(7)).tolist()
        expected = torch.empty(self.nbytes, dtype=torch.uint8)
        for k in order:
            src = filled(PAGE, seed=k)
            shard_file.write_from(src.view, k * PAGE)
            expected[k * PAGE : (k + 1) * PAGE] = src.tensor
            src.close()
        for k in reversed(order):
            out = HostBuffer(PAGE)
            shard_file.read_into(out.view, k * PAGE)
            assert torch.equal(out.tensor, expected[k * PAGE : (k + 1) * PAGE]), f"page {k}"
            out.close()
        whole = HostBuffer(self.nbytes)
        shard_file.read_into(whole.view, 0)
        assert torch.equal(whole.tensor, expected)
        whole.close()

    def test_overwrite_replaces(self, shard_file: ShardFile) -> None:
        first, second, out = filled(2 * PAGE, seed=1), filled(PAGE, seed=2), HostBuffer(2 * PAGE)
        try:
            shard_file.write_from(first.view, 0)
            shard_file.write_from(second.view, PAGE)
            shard_file.read_into(out.view, 0)
            assert torch.equal(out.tensor[:PAGE], first.tensor[:PAGE])
            assert torch.equal(out.tensor[PAGE:], second.tensor)
        finally:
            for b in (first, second, out):
                b.close()

    def test_random_writes_match_a_bytearray(self) -> None:
        # The property is built per call: Hypothesis refuses one @given method run
        # by several subclasses (it could not replay its examples reliably).
        pages = self.nbytes // PAGE
        extents = st.tuples(st.integers(0, pages - 1), st.integers(1, 4), st.integers(0, 2**31))

        @settings(max_examples=20, deadline=None)
        @given(writes=st.lists(extents, min_size=1, max_size=12))
        def check(writes: list[tuple[int, int, int]]) -> None:
            model = torch.zeros(self.nbytes, dtype=torch.uint8)
            with tempfile.TemporaryDirectory() as d:
                f = self.open_file(Path(d) / "shards.bin", self.nbytes, create=True)
                try:
                    for page, count, seed in writes:
                        count = min(count, pages - page)
                        src = filled(count * PAGE, seed)
                        f.write_from(src.view, page * PAGE)
                        model[page * PAGE : (page + count) * PAGE] = src.tensor
                        src.close()
                    out = HostBuffer(self.nbytes)
                    f.read_into(out.view, 0)
                    assert torch.equal(out.tensor, model)
                    out.close()
                finally:
                    f.close()

        check()

    def test_concurrent_requests(self, shard_file: ShardFile) -> None:
        """Positional I/O from several threads at once (the I/O queue does this)."""
        pages = self.nbytes // PAGE
        srcs = [filled(PAGE, seed=100 + k) for k in range(pages)]
        outs = [HostBuffer(PAGE) for _ in range(pages)]
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda k: shard_file.write_from(srcs[k].view, k * PAGE), range(pages)))
                list(pool.map(lambda k: shard_file.read_into(outs[k].view, k * PAGE), range(pages)))
            for k in range(pages):
                assert torch.equal(outs[k].tensor, srcs[k].tensor), f"page {k}"
        finally:
            for b in srcs + outs:
                b.close()

    def test_through_the_io_queue(self, shard_file: ShardFile) -> None:
        src, out = filled(self.nbytes, seed=3), HostBuffer(self.nbytes)
        try:
            with IOQueue(workers=3, request_bytes=2 * PAGE) as io:
                io.write(shard_file, src.view, 0).wait()
                io.read(shard_file, out.view, 0).wait()
                assert io.stats.bytes_written == io.stats.bytes_read == self.nbytes
            assert torch.equal(out.tensor, src.tensor)
        finally:
            src.close()
            out.close()

    # -- requests outside the file ------------------------------------
    def test_last_page_is_in_range(self, shard_file: ShardFile) -> None:
        src, out = filled(PAGE, seed=4), HostBuffer(PAGE)
        try:
            shard_file.write_from(src.view, self.nbytes - PAGE)
            shard_file.read_into(out.view, self.nbytes - PAGE)
            assert torch.equal(out.tensor, src.tensor)
        finally:
            src.close()
            out.close()

    @pytest.mark.parametrize("where", ["at_end", "across_end", "negative", "far"])
    def test_out_of_range_is_refused(self, shard_file: ShardFile, path: Path, where: str) -> None:
        offset, length = {
            "at_end": (self.nbytes, PAGE),
            "across_end": (self.nbytes - PAGE, 2 * PAGE),
            "negative": (-PAGE, PAGE),
            "far": (1 << 40, PAGE),
        }[where]
        buf = filled(length, seed=5)
        try:
            with pytest.raises(BackendError, match=str(offset)):
                shard_file.write_from(buf.view, offset)
            with pytest.raises(BackendError, match=str(offset)):
                shard_file.read_into(buf.view, offset)
        finally:
            buf.close()
        assert path.stat().st_size == self.nbytes, "a refused request changed the file's size"
        out = HostBuffer(self.nbytes)
        shard_file.read_into(out.view, 0)
        assert int(out.tensor.count_nonzero()) == 0, "a refused write changed the file"
        out.close()

    # -- durability and lifecycle -------------------------------------
    def test_sync_then_reopen_sees_the_data(self, path: Path) -> None:
        src = filled(self.nbytes, seed=6)
        with self.open_file(path, self.nbytes, create=True) as f:
            f.write_from(src.view, 0)
            f.sync()
        out = HostBuffer(self.nbytes)
        with self.open_file(path, self.nbytes, create=False) as f:
            f.read_into(out.view, 0)
        assert torch.equal(out.tensor, src.tensor)
        src.close()
        out.close()

    def test_sync_makes_written_ranges_survive_a_power_cut(self, tmp_path: Path) -> None:
        """Once ``sync()`` returns, a power cut keeps every write before it.

        Reopening after ``sync`` (the test above) reads the page cache and
        would pass a ``sync`` that does nothing. This records the system
        calls (``fsync``/``fdatasync``, or ``msync`` of the mapped range) and
        builds the worst image a power cut right after ``sync`` may leave.
        """
        if not self.observable:
            pytest.skip(f"backend {self.backend!r} is not observable by the power-cut recorder")
        root = tmp_path / "powercut"
        root.mkdir()
        src = filled(3 * PAGE, seed=12)
        expected = bytes(src.tensor.numpy())
        try:
            with Recorder(root) as rec:
                f = self.open_file(root / "shards.bin", self.nbytes, create=True)
                dfd = os.open(root, os.O_RDONLY)
                os.fsync(dfd)  # the file's name is durable: that is not the backend's job
                os.close(dfd)
                f.write_from(src.view, PAGE)
                f.write_from(src.view[:PAGE], self.nbytes - PAGE)
                f.sync()
                rec.phase("synced")
                f.close()
        finally:
            src.close()
        recording = rec.recording()
        cut = next(op.begin for op in recording.ops if op.kind == "phase") + 1
        image = recording.image(cut, seed=0, style="dropped")
        data = (image.files or {}).get("shards.bin", b"")
        survived = data[PAGE : 4 * PAGE] == expected and data[self.nbytes - PAGE :] == expected[:PAGE]
        assert survived, (
            f"sync() of {self.backend!r} returned, yet a power cut right after it would lose written bytes "
            f"(file {len(data)} of {self.nbytes} bytes after the cut): sync must fsync/fdatasync the file "
            "(or msync the mapped range) after the writes"
        )

    def test_sync_twice_and_without_writes(self, shard_file: ShardFile) -> None:
        shard_file.sync()
        shard_file.sync()

    def test_create_on_an_existing_file_extends_and_keeps_it(self, path: Path) -> None:
        src = filled(PAGE, seed=8)
        with self.open_file(path, 2 * PAGE, create=True) as f:
            f.write_from(src.view, PAGE)
            f.sync()
        out = HostBuffer(PAGE)
        with self.open_file(path, self.nbytes, create=True) as f:
            assert path.stat().st_size == self.nbytes
            f.read_into(out.view, PAGE)
        assert torch.equal(out.tensor, src.tensor)
        src.close()
        out.close()

    def test_empty_file(self, path: Path) -> None:
        """A store without shards opens a zero-byte file: that must work like any other."""
        with self.open_file(path, 0, create=True) as f:
            f.allocate(0, 0)
            f.sync()
        with self.open_file(path, 0, create=False) as f:
            assert f.nbytes == 0
        assert path.stat().st_size == 0

    def test_close_twice(self, shard_file: ShardFile) -> None:
        shard_file.close()
        shard_file.close()
        assert shard_file.closed

    def test_context_manager_closes(self, path: Path) -> None:
        with self.open_file(path, self.nbytes, create=True) as f:
            assert not f.closed
        assert f.closed

    # -- faults users can act on --------------------------------------
    def test_missing_file(self, path: Path) -> None:
        with pytest.raises(CorruptStateError, match="missing") as info:
            self.open_file(path, self.nbytes, create=False)
        assert str(path) in str(info.value)
        assert not path.exists(), "opening without create made the file"

    def test_truncated_file_on_open(self, path: Path) -> None:
        with self.open_file(path, self.nbytes, create=True):
            pass
        os.truncate(path, self.nbytes // 2)
        with pytest.raises(CorruptStateError, match="truncated") as info:
            self.open_file(path, self.nbytes, create=False)
        assert str(path) in str(info.value) and str(self.nbytes) in str(info.value)
        assert path.stat().st_size == self.nbytes // 2, "a failed open changed the file"

    def test_truncated_while_open(self, shard_file: ShardFile, path: Path) -> None:
        """A file cut short behind the backend's back is an error, never a crash (SIGBUS)."""
        os.truncate(path, PAGE)
        out = HostBuffer(2 * PAGE)
        try:
            with pytest.raises(CorruptStateError, match="truncated"):
                shard_file.read_into(out.view, self.nbytes - 2 * PAGE)
        finally:
            out.close()

    def test_allocate_reserves_ranges(self, shard_file: ShardFile, path: Path) -> None:
        shard_file.allocate(0, 2 * PAGE)
        shard_file.allocate(self.nbytes - PAGE, PAGE)
        shard_file.allocate(PAGE, 0)  # nothing to do
        assert path.stat().st_size == self.nbytes
        self.test_read_after_write(shard_file, 2, 0)

    @pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
    def test_no_space_to_allocate(self, shard_file: ShardFile, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
        monkeypatch.setattr(os, "posix_fallocate", _failing(os.posix_fallocate, err))
        with pytest.raises(DiskFullError) as info:
            shard_file.allocate(0, self.nbytes)
        assert str(shard_file.path) in str(info.value) and "space" in str(info.value)

    def test_allocate_without_fallocate_support_stays_sparse(
        self, shard_file: ShardFile, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(os, "posix_fallocate", _failing(os.posix_fallocate, errno.EOPNOTSUPP))
        shard_file.allocate(0, self.nbytes)  # filesystems without fallocate are not an error
        monkeypatch.undo()
        self.test_read_after_write(shard_file, 1, 0)

    @pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
    def test_no_space_while_writing(self, shard_file: ShardFile, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
        src = filled(PAGE, seed=9)
        try:
            self.inject_write_fault(monkeypatch, shard_file, err)
            with pytest.raises(DiskFullError) as info:
                shard_file.write_from(src.view, 0)
                shard_file.sync()
            assert str(shard_file.path) in str(info.value)
        finally:
            monkeypatch.undo()
            src.close()

    def test_other_write_faults_are_backend_errors(self, shard_file: ShardFile, monkeypatch: pytest.MonkeyPatch) -> None:
        src = filled(PAGE, seed=10)
        try:
            self.inject_write_fault(monkeypatch, shard_file, errno.EIO)
            with pytest.raises(BackendError) as info:
                shard_file.write_from(src.view, 0)
                shard_file.sync()
            assert not isinstance(info.value, DiskFullError)
            assert str(shard_file.path) in str(info.value)
        finally:
            monkeypatch.undo()
            src.close()

    def test_errors_are_tierstore_and_os_errors(self) -> None:
        for cls in (BackendError, CorruptStateError, DiskFullError):
            assert issubclass(cls, TierstoreError) and issubclass(cls, OSError)


def _failing(real, err: int):
    """A stand-in for the ``os`` function ``real`` that fails with ``OSError(err)``."""

    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    fail.__name__ = getattr(real, "__name__", "fail")
    return fail


__all__ = ["BackendTests", "WRITE_CALLS", "filled", "random_bytes"]
