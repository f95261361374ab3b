"""Streaming checkpoints in zarr v3, and conversions to and from ``torch.optim.AdamW`` state dicts.

A checkpoint is a zarr v3 group holding one 1-D array per state field
(``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` / ``master_param`` when
present) over the layout's flat index space, chunked so that every shard is
exactly one chunk. The group's attributes name the format, the layout, the
step counts, the param groups and a parameter index, so plain ``zarr`` reads
any parameter's state without tierstore::

    g = zarr.open_group(path, mode="r")
    p = g.attrs["params"][3]
    exp_avg = g["exp_avg"][p["start"] : p["start"] + p["numel"]].reshape(p["shape"])

Moments are stored in the optimizer's ``moment_dtype`` (the group attribute
``moment_dtype``; float32 when absent): float32 arrays as above; ``bfloat16``
as uint16 arrays of the bfloat16 bits (``(codes.astype("uint32") << 16).view("float32")``);
``int8`` as uint8 code arrays plus a float32 ``<key>_scales`` array (one
scale per 256 elements) and the 255-value map in the code array's ``map``
attribute (``map[code] * scales[i // 256]`` in float32 at flat index ``i``;
code 255 is NaN). Loading
converts: a checkpoint of any format loads into an optimizer of any format
(same format: the stored bytes are copied; otherwise decoded and encoded).

Saving streams shard by shard through the optimizer's arena (one chunk of
each field in flight), loading streams back; both go through the optimizer's
public access protocol (:mod:`tierstore._runtime.access`: ``visit_shards``,
``replace_shards``). The chunk files of float32 arrays (masters, fp32
moments, int8 scales) are written from and read into the arena itself
(:mod:`tierstore._storage.chunkfile`; zarr writes and reads the metadata), so they
need no RAM beyond ``ram_budget`` but a 1 MiB scratch buffer, used when the
loading optimizer cuts its shards elsewhere than the checkpoint's chunks;
the code arrays of a compressed format (a half or a quarter of a float32
chunk) go through zarr, one chunk in flight. The full layout is in
``docs/checkpoints.md``.

A checkpoint is written into a hidden sibling directory, synced, and renamed
into place, so ``path`` holds a complete checkpoint or none.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> d = tempfile.mkdtemp()
>>> w = torch.nn.Parameter(torch.ones(10))
>>> with TieredAdamW([w], lr=0.1) as opt:
...     w.grad = torch.ones(10); _ = opt.step()
...     opt.save_checkpoint(f"{d}/ckpt.zarr")
>>> sd = checkpoint_to_state_dict(f"{d}/ckpt.zarr")
>>> sd["state"][0]["exp_avg"][:2].tolist(), float(sd["state"][0]["step"])
([0.10000000149011612, 0.10000000149011612], 1.0)
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import mmap
import os
import secrets
import shutil
import stat
import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype

from ._compute import codecs
from ._compute.hyper import check_hyper
from ._layout.layout import (
    DEFAULT_SHARD_NUMEL,
    FIELD_OF_STATE_KEY,
    MASTER_KEY,
    MAX_PARAMS,
    MOMENT_FIELDS,
    STATE_KEY_OF_FIELD,
    Layout,
    ShardSpec,
    fields_for,
)
from ._layout.torch_format import empty_state_dict, flat_sources, positions, require_amsgrad_field
from ._runtime.access import ShardAccess
from ._state import manifest as manifest_mod
from ._state.statedir import fsync_dir
from ._storage.chunkfile import SCRATCH_NBYTES, ChunkFiles, sync_and_drop
from ._storage.integrity import BlockDigests, shard_checksum
from ._version import __version__
from .errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptStateError,
    DiskFullError,
    FormatVersionError,
    LayoutMismatchError,
    StateDirError,
)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "export_statedir",
    "checkpoint_to_state_dict",
    "statedir_to_state_dict",
    "state_dict_to_checkpoint",
    "verify_checkpoint",
    "read_checkpoint_attributes",
    "FORMAT_NAME",
    "FORMAT_VERSION",
]

log = logging.getLogger(__name__)

FORMAT_NAME = "tierstore-checkpoint"
FORMAT_VERSION = 2  # 2: compressed moments (written only for them; float32 checkpoints stay version 1)
SCALES_SUFFIX = "_scales"
CHECKSUMS = ("xxh3", "crc32c", None)
SYNC_WINDOW = 2  # shards whose chunk files may still be syncing while the next is written
MAX_METADATA_NBYTES = 256 << 20  # 256 MiB: a zarr.json (the group's holds ~200 B per parameter)
MAX_STEP = 1 << 53  # the largest step count read back (every whole number up to it is a float)


@dataclass(frozen=True)
class _Header:
    """What a checkpoint records besides the arrays."""

    layout: Layout
    step_count: int
    param_groups: list[dict[str, Any]]  # encoded (manifest.encode_groups), without "params"
    param_steps: list[float | None]
    source: str  # "optimizer", "state_dir" or "torch"
    known_shapes: list[bool] | None = None  # torch-made checkpoints: shapes of stateless params are unknown
    has_master: list[bool] | None = None  # torch-made checkpoints: which params came with a master

    def attributes(self, checksum: str | None) -> dict[str, Any]:
        layout = self.layout
        index = []
        for p in layout.params:
            entry = {
                "index": p.index,
                "group": p.group,
                "shape": list(p.shape) if self.known_shapes is None or self.known_shapes[p.index] else None,
                "dtype": p.dtype,
                "start": p.start,
                "numel": p.numel,
                "trainable": p.trainable,
            }
            if "master" in layout.fields:
                entry["has_master"] = p.trainable and (self.has_master is None or self.has_master[p.index])
            index.append(entry)
        fmt = layout.format
        extra = {}
        if layout.encoded:
            extra = {
                "moment_dtype": fmt.name,
                "scale_arrays": {
                    STATE_KEY_OF_FIELD[f]: _scales_name(f) for f in layout.fields if f in MOMENT_FIELDS and fmt.block_numel
                },
            }
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION if layout.encoded else 1,
            **extra,
            "tierstore_version": __version__,
            "source": self.source,
            "fingerprint": layout.fingerprint,
            "layout": layout.to_dict(),
            "total_numel": layout.total_numel,
            "shard_numel": layout.shard_numel,
            "arrays": [STATE_KEY_OF_FIELD[f] for f in layout.fields],
            "checksum": checksum,
            "step_count": int(self.step_count),
            "param_groups": self.param_groups,
            "param_steps": [None if s is None else float(s) for s in self.param_steps],
            "params": index,
        }


# -- writing ---------------------------------------------------------------


class _Writer:
    """Writes one chunk per shard into a hidden sibling of ``path``; renames it into place on success."""

    def __init__(self, path: str | os.PathLike, header: _Header, *, overwrite: bool, checksum: str | None) -> None:
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
                for name, (dtype, numel, chunk, attributes) in _array_specs(self.layout, field).items():
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
        if not stat.S_ISDIR(st.st_mode) or not _is_checkpoint(self.path):
            # Never delete what is not ours (a typo could name $HOME, a link could point anywhere).
            what = "a directory that is not a tierstore checkpoint" if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode)
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
        self._put(STATE_KEY_OF_FIELD[field], shard, shard.start, data.numpy())

    def write_stored(self, shard: ShardSpec, field: str, stored: torch.Tensor) -> None:
        """Store a field's stored bytes (from a shard's extent, in the layout's format) as its chunks."""
        layout = self.layout
        if field not in MOMENT_FIELDS or not layout.encoded:
            self.write(shard, field, stored.view(torch.float32)[: shard.capacity])
            return
        fmt = layout.format
        codes, scales = codecs.split(fmt, stored, shard.capacity)
        self._put(STATE_KEY_OF_FIELD[field], shard, shard.start, _numpy_codes(codes))
        if scales is not None:
            self._put(_scales_name(field), shard, shard.start // fmt.block_numel, scales.numpy())

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
                    _fsync_file(Path(dirpath) / name)
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

    def __enter__(self) -> _Writer:
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


def _scales_name(field: str) -> str:
    return STATE_KEY_OF_FIELD[field] + SCALES_SUFFIX


def _numpy_codes(codes: torch.Tensor) -> np.ndarray:
    """Codes as NumPy (bfloat16 as the uint16 of its bits: NumPy has no bfloat16)."""
    if codes.dtype == torch.bfloat16:
        return codes.view(torch.int16).numpy().view(np.uint16)
    return codes.numpy()


def _array_specs(layout: Layout, field: str) -> dict[str, tuple[str, int, int, dict[str, Any]]]:
    """The arrays holding ``field`` in a checkpoint of ``layout``: name -> (dtype, length, chunk, attributes)."""
    total, chunk, fmt = layout.total_numel, layout.shard_numel, layout.format
    key = STATE_KEY_OF_FIELD[field]
    if field not in MOMENT_FIELDS or fmt.exact:
        return {key: ("float32", total, chunk, {"field": field})}
    if fmt.code_itemsize == 2:
        return {key: ("uint16", total, chunk, {
            "field": field, "encoding": "bfloat16",
            "decode": "(codes.astype('uint32') << 16).view('float32')",
        })}
    bn = fmt.block_numel
    values = codecs.int8_map(fmt, field)
    return {
        key: ("uint8", total, chunk, {
            "field": field, "encoding": "int8-blockwise", "block_numel": bn, "scales": _scales_name(field),
            "nonfinite_code": codecs.NONFINITE_CODE, "map": [float(v) for v in values],
            "decode": "numpy.append(map, numpy.nan).astype('float32')[codes] * scales[i // block_numel] (i: the flat index)",
        }),
        _scales_name(field): ("float32", total // bn, chunk // bn, {"field": field, "scales_of": key, "block_numel": bn}),
    }


def _chunk_file_nbytes(arr: Any) -> int:
    """Bytes of every chunk file of a checkpoint array (edge chunks are stored whole; crc32c adds 4)."""
    crc = any(isinstance(c, Crc32cCodec) for c in arr.metadata.codecs)
    return arr.chunks[0] * arr.dtype.itemsize + (4 if crc else 0)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory whose own ``zarr.json`` (a regular file, read without following
    links and bounded in size) names the tierstore checkpoint format."""
    try:
        raw = _read_regular(path / "zarr.json", MAX_METADATA_NBYTES)
        attrs = json.loads(raw).get("attributes", {})
        return isinstance(attrs, dict) and attrs.get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable or not JSON: not a checkpoint
        return False


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path``: a regular file (never through a link, never a FIFO) of at most ``limit`` bytes.

    Raises
    ------
    OSError
        If it cannot be opened, is a link (``ELOOP``), is not a regular file
        or is larger than ``limit`` (``EFBIG``).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{path} holds {st.st_size} bytes, more than {limit}")
        chunks, left = [], limit + 1
        while left > 0 and (piece := os.read(fd, min(left, 1 << 20))):
            chunks.append(piece)
            left -= len(piece)
        if left <= 0:
            raise OSError(errno.EFBIG, f"{path} grew past {limit} bytes while read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_output_file(path: str | os.PathLike, write: Callable[[Any], object], *, overwrite: bool) -> Path:
    """Write a file at ``path`` atomically: ``write(file)`` fills a new temporary beside it, which then replaces it.

    The temporary is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``,
    a random name in the target's directory), so a file or link planted
    under its name is never written through; it is synced and renamed over
    the target, so ``path`` holds the old file or the complete new one.
    ``overwrite`` replaces only a regular file: a directory, link, FIFO,
    socket or device at ``path`` is refused, never followed or truncated.

    Parameters
    ----------
    path
        The file to create (its directory must exist).
    write
        Called with the temporary opened for binary writing (e.g.
        ``lambda f: torch.save(obj, f)``).
    overwrite
        Replace an existing regular file at ``path``.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    CheckpointExistsError
        If ``path`` exists and ``overwrite`` is false, or it is not a regular file.
    StateDirError
        If the directory of ``path`` does not exist or cannot be written.
    DiskFullError
        If the drive fills up (the temporary is removed, ``path`` is untouched).

    Example
    -------
    >>> import tempfile
    >>> out = write_output_file(tempfile.mkdtemp() + "/x.bin", lambda f: f.write(b"hi"), overwrite=False)
    >>> out.read_bytes()
    b'hi'
    """
    path = Path(path).expanduser()

    def check() -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not overwrite:
            raise CheckpointExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it, or choose another path")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointExistsError(
                f"{str(path)!r} is {_kind(st.st_mode)}, so it is not replaced (overwrite replaces only a regular "
                "file); remove it yourself or choose another path"
            )

    check()
    parent = path.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = parent / f".{path.name}.{secrets.token_hex(8)}.partial"
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as to any file the user writes
            break
        except FileExistsError:
            continue  # that name is taken (by a planted file or link too): draw another
        except OSError as exc:
            raise StateDirError(
                f"cannot create a file in {str(parent)!r} ({exc.strerror}); pass an output path in an existing, "
                "writable directory"
            ) from exc
    else:  # pragma: no cover - 100 random 64-bit names all taken
        raise StateDirError(f"cannot find a free temporary name in {str(parent)!r}")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        check()  # again: the target may have changed while the file was written
        os.replace(tmp, path)  # replaces a link itself, never its target
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"disk full while writing {str(path)!r}; free space on that drive or write elsewhere") from exc
        raise
    fsync_dir(parent)
    return path


def save_checkpoint(opt: ShardAccess, path: str | os.PathLike, *, overwrite: bool = False, checksum: str | None = "xxh3") -> None:
    """Stream an optimizer's state into a zarr v3 checkpoint at ``path``, one chunk per shard.

    Shards are visited read-only, disk shards through the optimizer's arena,
    so the RAM used beyond ``ram_budget`` is about one chunk of one field.
    The checkpoint appears at ``path`` only once it is complete and synced.

    Parameters
    ----------
    opt
        An open :class:`~tierstore.TieredAdamW` (any :class:`~tierstore._runtime.access.ShardAccess`).
    path
        Directory of the zarr group to create (local filesystem).
    overwrite
        Replace an existing checkpoint at ``path`` (only a tierstore
        checkpoint is ever replaced; the old one is removed after the new
        one is in place).
    checksum
        ``"xxh3"`` (default): a 64-bit xxHash of every chunk in the array's
        attributes, verified by :func:`load_checkpoint`; ``"crc32c"``: zarr's
        crc32c codec, verified by any zarr reader but about 7 ms slower per
        16 MiB chunk; ``None``: no checksum.

    Raises
    ------
    CheckpointExistsError
        If ``path`` exists and ``overwrite`` is false, or it is not a checkpoint.
    ConfigError
        For an unknown ``checksum``.
    ClosedError, StepFailedError
        If the optimizer is closed or failed.

    Example
    -------
    >>> import tempfile, torch, zarr
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> [round(float(x), 6) for x in zarr.open_group(path, mode="r")["exp_avg_sq"][:3]]
    [0.001, 0.001, 0.001]
    """
    layout = opt.layout
    header = _Header(
        layout=layout,
        step_count=opt.step_count,
        param_groups=manifest_mod.encode_groups(opt.param_groups),
        param_steps=opt.param_steps(),
        source="optimizer",
    )
    with _Writer(path, header, overwrite=overwrite, checksum=checksum) as writer:

        def visit(shard: ShardSpec, extent: torch.Tensor) -> None:
            for field in layout.fields:
                writer.write_stored(shard, field, layout.stored_field(extent, shard, field))

        opt.visit_stored(visit)  # the stored bytes: a compressed format is copied, not decoded
    log.info("saved checkpoint of step %d to %s", opt.step_count, path)


def export_statedir(
    state_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    checksum: str | None = "xxh3",
    progress: Callable[[int], object] | None = None,
) -> None:
    """Stream a state directory's last commit into a zarr v3 checkpoint (no optimizer, no model).

    Every shard is read once and verified against its checksum before it is
    written; about one shard of RAM is used.

    Parameters
    ----------
    state_dir
        A tierstore state directory (it may be in use: its committed copies
        stay intact for one more step; a checksum error means it moved on twice, rerun).
    path, overwrite, checksum
        As :func:`save_checkpoint`.
    progress
        Called with the bytes of each shard done (for a progress bar).

    Raises
    ------
    CorruptStateError
        If the manifest or any shard is corrupt, or the state was left dirty.
    FormatVersionError
        If the state directory was written by a newer tierstore.
    CheckpointExistsError
        As :func:`save_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d + "/state") as opt:
    ...     _ = opt.step()
    >>> export_statedir(d + "/state", d + "/ckpt.zarr")
    >>> float(checkpoint_to_state_dict(d + "/ckpt.zarr")["state"][0]["step"])
    1.0
    """
    with open_state_reader(state_dir) as reader:
        _require_clean(reader)
        step_count, param_steps, _ = check_manifest_header(reader)
        header = _Header(
            layout=reader.layout,
            step_count=step_count,
            param_groups=list(reader.manifest["param_groups"]),  # checked, still encoded as saved
            param_steps=param_steps,
            source="state_dir",
        )
        with _Writer(path, header, overwrite=overwrite, checksum=checksum) as writer:
            for shard, extent in reader.iter_extents():
                for field in reader.layout.fields:
                    writer.write_stored(shard, field, reader.layout.stored_field(extent, shard, field))
                if progress is not None:
                    progress(reader.layout.shard_nbytes(shard))


def _require_clean(reader: Any) -> None:
    if not reader.clean:
        raise CorruptStateError(
            f"{reader.path} was written with durable=False by a run that did not close() cleanly, so "
            "its files mix several steps; there is no consistent state to read"
        )


def check_state_files(state_dir: str | os.PathLike) -> Path:
    """Check that ``state_dir`` is a directory whose manifest and state files are regular files.

    Runs before anything in the directory is opened: a FIFO in place of a
    shard file or the manifest would hang a read, a device would feed it
    without end, a link would point it outside the directory.

    Returns
    -------
    Path
        The directory.

    Raises
    ------
    StateDirError
        If ``state_dir`` does not exist or is not a directory.
    CorruptStateError
        If its manifest or a state file is a link, FIFO, socket, device or directory.

    Example
    -------
    >>> import tempfile
    >>> check_state_files(tempfile.mkdtemp()).is_dir()
    True
    """
    from ._state.statedir import MANIFEST
    from ._storage.store import STATE_FILES

    path = Path(state_dir).expanduser()
    try:
        top = os.stat(path)  # the directory the caller named may be a link; nothing inside it may
    except FileNotFoundError:
        raise StateDirError(f"state directory {str(path)!r} does not exist; pass the state_dir a TieredAdamW wrote") from None
    except OSError as exc:
        raise StateDirError(f"cannot read state directory {str(path)!r} ({exc.strerror}); check the path and its permissions") from exc
    if not stat.S_ISDIR(top.st_mode):
        raise StateDirError(f"state directory {str(path)!r} is {_kind(top.st_mode)}, not a directory; pass the state_dir a TieredAdamW wrote")
    for name in (MANIFEST, *STATE_FILES):
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            continue  # the reader says what a missing file means
        except OSError as exc:
            raise CorruptStateError(f"cannot read {path / name} ({exc.strerror}); check its permissions") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStateError(
                f"{path / name} is {_kind(st.st_mode)}, not a regular file; a state directory holds only regular "
                "files, so it is not read. Restore the state directory from a checkpoint"
            )
    return path


def open_state_reader(state_dir: str | os.PathLike) -> Any:
    """A :class:`~tierstore._state.reader.StateReader` over ``state_dir``, its files checked first (:func:`check_state_files`)
    and its manifest's step counts, param groups and shard records checked (:func:`check_manifest_header`).

    Raises
    ------
    StateDirError, CorruptStateError
        As :func:`check_state_files` and :func:`check_manifest_header`.
    FormatVersionError
        If the manifest was written by another format version.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d) as opt:
    ...     _ = opt.step()
    >>> with open_state_reader(d) as reader:
    ...     reader.step_count
    1
    """
    from ._state.reader import StateReader

    reader = StateReader(check_state_files(state_dir))
    try:
        check_manifest_header(reader)
    except BaseException:
        reader.close()
        raise
    return reader


def check_manifest_header(reader: Any) -> tuple[int, list[float | None], list[dict[str, Any]]]:
    """A state directory's step counts and param groups, checked as a checkpoint's are (:func:`_check_header`),
    and its shard records (one per shard of the layout, each naming copy 0 or 1).

    Raises
    ------
    CorruptStateError
        Naming the manifest and the value.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d) as opt:
    ...     _ = opt.step()
    >>> with open_state_reader(d) as reader:
    ...     check_manifest_header(reader)[:2]
    (1, [1.0])
    """
    from ._state.statedir import MANIFEST

    m = reader.manifest
    where = f"the manifest {reader.path / MANIFEST}"
    header = _check_header(
        where, reader.layout, step_count=m.get("step_count"), param_steps=m.get("param_steps"), param_groups=m.get("param_groups")
    )
    records = m.get("shards")
    if not isinstance(records, list) or len(records) != len(reader.layout.shards):
        count = len(records) if isinstance(records, list) else type(records).__name__
        raise CorruptStateError(f"{where} has {count} shard records for the {len(reader.layout.shards)} shards of its layout")
    for i, rec in enumerate(records):
        if (
            not isinstance(rec, dict)
            or type(rec.get("copy")) is not int
            or rec["copy"] not in (0, 1)
            or not (rec.get("checksum") is None or isinstance(rec.get("checksum"), str))
            or not (rec.get("stale_checksum") is None or isinstance(rec.get("stale_checksum"), str))
        ):
            raise CorruptStateError(f"{where} has a malformed record for shard {i}: {rec!r}; restore the state directory from a checkpoint")
    return header


# -- reading ---------------------------------------------------------------


class _Checkpoint:
    """An opened checkpoint: attributes checked, arrays opened, chunks read and verified.

    Nothing in a checkpoint is trusted before it is checked: every entry must
    be a regular file or a directory (a symlink, FIFO or device is refused
    before zarr opens anything), metadata files are bounded in size, the
    attributes must describe the layout they carry (parameter index, arrays,
    formats and their block sizes, step counts, hyperparameters torch's
    ``AdamW`` accepts), and every chunk file must be there with its size.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        entries = _scan_checkpoint(self.path)
        try:
            group = zarr.open_group(str(self.path), mode="r")
            attrs = group.attrs.asdict()
        except Exception as exc:  # zarr raises many kinds on a damaged zarr.json
            raise CorruptStateError(
                f"cannot open the checkpoint {self.path}: {exc}; the checkpoint is damaged, write it again"
            ) from exc
        fmt, version = attrs.get("format"), attrs.get("format_version")
        if fmt != FORMAT_NAME:
            raise FormatVersionError(
                f"{self.path} is a zarr group but not a tierstore checkpoint (format={fmt!r}); pass a "
                "path written by save_checkpoint"
            )
        if type(version) is not int or version > FORMAT_VERSION or version < 1:
            raise FormatVersionError(
                f"{self.path} has checkpoint format_version {version!r}; this tierstore reads "
                f"{FORMAT_NAME} versions up to {FORMAT_VERSION}. Upgrade tierstore to load it"
            )
        self.attrs = attrs
        try:
            self.layout = manifest_mod.saved_layout(attrs, str(self.path))
        except CorruptStateError as exc:
            raise CorruptStateError(f"{exc}; the checkpoint is damaged, write it again") from exc
        header = _check_header(
            f"checkpoint {self.path}",
            self.layout,
            step_count=attrs.get("step_count"),
            param_steps=attrs.get("param_steps"),
            param_groups=attrs.get("param_groups"),
        )
        self.step_count, self.param_steps, self.param_groups = header
        self.params: list[dict] = _check_param_index(attrs, self.layout, str(self.path))
        names = self._check_arrays_attribute(attrs, version)
        self.format = self.layout.format
        self.arrays: dict[str, Any] = {}  # field -> its (code) array
        self.scales: dict[str, Any] = {}  # field -> its scales array (int8)
        self.chunk_checksums: dict[str, list[str] | None] = {}  # array name -> per-chunk checksums
        self.files: dict[str, ChunkFiles | None] = {}  # array name -> its chunk files (float32 arrays)
        checksum = attrs.get("checksum")
        for name in names:
            field = FIELD_OF_STATE_KEY[name]
            for array_name, spec in _array_specs(self.layout, field).items():
                arr = self._open_array(group, array_name, spec, entries, crc32c=checksum == "crc32c")
                if array_name == name:
                    self.arrays[field] = arr
                else:
                    self.scales[field] = arr
                self.chunk_checksums[array_name] = self._chunk_checksums(arr, array_name) if checksum == "xxh3" else None
                self.files[array_name] = ChunkFiles.of(self.path / array_name, arr)
        self._cache: dict[str, tuple[int, np.ndarray]] = {}  # array name or field -> (chunk, its values)
        self._stream: mmap.mmap | None = None  # 1 MiB, for chunks only partly wanted (unmapped with the checkpoint)

    def _check_arrays_attribute(self, attrs: dict[str, Any], version: int) -> list[str]:
        """The arrays the checkpoint lists: exactly one per field of its layout, and the attributes that go with them."""
        layout = self.layout
        where = f"checkpoint {self.path}"
        expected = [STATE_KEY_OF_FIELD[f] for f in layout.fields]
        names = attrs.get("arrays")
        if not _same(names, expected):
            missing = [n for n in expected if not isinstance(names, list) or n not in names]
            raise CorruptStateError(
                f"{where} lists arrays {names!r}; its layout holds {expected}"
                + (f" (missing {missing}: a missing moment is never read as zeros)" if missing else "")
                + ". The checkpoint is damaged, write it again"
            )
        for field in ("exp_avg", "exp_avg_sq"):
            if field not in layout.fields:
                raise CorruptStateError(f"{where} has no {field} array (its layout holds {list(layout.fields)}); it is not an AdamW checkpoint")
        checks: dict[str, Any] = {"shard_numel": layout.shard_numel, "total_numel": layout.total_numel}
        if layout.encoded:
            checks["moment_dtype"] = layout.format.name
            checks["scale_arrays"] = {
                STATE_KEY_OF_FIELD[f]: _scales_name(f) for f in layout.fields if f in MOMENT_FIELDS and layout.format.block_numel
            }
            if version < 2:
                raise CorruptStateError(f"{where} holds {layout.format.name} moments but says format_version {version}; they came with version 2")
        elif "moment_dtype" in attrs or "scale_arrays" in attrs:
            raise CorruptStateError(f"{where} has moment_dtype/scale_arrays attributes but its layout holds float32 moments")
        for key, value in checks.items():
            if not _same(attrs.get(key), value):
                raise CorruptStateError(f"{where} has {key}={attrs.get(key)!r}; its layout says {value!r}. The checkpoint is damaged, write it again")
        if attrs.get("checksum") not in CHECKSUMS:
            raise CorruptStateError(f"{where} has checksum={attrs.get('checksum')!r}; known checksums are {list(CHECKSUMS)}")
        return names

    def _chunk_checksums(self, arr: Any, name: str) -> list[str]:
        where = f"array {name} of checkpoint {self.path}"
        sums = arr.attrs.get("chunk_checksums")
        if arr.attrs.get("chunk_checksum") != "xxh3_64" or not isinstance(sums, list) or len(sums) != len(self.layout.shards):
            raise CorruptStateError(f"{where} lacks its chunk checksums (the checkpoint says checksum='xxh3'); write it again")
        if not all(isinstance(d, str) and len(d) == 16 for d in sums):
            raise CorruptStateError(f"{where} has chunk checksums that are not 16-digit xxh3 hex strings; write it again")
        return sums

    def _open_array(
        self, group: Any, name: str, spec: tuple[str, int, int, dict], entries: dict[str, int], *, crc32c: bool
    ) -> Any:
        where = f"array {name} of checkpoint {self.path}"
        try:
            arr = group[name]
        except Exception as exc:
            raise CorruptStateError(f"{where} is missing or unreadable ({exc}); the checkpoint is damaged") from exc
        dtype, numel, chunk, attributes = spec
        if (
            not isinstance(arr, zarr.Array)
            or tuple(arr.shape) != (numel,)
            or tuple(arr.chunks) != (chunk,)
            or arr.dtype != np.dtype(dtype)
        ):
            raise CorruptStateError(
                f"{where} is {getattr(arr, 'shape', '?')} {getattr(arr, 'dtype', '?')} in chunks of "
                f"{getattr(arr, 'chunks', '?')}; its layout needs ({numel},) {dtype} in chunks of ({chunk},)"
            )
        # Only the codecs tierstore writes: the chunk files then have a known size, and no
        # codec can expand a small file into a large allocation.
        codecs_ = tuple(arr.metadata.codecs)
        plain = (
            len(codecs_) == 1 + crc32c
            and isinstance(codecs_[0], BytesCodec)
            and getattr(codecs_[0].endian, "value", "little") == "little"
            and (not crc32c or isinstance(codecs_[1], Crc32cCodec))
        )
        if not plain:
            raise CorruptStateError(
                f"{where} is encoded with {[type(c).__name__ for c in codecs_]}; a tierstore checkpoint uses "
                f"BytesCodec (little endian){' and Crc32cCodec' if crc32c else ''} only"
            )
        saved = dict(arr.attrs)
        extra = set(saved) - set(attributes) - {"chunk_checksum", "chunk_checksums"}
        differs = [k for k in attributes if not _same(saved.get(k), attributes[k])]
        if differs or extra:
            key = differs[0] if differs else sorted(extra)[0]
            raise CorruptStateError(
                f"{where} has attribute {key}={saved.get(key)!r}"
                + (f" where its format needs {attributes[key]!r}" if key in attributes else ", which tierstore never writes")
                + " (a decoder that trusted it would read other values); the checkpoint is damaged, write it again"
            )
        # A missing chunk is refused here; one of the wrong size when it is read (verify lists each).
        missing = [i for i in range(arr.nchunks) if f"{name}/{arr.metadata.encode_chunk_key((i,))}" not in entries]
        if missing:
            raise CorruptStateError(
                f"{where} stores {arr.nchunks - len(missing)} of its {arr.nchunks} chunks (chunk {missing[0]} "
                "is missing); chunk files were deleted or never written. Write the checkpoint again"
            )
        return arr

    @property
    def has_master(self) -> list[bool]:
        return [bool(p.get("has_master", p["trainable"])) for p in self.params]

    def array_names(self) -> list[str]:
        """Every array of the checkpoint (codes and scales), as stored."""
        return list(self.chunk_checksums)

    def _array(self, name: str) -> Any:
        field = FIELD_OF_STATE_KEY.get(name)
        if field is not None:
            return self.arrays[field]
        return self.scales[FIELD_OF_STATE_KEY[name.removesuffix(SCALES_SUFFIX)]]

    def _where(self, name: str, index: int) -> str:
        arr = self._array(name)
        lo = index * arr.chunks[0]
        hi = min(lo + arr.chunks[0], arr.shape[0])
        return f"chunk {index} (elements {lo}..{hi}) of array {name} in {self.path}"

    def _read_file(self, name: str, index: int, out: np.ndarray, offset: int = 0) -> None:
        """Elements ``[offset, offset + out.size)`` of chunk ``index`` into ``out``, straight from its file, verified."""
        files = self.files[name]
        assert files is not None
        arr = self._array(name)
        chunk = arr.chunks[0]
        valid = min(chunk, arr.shape[0] - index * chunk) * out.itemsize
        digests = BlockDigests(valid) if self.chunk_checksums[name] is not None else None
        whole = offset == 0 and out.nbytes == valid
        # ChunkFiles opens the file itself; this refuses a link, FIFO or device in its place first.
        self._check_chunk_file(name, index, arr, self._where(name, index))
        if not whole and self._stream is None:
            self._stream = mmap.mmap(-1, SCRATCH_NBYTES)  # not malloc: glibc would keep it after use
        try:
            files.read(
                index,
                memoryview(out).cast("B"),
                valid_nbytes=valid,
                offset=offset * out.itemsize,
                digests=digests,
                scratch=None if whole else memoryview(self._stream),
            )
        except (OSError, ValueError) as exc:  # missing, truncated, or a crc32c mismatch
            raise CorruptStateError(f"{self._where(name, index)} is corrupt ({exc}); write the checkpoint again") from exc
        sums = self.chunk_checksums[name]
        got = None if digests is None else digests.value()
        if sums is not None and got != sums[index]:
            raise CorruptStateError(
                f"{self._where(name, index)} fails its checksum: expected {sums[index]}, read {got}; the "
                "checkpoint is corrupt, write it again"
            )

    def verify_chunk(self, name: str, index: int) -> None:
        """Read chunk ``index`` of array ``name`` and verify it, keeping nothing (float32: 1 MiB of scratch)."""
        if self.files[name] is not None:
            self._read_file(name, index, np.empty(0, dtype=np.float32))
            return
        arr = self._array(name)
        chunk = arr.chunks[0]
        cached = self._cache.pop(name, None)  # its bytes are about to change
        buffer = cached[1] if cached is not None else np.empty(chunk, dtype=arr.dtype)
        self.read_chunk(name, index, buffer[: min(chunk, arr.shape[0] - index * chunk)])

    def read_chunk(self, name: str, index: int, out: np.ndarray) -> None:
        """Read chunk ``index`` of array ``name`` into ``out`` (its exact size and dtype) and verify it."""
        if self.files[name] is not None:
            self._read_file(name, index, out)
            return
        arr = self._array(name)
        chunk = arr.chunks[0]
        lo = index * chunk
        where = f"chunk {index} (elements {lo}..{lo + out.size}) of array {name} in {self.path}"
        self._check_chunk_file(name, index, arr, where)
        try:
            arr.get_basic_selection(slice(lo, lo + out.size), out=default_buffer_prototype().nd_buffer.from_numpy_array(out))
        except Exception as exc:  # a crc32c mismatch or a truncated file surfaces as ValueError
            raise CorruptStateError(f"{where} is corrupt ({exc}); write the checkpoint again") from exc
        sums = self.chunk_checksums[name]
        if sums is not None:
            got = shard_checksum(memoryview(out).cast("B"))
            if got != sums[index]:
                raise CorruptStateError(
                    f"{where} fails its checksum: expected {sums[index]}, read {got}; the checkpoint is "
                    "corrupt, write it again"
                )

    def _check_chunk_file(self, name: str, index: int, arr: Any, where: str) -> None:
        """Before zarr reads a chunk (it reads a file whole, following links): a regular file of a chunk's size."""
        path = self.path / name / arr.metadata.encode_chunk_key((index,))
        expected = _chunk_file_nbytes(arr)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise CorruptStateError(f"{where} cannot be read ({exc.strerror}); write the checkpoint again") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStateError(f"{where}: {path} is {_kind(st.st_mode)}, not a regular file; write the checkpoint again")
        if st.st_size != expected:
            raise CorruptStateError(
                f"{where} is corrupt ({path} holds {st.st_size} bytes, a chunk is {expected}); write the checkpoint again"
            )

    def _ranged(
        self,
        name: str,
        lo: int,
        out: np.ndarray,
        read: Callable[[int, np.ndarray], None],
        chunk: int,
        total: int,
        *,
        files: bool = False,
    ) -> None:
        """Elements ``[lo, lo + out.size)`` through ``read(chunk_index, out)``, whole chunks straight
        into ``out``; a chunk only partly wanted streams from its file through 1 MiB of scratch
        (``files``: array ``name`` has chunk files), or is read once into a cached buffer."""
        hi = lo + out.size
        for index in range(lo // chunk, -(-hi // chunk)):
            c0, c1 = index * chunk, min((index + 1) * chunk, total)
            a, b = max(lo, c0), min(hi, c1)
            if a == c0 and b == c1:
                read(index, out[a - lo : b - lo])
                continue
            if files:
                self._read_file(name, index, out[a - lo : b - lo], offset=a - c0)
                continue
            cached = self._cache.get(name)
            if cached is None or cached[0] != index:
                buffer = cached[1] if cached is not None else np.empty(chunk, dtype=out.dtype)
                read(index, buffer[: c1 - c0])
                self._cache[name] = cached = (index, buffer)
            out[a - lo : b - lo] = cached[1][a - c0 : b - c0]

    def read_range(self, name: str, lo: int, out: np.ndarray) -> None:
        """Elements ``[lo, lo + out.size)`` of array ``name`` as stored, verified chunk by chunk."""
        arr = self._array(name)
        self._ranged(
            name, lo, out, lambda i, o: self.read_chunk(name, i, o), arr.chunks[0], arr.shape[0], files=self.files[name] is not None
        )

    def read_values(self, field: str, lo: int, out: np.ndarray) -> None:
        """The fp32 values ``[lo, lo + out.size)`` of ``field`` (decoded in a compressed format)."""
        if field not in MOMENT_FIELDS or not self.layout.encoded:
            self.read_range(STATE_KEY_OF_FIELD[field], lo, out)
            return
        self._ranged(field, lo, out, lambda i, o: self._decode_chunk(field, i, o), self.layout.shard_numel, self.layout.total_numel)

    def _decode_chunk(self, field: str, index: int, out: np.ndarray) -> None:
        fmt, key = self.format, STATE_KEY_OF_FIELD[field]
        n = out.size
        codes = np.empty(n, dtype=self.arrays[field].dtype)
        self.read_chunk(key, index, codes)
        scales = None
        if fmt.block_numel:
            scales = torch.from_numpy(np.empty(fmt.num_blocks(n), dtype=np.float32))
            self.read_chunk(_scales_name(field), index, scales.numpy())
        code_tensor = torch.from_numpy(codes)
        if fmt.code_itemsize == 2:
            code_tensor = code_tensor.view(torch.bfloat16)
        codecs.decode_chunk(fmt, field, code_tensor, scales, torch.from_numpy(out))

    def read_stored(self, field: str, shard: ShardSpec, stored: torch.Tensor) -> None:
        """A field's stored bytes for ``shard`` of a layout of this checkpoint's format and flat space."""
        fmt = self.format
        if field not in MOMENT_FIELDS or not self.layout.encoded:
            self.read_range(STATE_KEY_OF_FIELD[field], shard.start, stored.view(torch.float32)[: shard.capacity].numpy())
            return
        stored.zero_()  # padding
        codes, scales = codecs.split(fmt, stored, shard.capacity)
        self.read_range(STATE_KEY_OF_FIELD[field], shard.start, _numpy_codes(codes))
        if scales is not None:
            self.read_range(_scales_name(field), shard.start // fmt.block_numel, scales.numpy())


def _kind(mode: int) -> str:
    """What a file is, in words (for errors about files that are not regular files)."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _scan_checkpoint(path: Path) -> dict[str, int]:
    """Every file of a checkpoint (relative path -> size), checking that each entry is a regular file or a directory.

    Runs before zarr opens anything: zarr follows symlinks and reads whole
    files, so a FIFO would hang it, a device feed it without end and a link
    point it outside the checkpoint.

    Raises
    ------
    CorruptStateError
        If ``path`` is not a directory holding ``zarr.json``, or any entry under
        it is a symlink, FIFO, socket or device, or a ``zarr.json`` is larger than
        :data:`MAX_METADATA_NBYTES`.
    """
    try:
        top = os.stat(path)  # the path the caller named may be a link; nothing inside it may
    except FileNotFoundError:
        raise CorruptStateError(
            f"checkpoint {str(path)!r} does not exist; pass the path that save_checkpoint, export_statedir "
            "or state_dict_to_checkpoint wrote"
        ) from None
    except OSError as exc:
        raise CorruptStateError(f"cannot read checkpoint {str(path)!r} ({exc.strerror}); check the path and its permissions") from exc
    if not stat.S_ISDIR(top.st_mode):
        raise CorruptStateError(
            f"checkpoint {str(path)!r} is {_kind(top.st_mode)}, not a directory; a zarr checkpoint is a directory "
            "holding zarr.json (a .pt file is read with torch.load)"
        )
    sizes: dict[str, int] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            with os.scandir(path / rel if rel else path) as it:
                listed = [(entry.name, entry.stat(follow_symlinks=False)) for entry in it]
        except OSError as exc:
            raise CorruptStateError(f"cannot list {path / rel} ({exc.strerror}); check its permissions") from exc
        for name, st in listed:
            child = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                pending.append(child)
            elif not stat.S_ISREG(st.st_mode):
                raise CorruptStateError(
                    f"{path / child} is {_kind(st.st_mode)}, not a regular file; a checkpoint holds only regular "
                    "files and directories, so it is not read. Write the checkpoint again"
                )
            elif name == "zarr.json" and st.st_size > MAX_METADATA_NBYTES:
                raise CorruptStateError(
                    f"{path / child} holds {st.st_size} bytes, more than the {MAX_METADATA_NBYTES} a checkpoint's "
                    "metadata may take; it is not read. Write the checkpoint again"
                )
            else:
                sizes[child] = st.st_size
    if "zarr.json" not in sizes:
        raise CorruptStateError(
            f"{str(path)!r} is not a zarr v3 checkpoint (no zarr.json); pass the path that "
            "save_checkpoint, export_statedir or state_dict_to_checkpoint wrote"
        )
    return sizes


def _same(a: Any, b: Any) -> bool:
    """JSON values equal with their types (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_header(
    where: str, layout: Layout, *, step_count: Any, param_steps: Any, param_groups: Any
) -> tuple[int, list[float | None], list[dict[str, Any]]]:
    """Check the step counts and param groups saved beside a layout (a checkpoint's or a manifest's).

    Step counts are non-negative whole numbers (:data:`MAX_STEP` at most), one per
    parameter or ``None``; every group a parameter names exists, and its
    hyperparameters are values ``torch.optim.AdamW`` accepts
    (:func:`tierstore._compute.hyper.check_hyper`); a group using amsgrad needs the
    ``max_exp_avg_sq`` field.

    Returns
    -------
    (step_count, param_steps, param_groups)
        The checked values, groups decoded (``betas`` as a tuple).

    Raises
    ------
    CorruptStateError
        Naming ``where``, the value and what was expected.
    """
    fix = "the state is damaged or was not written by tierstore"
    if type(step_count) is not int or not 0 <= step_count <= MAX_STEP:
        raise CorruptStateError(f"{where} has step_count={step_count!r}; it must be a whole number in [0, {MAX_STEP}] ({fix})")
    if not isinstance(param_steps, list) or len(param_steps) != len(layout.params):
        count = len(param_steps) if isinstance(param_steps, list) else type(param_steps).__name__
        raise CorruptStateError(f"{where} has {count} param_steps for the {len(layout.params)} parameters of its layout ({fix})")
    steps: list[float | None] = []
    for i, s in enumerate(param_steps):
        if s is not None and not (_is_number(s) and math.isfinite(s) and 0 <= s <= MAX_STEP and float(s).is_integer()):
            raise CorruptStateError(f"{where} has param_steps[{i}]={s!r}; a step is null or a whole number in [0, {MAX_STEP}] ({fix})")
        steps.append(None if s is None else float(s))
    needed = 1 + max((p.group for p in layout.params), default=0)
    if not isinstance(param_groups, list) or not needed <= len(param_groups) <= MAX_PARAMS:
        count = len(param_groups) if isinstance(param_groups, list) else type(param_groups).__name__
        raise CorruptStateError(f"{where} has {count} param_groups; its parameters name {needed} ({fix})")
    groups = []
    for gi, group in enumerate(param_groups):
        at = f"{where} param_groups[{gi}]"
        if not isinstance(group, dict):
            raise CorruptStateError(f"{at} is {type(group).__name__}, not an object ({fix})")
        for key in ("lr", "eps", "weight_decay"):
            if not _is_number(group.get(key)):
                raise CorruptStateError(f"{at} has {key}={group.get(key)!r}; it must be a number ({fix})")
        betas = group.get("betas")
        if not (isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) for b in betas)):
            raise CorruptStateError(f"{at} has betas={betas!r}; it must be a pair of numbers ({fix})")
        for key in ("amsgrad", "maximize"):
            if key in group and not isinstance(group[key], bool):
                raise CorruptStateError(f"{at} has {key}={group[key]!r}; it must be true or false ({fix})")
        decoded = manifest_mod.decode_group(group)
        try:
            check_hyper(decoded["lr"], decoded["betas"], decoded["eps"], decoded["weight_decay"], f" in {at}")
        except ConfigError as exc:  # torch's AdamW would refuse the value: so does a load
            raise CorruptStateError(f"{exc} ({fix})") from None
        if decoded.get("amsgrad") and "max_exp_avg_sq" not in layout.fields:
            raise CorruptStateError(f"{at} uses amsgrad but the state has no max_exp_avg_sq ({fix})")
        groups.append(decoded)
    return step_count, steps, groups


def _check_param_index(attrs: dict[str, Any], layout: Layout, where: str) -> list[dict[str, Any]]:
    """The checkpoint's parameter index, checked entry by entry against its layout.

    The index is what plain zarr readers (and :func:`load_checkpoint`'s mapping
    of another flat space) use: an entry that differs from the layout would
    put moments on other parameters.

    Raises
    ------
    CorruptStateError
        Naming the first entry and key that differ.
    """
    index = attrs.get("params")
    if not isinstance(index, list) or len(index) != len(layout.params):
        count = len(index) if isinstance(index, list) else type(index).__name__
        raise CorruptStateError(
            f"the parameter index of checkpoint {where} has {count} entries, its layout {len(layout.params)} "
            "parameters; the checkpoint is damaged, write it again"
        )
    keys = {"index", "group", "shape", "dtype", "start", "numel", "trainable"}
    for p, saved in zip(layout.params, index):
        expected = {
            "index": p.index, "group": p.group, "shape": list(p.shape), "dtype": p.dtype,
            "start": p.start, "numel": p.numel, "trainable": p.trainable,
        }
        at = f"parameter {p.index} in the index of checkpoint {where}"
        if not isinstance(saved, dict) or not keys <= set(saved) <= keys | {"has_master"}:
            raise CorruptStateError(f"{at} has keys {sorted(saved) if isinstance(saved, dict) else saved!r}; expected {sorted(keys)}")
        for key, value in expected.items():
            # Converted torch state dicts do not know the shapes of parameters without state (frozen here).
            if key == "shape" and saved[key] is None and not p.trainable:
                continue
            if not _same(saved[key], value):
                raise CorruptStateError(
                    f"{at} has {key}={saved[key]!r}, its layout {value!r}; the checkpoint is damaged, write it again"
                )
        if "has_master" in saved and (
            not isinstance(saved["has_master"], bool) or (saved["has_master"] and not (p.trainable and "master" in layout.fields))
        ):
            raise CorruptStateError(f"{at} has has_master={saved['has_master']!r} but its layout keeps no master for it")
    return index


def _check_same_model(ck: _Checkpoint, mine: Layout, n_groups: int) -> None:
    """Refuse a checkpoint of another model (shard size, fields and dtypes may differ)."""
    fix = (
        "Load a checkpoint saved from this model, or build the optimizer over the same parameters "
        "and param groups, in the same order, as the run that saved it"
    )
    where = f"checkpoint {ck.path}"
    if len(ck.params) != len(mine.params):
        raise LayoutMismatchError(f"{where} has {len(ck.params)} parameters, this optimizer has {len(mine.params)}. {fix}")
    if len(ck.param_groups) != n_groups:
        raise LayoutMismatchError(f"{where} has {len(ck.param_groups)} param groups, this optimizer has {n_groups}. {fix}")
    for saved, p in zip(ck.params, mine.params):
        shape = None if saved["shape"] is None else tuple(saved["shape"])
        # Flat starts may differ (another moment format aligns parameters to its blocks):
        # the load maps each parameter's elements.
        differs = (
            saved["group"] != p.group
            or bool(saved["trainable"]) != p.trainable
            or (shape is not None and shape != p.shape)
        )
        if differs:
            def text(shape: Any, group: int, trainable: bool) -> str:
                return f"shape {shape if shape is not None else '(unknown)'} in group {group}{'' if trainable else ', frozen'}"

            hint = fix
            if shape is None:
                hint = (
                    "It was converted from a torch state dict in which this parameter had no state; "
                    "convert it again with state_dict_to_checkpoint(..., params=model.parameters())"
                )
            raise LayoutMismatchError(
                f"{where}: parameter {p.index} has {text(shape, saved['group'], saved['trainable'])}, in this "
                f"optimizer it has {text(p.shape, p.group, p.trainable)}. {hint}"
            )


def load_checkpoint(opt: ShardAccess, path: str | os.PathLike) -> None:
    """Stream a checkpoint back into an optimizer's state and commit it.

    Restores every moment, step count, the param groups' hyperparameters,
    ``opt.step_count`` and (when both have one) the fp32 master copy, which
    is then written into the parameters. The checkpoint may have been
    written with another ``shard_numel``, RAM budget or backend; it must
    come from the same model (parameter shapes, order, groups and frozen
    flags). Master weights in the checkpoint are ignored by an optimizer
    that keeps none (fp32 CPU parameters without ``keep_master``), as
    ``load_state_dict`` does; an optimizer that keeps them seeds them from
    its parameters when the checkpoint has none. A checkpoint always holds
    ``exp_avg`` and ``exp_avg_sq`` (one that lacks either is refused, never
    read as zeros). One saved without amsgrad loads into an optimizer built
    with ``amsgrad=True`` as torch loads it: the saved groups are restored
    (``amsgrad=False``), so ``max_exp_avg_sq`` is not used; it is set to
    zeros, its initial value, should a group switch amsgrad on again (where
    torch's AdamW would fail at the next step for want of it). A checkpoint
    whose groups use amsgrad must hold ``max_exp_avg_sq``. The checkpoint's ``moment_dtype`` may
    differ from the optimizer's: the moments are decoded and encoded (with
    the same format and flat space, the stored bytes are copied, bit for
    bit). This is how a state directory changes format (``docs/formats.md``).

    Raises
    ------
    LayoutMismatchError
        If the checkpoint belongs to another model (names the first difference).
    FormatVersionError
        If it was written by a newer checkpoint format, or is not a tierstore checkpoint.
    CorruptStateError
        If a chunk fails its checksum or is missing (nothing is committed then).
    ValueError
        If the checkpoint uses amsgrad and the optimizer was built without it.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> with TieredAdamW([w], lr=0.5) as fresh:
    ...     load_checkpoint(fresh, path)
    ...     fresh.step_count, fresh.param_groups[0]["lr"]
    (1, 0.1)
    """
    ck = _Checkpoint(path)
    layout = opt.layout
    _check_same_model(ck, layout, len(opt.param_groups))
    require_amsgrad_field(ck.param_groups, layout, f"checkpoint {ck.path}")
    if "master" in ck.arrays and "master" not in layout.fields:
        log.info("%s holds master weights; this optimizer keeps none (fp32 parameters), so they are not loaded", ck.path)

    # Only these may be absent (the checkpoint's own arrays are exactly its layout's fields, exp_avg
    # and exp_avg_sq always among them): the master is seeded from the parameters, max_exp_avg_sq
    # starts at zeros as torch would start it, and is unused under the restored groups.
    absent = [f for f in layout.fields if f not in ck.arrays]
    if not set(absent) <= {"master", "max_exp_avg_sq"}:  # pragma: no cover - _Checkpoint refuses these
        raise CorruptStateError(f"checkpoint {ck.path} lacks {absent}; write it again")
    same_space = all(p.start == saved["start"] for p, saved in zip(layout.params, ck.params) if p.trainable)
    copy_stored = same_space and ck.format == layout.format

    def fill_stored(shard: ShardSpec, extent: torch.Tensor) -> None:
        for field in layout.fields:
            stored = layout.stored_field(extent, shard, field)
            if field in ck.arrays:
                ck.read_stored(field, shard, stored)
            else:
                stored.zero_()  # max_exp_avg_sq the checkpoint lacks (zero bytes: zeros); a master is seeded afterwards

    def fill(shard: ShardSpec, flat: torch.Tensor) -> None:
        for field, values in layout.field_views(flat, shard).items():
            out = values.numpy()
            if field not in ck.arrays:
                out.fill(0.0)  # as above
            elif same_space:
                ck.read_values(field, shard.start, out)
            else:  # parameter by parameter: the checkpoint's flat space is aligned differently
                out.fill(0.0)
                for seg in shard.segments:
                    start = ck.params[seg.param]["start"] + seg.param_offset
                    ck.read_values(field, start, out[seg.shard_offset : seg.shard_offset + seg.length])

    steps = {i: s for i, s in enumerate(ck.param_steps) if s is not None and layout.params[i].trainable}
    masters = set()
    if "master" in ck.arrays:
        masters = {i for i, (p, given) in enumerate(zip(layout.params, ck.has_master)) if p.trainable and given}
    # A failed load leaves the optimizer refusing use (its state is half-replaced).
    opt.replace_shards(
        fill_stored if copy_stored else fill,
        param_steps=steps,
        groups=ck.param_groups,
        masters_given=masters,
        step_count=ck.step_count,
        stored=copy_stored,
    )
    log.info("loaded checkpoint %s (step %d)", ck.path, ck.step_count)


# -- conversions for states that fit in RAM ----------------------------------------


def checkpoint_to_state_dict(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint as a ``torch.optim.AdamW`` state dict (every moment as a full CPU tensor).

    Parameters that never took a step have no entry in ``state``, as in
    torch. ``master_param`` is included where the checkpoint has master
    weights; ``torch.optim.AdamW`` ignores it, ``TieredAdamW`` loads it.

    Raises
    ------
    CorruptStateError, FormatVersionError
        As :func:`load_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> ref = torch.optim.AdamW([w], lr=0.1)
    >>> ref.load_state_dict(checkpoint_to_state_dict(path)); ref.state[w]["exp_avg"].tolist()
    [0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    ck = _Checkpoint(path)
    layout = ck.layout
    result, flats = empty_state_dict(layout, ck.param_steps, ck.param_groups, has_master=ck.has_master)
    scratch = torch.empty(len(layout.fields) * layout.shard_numel, dtype=torch.float32)
    for index in layout.shards_of(flats):
        shard = layout.shards[index]
        flat = scratch[: len(layout.fields) * shard.capacity]
        for field, values in layout.field_views(flat, shard).items():
            ck.read_values(field, shard.start, values.numpy())
        layout.copy_out(shard, flat, flats)
    return result


def statedir_to_state_dict(state_dir: str | os.PathLike) -> dict[str, Any]:
    """A state directory's last commit as a ``torch.optim.AdamW`` state dict (no optimizer needed).

    Raises
    ------
    CorruptStateError, FormatVersionError
        As :func:`export_statedir`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d) as opt:
    ...     _ = opt.step()
    >>> sorted(statedir_to_state_dict(d)["state"][0])
    ['exp_avg', 'exp_avg_sq', 'step']
    """
    with open_state_reader(state_dir) as reader:
        _require_clean(reader)
        layout = reader.layout
        _, param_steps, param_groups = check_manifest_header(reader)
        result, flats = empty_state_dict(layout, param_steps, param_groups)
        for index in layout.shards_of(flats):
            layout.copy_out(layout.shards[index], reader.read_shard(index), flats)
    return result


def state_dict_to_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    shard_numel: int = DEFAULT_SHARD_NUMEL,
    params: Iterable[torch.Tensor] | None = None,
    overwrite: bool = False,
    checksum: str | None = "xxh3",
) -> None:
    """Write a ``torch.optim.AdamW`` (or ``TieredAdamW``) state dict as a zarr checkpoint.

    A parameter with state (``exp_avg``...) is trainable with the state's
    shape. Without ``params``, a parameter with no state is recorded as
    frozen with an unknown shape: loading then works only into an optimizer
    where that parameter is frozen too. Pass ``params`` (the model's
    parameters, in the state dict's order) to record every shape and which
    are trainable; trainable parameters without state get zeros and no step,
    as after construction.

    Parameters
    ----------
    state_dict
        ``optimizer.state_dict()`` of ``torch.optim.AdamW``.
    path, overwrite, checksum
        As :func:`save_checkpoint`.
    shard_numel
        Elements per chunk (rounded up to a multiple of 1024).
    params
        Optional: the parameters the state dict belongs to.

    Raises
    ------
    ConfigError
        If the state dict is malformed or does not match ``params``.
    CheckpointExistsError
        As :func:`save_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w], lr=0.1); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path, shard_numel=1024)
    >>> checkpoint_to_state_dict(path)["state"][0]["exp_avg"].tolist()
    [0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    groups, position = positions(state_dict)
    n = len(position)
    given = None if params is None else list(params)
    if given is not None and len(given) != n:
        raise ConfigError(f"params has {len(given)} tensors but the state dict's param groups list {n}; pass them all, in order")
    entries: list[dict[str, Any]] = [{} for _ in range(n)]
    for pid, entry in state_dict["state"].items():
        entries[position[pid]] = entry
    amsgrad_of = [bool(g.get("amsgrad", False)) for ids, g in zip(groups, state_dict["param_groups"]) for _ in ids]
    for i, entry in enumerate(entries):
        _check_torch_entry(i, entry, amsgrad=amsgrad_of[i])
    for gi, group in enumerate(state_dict["param_groups"]):
        # The reader refuses hyperparameters torch's AdamW refuses: so does the writer.
        check_hyper(group.get("lr"), group.get("betas"), group.get("eps"), group.get("weight_decay"), f" in param group {gi}")
    fields = fields_for(
        amsgrad=any("max_exp_avg_sq" in e for e in entries), master=any(MASTER_KEY in e for e in entries)
    )
    stand_ins: list[list[torch.Tensor]] = []
    known, steps, has_master = [], [], []
    for ids in groups:
        group_tensors = []
        for pid in ids:
            i = position[pid]
            entry = entries[i]
            if given is not None:
                p = given[i]
                stand_in = torch.empty(p.shape, dtype=p.dtype, device="meta").requires_grad_(bool(p.requires_grad) and p.is_floating_point())
                if entry and entry["exp_avg"].numel() != p.numel():
                    raise ConfigError(
                        f"the exp_avg of parameter {i} has {entry['exp_avg'].numel()} elements, params[{i}] "
                        f"has {p.numel()} (shape {tuple(p.shape)}); pass the parameters in the state dict's order"
                    )
                known.append(True)
            elif entry:
                ref = entry["exp_avg"]
                stand_in = torch.empty(ref.shape, dtype=ref.dtype, device="meta").requires_grad_(True)
                known.append(True)
            else:
                stand_in = torch.empty(0, device="meta")
                known.append(False)
            group_tensors.append(stand_in)
            steps.append(float(entry["step"]) if entry and "step" in entry else None)
            has_master.append(MASTER_KEY in entry)
        stand_ins.append(group_tensors)
    layout = Layout.build(stand_ins, shard_numel=shard_numel, fields=fields)
    if given is not None:
        for i, entry in enumerate(entries):
            if entry and not layout.params[i].trainable:
                raise ConfigError(f"parameter {i} has optimizer state but params[{i}] does not require grad")
    sources = flat_sources({i: e for i, e in enumerate(entries) if e and layout.params[i].trainable}, layout)
    header = _Header(
        layout=layout,
        step_count=int(max((s for s in steps if s is not None), default=0)),
        param_groups=manifest_mod.encode_groups(state_dict["param_groups"]),
        param_steps=steps,
        source="torch",
        known_shapes=known,
        has_master=has_master,
    )
    scratch = torch.empty(layout.shard_numel * len(fields), dtype=torch.float32)
    with _Writer(path, header, overwrite=overwrite, checksum=checksum) as writer:
        for shard in layout.shards:
            flat = scratch[: shard.capacity * len(fields)]
            layout.copy_in(shard, flat, sources)
            for field, t in layout.field_views(flat, shard).items():
                writer.write(shard, field, t)


def _check_torch_entry(i: int, entry: Any, *, amsgrad: bool) -> None:
    """Refuse a torch AdamW state entry that is not complete: a missing moment is never written as zeros.

    As in torch, an entry has ``step``, ``exp_avg`` and ``exp_avg_sq``, and
    ``max_exp_avg_sq`` when its group uses amsgrad (torch's AdamW fails at
    its next step without it); every tensor has the same number of elements.

    Raises
    ------
    ConfigError
        Naming the parameter, the key and the fix.
    """
    if not isinstance(entry, dict):
        raise ConfigError(f"the state of parameter {i} is {type(entry).__name__}, not a dict; pass optimizer.state_dict()")
    if not entry:
        return
    required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    missing = [k for k in required if k not in entry]
    if missing:
        raise ConfigError(
            f"the state of parameter {i} lacks {missing}"
            + (" (its param group uses amsgrad)" if "max_exp_avg_sq" in missing else "")
            + "; a missing tensor is never written as zeros. Pass the complete state dict of a torch.optim.AdamW"
        )
    step = entry["step"]
    try:
        value = float(step)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if isinstance(step, bool) or not (math.isfinite(value) and 0 <= value <= MAX_STEP and value.is_integer()):
        raise ConfigError(f"the step of parameter {i} is {step!r}; a step is a whole number >= 0 (as torch's AdamW counts)")
    numel = None
    for key in STATE_KEY_OF_FIELD.values():
        if key not in entry:
            continue
        tensor = entry[key]
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"the {key} of parameter {i} is {type(tensor).__name__}, not a tensor; pass optimizer.state_dict()")
        if numel is not None and tensor.numel() != numel:
            raise ConfigError(
                f"the {key} of parameter {i} has {tensor.numel()} elements, its exp_avg {numel}; every tensor of a "
                "parameter's state has the parameter's size"
            )
        numel = tensor.numel() if numel is None else numel


def verify_checkpoint(path: str | os.PathLike, *, progress: Callable[[int], object] | None = None) -> list[str]:
    """Read every chunk of a checkpoint and return one message per damaged chunk (empty: all good).

    Parameters
    ----------
    path
        The checkpoint.
    progress
        Called with the bytes of each chunk checked (for a progress bar).

    Raises
    ------
    CorruptStateError, FormatVersionError
        If the checkpoint's metadata cannot be read (nothing to check chunks against).

    Example
    -------
    >>> import tempfile, torch
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w]); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path)
    >>> verify_checkpoint(path)
    []
    """
    ck = _Checkpoint(path)
    problems = []
    for name in ck.array_names():
        arr = ck._array(name)
        chunk = arr.chunks[0]
        for shard in ck.layout.shards:
            n = min(chunk, arr.shape[0] - shard.index * chunk)
            try:
                ck.verify_chunk(name, shard.index)
            except CorruptStateError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(n * arr.dtype.itemsize)
    return problems


def read_checkpoint_attributes(path: str | os.PathLike) -> dict[str, Any]:
    """The checked attributes of a checkpoint (format, layout, steps, groups, parameter index).

    Raises
    ------
    CorruptStateError, FormatVersionError
        As :func:`load_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w]); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path)
    >>> read_checkpoint_attributes(path)["params"][0]["shape"]
    [3]
    """
    return dict(_Checkpoint(path).attrs)

