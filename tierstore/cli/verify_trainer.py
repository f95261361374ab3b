"""``tierstore verify`` on a trainer's checkpoint folder, or on the folder that holds its checkpoints.

A trainer checkpoint made with :mod:`tierstore.integrations` holds the
optimizer as ``tierstore_optimizer.json`` (the reference) and
``tierstore_optimizer.zarr/`` (the snapshot). ``verify`` given such a folder,
or a trainer's output folder of ``checkpoint-N/`` folders, checks every
snapshot against its reference and its chunk checksums, and names the
orphans: snapshots no reference uses and leftovers of a crashed save, with
their size (see :func:`tierstore.integrations.snapshot.check_trainer_checkpoints`).

Exit status: 0 all good; 1 a checkpoint cannot resume its optimizer
(missing, damaged or mismatched snapshot); 3 only orphans (disk to free,
nothing that a resume needs is damaged).

Example
-------
>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> verify_trainer_checkpoints(d) is None  # nothing a trainer integration wrote: verify's other checks apply
True
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["holds_trainer_checkpoints", "verify_trainer_checkpoints"]

EXIT_OK, EXIT_CORRUPT, EXIT_ORPHANS = 0, 1, 3


def holds_trainer_checkpoints(path: str | os.PathLike) -> bool:
    """True when ``path`` or a folder directly inside it has a trainer snapshot, its reference or a save's leftover."""
    from ..integrations.snapshot import LEFTOVER_PREFIXES, REFERENCE_NAME, SNAPSHOT_NAME

    def marked(folder: Path) -> bool:
        try:
            with os.scandir(folder) as it:
                return any(e.name in (REFERENCE_NAME, SNAPSHOT_NAME) or e.name.startswith(LEFTOVER_PREFIXES) for e in it)
        except OSError:
            return False

    root = Path(path)
    if not root.is_dir() or os.path.lexists(root / "zarr.json"):
        return False
    if marked(root):
        return True
    with os.scandir(root) as it:
        return any(marked(Path(e.path)) for e in it if e.is_dir(follow_symlinks=False))


def verify_trainer_checkpoints(path: str | os.PathLike) -> int | None:
    """Print the findings for the trainer checkpoints in ``path`` and return the exit status; ``None`` if it holds none."""
    from ..integrations.snapshot import check_trainer_checkpoints

    if not holds_trainer_checkpoints(path):
        return None
    findings = check_trainer_checkpoints(path)
    for finding in findings:
        print(finding)
    errors = [f for f in findings if f.kind == "error"]
    orphans = [f for f in findings if f.kind == "orphan"]
    if errors:
        print(f"{len(errors)} error(s), {len(orphans)} orphan(s) in {path}: resume from a checkpoint without errors")
        return EXIT_CORRUPT
    if orphans:
        freed = sum(f.nbytes for f in orphans)
        print(f"{len(orphans)} orphan(s) in {path}, {freed} bytes to free by deleting them; every referenced snapshot is intact")
        return EXIT_ORPHANS
    print(f"ok: every optimizer snapshot in {path} matches its reference and its checksums")
    return EXIT_OK
