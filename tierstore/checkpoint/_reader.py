"""Reading a checkpoint: opened, checked, and read chunk by chunk with every chunk verified.

:class:`CheckpointReader` trusts nothing it has not checked (its files,
metadata, attributes and chunk files: :mod:`tierstore.checkpoint._validate`),
reads float32 chunks straight from their files into the caller's buffer
and the code arrays of a compressed format through zarr, and decodes
moments on request. :func:`verify_checkpoint` and
:func:`read_checkpoint_attributes` are the reads without an optimizer.

Example
-------
>>> import tempfile, torch
>>> from tierstore.checkpoint import state_dict_to_checkpoint
>>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
>>> ref = torch.optim.AdamW([w]); ref.step()
>>> path = tempfile.mkdtemp() + "/ckpt.zarr"
>>> state_dict_to_checkpoint(ref.state_dict(), path)
>>> ck = CheckpointReader(path)
>>> ck.step_count, ck.array_names()
(1, ['exp_avg', 'exp_avg_sq'])
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.buffer import default_buffer_prototype

from .._compute import codecs, formats
from .._compute.algorithms import ADAMW
from .._layout.layout import ShardSpec
from .._layout.scalar_record import RECORD_KEY
from .._state import manifest as manifest_mod
from .._storage.chunkfile import SCRATCH_NBYTES, ChunkFiles
from .._storage.integrity import BlockDigests, shard_checksum
from ..errors import CorruptStateError, FormatVersionError
from ._files import file_kind
from ._validate import check_header, check_param_index, check_scalars, same_json, scan_checkpoint
from ._zarr_format import (
    ALGORITHM_VERSION,
    CHECKSUMS,
    FORMAT_NAME,
    FORMAT_VERSION,
    SCALES_SUFFIX,
    algorithm_attribute,
    array_specs,
    chunk_file_nbytes,
    least_version,
    numpy_codes,
    scales_name,
)

__all__ = ["CheckpointReader", "verify_checkpoint", "read_checkpoint_attributes"]

class CheckpointReader:
    """An opened checkpoint: attributes checked, arrays opened, chunks read and verified.

    Nothing in a checkpoint is trusted before it is checked: every entry must
    be a regular file or a directory (a symlink, FIFO or device is refused
    before zarr opens anything), metadata files are bounded in size, the
    attributes must describe the layout they carry (its optimizer algorithm,
    parameter index, arrays, formats and their block sizes, step counts and the
    scalars recorded beside them,
    hyperparameters the algorithm's torch class accepts), and every chunk
    file must be there with its size.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        entries = scan_checkpoint(self.path)
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
        header = check_header(
            f"checkpoint {self.path}",
            self.layout,
            step_count=attrs.get("step_count"),
            param_steps=attrs.get("param_steps"),
            param_groups=attrs.get("param_groups"),
        )
        self.step_count, self.param_steps, self.param_groups = header
        self.param_scalars = check_scalars(f"checkpoint {self.path}", self.layout, attrs.get(RECORD_KEY), self.param_steps)
        self.params: list[dict] = check_param_index(attrs, self.layout, str(self.path))
        names = self._check_arrays_attribute(attrs, version)
        self.format = self.layout.format
        self.arrays: dict[str, Any] = {}  # field -> its (code) array
        self.scales: dict[str, Any] = {}  # field -> its scales array (int8)
        self.chunk_checksums: dict[str, list[str] | None] = {}  # array name -> per-chunk checksums
        self.files: dict[str, ChunkFiles | None] = {}  # array name -> its chunk files (float32 arrays)
        checksum = attrs.get("checksum")
        for name in names:
            field = self.layout.field_of_key(name)  # names are the layout's own keys (checked above)
            for array_name, spec in array_specs(self.layout, field).items():
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
        expected = [layout.state_key(f) for f in layout.fields]
        names = attrs.get("arrays")
        if not same_json(names, expected):
            missing = [n for n in expected if not isinstance(names, list) or n not in names]
            raise CorruptStateError(
                f"{where} lists arrays {names!r}; its layout holds {expected}"
                + (f" (missing {missing}: a missing moment is never read as zeros)" if missing else "")
                + ". The checkpoint is damaged, write it again"
            )
        algorithm = layout.algorithm  # its layout holds every field the algorithm always keeps (Layout.from_dict)
        if version < least_version(layout) and algorithm.name != ADAMW.name:
            raise CorruptStateError(
                f"{where} holds {algorithm.label} state but says format_version {version}; such state came with "
                f"version {ALGORITHM_VERSION}. The checkpoint is damaged, write it again"
            )
        named = {k: attrs[k] for k in ("algorithm", "torch_class") if k in attrs}
        if not same_json(named, algorithm_attribute(layout)):
            raise CorruptStateError(
                f"{where} has algorithm attributes {named!r}; its layout holds {algorithm.label} state "
                f"({algorithm_attribute(layout) or 'no attributes for AdamW'}). The checkpoint is damaged, write it again"
            )
        checks: dict[str, Any] = {"shard_numel": layout.shard_numel, "total_numel": layout.total_numel}
        if layout.encoded:
            checks["moment_dtype"] = layout.format.name
            checks["scale_arrays"] = {
                layout.state_key(f): scales_name(layout, f) for f in layout.encoded_fields if layout.format.block_numel
            }
            if version < 2:
                raise CorruptStateError(
                    f"{where} holds {layout.format.name} moments but says format_version {version}; they came with "
                    "version 2. The checkpoint is damaged, write it again"
                )
        elif "moment_dtype" in attrs or "scale_arrays" in attrs:
            raise CorruptStateError(
                f"{where} has moment_dtype/scale_arrays attributes but its layout holds float32 moments. The checkpoint "
                "is damaged, write it again"
            )
        for key, value in checks.items():
            if not same_json(attrs.get(key), value):
                raise CorruptStateError(f"{where} has {key}={attrs.get(key)!r}; its layout says {value!r}. The checkpoint is damaged, write it again")
        if attrs.get("checksum") not in CHECKSUMS:
            raise CorruptStateError(
                f"{where} has checksum={attrs.get('checksum')!r}; known checksums are {list(CHECKSUMS)}. The checkpoint "
                "is damaged, write it again"
            )
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
                f"{getattr(arr, 'chunks', '?')}; its layout needs ({numel},) {dtype} in chunks of ({chunk},) (a decoder that "
                "trusted it would read other values). The checkpoint is damaged, write it again"
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
                f"BytesCodec (little endian){' and Crc32cCodec' if crc32c else ''} only; write the checkpoint again with tierstore"
            )
        saved = dict(arr.attrs)
        extra = set(saved) - set(attributes) - {"chunk_checksum", "chunk_checksums"}
        differs = [k for k in attributes if not same_json(saved.get(k), attributes[k])]
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
        field = self.layout.field_of_key(name)
        if field is not None:
            return self.arrays[field]
        return self.scales[self.layout.field_of_key(name.removesuffix(SCALES_SUFFIX))]

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
        expected = chunk_file_nbytes(arr)
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise CorruptStateError(f"{where} cannot be read ({exc.strerror}); write the checkpoint again") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStateError(f"{where}: {path} is {file_kind(st.st_mode)}, not a regular file; write the checkpoint again")
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
        if field not in self.layout.encoded_fields or not self.layout.encoded:
            self.read_range(self.layout.state_key(field), lo, out)
            return
        self._ranged(field, lo, out, lambda i, o: self._decode_chunk(field, i, o), self.layout.shard_numel, self.layout.total_numel)

    def _decode_chunk(self, field: str, index: int, out: np.ndarray) -> None:
        fmt, key = self.format, self.layout.state_key(field)
        n = out.size
        codes = np.empty(n, dtype=self.arrays[field].dtype)
        self.read_chunk(key, index, codes)
        scales = None
        if fmt.block_numel:
            scales = torch.from_numpy(np.empty(fmt.num_blocks(n), dtype=np.float32))
            self.read_chunk(scales_name(self.layout, field), index, scales.numpy())
        code_tensor = torch.from_numpy(codes)
        if fmt.code_itemsize == 2:
            code_tensor = code_tensor.view(torch.bfloat16)
        codecs.decode_chunk(fmt, field, code_tensor, scales, torch.from_numpy(out))

    def read_stored(self, field: str, shard: ShardSpec, stored: torch.Tensor) -> None:
        """A field's stored bytes for ``shard`` of a layout of this checkpoint's format and flat space."""
        fmt = self.format
        if field not in self.layout.encoded_fields or not self.layout.encoded:
            self.read_range(self.layout.state_key(field), shard.start, stored.view(torch.float32)[: shard.capacity].numpy())
            return
        stored.zero_()  # padding
        codes, scales = formats.split(fmt, stored, shard.capacity)
        self.read_range(self.layout.state_key(field), shard.start, numpy_codes(codes))
        if scales is not None:
            self.read_range(scales_name(self.layout, field), shard.start // fmt.block_numel, scales.numpy())


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
    >>> from tierstore.checkpoint import state_dict_to_checkpoint
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w]); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path)
    >>> verify_checkpoint(path)
    []
    """
    ck = CheckpointReader(path)
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
    >>> from tierstore.checkpoint import state_dict_to_checkpoint
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w]); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path)
    >>> read_checkpoint_attributes(path)["params"][0]["shape"]
    [3]
    """
    return dict(CheckpointReader(path).attrs)
