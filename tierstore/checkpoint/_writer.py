"""Writing a checkpoint: one chunk per shard into a hidden sibling directory, synced, renamed into place.

:class:`CheckpointWriter` takes a :class:`~tierstore.checkpoint._zarr_format.CheckpointHeader`
and the chunks of each shard, in any source's order (an optimizer's arena,
a state reader, a torch state dict); ``path`` holds a complete checkpoint
or none.

Example
-------
>>> import tempfile, torch
>>> from tierstore._layout.layout import Layout, fields_for
>>> from tierstore._state.manifest import encode_groups
>>> from tierstore.checkpoint._zarr_format import CheckpointHeader
>>> w = torch.zeros(3, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=fields_for(amsgrad=False, master=False))
>>> groups = encode_groups(torch.optim.AdamW([w]).param_groups)
>>> header = CheckpointHeader(layout=layout, step_count=0, param_groups=groups, param_steps=[None], source="torch")
>>> path = tempfile.mkdtemp() + "/ckpt.zarr"
>>> with CheckpointWriter(path, header, overwrite=False, checksum="xxh3") as writer:
...     for shard in layout.shards:
...         for field in layout.fields:
...             writer.write(shard, field, torch.zeros(shard.capacity))
>>> sorted(p.name for p in Path(path).iterdir())
['exp_avg', 'exp_avg_sq', 'zarr.json']
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec

from .._compute import formats
from .._layout.layout import ShardSpec
from .._state.statedir import fsync_dir
from .._storage.chunkfile import ChunkFiles, sync_and_drop
from .._storage.integrity import shard_checksum
from ..errors import CheckpointExistsError, ConfigError, DiskFullError
from ._files import file_kind, fsync_file
from ._zarr_format import (
    CHECKSUMS,
    CheckpointHeader,
    array_specs,
    is_checkpoint,
    numpy_codes,
    scales_name,
)

__all__ = ["CheckpointWriter", "SYNC_WINDOW"]

SYNC_WINDOW = 2  # shards whose chunk files may still be syncing while the next is written


class CheckpointWriter:
    """Writes one chunk per shard into a hidden sibling of ``path``; renames it into place on success."""

    def __init__(self, path: str | os.PathLike, header: CheckpointHeader, *, overwrite: bool, checksum: str | None) -> None:
        if checksum not in CHECKSUMS:
            raise ConfigError(f"checksum={checksum!r} is unknown; choose 'xxh3' (default), 'crc32c' or None")
        self.path = Path(path).expanduser()
        self.overwrite = bool(overwrite)
        self.checksum = checksum
        self.layout = header.layout
        self._check_target()
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{self.path.name}.partial-"))
        try:
            group = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
            group.attrs.put(header.attributes(checksum))
            self.arrays = {}
            for field in self.layout.fields:
                for name, (dtype, numel, chunk, attributes) in array_specs(self.layout, field).items():
                    self.arrays[name] = group.create_array(
                        name,
                        shape=(numel,),
                        chunks=(chunk,),
                        dtype=dtype,
                        fill_value=0,
                        compressors=[Crc32cCodec()] if checksum == "crc32c" else None,
                        # Every chunk is stored, zeros too: a missing chunk file is then corruption.
                        config={"write_empty_chunks": True},
                        attributes=attributes,
                    )
            # Float32 chunk files are written straight from the caller's buffer (zarr would copy each one).
            self.files = {name: ChunkFiles.of(self.tmp / name, array) for name, array in self.arrays.items()}
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.digests: dict[str, list[str | None]] = {name: [None] * len(self.layout.shards) for name in self.arrays}
        self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-checkpoint-sync")
        self._syncs: deque[Future] = deque()

    def _check_target(self) -> None:
        """Refuse a target ``overwrite`` may not replace: anything but a tierstore checkpoint directory.

        The target is examined with ``lstat``: a symlink is never followed, so
        a link planted at the path cannot make the replacement land elsewhere.
        """
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not self.overwrite:
            raise CheckpointExistsError(
                f"checkpoint path {str(self.path)!r} already exists; pass overwrite=True to replace it, "
                "or choose another path"
            )
        if not stat.S_ISDIR(st.st_mode) or not is_checkpoint(self.path):
            # Never delete what is not ours (a typo could name $HOME, a link could point anywhere).
            what = "a directory that is not a tierstore checkpoint" if stat.S_ISDIR(st.st_mode) else file_kind(st.st_mode)
            raise CheckpointExistsError(
                f"{str(self.path)!r} exists and is {what}, so overwrite=True will not replace it (it replaces "
                "only a tierstore checkpoint directory); remove it yourself or choose another path"
            )

    def write(self, shard: ShardSpec, field: str, data: torch.Tensor) -> None:
        """Store ``data`` (``shard.capacity`` fp32 elements) as the shard's chunk of an fp32 ``field``.

        Raises
        ------
        DiskFullError
            If the drive is full (nothing is left at ``path``).
        """
        self._put(self.layout.state_key(field), shard, shard.start, data.numpy())

    def write_stored(self, shard: ShardSpec, field: str, stored: torch.Tensor) -> None:
        """Store a field's stored bytes (from a shard's extent, in the layout's format) as its chunks."""
        layout = self.layout
        if field not in layout.encoded_fields or not layout.encoded:
            self.write(shard, field, stored.view(torch.float32)[: shard.capacity])
            return
        fmt = layout.format
        codes, scales = formats.split(fmt, stored, shard.capacity)
        self._put(layout.state_key(field), shard, shard.start, numpy_codes(codes))
        if scales is not None:
            self._put(scales_name(layout, field), shard, shard.start // fmt.block_numel, scales.numpy())

    def _put(self, name: str, shard: ShardSpec, lo: int, values: np.ndarray) -> None:
        array = self.arrays[name]
        files = self.files[name]
        try:
            if files is not None:  # a chunk is a shard's part: chunk index = shard index
                _write_chunk_file(files, shard.index, memoryview(values).cast("B"))
            else:  # a code array (or an encoding tierstore does not write itself): zarr's path
                array[lo : lo + values.size] = values
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"disk full while writing checkpoint {str(self.path)!r}; free space on that drive or "
                    "write the checkpoint elsewhere (nothing was left at that path)"
                ) from exc
            raise
        if self.checksum == "xxh3":
            self.digests[name][shard.index] = shard_checksum(memoryview(values).cast("B"))
        chunk_file = self.tmp / name / array.metadata.encode_chunk_key((shard.index,))
        self._syncs.append(self._sync_pool.submit(sync_and_drop, chunk_file))
        # Sync behind the writes, at most two shards behind: the drive works while the
        # next shards are written, and dirty page cache stays bounded for huge states.
        while len(self._syncs) > SYNC_WINDOW * len(self.arrays):
            self._syncs.popleft().result()

    def finish(self) -> None:
        """Record the checksums, make every file durable, and rename the checkpoint into place."""
        if self.checksum == "xxh3":
            for name, digests in self.digests.items():
                missing = [i for i, d in enumerate(digests) if d is None]
                if missing:  # a bug in the caller, not a user error
                    raise RuntimeError(f"checkpoint array {name} is missing shards {missing[:5]}; this is a bug")
                self.arrays[name].attrs.update({"chunk_checksum": "xxh3_64", "chunk_checksums": digests})
        self._drain()
        for dirpath, _dirnames, filenames in os.walk(self.tmp):
            for name in filenames:
                if name == "zarr.json":
                    fsync_file(Path(dirpath) / name)
            fsync_dir(Path(dirpath))
        old = None
        self._check_target()  # again: the path may have changed while the checkpoint was written
        if os.path.lexists(self.path):
            old = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.old-"))
            os.rename(self.path, old / "ckpt")
        try:
            os.rename(self.tmp, self.path)  # a directory is renamed only onto a missing or empty one
        except OSError as exc:
            if old is not None:
                with contextlib.suppress(OSError):
                    os.rename(old / "ckpt", self.path)
            raise CheckpointExistsError(
                f"cannot move the new checkpoint into {str(self.path)!r} ({exc.strerror}): something was put "
                "there while it was written; remove it or choose another path"
            ) from exc
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _drain(self) -> None:
        try:
            while self._syncs:
                self._syncs.popleft().result()
        finally:
            self._sync_pool.shutdown(wait=True)

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # already failing: the first error is what matters
            self._drain()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finish()
        except BaseException:
            self.abort()
            raise


def _write_chunk_file(files: ChunkFiles, index: int, data: memoryview) -> None:
    """Write one chunk file (a seam: the disk-full test makes it raise ``ENOSPC``)."""
    files.write(index, data)
