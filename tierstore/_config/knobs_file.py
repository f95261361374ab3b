"""The knobs file: what ``tierstore tune`` measured and picked, read back by ``TieredAdamW(knobs=...)``.

A knobs file holds resources only, never identity: I/O workers, request
size, prefetch depth and update threads (:data:`TUNED`), each drive's
measured bandwidth (which a *new* state's placement may use instead of its
quick probe), and a shard size that is only a suggestion (the shard size is
part of a state's identity: a knobs file never sets it). A state therefore
runs with any knobs file, or none.

The optimizer takes a value from the file only for a knob its caller left at
the default (:meth:`KnobsFile.apply`): an argument given explicitly wins,
even one equal to the default (the registry's int defaults are
:class:`~tierstore._config.registry.Default` objects, told apart by identity).

The file is read as every file tierstore reads back is: never through a
symbolic link at its last component, only a regular file, at most
:data:`MAX_KNOBS_FILE_BYTES`, strict JSON (no ``NaN``), known keys only,
every value checked by its knob's own check and bounded
(:data:`UPPER_BOUNDS`); a file from a newer tierstore is a
:class:`~tierstore.errors.FormatVersionError`. Every refusal is a
:class:`~tierstore.errors.ConfigError` naming the file, the entry and the fix.

Example
-------
>>> import json, tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "tuned.json"
>>> _ = path.write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION,
...                                 "knobs": {"io_workers": 4, "request_bytes": 4 << 20}}))
>>> tuned = read_knobs_file(path)
>>> tuned.knobs
{'io_workers': 4, 'request_bytes': 4194304}
>>> from tierstore._config.registry import KNOBS
>>> tuned.apply({"io_workers": KNOBS["io_workers"].default, "request_bytes": 1 << 20})  # an explicit value wins
{'io_workers': 4, 'request_bytes': 1048576}
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, FormatVersionError
from .registry import KNOBS

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TUNED",
    "UPPER_BOUNDS",
    "MAX_KNOBS_FILE_BYTES",
    "DriveFigure",
    "KnobsFile",
    "read_knobs_file",
    "knobs_document",
    "encode_knobs_file",
    "device_of",
]

FORMAT_NAME = "tierstore-knobs"
FORMAT_VERSION = 1
#: The knobs a knobs file may set: resources of the streaming machinery.
TUNED = ("io_workers", "request_bytes", "prefetch_depth", "update_threads")
#: The largest value of each a file may hold: beyond these a value is a mistake or crafted (threads and
#: buffers are made from them at construction).
UPPER_BOUNDS = {"io_workers": 256, "request_bytes": 256 << 20, "prefetch_depth": 64, "update_threads": 4096}
MAX_KNOBS_FILE_BYTES = 1 << 20  # 1 MiB: tune writes a few KiB
MAX_DRIVES = 64  # as many as a state may span (tierstore._storage.placement.MAX_DRIVES)
MAX_PATH_CHARS = 4096
MAX_BANDWIDTH = 1e13  # bytes/s: 10 TB/s, beyond any drive
MAX_SUGGESTED_SHARD_NUMEL = 1 << 30
_KEYS = {"format", "version", "knobs", "drives", "suggested", "fallback", "measurements", "hardware", "written_by",
         "created", "command"}
_DRIVE_KEYS = {"path", "device", "bandwidth", "read_bandwidth", "write_bandwidth", "backend"}


@dataclass(frozen=True)
class DriveFigure:
    """One drive's measured speed: the directory measured, its device (``st_dev``) and bytes per second.

    ``bandwidth`` is what placement weighs a drive by: bytes written then read
    back per second, ``1 / (1/read + 1/write)``.
    """

    path: str
    device: int | None
    bandwidth: float
    read_bandwidth: float | None = None
    write_bandwidth: float | None = None
    backend: str | None = None


@dataclass(frozen=True)
class KnobsFile:
    """A knobs file, read and checked (:func:`read_knobs_file`)."""

    path: str
    knobs: dict[str, Any] = field(default_factory=dict)
    drives: tuple[DriveFigure, ...] = ()
    shard_numel: int | None = None  # a suggestion for a new state, never applied
    fallback: bool = False  # the tuner's pick was not faster than the defaults: these are the defaults

    def apply(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` (a front's knob arguments by name) with this file's value for each knob left at its default.

        A knob is left at its default when its argument *is* the registry's
        default object (:class:`~tierstore._config.registry.Default`, or ``None``).
        """
        out = dict(given)
        for name, value in self.knobs.items():
            if name in out and out[name] is KNOBS[name].default:
                out[name] = value
        return out

    def bandwidths_for(self, directories: Sequence[str | os.PathLike]) -> list[float] | None:
        """Each directory's share of its drive's bandwidth from this file, or ``None`` unless every drive is found.

        A directory is found by the directory measured that holds it (itself
        or a parent), else by its drive (``st_dev``; a directory that does not
        exist yet: its nearest existing parent's, where it will be made).
        Directories on one drive share one figure (the mean of those found for
        them, when ``tune`` measured several of its directories), split
        equally, as the optimizer's own probe splits it: two directories on
        one drive place half and half.

        Example
        -------
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> KnobsFile("k.json", drives=(DriveFigure(d, device_of(d), 2e9),)).bandwidths_for([d + "/state"])
        [2000000000.0]
        >>> KnobsFile("k.json", drives=(DriveFigure(d, device_of(d), 2e9),)).bandwidths_for([d + "/a", d + "/b"])
        [1000000000.0, 1000000000.0]
        """
        by_device: dict[int, float] = {}
        for d in self.drives:
            if d.device is not None:
                by_device.setdefault(d.device, d.bandwidth)
        measured = [(os.path.abspath(d.path), d.bandwidth) for d in self.drives]
        found: list[tuple[int, float]] = []  # (drive, figure) per directory
        for directory in directories:
            where = os.path.abspath(Path(directory).expanduser())
            inside = [(len(path), bw) for path, bw in measured if where == path or where.startswith(path.rstrip("/") + "/")]
            device = device_of(directory)
            figure = max(inside)[1] if inside else by_device.get(device)
            if figure is None:
                return None
            found.append((device, figure))
        shared: dict[int, list[float]] = {}
        for device, figure in found:
            shared.setdefault(device, []).append(figure)
        # The drive's one figure (the mean of those found for it) over the directories that share it.
        return [statistics.fmean(shared[device]) / len(shared[device]) for device, _ in found]


def device_of(directory: str | os.PathLike) -> int:
    """``st_dev`` of ``directory``, or of its nearest existing parent (where it would be made)."""
    probe = Path(directory).expanduser().absolute()
    while True:
        try:
            return os.stat(probe).st_dev
        except OSError:
            if probe == probe.parent:
                raise
            probe = probe.parent


# -- reading ---------------------------------------------------------------------------
def _fail(path: str, what: str, fix: str = "") -> ConfigError:
    text = f"knobs file {path!r}: {what}"
    return ConfigError(text + (f"; {fix}" if fix else ""))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


REWRITE = "write a new one with `tierstore tune DIR...`"


def _read_bytes(path: str) -> bytes:
    """The file's bytes: a regular file reached without a link at its last component, at most the limit."""
    from ..backends.base import file_kind

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(path, "does not exist", "pass the file `tierstore tune DIR... --out FILE` wrote") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _fail(path, "is a symbolic link; a knobs file is never read through one", "pass the file it "
                        "points to") from None
        raise _fail(path, f"cannot be read ({exc.strerror})", "check its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(path, f"is {file_kind(st.st_mode)}, not a regular file", "pass the JSON file tune wrote")
        if st.st_size > MAX_KNOBS_FILE_BYTES:
            raise _fail(path, f"is {st.st_size} bytes, more than the {MAX_KNOBS_FILE_BYTES >> 10} KiB a knobs file "
                        "may be: tune never writes one that large", REWRITE)
        chunks, total = [], 0
        while total <= MAX_KNOBS_FILE_BYTES:
            chunk = os.read(fd, MAX_KNOBS_FILE_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror})", "check the file and its drive") from None
    finally:
        os.close(fd)
    if total > MAX_KNOBS_FILE_BYTES:
        raise _fail(path, f"grew beyond {MAX_KNOBS_FILE_BYTES >> 10} KiB while it was read", REWRITE)
    return b"".join(chunks)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def _number(path: str, where: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, f"{where}={_short(value)} is not a number of bytes per second", REWRITE)
    number = float(value)
    if not (math.isfinite(number) and 0 < number <= MAX_BANDWIDTH):
        raise _fail(path, f"{where}={_short(value)} must be a number of bytes per second above 0 and at most "
                    f"{MAX_BANDWIDTH:.0e}", REWRITE)
    return number


def _knobs(path: str, section: Any) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise _fail(path, f"'knobs' is {_short(section)}, not an object of knob values", REWRITE)
    out: dict[str, Any] = {}
    for name, value in section.items():
        if name not in TUNED:
            knob = KNOBS.get(name)
            if knob is not None and knob.kind == "identity":
                raise _fail(path, f"knobs.{name} is part of the state's identity; a knobs file holds resources "
                            "only", "remove it (tune suggests a shard size under 'suggested', for a new state)")
            raise _fail(path, f"knobs.{_short(name)} is not a knob a knobs file may set",
                        f"remove it; the knobs are {', '.join(TUNED)}")
        label = f"knobs file {path!r}: knobs.{name}"
        checked = KNOBS[name].validate(value, label)
        if checked is not None and checked > UPPER_BOUNDS[name]:
            raise _fail(path, f"knobs.{name}={value!r} is above {UPPER_BOUNDS[name]}, the most a knobs file may "
                        "set", REWRITE)
        out[name] = checked
    return out


def _drives(path: str, section: Any) -> tuple[DriveFigure, ...]:
    if not isinstance(section, list):
        raise _fail(path, f"'drives' is {_short(section)}, not a list of drives", REWRITE)
    if len(section) > MAX_DRIVES:
        raise _fail(path, f"'drives' lists {len(section)} drives, more than {MAX_DRIVES}", REWRITE)
    out = []
    for k, entry in enumerate(section):
        where = f"drives[{k}]"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where} is {_short(entry)}, not an object", REWRITE)
        unknown = sorted(set(entry) - _DRIVE_KEYS)
        if unknown:
            raise _fail(path, f"{where} has unknown keys {_short(unknown)}", REWRITE)
        where_path = entry.get("path")
        if not isinstance(where_path, str) or not where_path or len(where_path) > MAX_PATH_CHARS or "\0" in where_path:
            raise _fail(path, f"{where}.path={_short(where_path)} is not a directory's path", REWRITE)
        device = entry.get("device")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < 1 << 64):
            raise _fail(path, f"{where}.device={_short(device)} is not a device number", REWRITE)
        backend = entry.get("backend")
        if backend is not None and KNOBS["backend"].validate(backend, f"knobs file {path!r}: {where}.backend") == "auto":
            backend = None
        out.append(DriveFigure(
            where_path, device, _number(path, f"{where}.bandwidth", entry.get("bandwidth")),  # type: ignore[arg-type]
            _number(path, f"{where}.read_bandwidth", entry.get("read_bandwidth"), optional=True),
            _number(path, f"{where}.write_bandwidth", entry.get("write_bandwidth"), optional=True),
            backend,
        ))
    return tuple(out)


def _suggested(path: str, section: Any) -> int | None:
    if not isinstance(section, dict):
        raise _fail(path, f"'suggested' is {_short(section)}, not an object", REWRITE)
    unknown = sorted(set(section) - {"shard_numel"})
    if unknown:
        raise _fail(path, f"'suggested' has unknown keys {_short(unknown)}", REWRITE)
    value = section.get("shard_numel")
    if value is None:
        return None
    KNOBS["shard_numel"].validate(value, f"knobs file {path!r}: suggested.shard_numel")
    if value > MAX_SUGGESTED_SHARD_NUMEL:
        raise _fail(path, f"suggested.shard_numel={value} is above {MAX_SUGGESTED_SHARD_NUMEL}", REWRITE)
    return value


def read_knobs_file(path: str | os.PathLike) -> KnobsFile:
    """Read and check the knobs file at ``path`` (see the module docs for what is refused).

    Raises
    ------
    ConfigError
        Naming the file, the entry and the fix: a missing file, a link, not a
        regular file, too large, not JSON, not a knobs file, an unknown key, a
        value out of its knob's range or an identity knob.
    FormatVersionError
        For a file written by a newer tierstore.
    """
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"knobs={_short(path)} must be the path of a knobs file written by `tierstore tune`, or None")
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigError(f"knobs={_short(path)} is not a file path; pass the file `tierstore tune` wrote, or None")
    raw = _read_bytes(text)
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, nesting too deep
        raise _fail(text, f"is not valid JSON ({_short(str(exc), 120)})", REWRITE) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise _fail(text, f"is not a knobs file (no \"format\": {FORMAT_NAME!r})", "pass the file `tierstore tune` "
                    "wrote")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _fail(text, f"has version {_short(version)}, not a knobs file version", REWRITE)
    if version > FORMAT_VERSION:
        raise FormatVersionError(f"knobs file {text!r} has version {version}; this tierstore reads version "
                                 f"{FORMAT_VERSION}: upgrade tierstore, or {REWRITE}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise _fail(text, f"has unknown keys {_short(unknown)}", REWRITE)
    fallback = data.get("fallback", False)
    if not isinstance(fallback, bool):
        raise _fail(text, f"'fallback' is {_short(fallback)}, not true or false", REWRITE)
    return KnobsFile(
        path=text,
        knobs=_knobs(text, data.get("knobs", {})),
        drives=_drives(text, data.get("drives", [])),
        shard_numel=_suggested(text, data.get("suggested", {})),
        fallback=fallback,
    )


# -- writing -----------------------------------------------------------------------------------
def knobs_document(knobs: Mapping[str, Any], *, drives: Sequence[DriveFigure] = (), shard_numel: int | None = None,
                   fallback: bool = False, **extra: Any) -> dict[str, Any]:
    """A knobs file's content (``extra``: ``measurements``, ``hardware``, ``written_by``, ``created``, ``command``).

    Raises
    ------
    ConfigError
        When the result would not read back (:func:`read_knobs_file`'s checks).

    Example
    -------
    >>> knobs_document({"io_workers": 4})["knobs"]
    {'io_workers': 4}
    """
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ConfigError(f"knobs_document: unknown keys {unknown}")
    doc: dict[str, Any] = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "knobs": dict(knobs)}
    doc["drives"] = [{k: v for k, v in vars(d).items() if v is not None} for d in drives]
    if shard_numel is not None:
        doc["suggested"] = {"shard_numel": shard_numel}
    doc["fallback"] = fallback
    doc.update(extra)
    _knobs("<new>", doc["knobs"])
    _drives("<new>", doc["drives"])
    return doc


def encode_knobs_file(document: Mapping[str, Any]) -> bytes:
    """The bytes of a knobs file (indented JSON; no ``NaN``), refused when beyond :data:`MAX_KNOBS_FILE_BYTES`.

    Raises
    ------
    ConfigError
        When the document is too large to read back.
    """
    payload = (json.dumps(document, indent=2, allow_nan=False) + "\n").encode()
    if len(payload) > MAX_KNOBS_FILE_BYTES:
        raise ConfigError(f"a knobs file of {len(payload)} bytes would not read back (at most {MAX_KNOBS_FILE_BYTES})")
    return payload
