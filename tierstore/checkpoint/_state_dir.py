"""A state directory read without an optimizer: its files and its manifest checked before anything is read.

What :func:`~tierstore.checkpoint.export_statedir`,
:func:`~tierstore.checkpoint.statedir_to_state_dict` and ``tierstore
inspect`` open: a :class:`~tierstore._state.reader.StateReader` over a
directory whose manifest and state files are regular files, and whose
manifest's step counts, param groups and shard records are checked as a
checkpoint's are.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
>>> with TieredAdamW([w], state_dir=d) as opt:
...     _ = opt.step()
>>> with open_state_reader(d) as reader:
...     require_clean(reader); reader.step_count
1
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CorruptStateError, StateDirError
from ._files import file_kind
from ._validate import check_header

__all__ = ["require_clean", "check_state_files", "open_state_reader", "check_manifest_header"]

def require_clean(reader: Any) -> None:
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
    from .._state.statedir import MANIFEST
    from .._storage.store import STATE_FILES

    path = Path(state_dir).expanduser()
    try:
        top = os.stat(path)  # the directory the caller named may be a link; nothing inside it may
    except FileNotFoundError:
        raise StateDirError(f"state directory {str(path)!r} does not exist; pass the state_dir a TieredAdamW wrote") from None
    except OSError as exc:
        raise StateDirError(f"cannot read state directory {str(path)!r} ({exc.strerror}); check the path and its permissions") from exc
    if not stat.S_ISDIR(top.st_mode):
        raise StateDirError(f"state directory {str(path)!r} is {file_kind(top.st_mode)}, not a directory; pass the state_dir a TieredAdamW wrote")
    for name in (MANIFEST, *STATE_FILES):
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            continue  # the reader says what a missing file means
        except OSError as exc:
            raise CorruptStateError(f"cannot read {path / name} ({exc.strerror}); check its permissions") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStateError(
                f"{path / name} is {file_kind(st.st_mode)}, not a regular file; a state directory holds only regular "
                "files, so it is not read. Restore the state directory from a checkpoint"
            )
    return path


def open_state_reader(state_dir: str | os.PathLike | list[str | os.PathLike]) -> Any:
    """A :class:`~tierstore._state.reader.StateReader` over ``state_dir``, its files checked first (:func:`check_state_files`)
    and its manifest's step counts, param groups and shard records checked (:func:`check_manifest_header`).

    ``state_dir``: a state directory, or the home of a state over several
    (its other directories are found at the paths its manifest recorded), or
    the list of all of them, home first.

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
    from .._state.reader import StateReader

    given = state_dir if isinstance(state_dir, (list, tuple)) else [state_dir]
    reader = StateReader([check_state_files(d) for d in given])
    try:
        check_manifest_header(reader)
    except BaseException:
        reader.close()
        raise
    return reader


def check_manifest_header(reader: Any) -> tuple[int, list[float | None], list[dict[str, Any]]]:
    """A state directory's step counts and param groups, checked as a checkpoint's are (:func:`check_header`),
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
    from .._state.statedir import MANIFEST

    m = reader.manifest
    where = f"the manifest {reader.path / MANIFEST}"
    header = check_header(
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
