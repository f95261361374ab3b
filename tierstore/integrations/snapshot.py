"""The optimizer's part of a trainer's checkpoint: a small reference file and a snapshot beside it.

A trainer (Hugging Face ``Trainer``, Lightning, accelerate) saves a
checkpoint as a folder. Instead of ``torch.save(optimizer.state_dict())``,
which builds the whole state in RAM, the optimizer's part is written into
that folder as two entries:

- ``tierstore_optimizer.zarr``: the **snapshot**, a zarr v3 checkpoint
  streamed shard by shard through the optimizer's arena
  (:func:`tierstore.checkpoint.save_checkpoint`: no RAM beyond
  ``ram_budget``, a checksum per chunk). It is a copy, independent of the
  state directory, so it stays valid while training goes on and the state
  directory keeps committing (its files are rewritten in place, so hard
  links could not do that; reflinks are not used yet). It costs
  the state's bytes once on disk (the moments, and the masters when kept,
  in their stored format).
- ``tierstore_optimizer.json``: the **reference**, written after the
  snapshot is complete and synced: the format, the step, the layout's
  fingerprint, the snapshot's name and size, the sha256 of the snapshot's
  root ``zarr.json`` (which holds every chunk's checksum) and one sha256
  over every ``zarr.json`` in it (each array's shape, type and codecs), so
  a reference matches exactly one snapshot.

Both live inside the checkpoint folder, so whatever deletes the folder
(rotation by ``save_total_limit`` or top-k, ``rm -r``) frees the snapshot,
and copying the folder carries it. Loading checks the reference, the
snapshot's metadata and every chunk's checksum, and names the checkpoint
when something is missing or damaged; it never starts fresh silently.

What can be left behind is found by :func:`check_trainer_checkpoints` (and
``tierstore verify`` on a checkpoint folder or on the trainer's output
folder): a snapshot without its reference (a save interrupted between the
two) and the hidden ``.tierstore_optimizer.zarr.partial-*``/``.old-*``
folders of a save that crashed. These are **orphans**: named with their
size, safe to delete.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> ckpt = tempfile.mkdtemp() + "/checkpoint-1"
>>> w = torch.nn.Parameter(torch.ones(4))
>>> with TieredAdamW([w], lr=0.1) as opt:
...     w.grad = torch.ones(4); _ = opt.step()
...     _ = save_trainer_snapshot(opt, ckpt)
>>> read_reference(ckpt)["step_count"]
1
>>> with TieredAdamW([w], lr=0.1) as fresh:
...     load_trainer_snapshot(fresh, ckpt); fresh.step_count
1
>>> check_trainer_checkpoints(ckpt)
[]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._state.statedir import atomic_write
from .._version import __version__
from ..checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from ..errors import ConfigError, CorruptStateError, FormatVersionError, TierstoreError

__all__ = [
    "REFERENCE_NAME",
    "SNAPSHOT_NAME",
    "REFERENCE_FORMAT",
    "REFERENCE_VERSION",
    "Finding",
    "save_trainer_snapshot",
    "load_trainer_snapshot",
    "read_reference",
    "has_trainer_snapshot",
    "snapshot_nbytes",
    "check_trainer_checkpoints",
    "tiered_optimizer",
    "refuse_stale_start",
    "DIGEST_KEYS",
    "read_reference_digest",
]

log = logging.getLogger(__name__)

REFERENCE_NAME = "tierstore_optimizer.json"
SNAPSHOT_NAME = "tierstore_optimizer.zarr"
REFERENCE_FORMAT = "tierstore-trainer-optimizer"
REFERENCE_VERSION = 2  # 2: metadata_sha256 (every zarr.json); 1 pinned the root zarr.json only
METADATA_MAX_BYTES = 64 << 20  # one zarr.json holds at most a chunk checksum per chunk: far below this
REFERENCE_MAX_BYTES = 1 << 20  # 1 MiB: a reference is a few hundred bytes; a bigger file is not one
# Hidden leftovers of tierstore.checkpoint's atomic writes (".NAME.partial-XXXX", ".NAME.old-XXXX").
LEFTOVER_PREFIXES = (f".{SNAPSHOT_NAME}.partial-", f".{SNAPSHOT_NAME}.old-")


@dataclass(frozen=True)
class Finding:
    """One problem :func:`check_trainer_checkpoints` found.

    ``kind``: ``"error"`` (a checkpoint cannot resume its optimizer: its
    snapshot is missing, damaged or not the one its reference names) or
    ``"orphan"`` (a snapshot or a save's leftover that no reference uses:
    disk to free). ``path``: what it is about; ``nbytes``: its size on disk
    (orphans); ``message``: what is wrong and what to do.
    """

    kind: str
    path: str
    message: str
    nbytes: int = 0

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def tiered_optimizer(optimizer: Any) -> Any:
    """The tiered optimizer (any front: ``TieredAdamW``, ``TieredSGD``, ...) inside ``optimizer``, or ``None``.

    accelerate's and Lightning's wrappers are unwrapped.

    Example
    -------
    >>> import torch
    >>> tiered_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
    True
    """
    # The front, imported on use so that importing this module stays light.
    from ..tiered_optimizer import TieredOptimizer

    seen = 0
    while optimizer is not None and seen < 8:
        # Lightning's LightningOptimizer derives from the optimizer's class and copies its __dict__:
        # it passes isinstance, so the optimizer it wraps (._optimizer) is taken first.
        inner = getattr(optimizer, "_optimizer", None)
        if isinstance(inner, TieredOptimizer):
            return inner
        if isinstance(optimizer, TieredOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)  # AcceleratedOptimizer(.optimizer) and the like
        seen += 1
    return None


def refuse_stale_start(opt: Any, trainer_step: int, fix: str) -> None:
    """Refuse a trainer that starts at step 0 with an optimizer that resumed a committed state.

    ``resume="auto"`` (or ``True``) continues a state directory's last commit: its moments belong to
    step ``opt.step_count``, while a trainer that starts fresh resets the model's schedule to step 0.
    Training on would mix the two silently. ``fix`` says how this trainer resumes from a checkpoint.

    Example
    -------
    >>> refuse_stale_start(None, 0, "Pass the checkpoint")  # no tiered optimizer: nothing to check

    Raises
    ------
    ConfigError
        Naming the state directory, the step it holds, and the ways out.
    """
    if trainer_step == 0 and opt is not None and opt.step_count > 0:
        raise ConfigError(
            f"the optimizer resumed step {opt.step_count} from state_dir={opt.state_dir!r}, but the trainer starts "
            f"at step 0: its moments would not match the model, the data order or the LR schedule. {fix}, or build "
            "the optimizer with resume=False and a fresh (or emptied) state_dir to start over"
        )


def _zarr_json_digest(snapshot: Path) -> str:
    # zarr.json holds the layout, steps and every chunk's checksum: its digest pins the whole snapshot.
    fd = os.open(snapshot / "zarr.json", os.O_RDONLY | os.O_NOFOLLOW)  # a link inside a snapshot is not followed
    with os.fdopen(fd, "rb") as f:
        return hashlib.sha256(f.read(METADATA_MAX_BYTES + 1)).hexdigest()


def _metadata_digest(snapshot: Path) -> str:
    """One sha256 over every ``zarr.json`` under ``snapshot`` (its path and its bytes), links not followed.

    The root's pins the chunks' checksums; each array's pins its shape, data type and codecs.
    """
    digest = hashlib.sha256()
    found = []
    for root, dirs, files in os.walk(snapshot):  # os.walk does not descend into links to folders
        dirs.sort()
        found += [os.path.join(root, n) for n in sorted(files) if n == "zarr.json"]
    for path in found:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(METADATA_MAX_BYTES + 1)
        if len(data) > METADATA_MAX_BYTES:
            raise CorruptStateError(f"{path} is larger than {METADATA_MAX_BYTES} bytes: not a snapshot's zarr.json")
        name = os.path.relpath(path, snapshot).encode()
        digest.update(len(name).to_bytes(8, "little") + name + hashlib.sha256(data).digest())
    return digest.hexdigest()


def snapshot_nbytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk under ``path`` (a snapshot or any folder; sparse holes not counted)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def save_trainer_snapshot(
    opt: Any, checkpoint_dir: str | os.PathLike, *, checksum: str | None = "xxh3", owner: str | None = None
) -> Path:
    """Write the optimizer's part of a trainer checkpoint into ``checkpoint_dir``; return the reference's path.

    Streams the state into ``checkpoint_dir/tierstore_optimizer.zarr``
    (:func:`tierstore.checkpoint.save_checkpoint`: shard by shard through
    the arena, within ``ram_budget``), then writes the reference
    ``tierstore_optimizer.json`` atomically. A snapshot already there (the
    same checkpoint saved again) is replaced. Disk cost: the state's bytes
    once (:func:`snapshot_nbytes`).

    Parameters
    ----------
    opt
        An open :class:`~tierstore.TieredAdamW`.
    checkpoint_dir
        The trainer's checkpoint folder (created if missing).
    checksum
        As :func:`~tierstore.checkpoint.save_checkpoint` (``"xxh3"`` by default).
    owner
        Where the trainer's checkpoint is a file beside the folder (Lightning's
        ``x.ckpt`` and ``x.ckpt.tierstore/``), its name: once that file is
        gone, :func:`check_trainer_checkpoints` names the folder an orphan.

    Raises
    ------
    ClosedError, StepFailedError
        If the optimizer is closed or failed.
    DiskFullError, StateDirError
        If the reference cannot be written.
    """
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    snapshot = folder / SNAPSHOT_NAME
    # Note: an existing reference goes first, so that a crash mid-save leaves an orphan snapshot
    # (named by check_trainer_checkpoints), never a reference to a snapshot that is being replaced.
    if os.path.lexists(folder / REFERENCE_NAME):
        os.unlink(folder / REFERENCE_NAME)
    save_checkpoint(opt, snapshot, overwrite=os.path.lexists(snapshot), checksum=checksum)
    reference = {
        "format": REFERENCE_FORMAT,
        "format_version": REFERENCE_VERSION,
        "tierstore_version": __version__,
        "snapshot": SNAPSHOT_NAME,
        "step_count": int(opt.step_count),
        "fingerprint": opt.layout.fingerprint,
        "state_bytes": int(opt.layout.state_nbytes),
        "snapshot_bytes": snapshot_nbytes(snapshot),
        "zarr_json_sha256": _zarr_json_digest(snapshot),
        "metadata_sha256": _metadata_digest(snapshot),
    }
    if owner is not None:
        reference["owner"] = owner
    path = folder / REFERENCE_NAME
    atomic_write(path, json.dumps(reference, indent=1).encode())
    log.info("saved the optimizer snapshot of step %d into %s", reference["step_count"], folder)
    return path


#: The reference fields that pin one snapshot (a file that names a snapshot keeps them to find it again).
DIGEST_KEYS = ("zarr_json_sha256", "metadata_sha256")


def read_reference_digest(reference_path: str | os.PathLike) -> dict[str, str]:
    """The digest fields (:data:`DIGEST_KEYS`) of the reference file ``reference_path``, as just written."""
    return {k: v for k, v in read_reference(Path(reference_path).parent).items() if k in DIGEST_KEYS}


def has_trainer_snapshot(checkpoint_dir: str | os.PathLike) -> bool:
    """True when ``checkpoint_dir`` holds a tierstore reference file (its snapshot is checked on load)."""
    return os.path.lexists(Path(checkpoint_dir) / REFERENCE_NAME)


def read_reference(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The checked reference file of ``checkpoint_dir``.

    Raises
    ------
    CorruptStateError
        If it is missing, unreadable, too large, not JSON or lacks a field.
    FormatVersionError
        If a newer tierstore wrote it.
    """
    folder = Path(checkpoint_dir)
    path = folder / REFERENCE_NAME
    try:
        with open(path, "rb") as f:
            raw = f.read(REFERENCE_MAX_BYTES + 1)
    except OSError as exc:
        raise CorruptStateError(
            f"checkpoint {str(folder)!r}: cannot read its optimizer reference {REFERENCE_NAME} ({exc.strerror}); "
            "copy the checkpoint folder again, whole"
        ) from exc
    try:
        if len(raw) > REFERENCE_MAX_BYTES:
            raise ValueError(f"larger than {REFERENCE_MAX_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != REFERENCE_FORMAT:
            raise ValueError(f"not a {REFERENCE_FORMAT!r} file")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"format_version is {version!r}")
        if version > REFERENCE_VERSION:
            raise FormatVersionError(
                f"checkpoint {str(folder)!r}: its optimizer reference has format version {version}; this "
                f"tierstore ({__version__}) reads up to {REFERENCE_VERSION}: upgrade tierstore"
            )
        for key, kind in (("snapshot", str), ("step_count", int), ("fingerprint", str), ("zarr_json_sha256", str)):
            if not isinstance(data.get(key), kind):
                raise ValueError(f"{key} is {data.get(key)!r}")
        if version >= 2 and not isinstance(data.get("metadata_sha256"), str):
            raise ValueError(f"metadata_sha256 is {data.get('metadata_sha256')!r}")
        if data["snapshot"] != SNAPSHOT_NAME:
            raise ValueError(f"snapshot names {data['snapshot']!r}, not {SNAPSHOT_NAME!r}")
        owner = data.get("owner")
        if owner is not None and (not isinstance(owner, str) or owner in ("", ".", "..") or "/" in owner):
            raise ValueError(f"owner is {owner!r}, not a file name")
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, FormatVersionError):
            raise
        raise CorruptStateError(
            f"checkpoint {str(folder)!r}: its optimizer reference {REFERENCE_NAME} is damaged ({exc}); "
            "resume from another checkpoint"
        ) from exc
    return data


def _checked_snapshot(folder: Path) -> tuple[dict[str, Any], Path]:
    """The reference and its snapshot's path, after checking that the snapshot is the one it names."""
    reference = read_reference(folder)
    snapshot = folder / SNAPSHOT_NAME
    if not os.path.isdir(snapshot):
        raise CorruptStateError(
            f"checkpoint {str(folder)!r} refers to its optimizer snapshot {SNAPSHOT_NAME}/ (step "
            f"{reference['step_count']}), which is missing: a checkpoint folder must be copied whole, "
            f"{SNAPSHOT_NAME}/ and {REFERENCE_NAME} included"
        )
    try:
        digest = _zarr_json_digest(snapshot)
        metadata = _metadata_digest(snapshot) if "metadata_sha256" in reference else None
    except OSError as exc:
        raise CorruptStateError(
            f"checkpoint {str(folder)!r}: its optimizer snapshot has no readable zarr.json ({exc.strerror}); "
            "copy the checkpoint folder again, whole, or resume from another checkpoint"
        ) from exc
    if digest != reference["zarr_json_sha256"]:
        raise CorruptStateError(
            f"checkpoint {str(folder)!r}: its optimizer snapshot is not the one {REFERENCE_NAME} names "
            "(zarr.json's sha256 differs: replaced or damaged); resume from another checkpoint"
        )
    if metadata is not None and metadata != reference["metadata_sha256"]:
        raise CorruptStateError(
            f"checkpoint {str(folder)!r}: its optimizer snapshot's array metadata is not what {REFERENCE_NAME} "
            "names (an array's zarr.json was replaced or damaged); resume from another checkpoint"
        )
    return reference, snapshot


def load_trainer_snapshot(opt: Any, checkpoint_dir: str | os.PathLike) -> None:
    """Load the optimizer's part of a trainer checkpoint, shard by shard, and commit it.

    Checks the reference and that the snapshot is the one it names, then
    :func:`tierstore.checkpoint.load_checkpoint` (every chunk's checksum,
    within ``ram_budget``). A durable state directory then holds this
    checkpoint's step: it follows the trainer's checkpoint.

    Raises
    ------
    CorruptStateError
        Naming the checkpoint, if the reference or the snapshot is missing or
        damaged. A chunk found damaged mid-load leaves the optimizer unusable
        (``StepFailedError`` on its next use): the job stops, it never trains
        on from a half-loaded state.
    LayoutMismatchError
        If the checkpoint belongs to another model.
    """
    folder = Path(checkpoint_dir)
    reference, snapshot = _checked_snapshot(folder)
    try:
        load_checkpoint(opt, snapshot)
    except CorruptStateError as exc:
        raise CorruptStateError(f"checkpoint {str(folder)!r}: its optimizer snapshot is damaged: {exc}") from exc
    log.info("loaded the optimizer snapshot of step %d from %s", reference["step_count"], folder)


def _candidates(root: Path) -> list[Path]:
    """``root`` and its sub-folders (a trainer's output folder holds checkpoint-N/, or Lightning's .ckpt folders)."""
    folders = [root]
    try:
        with os.scandir(root) as it:
            folders += sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False) and e.name != SNAPSHOT_NAME
                              and not e.name.startswith(LEFTOVER_PREFIXES))  # fmt: skip
    except NotADirectoryError:
        return []
    return folders


def check_trainer_checkpoints(path: str | os.PathLike, *, chunks: bool = True) -> list[Finding]:
    """Check the trainer checkpoints in ``path`` (one checkpoint folder, or a folder of them).

    For every folder with a reference: the snapshot is there, is the one it
    names, and (``chunks``) every chunk matches its checksum (an error
    otherwise). Everywhere: a snapshot with no reference, or a save's
    hidden leftover, is an orphan (named with its size; delete it).

    Raises
    ------
    ConfigError
        If ``path`` is not a directory.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "checkpoint-3" / SNAPSHOT_NAME).mkdir(parents=True)
    >>> [f.kind for f in check_trainer_checkpoints(d)]
    ['orphan']
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{str(root)!r} is not a directory; pass a trainer checkpoint folder or its output folder")
    findings: list[Finding] = []
    for folder in _candidates(root):
        snapshot = folder / SNAPSHOT_NAME
        if has_trainer_snapshot(folder):
            try:
                reference, _ = _checked_snapshot(folder)
                owner = reference.get("owner")
                if owner is not None and not os.path.lexists(folder.parent / owner):
                    size = snapshot_nbytes(folder)
                    findings.append(Finding("orphan", str(folder), f"{folder} ({size} bytes) is the optimizer "
                                            f"snapshot of {owner}, which is gone: nothing resumes from it; delete "
                                            "it", size))  # fmt: skip
                    continue
                problems = verify_checkpoint(snapshot) if chunks else []
            except TierstoreError as exc:
                findings.append(Finding("error", str(folder), str(exc)))
                continue
            findings += [Finding("error", str(folder), f"checkpoint {str(folder)!r}: {p}") for p in problems]
        elif os.path.lexists(snapshot):
            size = snapshot_nbytes(snapshot)
            findings.append(Finding("orphan", str(snapshot), f"{snapshot} ({size} bytes) has no {REFERENCE_NAME} "
                                    "beside it (a save was interrupted, or the reference was deleted): nothing "
                                    "resumes from it; delete it", size))  # fmt: skip
        with os.scandir(folder) as it:
            leftovers = sorted(e.path for e in it if e.name.startswith(LEFTOVER_PREFIXES))
        for left in leftovers:
            size = snapshot_nbytes(left)
            findings.append(Finding("orphan", left, f"{left} ({size} bytes) is what a crashed snapshot save left; "
                                    "delete it", size))  # fmt: skip
    return findings
