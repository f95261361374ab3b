"""A second, faster "drive" for tests of a state over several directories.

Tests of several drives want a second directory on another filesystem than
the first (``tmp_path``, on the machine's disk). :func:`second_drive` gives
the best this machine allows, and says which:

- ``"loop"``: an ext4 filesystem on a loop device backed by a file in tmpfs,
  mounted under the test's directory: a real filesystem (``O_DIRECT``
  works), faster than the disk. Needs root, ``losetup``/``mount`` allowed,
  ``mkfs.ext4`` and ``loop=True`` (a mount outlives a killed test process,
  so it is asked for, not assumed; tests/test_multi_drive.py asks when its
  environment says so);
- ``"tmpfs"``: a directory in ``/dev/shm`` (RAM): fast, but not a block
  device; ``O_DIRECT`` there works on Linux 6.6 and later, and before that
  ``backend="auto"`` falls back to ``mmap`` as it does on any tmpfs;
- ``"disk"``: another directory beside the first, where neither exists.

:meth:`SecondDrive.describe` is the sentence a test prints (or puts in an
assertion message) so its log says which kind it ran on.

Example
-------
>>> import tempfile
>>> drive = second_drive(tempfile.mkdtemp())
>>> drive.kind in ("loop", "tmpfs", "disk"), drive.path.is_dir()
(True, True)
>>> drive.close()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SecondDrive", "second_drive", "filesystem_of"]

LOOP_IMAGE_BYTES = 256 << 20  # 256 MiB of tmpfs for the loop device's backing file


@dataclass
class SecondDrive:
    """A directory on a second filesystem, and what kind it is."""

    path: Path
    kind: str  # "loop", "tmpfs" or "disk"
    why: str  # why this kind (what was tried)
    _cleanup: list | None = None

    def describe(self) -> str:
        return f"second drive: {self.kind} ({self.why}) at {self.path}, filesystem {filesystem_of(self.path)}"

    def close(self) -> None:
        """Unmount and remove what :func:`second_drive` made; safe twice."""
        steps, self._cleanup = self._cleanup or [], None
        for step in reversed(steps):
            with contextlib.suppress(Exception):
                step()


def filesystem_of(path: str | os.PathLike) -> str:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``, ...), from /proc/self/mounts."""
    best, kind = "", "unknown"
    target = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) >= 3:
                point = parts[1].replace("\\040", " ")
                if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, parts[2]
    return kind


def _loop(base: Path, image_bytes: int = LOOP_IMAGE_BYTES) -> SecondDrive | None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount", "umount")):
        return None
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    image = Path(tempfile.mkstemp(prefix="tierstore-loop-", suffix=".img", dir=shm)[1])
    mount_point = base / "loop-drive"
    mount_point.mkdir(parents=True, exist_ok=True)
    cleanup = [lambda: image.unlink(missing_ok=True), lambda: mount_point.rmdir()]
    try:
        os.truncate(image, image_bytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                step()
        return None
    cleanup.append(lambda: subprocess.run(["umount", str(mount_point)], check=False, capture_output=True, timeout=60))
    path = mount_point / "state"
    path.mkdir()
    return SecondDrive(path, "loop", "ext4 on a loop device backed by a file in tmpfs", cleanup)


def second_drive(base: str | os.PathLike, *, loop: bool = False, loop_bytes: int = LOOP_IMAGE_BYTES) -> SecondDrive:
    """A directory on a second, faster filesystem than ``base``'s, the best this machine allows (see the module docs).

    ``base``: the test's own directory (a loop device is mounted under it);
    ``loop``: try a loop device first, of ``loop_bytes`` (tmpfs holds its
    backing file: bench/multi_drive.py asks for room for its states).
    """
    base = Path(base)
    drive = _loop(base, loop_bytes) if loop else None
    if drive is not None:
        return drive
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and filesystem_of(shm) == "tmpfs":
        path = Path(tempfile.mkdtemp(prefix="tierstore-drive-", dir=shm))
        why = "a tmpfs directory: " + ("a loop device is not allowed here" if loop else "no loop device asked for")
        return SecondDrive(path, "tmpfs", why, [lambda: shutil.rmtree(path, ignore_errors=True)])
    path = Path(tempfile.mkdtemp(prefix="drive-", dir=base))
    return SecondDrive(path, "disk", "no tmpfs at /dev/shm and no loop device: another directory on the same disk")
