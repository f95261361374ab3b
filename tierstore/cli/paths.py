"""What a path given on the command line is, and whether a command can write where it is asked to.

Every check looks at names only (``stat``/``lstat``), before anything is
read or built, so a bad path fails at once with one line that names it:

- :func:`blocking_file`: the nearest existing part of a path that is not a
  directory, so nothing can be created below it (the demo's ``--state-dir``,
  an output's folder);
- :func:`input_kind`: a state directory or a zarr checkpoint (``inspect``,
  ``verify``, ``export``, ``to-torch``);
- :func:`file_output_problem` and :func:`checkpoint_output_problem`: why
  ``to-torch`` cannot write its ``.pt`` file or ``export`` its checkpoint,
  with advice that names ``--overwrite`` only where it would work.

Nothing here imports torch: ``tierstore verify --help`` stays fast.

Example
-------
>>> import tempfile
>>> f = Path(tempfile.mkdtemp()) / "notes.txt"; _ = f.write_text("x")
>>> blocking_file(f / "sub" / "out.pt") == (f, "a regular file")
True
>>> blocking_file(f.parent / "new" / "out.pt") is None  # a folder to create under a directory
True
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from ..errors import ConfigError, CorruptStateError
from . import EXIT_USAGE

__all__ = [
    "blocking_file",
    "input_kind",
    "parent_problem",
    "file_output_problem",
    "checkpoint_output_problem",
    "usage_error",
    "flag_text",
]

def _file_kind(mode: int) -> str:
    # The one wording (tierstore.backends.base.file_kind), imported on use: the backends package
    # imports torch, and the commands' --help must not.
    from ..backends.base import file_kind

    return file_kind(mode)


def blocking_file(path: str | os.PathLike) -> tuple[Path, str] | None:
    """The nearest existing part of ``path`` (itself or a folder above) and its kind, when it is not a directory.

    ``None`` when that part is a directory (or nothing exists at all): then
    ``path`` exists as a directory or can be created with ``mkdir -p``.
    Links are followed, as creating below them would.
    """
    path = Path(path)
    for above in (path, *path.parents):
        try:
            st = os.stat(above)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return None if stat.S_ISDIR(st.st_mode) else (above, _file_kind(st.st_mode))
    return None


def usage_error(message: str) -> int:
    """Print ``message`` as the command line's one-line error and return the usage exit status (2)."""
    print(f"tierstore: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def flag_text(exc: Exception) -> str:
    """An error of the library as the command line says it: the fix is a flag, not a keyword argument.

    >>> flag_text(ValueError("out.zarr exists; pass overwrite=True"))
    'out.zarr exists; pass --overwrite'
    """
    return str(exc).replace("overwrite=True", "--overwrite")


def input_kind(path: str | os.PathLike, command: str) -> str:
    """``"state_dir"`` or ``"checkpoint"``: what the directory ``path`` holds, before anything in it is read.

    Only names are looked at (``lstat``), so a damaged or crafted directory
    is classified without being read; reading it is then the command's job.

    Raises
    ------
    ConfigError
        If ``path`` does not exist, is not a directory, or holds neither a
        ``manifest.json`` (a state directory) nor a ``zarr.json`` (a zarr
        checkpoint): a usage error (exit 2) that names the path.
    CorruptStateError
        If ``path`` holds shard files but no ``manifest.json``: damaged
        input (exit 1); the message says what is missing and how to restore.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "zarr.json").write_text("{}")
    2
    >>> input_kind(d, "inspect")
    'checkpoint'
    """
    from .._state.statedir import LOCK, MANIFEST  # torch: only once a command runs
    from .._storage.store import STATE_FILES

    path = Path(path)
    wanted = "a tierstore state directory (the state_dir of a TieredAdamW) or a zarr checkpoint"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{command}: {str(path)!r} does not exist; pass {wanted}") from None
    except OSError as exc:
        raise ConfigError(f"{command}: cannot look at {str(path)!r} ({exc.strerror}); pass {wanted}") from exc
    if not stat.S_ISDIR(st.st_mode):
        hint = "; a .pt state dict is read with torch.load" if path.suffix == ".pt" else ""
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a directory"
        raise ConfigError(f"{command}: {str(path)!r} is {kind}, not a directory; pass {wanted}{hint}")
    if os.path.lexists(path / "zarr.json"):
        return "checkpoint"
    if os.path.lexists(path / MANIFEST):
        return "state_dir"
    found = [name for name in STATE_FILES if os.path.lexists(path / name)]
    if found:
        # An optimizer writes the manifest when it is built (step 0), so shard files without one were
        # copied without it or lost it: the shard files alone cannot be read (which copy is committed?).
        raise CorruptStateError(
            f"{command}: {str(path)!r} holds shard files ({', '.join(found)}) but {MANIFEST} is missing, the record of "
            "the committed step and of which copy of each shard holds it, so the shards cannot be read; copy "
            f"{MANIFEST} back from where the directory came from, or restore the state from a zarr checkpoint "
            "(docs/troubleshooting.md, 'Corrupt state')"
        )
    started = os.path.lexists(path / LOCK)
    raise ConfigError(
        f"{command}: {str(path)!r} holds neither {MANIFEST} (a state directory) nor zarr.json (a zarr checkpoint)"
        + (": an optimizer opened it, but no step was committed there" if started else f"; pass {wanted}")
    )


def parent_problem(out: Path) -> str | None:
    """Why no file can be created at ``out`` (which does not exist), or ``None``: its folder must be a directory.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> parent_problem(d / "x" / "out.pt").startswith("the directory of")
    True
    """
    parent = out.parent
    if parent.is_dir():
        return None
    blocked = blocking_file(parent)
    if blocked is not None:
        above, kind = blocked
        return f"cannot write {out}: {above} is {kind}, not a directory; pass an OUT inside an existing directory"
    return f"the directory of {out} ({parent}) does not exist; create it (mkdir -p {parent}) or pass another OUT"


def file_output_problem(out: Path, overwrite: bool, src: Path | None = None) -> str | None:
    """Why ``to-torch`` cannot write the file ``out`` (checked before the state is read), or ``None``.

    The advice names ``--overwrite`` only where it would work: it replaces a
    regular file, never a directory or a special file.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> file_output_problem(d, overwrite=False).endswith(f"pass a file path such as {d / 'state.pt'} or {d}.pt")
    True
    """
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        return parent_problem(out)
    if stat.S_ISDIR(st.st_mode):
        if src is not None and os.path.lexists(src) and os.path.samefile(src, out):
            return f"{out} is the directory being converted; pass the .pt file to write, such as {out}.pt"
        return (
            f"{out} is a directory; to-torch writes one .pt file and never replaces a directory (--overwrite "
            f"replaces only a regular file): pass a file path such as {out / 'state.pt'} or {out}.pt"
        )
    if not stat.S_ISREG(st.st_mode):
        return (
            f"{out} exists and is {_file_kind(st.st_mode)}, not a regular file, so --overwrite will not replace it; "
            "remove it yourself or pass another OUT"
        )
    if not overwrite:
        return f"{out} exists; pass --overwrite to replace it, or choose another OUT"
    return None


def checkpoint_output_problem(src: Path, out: Path, overwrite: bool) -> str | None:
    """Why ``export`` cannot write the checkpoint ``out`` (before the state is read), or ``None``.

    ``--overwrite`` replaces only a tierstore checkpoint, so the advice names
    it only for a directory that holds a ``zarr.json``; the library checks the
    rest (that it is tierstore's) when it writes.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> "is a directory that is not a zarr checkpoint, so --overwrite will not" in checkpoint_output_problem(d / "s", d, overwrite=True)
    True
    """
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        return parent_problem(out)
    other = out.with_name(out.stem + "-2.zarr") if out.suffix == ".zarr" else out.with_name(out.name + ".zarr")
    with_name = f"pass a new path for the checkpoint, such as {other}"
    if stat.S_ISDIR(st.st_mode) and os.path.lexists(src) and os.path.samefile(src, out):
        return f"{out} is the state directory being exported; {with_name}"
    if not stat.S_ISDIR(st.st_mode) or not os.path.lexists(out / "zarr.json"):
        what = "a directory that is not a zarr checkpoint" if stat.S_ISDIR(st.st_mode) else _file_kind(st.st_mode)
        return (
            f"{out} exists and is {what}, so --overwrite will not replace it (it replaces only a tierstore "
            f"checkpoint); remove it yourself or {with_name}"
        )
    if not overwrite:
        return f"checkpoint {out} exists; pass --overwrite to replace it, or choose another OUT"
    return None
