"""What ties the directories of one state together: each directory's member record, and the manifest's drive record.

A state over two or more directories (one per drive; the first is the
*home*, which holds the manifest) records in its manifest the key
``"drives"``::

    {"id": "<16 hex digits>", "count": N, "placement": [the drive of each shard],
     "paths": [each directory as last opened], "bandwidths": [bytes/s per drive] or null,
     "backends": [each drive's backend] or null}

and every one of its directories, the home too, holds a member record
(:data:`MEMBER`, ``drive.json``)::

    {"format": "tierstore-drive", "version": 1, "state": "<id>", "index": k, "count": N}

The id is random, made when the state is created; ``index`` says which
drive of the state the directory is. The placement is part of the state's
identity (a resume keeps it); ``paths``, ``bandwidths`` and ``backends``
only inform (paths change when drives are remounted: the next open records
the new ones). A one-directory state has neither record: its manifest and
its files are byte for byte what a single state directory always held.

Both are read back as untrusted input: bounded in size, every field's type
and range checked before use (:func:`validate_drives`, :meth:`Member.parse`).

Example
-------
>>> m = Member(state="0123456789abcdef", index=1, count=2)
>>> Member.parse(m.to_bytes(), "/d1/drive.json") == m
True
>>> Member.parse(b'{"format": "tierstore-drive", "version": 1}', "/d1/drive.json")
Traceback (most recent call last):
...
tierstore.errors.CorruptStateError: the member record /d1/drive.json has state=None, expected 16 lowercase hex ...
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._layout.layout import Layout
from .._storage.placement import MAX_DRIVES
from ..errors import CorruptStateError, FormatVersionError
from .manifest import short_repr

__all__ = ["MEMBER", "MAX_MEMBER_BYTES", "Member", "new_state_id", "drive_record", "validate_drives"]

MEMBER = "drive.json"
MEMBER_FORMAT = "tierstore-drive"
MEMBER_VERSION = 1
MAX_MEMBER_BYTES = 4 << 10  # 4 KiB: a record is under 100 bytes
MAX_PATH_CHARS = 4096  # PATH_MAX
_ID = re.compile(r"[0-9a-f]{16}")
_FIX = "it was damaged or crafted: restore the state's directories from a checkpoint, or start over with empty ones"


def new_state_id() -> str:
    """A fresh state's id: 64 random bits, as 16 hex digits."""
    return secrets.token_hex(8)


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class Member:
    """What a directory says of itself: which state it belongs to, and which of its drives it is."""

    state: str
    index: int
    count: int

    def to_bytes(self) -> bytes:
        body = {"format": MEMBER_FORMAT, "version": MEMBER_VERSION, "state": self.state, "index": self.index, "count": self.count}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Member:
        """A member record read back, every field checked.

        Raises
        ------
        CorruptStateError
            If it is not the JSON object tierstore writes, naming ``where``, the field and the fix.
        FormatVersionError
            If a newer tierstore wrote it.
        """
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise CorruptStateError(f"the member record {where} is not valid JSON; {_FIX}") from None
        if not isinstance(body, dict) or body.get("format") != MEMBER_FORMAT:
            raise CorruptStateError(f"{where} is not a tierstore member record (no \"format\": {MEMBER_FORMAT!r}); {_FIX}")
        version = body.get("version")
        if version != MEMBER_VERSION or isinstance(version, bool):
            raise FormatVersionError(
                f"the member record {where} has version {short_repr(version)}; this tierstore reads version "
                f"{MEMBER_VERSION}. Upgrade tierstore to resume it"
            )
        state, index, count = body.get("state"), body.get("index"), body.get("count")
        if not (isinstance(state, str) and _ID.fullmatch(state)):
            raise CorruptStateError(f"the member record {where} has state={short_repr(state)}, expected 16 lowercase hex digits; {_FIX}")
        if not _whole(count, 2, MAX_DRIVES):
            raise CorruptStateError(f"the member record {where} has count={short_repr(count)}, expected 2 to {MAX_DRIVES}; {_FIX}")
        if not _whole(index, 0, count - 1):
            raise CorruptStateError(f"the member record {where} has index={short_repr(index)}, expected 0 to {count - 1}; {_FIX}")
        return cls(state, index, count)


def drive_record(
    *,
    state: str,
    placement: Sequence[int],
    paths: Sequence[str],
    bandwidths: Sequence[float] | None,
    backends: Sequence[str] | None,
) -> dict[str, Any]:
    """The manifest's ``"drives"`` entry (see the module docs).

    Example
    -------
    >>> drive_record(state="0123456789abcdef", placement=[0, 1], paths=["/a", "/b"], bandwidths=None,
    ...              backends=None)["count"]
    2
    """
    return {
        "id": state,
        "count": len(paths),
        "placement": list(placement),
        "paths": list(paths),
        "bandwidths": None if bandwidths is None else [float(b) for b in bandwidths],
        "backends": None if backends is None else list(backends),
    }


def _invalid(where: str, key: str, value: Any, expected: str) -> CorruptStateError:
    return CorruptStateError(f"the manifest {where} has drives.{key}={short_repr(value)}, expected {expected}; {_FIX}")


def validate_drives(manifest: dict[str, Any], layout: Layout, where: str) -> None:
    """Check the manifest's ``"drives"`` entry, if any, before anything uses it.

    Raises
    ------
    CorruptStateError
        Naming the manifest, the key, its value, what was expected and the fix.

    Example
    -------
    >>> validate_drives({"drives": {"id": "x"}}, None, "/run/manifest.json")
    Traceback (most recent call last):
    ...
    tierstore.errors.CorruptStateError: the manifest /run/manifest.json has drives.id='x', expected 16 lowercase ...
    """
    if "drives" not in manifest:
        return
    record = manifest["drives"]
    if not isinstance(record, dict):
        raise CorruptStateError(
            f"the manifest {where} has drives={short_repr(record)}, expected the drive record tierstore writes; {_FIX}"
        )
    state = record.get("id")
    if not (isinstance(state, str) and _ID.fullmatch(state)):
        raise _invalid(where, "id", state, "16 lowercase hex digits")
    count = record.get("count")
    if not _whole(count, 2, MAX_DRIVES):
        raise _invalid(where, "count", count, f"a whole number from 2 to {MAX_DRIVES}")
    placement = record.get("placement")
    if not isinstance(placement, list) or len(placement) != len(layout.shards):
        shown = f"{len(placement)} entries" if isinstance(placement, list) else short_repr(placement)
        raise _invalid(where, "placement", shown, f"a list of {len(layout.shards)} drive indices, one per shard")
    for index, drive in enumerate(placement):
        if not _whole(drive, 0, count - 1):
            raise _invalid(where, f"placement[{index}]", drive, f"a drive index from 0 to {count - 1}")
    paths = record.get("paths")
    if not isinstance(paths, list) or len(paths) != count:
        raise _invalid(where, "paths", paths, f"a list of {count} directory paths")
    for k, path in enumerate(paths):
        if not (isinstance(path, str) and 0 < len(path) <= MAX_PATH_CHARS and "\0" not in path):
            raise _invalid(where, f"paths[{k}]", path, f"a path of at most {MAX_PATH_CHARS} characters")
    bandwidths = record.get("bandwidths")
    if bandwidths is not None:
        if not isinstance(bandwidths, list) or len(bandwidths) != count:
            raise _invalid(where, "bandwidths", bandwidths, f"null or a list of {count} numbers")
        for k, value in enumerate(bandwidths):
            good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            if not good:
                raise _invalid(where, f"bandwidths[{k}]", value, "a positive number of bytes per second")
    backends = record.get("backends")
    if backends is not None:
        if not isinstance(backends, list) or len(backends) != count:
            raise _invalid(where, "backends", backends, f"null or a list of {count} backend names")
        for k, name in enumerate(backends):
            if not (isinstance(name, str) and 0 < len(name) <= 64):
                raise _invalid(where, f"backends[{k}]", name, "a backend name")
