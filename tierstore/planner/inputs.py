"""What ``tierstore plan`` reads: parameter counts, sizes, speeds, a ``bench io`` file, a model factory.

Each reader checks its value and raises :class:`~tierstore.errors.ConfigError`
naming the value and the fix; the arithmetic (:mod:`tierstore.planner.memory`)
and the command (:mod:`tierstore.cli.plan`) take what they return.

Example
-------
>>> parse_count("7B"), parse_nbytes("512GiB", "--host-ram"), parse_rate("600", "--drive-tbw")
(7000000000, 549755813888, 600.0)
"""

from __future__ import annotations

import inspect
import json
import math
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .._platform.factory import resolve
from ..errors import ConfigError
from ..sizes import parse_size

if TYPE_CHECKING:  # torch is imported where a model is built: `tierstore plan --help` stays fast
    import torch

__all__ = [
    "PRECISION_DTYPES",
    "parse_count",
    "parse_nbytes",
    "parse_rate",
    "read_io_json",
    "read_io_json_drives",
    "load_model",
    "existing_ancestor",
    "disk_free",
]

#: ``--precision``/``precision=`` names -> the torch dtype of the parameters (an fp32 master for bf16/fp16).
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: int | float | str, *, name: str = "params") -> int:
    """A parameter count written as ``7e9``, ``7B``, ``70B``, ``125M``, ``1.5B`` or ``350k``.

    Raises
    ------
    ConfigError
        If ``value`` is not a positive count.

    Example
    -------
    >>> parse_count("7B"), parse_count("125M"), parse_count("7e9")
    (7000000000, 125000000, 7000000000)
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a bool; give a parameter count such as 7e9 or '7B'")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        if value.strip().startswith("-"):
            raise ConfigError(f"{name}={value!r} is negative; give a parameter count > 0 such as '7B'")
        match = _COUNT.match(value)
        if match is None:
            raise ConfigError(
                f"{name}={value!r} is not a parameter count; write it like '7e9', '7B', '70B', '125M' or '350k'"
            )
        number = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    else:
        raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; give an int or a string like '7B'")
    if not math.isfinite(number) or number < 1:
        raise ConfigError(f"{name}={value!r} must be a finite parameter count >= 1, e.g. '7B'")
    return round(number)


def parse_nbytes(value: int | str | None, name: str, *, allow_zero: bool = False) -> int | None:
    """A byte size (``"80GB"``, ``"512GiB"``, an int); ``None`` stays ``None``.

    Raises
    ------
    ConfigError
        For a negative size, a zero size (unless ``allow_zero``), or text that is not a size.

    Example
    -------
    >>> parse_nbytes("1KiB", "--host-ram"), parse_nbytes(None, "--disk-free")
    (1024, None)
    """
    if value is None:
        return None
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ConfigError(f"{name}={value!r} is negative; give a size such as '80GB' or '512GiB'")
    nbytes = parse_size(value, name=name)
    if nbytes == 0 and not allow_zero:
        raise ConfigError(f"{name}={value!r} is zero; give a size > 0 such as '80GB' or '512GiB'")
    return nbytes


def parse_rate(value: float | str | None, name: str) -> float | None:
    """A finite number > 0 (a speed, a TBW rating, months); ``None`` stays ``None``.

    Raises
    ------
    ConfigError
        For a bool, text that is not a number, or a number that is not finite and > 0.

    Example
    -------
    >>> parse_rate("2.5", "--read-gbps")
    2.5
    """
    if value is None:
        return None
    try:
        if isinstance(value, bool):  # a JSON true is not a speed
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={value!r} is not a number; give a speed such as 2.5") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{name}={value!r} must be a finite number > 0, e.g. 2.5")
    return number


def read_io_json(path: str | Path) -> dict[str, float | None]:
    """The bandwidths in a ``tierstore bench io --json`` file; missing keys are ``None``.

    Reads ``summary.best_read_GBps``, ``summary.best_write_GBps`` and
    ``summary.memory_GBps``.

    Raises
    ------
    ConfigError
        If the file is missing, is not JSON, or holds a non-positive speed.

    Example
    -------
    >>> import json, tempfile
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write(json.dumps({"summary": {"best_read_GBps": 6.5}})); f.close()
    >>> read_io_json(f.name)
    {'read_gbps': 6.5, 'write_gbps': None, 'memory_gbps': None}
    """
    path = Path(path)
    summary = _io_summary(path)
    keys = {"read_gbps": "best_read_GBps", "write_gbps": "best_write_GBps", "memory_gbps": "memory_GBps"}
    found = {}
    for ours, theirs in keys.items():
        value = summary.get(theirs)
        if isinstance(value, float) and math.isnan(value):
            value = None  # bench io writes NaN for what it could not measure
        found[ours] = parse_rate(value, f"summary.{theirs} in {path}")
    return found


def _io_summary(path: Path) -> dict:
    """The ``summary`` object of a ``bench io --json`` file (empty when it has none)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"io json file {str(path)!r} does not exist; write one with "
            f"`tierstore bench io --dir DIR --json {path}` or pass --read-gbps/--write-gbps"
        ) from None
    except OSError as exc:
        raise ConfigError(f"io json file {str(path)!r} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise ConfigError(
            f"io json file {str(path)!r} is not JSON ({exc}); it should be the output of `tierstore bench io --json`"
        ) from None
    summary = data.get("summary") if isinstance(data, dict) else None
    return summary if isinstance(summary, dict) else {}


def read_io_json_drives(path: str | Path) -> list[tuple[str, float | None, float | None]]:
    """Each drive of a ``tierstore bench io DIR DIR... --json`` file: its directory, read and write GB/s.

    Reads ``summary.drives`` (none in a one-drive file: an empty list).

    Raises
    ------
    ConfigError
        If the file is missing or not JSON, or a drive's entry is not a directory and speeds.

    Example
    -------
    >>> import json, tempfile
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    >>> _ = f.write(json.dumps({"summary": {"drives": [{"dir": "/nvme0", "read_GBps": 6.5, "write_GBps": 3.0}]}}))
    >>> f.close(); read_io_json_drives(f.name)
    [('/nvme0', 6.5, 3.0)]
    """
    path = Path(path)
    drives = _io_summary(path).get("drives") or []
    if not isinstance(drives, list) or len(drives) > 64:
        raise ConfigError(f"summary.drives in {path} is not a list of at most 64 drives; write the file again with "
                          "`tierstore bench io DIR DIR... --json FILE`")
    out = []
    for k, d in enumerate(drives):
        where = d.get("dir") if isinstance(d, dict) else None
        if not isinstance(where, str) or not where:
            raise ConfigError(f"summary.drives[{k}] in {path} names no directory; write the file again with "
                              "`tierstore bench io DIR DIR... --json FILE`")
        speeds = [d.get(key) for key in ("read_GBps", "write_GBps")]
        speeds = [None if isinstance(v, float) and math.isnan(v) else v for v in speeds]
        out.append((where, *(parse_rate(v, f"summary.drives[{k}].{key} in {path}")
                             for v, key in zip(speeds, ("read_GBps", "write_GBps")))))
    return out


def load_model(spec: str) -> torch.nn.Module:
    """Import ``module:factory`` (or ``path/to/file.py:factory``) and build the model on ``meta``.

    A factory with a ``device`` parameter gets ``device=torch.device("meta")``;
    any factory runs under ``with torch.device("meta")``, so no weights are
    allocated. The factory returns the ``nn.Module``, or a tuple whose first
    element is one: the ``(model, batch, loss_fn)`` factory of ``tierstore
    diagnose`` works here too (the rest of the tuple is ignored).

    Raises
    ------
    ConfigError
        If the spec is malformed, the import or the call fails, or the factory
        returns neither an ``nn.Module`` nor a tuple starting with one.

    Example
    -------
    >>> model = load_model("torch.nn:PReLU")
    >>> next(model.parameters()).device
    device(type='meta')
    """
    import torch

    factory = resolve(spec, flag="--model")
    attr = spec.rpartition(":")[2]
    meta = torch.device("meta")
    try:
        takes_device = "device" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_device = False
    try:
        with meta:
            model = factory(device=meta) if takes_device else factory()
    except Exception as exc:
        raise ConfigError(
            f"--model {spec!r}: calling {attr}() on the meta device failed: {exc!r}. "
            "Make the factory work under `with torch.device('meta')`, or pass --params instead"
        ) from None
    if isinstance(model, tuple) and model and isinstance(model[0], torch.nn.Module):
        # The factory `tierstore diagnose` takes returns (model, batch[, loss_fn]): one factory serves both.
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module; return the "
            "model, or a tuple whose first element is the model (such as diagnose's (model, batch, loss_fn))"
        )
    return model


def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent (absolute).

    Example
    -------
    >>> existing_ancestor("/no/such/dir/anywhere")
    PosixPath('/')
    """
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def disk_free(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    return shutil.disk_usage(existing_ancestor(path)).free
