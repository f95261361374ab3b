"""The manifest file: its format name and version, its checksum, and its bounded, checked read.

What a manifest holds and how a resume checks it is :mod:`tierstore._state.manifest`;
:meth:`~tierstore._state.statedir.StateDir.write_manifest` writes it.

Example
-------
>>> body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step_count": 3}
>>> len(manifest_checksum(body)), manifest_checksum(body) == manifest_checksum({**body, "manifest_checksum": "x"})
(16, True)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from ..backends.base import open_regular
from ..errors import CorruptStateError, FormatVersionError, TierstoreError
from . import manifest as manifest_mod
from .drive_record import validate_drives
from .manifest import short_repr

FORMAT_NAME = "tierstore"
FORMAT_VERSION = 1

#: The largest manifest read: 256 MiB. A manifest holds about 200 bytes per shard (its
#: record and the previous commit's) plus about 150 per parameter: 256 MiB is over a
#: million shards, 4 Pi elements at the default 4 Mi-element shards. A larger file is
#: not a manifest tierstore wrote (and one is refused before it is written).
MAX_MANIFEST_BYTES = 256 << 20


def manifest_checksum(body: dict) -> str:
    content = {k: v for k, v in body.items() if k != "manifest_checksum"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(canonical):016x}"


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``fd`` (one more than allowed tells the caller it is too long)."""
    chunks, total = [], 0
    while total <= limit:
        chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_manifest_file(path: Path, *, dir_fd: int | None = None) -> dict:
    """Read and check a manifest file (see :meth:`~tierstore._state.statedir.StateDir.read_manifest`).

    ``dir_fd``: the descriptor of the directory holding it (``path.name`` is
    opened relative to it). Only a regular file is read, never through a
    symlink, and at most :data:`MAX_MANIFEST_BYTES` of it.
    """
    path = Path(path)
    fix = "restore the state directory from a checkpoint"
    try:
        fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd, what="manifest")
    except FileNotFoundError:
        raise CorruptStateError(
            f"{path} is missing; this directory holds no committed state: pass the state_dir of a run that "
            f"committed, or {fix}"
        ) from None
    except TierstoreError:
        raise
    except OSError as exc:
        raise CorruptStateError(f"{path} cannot be read ({exc.strerror}); {fix}") from exc
    try:
        size = os.fstat(fd).st_size
        raw = b"" if size > MAX_MANIFEST_BYTES else read_at_most(fd, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise CorruptStateError(f"{path} cannot be read ({exc.strerror}); {fix}") from exc
    finally:
        os.close(fd)
    if size > MAX_MANIFEST_BYTES or len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptStateError(
            f"{path} is {max(size, len(raw))} bytes, more than the {MAX_MANIFEST_BYTES >> 20} MiB a tierstore "
            f"manifest may be: it is not one tierstore wrote; {fix}"
        )
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptStateError(f"{path} is corrupt (not valid JSON: {short_repr(str(exc), 200)}); {fix}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CorruptStateError(f"{path} is not a tierstore manifest (no \"format\": {FORMAT_NAME!r}); {fix}")
    version = data.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise FormatVersionError(
            f"{path} has format_version {short_repr(version)}; this tierstore ({FORMAT_NAME} format "
            f"{FORMAT_VERSION}) cannot read it. "
            + ("Upgrade tierstore to resume it." if newer else f"It was not written by a known tierstore; {fix}.")
        )
    try:
        intact = data.get("manifest_checksum") == manifest_checksum(data)
    except (ValueError, RecursionError):
        intact = False
    if not intact:
        raise CorruptStateError(
            f"{path} fails its checksum: it was modified or corrupted after it was written; {fix}"
        )
    layout = manifest_mod.validate(data, str(path))
    validate_drives(data, layout, str(path))
    return data
