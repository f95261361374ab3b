"""Record every operation that reaches one directory (or several), from every thread, in one order.

:class:`Recorder` (a context manager) replaces, while active, the ``os``
functions through which bytes and names reach a directory (``open``,
``close``, ``write``, ``pwrite``, ``pwritev``, ``writev``, ``fsync``,
``fdatasync``, ``ftruncate``, ``truncate``, ``posix_fallocate``,
``replace``, ``rename``, ``unlink``, ``remove``, ``mkdir``, ``rmdir``), and
wraps the mmap backend's two seams, :meth:`MmapFile._store
<tierstore.backends.mmap_file.MmapFile._store>` (a copy into the shared
mapping: a write without a system call) and :meth:`MmapFile._msync
<tierstore.backends.mmap_file.MmapFile._msync>`. Every event takes a number
from one lock-protected counter before its system call (``begin``) and one
after it returned (``end``): a global order over all threads.
:mod:`tierstore.testing.powercut` says why this way of recording;
:mod:`tierstore.testing.fsimage` builds what a power cut would leave.
Anything the model does not cover (subdirectories, ``O_APPEND``, a rename
into or out of the directory) is listed in ``Recording.unsupported``.

Several directories (a state over several drives) are recorded in one log:
``Recorder([home, drive1, ...])``. A file of directory ``k > 0`` is named
``"k/name"`` in the log and the images, and directory syncs say whose
(``where``: ``"root"`` or ``"root{k}"``, a parent ``"parent"`` or
``"parent{k}"``, several when directories share a parent), so each name is
durable only once its own directory was synced.

Example
-------
>>> import os, tempfile
>>> root = os.path.join(tempfile.mkdtemp(), "d")
>>> with Recorder(root) as rec:
...     os.mkdir(root)
...     fd = os.open(os.path.join(root, "f"), os.O_WRONLY | os.O_CREAT)
...     _ = os.write(fd, b"x" * 10); os.fsync(fd); os.close(fd)
>>> recording = rec.recording()
>>> recording.image(recording.end, seed=0, style="kept").files
{'f': b'xxxxxxxxxx'}
>>> print(recording.image(recording.end, seed=0, style="dropped").files)  # the parent was never synced
None
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .fsimage import Op, Recording

__all__ = ["Recorder"]

@dataclass
class _Open:
    inode: int | None  # None: a directory
    where: str = "root"


def root_tag(k: int) -> str:
    """How the log names directory ``k``'s own syncs: ``"root"`` for the first, ``"root{k}"`` for the others."""
    return "root" if k == 0 else f"root{k}"


def parent_tag(k: int) -> str:
    return "parent" if k == 0 else f"parent{k}"


class Recorder:
    """Record every operation that reaches ``root`` while active (a context manager).

    Files already in ``root`` when recording starts are taken as durable.

    Parameters
    ----------
    root
        The directory to watch (it may not exist yet: its creation is recorded),
        or a list of them (a state over several drives), recorded in one log.
    """

    def __init__(self, root: str | Path | list[str | Path] | tuple[str | Path, ...]) -> None:
        roots = list(root) if isinstance(root, (list, tuple)) else [root]
        self.roots = [os.path.abspath(r) for r in roots]
        self.root = self.roots[0]
        self.parent = os.path.dirname(self.root)
        self.parents = [os.path.dirname(r) for r in self.roots]
        self._resolved = {}
        for path in (*self.roots, *self.parents):
            self._resolved[os.path.realpath(path)] = path
        self._lock = threading.Lock()
        self._clock = 0
        self._ops: list[Op] = []
        self._fds: dict[int, _Open] = {}
        self._names: dict[str, int] = {}
        self._initial: dict[int, bytes] = {}
        self._next_inode = 0
        self._unsupported: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        self._existed = [os.path.isdir(r) for r in self.roots]
        self._root_existed = self._existed[0]

    @staticmethod
    def _qualified(k: int, name: str) -> str:
        """A file's name in the log: its own name in the first directory, ``"k/name"`` in directory ``k``."""
        return name if k == 0 else f"{k}/{name}"

    # -- lifecycle ----------------------------------------------------
    def __enter__(self) -> Recorder:
        for k, root in enumerate(self.roots):
            if not self._existed[k]:
                continue
            for name in sorted(os.listdir(root)):
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    inode = self._new_inode()
                    self._names[self._qualified(k, name)] = inode
                    with open(path, "rb") as f:
                        self._initial[inode] = f.read()
                else:
                    self._unsupported.append(f"{path} exists and is not a file")
        self._first_names = dict(self._names)
        self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    def recording(self) -> Recording:
        """What was recorded so far, ordered by start."""
        with self._lock:
            ops = sorted(self._ops, key=lambda op: op.begin)
            return Recording(
                ops=ops,
                initial=dict(self._initial),
                initial_names=dict(self._first_names),
                root_existed=self._root_existed,
                unsupported=list(self._unsupported),
                end=self._clock + 1,
                members_existed=tuple(self._existed[1:]),
            )

    # -- marks a harness adds -----------------------------------------
    def report(self, step: int | None) -> None:
        """Note that ``step`` is now reported committed (``None``: nothing is resumable now)."""
        with self._lock:
            t = self._tick()
            self._ops.append(Op(t, t, "report", step=step))

    def phase(self, label: str) -> None:
        """Note what the recorded run is doing from now on (``"step 3"``)."""
        with self._lock:
            t = self._tick()
            self._ops.append(Op(t, t, "phase", label=label))

    # -- bookkeeping --------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def begin(self) -> int:
        with self._lock:
            return self._tick()

    def _new_inode(self) -> int:
        self._next_inode += 1
        return self._next_inode

    def _add(self, op: Op) -> None:
        """Append ``op`` with its end taken now (call under the lock)."""
        op.end = self._tick()
        self._ops.append(op)

    def _place(self, path: object) -> tuple[str | None, str]:
        """Where ``path`` is: ("file", its name in the log) in a root, ("root"|"parent", whose: the tags
        of :meth:`_where_tag`) or ("below", path); (None, "") elsewhere."""
        if isinstance(path, int):
            return None, ""
        try:
            text = os.fsdecode(path)
        except TypeError:
            return None, ""
        full = os.path.abspath(text)
        if full in self.roots:
            return "root", root_tag(self.roots.index(full))
        if full in self.parents:
            return "parent", ",".join(parent_tag(k) for k, p in enumerate(self.parents) if p == full)
        head, name = os.path.split(full)
        if head in self.roots:
            return "file", self._qualified(self.roots.index(head), name)
        if any(full.startswith(root + os.sep) for root in self.roots):
            return "below", full
        return None, ""

    # -- the hooks ----------------------------------------------------
    def _install(self) -> None:
        from ..backends import mmap_file

        hooks = {
            "open": self._open,
            "close": self._close,
            "write": self._write,
            "pwrite": self._pwrite,
            "pwritev": self._pwritev,
            "writev": self._writev,
            "ftruncate": self._ftruncate,
            "truncate": self._truncate,
            "posix_fallocate": self._fallocate,
            "replace": self._rename,
            "rename": self._rename,
            "unlink": self._unlink,
            "remove": self._unlink,
            "mkdir": self._mkdir,
            "rmdir": self._rmdir,
        }
        self._real = {}
        for name, hook in hooks.items():
            real = getattr(os, name, None)
            if real is None:
                continue
            self._real[name] = real
            self._saved.append((os, name, real))
            setattr(os, name, hook)
        for name in ("fsync", "fdatasync"):
            self._real[name] = getattr(os, name)
            self._saved.append((os, name, self._real[name]))
            setattr(os, name, self._sync_hook(name))
        cls = mmap_file.MmapFile
        self._real_store, self._real_msync = cls._store, cls._msync
        self._saved += [(cls, "_store", cls._store), (cls, "_msync", cls._msync)]
        recorder = self

        def store(file: mmap_file.MmapFile, offset: int, source) -> None:
            recorder._map_store(file, offset, source)

        def msync(file: mmap_file.MmapFile, offset: int, length: int) -> None:
            recorder._map_msync(file, offset, length)

        cls._store, cls._msync = store, msync

    def _where(self, path, dir_fd) -> tuple[str | None, str]:
        """:meth:`_place` of ``path`` as the call means it: relative to ``dir_fd`` when given.

        The state directory opens its files by name relative to its own
        descriptor; the directory that descriptor names (``/proc/self/fd``)
        tells where such a name is.
        """
        if dir_fd is None or isinstance(path, int) or os.path.isabs(os.fsdecode(path)):
            return self._place(path)
        try:
            directory = os.readlink(f"/proc/self/fd/{dir_fd}")
        except OSError:
            return None, ""
        directory = self._resolved.get(directory, directory)  # the name the recorder was given
        return self._place(os.path.join(directory, os.fsdecode(path)))

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        place, name = self._where(path, dir_fd)
        real = self._real["open"]
        if place is None:
            return real(path, flags, mode, dir_fd=dir_fd)
        if place == "below":
            self._unsupported.append(f"open of {name} (a subdirectory is not modelled)")
            return real(path, flags, mode, dir_fd=dir_fd)
        if place in ("root", "parent"):
            fd = real(path, flags, mode, dir_fd=dir_fd)
            self._fds[fd] = _Open(None, name)  # a directory: whose syncs these are
            return fd
        begin = self.begin()
        fd = real(path, flags, mode, dir_fd=dir_fd)
        with self._lock:
            inode = self._names.get(name)
            if inode is None:
                inode = self._names[name] = self._new_inode()
                self._add(Op(begin, 0, "create", inode=inode, name=name))
            if flags & os.O_TRUNC:
                self._add(Op(begin, 0, "truncate", inode=inode, size=0))
            if flags & os.O_APPEND:
                self._unsupported.append(f"{name} opened with O_APPEND")
            self._fds[fd] = _Open(inode)
        return fd

    def _close(self, fd):
        self._fds.pop(fd, None)  # before closing: another thread may get this number next
        return self._real["close"](fd)

    def _written(self, fd: int, offset: int, payload: bytes, begin: int, n: int) -> None:
        opened = self._fds.get(fd)
        if opened is None or opened.inode is None or n <= 0:
            return
        with self._lock:
            self._add(Op(begin, 0, "write", inode=opened.inode, offset=offset, data=payload[:n]))

    def _write(self, fd, data):
        if fd not in self._fds:
            return self._real["write"](fd, data)
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        payload = bytes(memoryview(data).cast("B"))
        begin = self.begin()
        n = self._real["write"](fd, data)
        self._written(fd, offset, payload, begin, n)
        return n

    def _writev(self, fd, buffers):
        if fd not in self._fds:
            return self._real["writev"](fd, buffers)
        buffers = list(buffers)
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        payload = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        begin = self.begin()
        n = self._real["writev"](fd, buffers)
        self._written(fd, offset, payload, begin, n)
        return n

    def _pwrite(self, fd, data, offset):
        if fd not in self._fds:
            return self._real["pwrite"](fd, data, offset)
        payload = bytes(memoryview(data).cast("B"))
        begin = self.begin()
        n = self._real["pwrite"](fd, data, offset)
        self._written(fd, offset, payload, begin, n)
        return n

    def _pwritev(self, fd, buffers, offset, *flags):
        if fd not in self._fds:
            return self._real["pwritev"](fd, buffers, offset, *flags)
        buffers = list(buffers)
        payload = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        begin = self.begin()
        n = self._real["pwritev"](fd, buffers, offset, *flags)
        self._written(fd, offset, payload, begin, n)
        return n

    def _sync_hook(self, which: str):
        real = self._real[which]

        def sync(fd):
            opened = self._fds.get(fd)
            if opened is None:
                return real(fd)
            begin = self.begin()
            real(fd)
            with self._lock:
                if opened.inode is None:
                    self._add(Op(begin, 0, "dirsync", where=opened.where))
                else:
                    self._add(Op(begin, 0, "sync", inode=opened.inode, channel="fd"))

        return sync

    def _ftruncate(self, fd, length):
        opened = self._fds.get(fd)
        if opened is None or opened.inode is None:
            return self._real["ftruncate"](fd, length)
        begin = self.begin()
        self._real["ftruncate"](fd, length)
        with self._lock:
            self._add(Op(begin, 0, "truncate", inode=opened.inode, size=int(length)))

    def _truncate(self, path, length):
        if isinstance(path, int):
            return self._ftruncate(path, length)
        place, name = self._place(path)
        if place != "file":
            if place is not None:
                self._unsupported.append(f"truncate of {path}")
            return self._real["truncate"](path, length)
        begin = self.begin()
        self._real["truncate"](path, length)
        with self._lock:
            inode = self._names.get(name)
            if inode is not None:
                self._add(Op(begin, 0, "truncate", inode=inode, size=int(length)))

    def _fallocate(self, fd, offset, length):
        opened = self._fds.get(fd)
        if opened is None or opened.inode is None:
            return self._real["posix_fallocate"](fd, offset, length)
        begin = self.begin()
        self._real["posix_fallocate"](fd, offset, length)
        with self._lock:
            self._add(Op(begin, 0, "extend", inode=opened.inode, size=int(offset + length)))

    def _rename(self, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        (p1, n1), (p2, n2) = self._where(src, src_dir_fd), self._where(dst, dst_dir_fd)
        real = functools.partial(self._real["rename"], src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if p1 is None and p2 is None:
            return real()
        if p1 != "file" or p2 != "file" or n1.partition("/")[0] != n2.partition("/")[0] and ("/" in n1 or "/" in n2):
            self._unsupported.append(f"rename {src} -> {dst} (not both in one of {self.roots})")
            return real()
        begin = self.begin()
        real()
        with self._lock:
            inode = self._names.pop(n1, None)
            if inode is not None:
                self._names[n2] = inode
            self._add(Op(begin, 0, "rename", inode=inode if inode is not None else -1, name=n1, target=n2))

    def _unlink(self, path, *, dir_fd=None):
        place, name = self._where(path, dir_fd)
        if place is None:
            return self._real["unlink"](path, dir_fd=dir_fd)
        if place != "file":
            self._unsupported.append(f"unlink of {path}")
            return self._real["unlink"](path, dir_fd=dir_fd)
        begin = self.begin()
        self._real["unlink"](path, dir_fd=dir_fd)
        with self._lock:
            self._names.pop(name, None)
            self._add(Op(begin, 0, "unlink", name=name))

    def _mkdir(self, path, mode=0o777, *, dir_fd=None):
        place, tag = self._where(path, dir_fd)
        if place is None or place == "parent":
            return self._real["mkdir"](path, mode, dir_fd=dir_fd)
        if place != "root":
            self._unsupported.append(f"mkdir of {path} (a subdirectory is not modelled)")
            return self._real["mkdir"](path, mode, dir_fd=dir_fd)
        begin = self.begin()
        self._real["mkdir"](path, mode, dir_fd=dir_fd)
        with self._lock:
            self._add(Op(begin, 0, "mkroot", where=tag))

    def _rmdir(self, path, *, dir_fd=None):
        place, _ = self._where(path, dir_fd)
        if place not in (None, "parent"):
            self._unsupported.append(f"rmdir of {path}")
        return self._real["rmdir"](path, dir_fd=dir_fd)

    def _map_store(self, file, offset: int, source) -> None:
        opened = self._fds.get(file.fd)
        if opened is None or opened.inode is None:
            return self._real_store(file, offset, source)
        payload = source.numpy().tobytes()
        begin = self.begin()
        self._real_store(file, offset, source)
        with self._lock:
            self._add(Op(begin, 0, "write", inode=opened.inode, offset=offset, data=payload, channel="map"))

    def _map_msync(self, file, offset: int, length: int) -> None:
        opened = self._fds.get(file.fd)
        if opened is None or opened.inode is None:
            return self._real_msync(file, offset, length)
        begin = self.begin()
        self._real_msync(file, offset, length)
        with self._lock:
            self._add(Op(begin, 0, "sync", inode=opened.inode, channel="map", offset=offset, length=length))
