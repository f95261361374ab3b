"""Record what reaches one directory, and build the images a power cut could leave of it.

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
:mod:`tierstore.testing.powercut` says why this way of recording.
Anything the model does not cover (subdirectories, ``O_APPEND``, a rename
into or out of the directory) is listed in :attr:`Recording.unsupported`.

The model (:meth:`Recording.image`)
-----------------------------------
- A write, truncate or allocation is durable once a sync of the same file
  that began after it ended has returned: ``fsync``/``fdatasync`` of any
  descriptor of the file for writes through descriptors; for stores into a
  mapping, only an ``msync`` whose range covers them (an ``fsync`` does not
  count). Either sync makes size changes durable (``msync`` is a ranged
  ``fdatasync`` on Linux).
- A create, rename or unlink in the directory is durable once an ``fsync``
  of the directory that began after it ended has returned; the directory's
  own creation, once its parent was so synced.
- A cut falls before some event's start, or after the last. Durable
  operations that started before it are in the image; every other one is,
  by a seeded draw, kept, dropped or (a write) torn: each 4 KiB page of it
  kept or not. Name operations apply in order, a rename or unlink whose
  source is gone being skipped. Each image has a style: ``kept`` (every
  unsynced operation reached the drive: what a process kill leaves),
  ``dropped`` (none did: the worst case) or ``mixed`` (random odds).

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

import bisect
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PAGE = 4096
STYLES = ("kept", "dropped", "mixed")
NAME_KINDS = ("create", "rename", "unlink")
DATA_KINDS = ("write", "truncate", "extend")


@dataclass
class Op:
    """One recorded event. ``begin``/``end``: the global counter before and after its system call."""

    begin: int
    end: int
    kind: str  # create rename unlink mkroot write truncate extend sync dirsync report phase
    inode: int = -1
    name: str = ""  # create/unlink: the name; rename: the source
    target: str = ""  # rename: the destination
    offset: int = 0
    data: bytes = b""
    size: int = 0  # truncate: the new size; extend: the size grown to at least
    length: int = 0  # a mapping's msync: the range's length
    channel: str = "fd"  # write/sync through a descriptor ("fd") or a shared mapping ("map")
    where: str = "root"  # dirsync: "root" or "parent"
    step: int | None = None  # report: the step reported committed (None: nothing resumable)
    label: str = ""  # phase


@dataclass
class _Open:
    inode: int | None  # None: a directory
    where: str = "root"


class Recorder:
    """Record every operation that reaches ``root`` while active (a context manager).

    Files already in ``root`` when recording starts are taken as durable.

    Parameters
    ----------
    root
        The directory to watch (it may not exist yet: its creation is recorded).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = os.path.abspath(root)
        self.parent = os.path.dirname(self.root)
        self._lock = threading.Lock()
        self._clock = 0
        self._ops: list[Op] = []
        self._fds: dict[int, _Open] = {}
        self._names: dict[str, int] = {}
        self._initial: dict[int, bytes] = {}
        self._next_inode = 0
        self._unsupported: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        self._root_existed = os.path.isdir(self.root)

    # -- lifecycle ----------------------------------------------------
    def __enter__(self) -> Recorder:
        if self._root_existed:
            for name in sorted(os.listdir(self.root)):
                path = os.path.join(self.root, name)
                if os.path.isfile(path):
                    inode = self._new_inode()
                    self._names[name] = inode
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
        """Where ``path`` is: ("file", name) in root, ("root"|"parent", "") or ("below", path); (None, "") elsewhere."""
        if isinstance(path, int):
            return None, ""
        try:
            text = os.fsdecode(path)
        except TypeError:
            return None, ""
        full = os.path.abspath(text)
        if full == self.root:
            return "root", ""
        if full == self.parent:
            return "parent", ""
        head, name = os.path.split(full)
        if head == self.root:
            return "file", name
        if full.startswith(self.root + os.sep):
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

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        place, name = (None, "") if dir_fd is not None else self._place(path)
        real = self._real["open"]
        if place is None:
            return real(path, flags, mode, dir_fd=dir_fd)
        if place == "below":
            self._unsupported.append(f"open of {name} (a subdirectory is not modelled)")
            return real(path, flags, mode)
        if place in ("root", "parent"):
            fd = real(path, flags, mode)
            self._fds[fd] = _Open(None, place)
            return fd
        begin = self.begin()
        fd = real(path, flags, mode)
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
        (p1, n1), (p2, n2) = self._place(src), self._place(dst)
        if src_dir_fd is not None or dst_dir_fd is not None or (p1 is None and p2 is None):
            return self._real["rename"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if p1 != "file" or p2 != "file":
            self._unsupported.append(f"rename {src} -> {dst} (not both in {self.root})")
            return self._real["rename"](src, dst)
        begin = self.begin()
        self._real["rename"](src, dst)
        with self._lock:
            inode = self._names.pop(n1, None)
            if inode is not None:
                self._names[n2] = inode
            self._add(Op(begin, 0, "rename", inode=inode if inode is not None else -1, name=n1, target=n2))

    def _unlink(self, path, *, dir_fd=None):
        place, name = (None, "") if dir_fd is not None else self._place(path)
        if place is None:
            return self._real["unlink"](path, dir_fd=dir_fd)
        if place != "file":
            self._unsupported.append(f"unlink of {path}")
            return self._real["unlink"](path)
        begin = self.begin()
        self._real["unlink"](path)
        with self._lock:
            self._names.pop(name, None)
            self._add(Op(begin, 0, "unlink", name=name))

    def _mkdir(self, path, mode=0o777, *, dir_fd=None):
        place, _ = (None, "") if dir_fd is not None else self._place(path)
        if place is None or place == "parent":
            return self._real["mkdir"](path, mode, dir_fd=dir_fd)
        if place != "root":
            self._unsupported.append(f"mkdir of {path} (a subdirectory is not modelled)")
            return self._real["mkdir"](path, mode)
        begin = self.begin()
        self._real["mkdir"](path, mode)
        with self._lock:
            self._add(Op(begin, 0, "mkroot"))

    def _rmdir(self, path, *, dir_fd=None):
        place, _ = (None, "") if dir_fd is not None else self._place(path)
        if place not in (None, "parent"):
            self._unsupported.append(f"rmdir of {path}")
        return self._real["rmdir"](path, dir_fd=dir_fd)

    def _map_store(self, file, offset: int, source) -> None:
        opened = self._fds.get(file._fd)
        if opened is None or opened.inode is None:
            return self._real_store(file, offset, source)
        payload = source.numpy().tobytes()
        begin = self.begin()
        self._real_store(file, offset, source)
        with self._lock:
            self._add(Op(begin, 0, "write", inode=opened.inode, offset=offset, data=payload, channel="map"))

    def _map_msync(self, file, offset: int, length: int) -> None:
        opened = self._fds.get(file._fd)
        if opened is None or opened.inode is None:
            return self._real_msync(file, offset, length)
        begin = self.begin()
        self._real_msync(file, offset, length)
        with self._lock:
            self._add(Op(begin, 0, "sync", inode=opened.inode, channel="map", offset=offset, length=length))


# -- what a cut leaves ------------------------------------------------------------------


@dataclass
class Image:
    """The directory a power cut at ``cut`` left, for one draw of the unsynced operations."""

    cut: int
    seed: int
    style: str
    files: dict[str, bytes] | None  # None: the directory itself did not survive
    reported: int | None  # the step last reported committed before the cut (None: none, or retracted)
    phase: str  # what the run was doing at the cut
    fates: dict[str, int] = field(default_factory=dict)  # unsynced operations kept / torn / dropped

    def materialize(self, path: str | Path) -> None:
        """Write the image to ``path`` (which must not exist); nothing when the directory was lost."""
        if self.files is None:
            return
        path = Path(path)
        path.mkdir(parents=True)
        for name, data in self.files.items():
            (path / name).write_bytes(data)

    def describe(self) -> str:
        fates = ", ".join(f"{k} {v}" for k, v in sorted(self.fates.items()) if v)
        files = "directory lost" if self.files is None else f"{len(self.files)} files"
        return f"cut {self.cut} in {self.phase!r} ({self.style}: {fates or 'nothing unsynced'}; {files})"


@dataclass
class Recording:
    """Recorded operations (ordered by start) and the images a cut between them could leave."""

    ops: list[Op]
    initial: dict[int, bytes]  # contents of the files present when recording started
    initial_names: dict[str, int]
    root_existed: bool
    unsupported: list[str]
    end: int  # a cut here falls after every operation

    def __post_init__(self) -> None:
        self._durable = self._durability()

    def _durability(self) -> list[float]:
        """For each operation, the counter value after which it is durable (inf: never)."""
        syncs: dict[int, list[Op]] = {}
        dirsyncs: dict[str, list[Op]] = {}
        for op in self.ops:
            if op.kind == "sync":
                syncs.setdefault(op.inode, []).append(op)
            elif op.kind == "dirsync":
                dirsyncs.setdefault(op.where, []).append(op)
        out: list[float] = []
        for op in self.ops:
            if op.kind in DATA_KINDS:
                candidates = [s for s in syncs.get(op.inode, ()) if s.begin > op.end and _covers(s, op)]
            elif op.kind in NAME_KINDS:
                candidates = [s for s in dirsyncs.get("root", ()) if s.begin > op.end]
            elif op.kind == "mkroot":
                candidates = [s for s in dirsyncs.get("parent", ()) if s.begin > op.end]
            else:
                candidates = []
            out.append(min((s.end for s in candidates), default=float("inf")))
        return out

    # -- where to cut -------------------------------------------------
    def cut_points(self) -> list[int]:
        """Every distinct cut: before each operation's start, and after the last."""
        return sorted({op.begin for op in self.ops} | {self.end})

    def edges(self) -> list[int]:
        """Cuts right after a sync, a rename or a report returned (where durability changes)."""
        points = self.cut_points()
        out = set()
        for op in self.ops:
            if op.kind in ("sync", "dirsync", "rename", "report"):
                i = bisect.bisect_right(points, op.end)
                if i < len(points):
                    out.add(points[i])
        return sorted(out)

    def reported_at(self, cut: int) -> int | None:
        """The step last reported committed before ``cut`` (``None``: none, or retracted)."""
        step = None
        for op in self.ops:
            if op.begin >= cut:
                break
            if op.kind == "report":
                step = op.step
        return step

    def phase_at(self, cut: int) -> str:
        label = "start"
        for op in self.ops:
            if op.begin >= cut:
                break
            if op.kind == "phase":
                label = op.label
        return label

    def images(self, count: int, *, seed: int) -> Iterator[Image]:
        """``count`` images spread over the run's phases (:meth:`Recorder.phase`).

        Each round gives every phase one image, in a random order; the cut
        falls anywhere in the phase in even rounds, right after a sync,
        rename or report in odd ones.
        """
        rng = random.Random(seed)
        anywhere: dict[str, list[int]] = {}
        for cut in self.cut_points():
            anywhere.setdefault(self.phase_at(cut), []).append(cut)
        after: dict[str, list[int]] = {}
        for cut in self.edges():
            after.setdefault(self.phase_at(cut), []).append(cut)
        phases = list(anywhere)
        order: list[str] = []
        for k in range(count):
            if not order:  # each round visits every phase once, in a random order
                order = rng.sample(phases, len(phases))
            phase = order.pop()
            pool = after.get(phase) if (k // len(phases)) % 2 else None
            cut = rng.choice(pool or anywhere[phase])
            yield self.image(cut, seed=rng.randrange(1 << 32))

    # -- one image ----------------------------------------------------
    def image(self, cut: int, *, seed: int, style: str | None = None) -> Image:
        """What a cut at ``cut`` leaves, the unsynced operations' fates drawn from ``seed``.

        ``style``: ``"kept"`` (every unsynced operation reached the drive: what
        a process kill leaves), ``"dropped"`` (none did: the worst case) or
        ``"mixed"``; ``None`` draws one.
        """
        rng = random.Random(f"{cut}/{seed}")
        if style is None:
            style = rng.choice(("kept", "dropped", "mixed", "mixed", "mixed"))
        if style == "kept":
            odds, p_name = (1.0, 0.0, 0.0), 1.0
        elif style == "dropped":
            odds, p_name = (0.0, 0.0, 1.0), 0.0
        elif style == "mixed":
            odds, p_name = (rng.random(), rng.random(), rng.random()), rng.random()
        else:
            raise ValueError(f"style={style!r}; choose one of {STYLES}")
        fates = dict.fromkeys(("writes kept", "writes torn", "writes dropped", "names kept", "names dropped"), 0)
        names = dict(self.initial_names)
        root = self.root_existed
        contents: dict[int, bytearray] = {}
        for op, durable_after in zip(self.ops, self._durable):
            if op.begin >= cut:
                break
            durable = durable_after < cut
            if op.kind in NAME_KINDS or op.kind == "mkroot":
                if not durable:
                    keep = rng.random() < p_name
                    fates["names kept" if keep else "names dropped"] += 1
                    if not keep:
                        continue
                if op.kind == "mkroot":
                    root = True
                else:
                    _rename_apply(names, op)
            elif op.kind in DATA_KINDS:
                buf = contents.get(op.inode)
                if buf is None:
                    buf = contents[op.inode] = bytearray(self.initial.get(op.inode, b""))
                if durable:
                    _apply(buf, op, None)
                    continue
                fate = rng.choices(("kept", "torn", "dropped"), weights=odds)[0] if sum(odds) else "dropped"
                if op.kind != "write" and fate == "torn":
                    fate = "kept"
                fates[f"writes {fate}"] += 1
                if fate == "kept":
                    _apply(buf, op, None)
                elif fate == "torn":
                    _apply(buf, op, rng)
        files = None
        if root:
            files = {name: bytes(contents.get(inode, self.initial.get(inode, b""))) for name, inode in names.items()}
        return Image(cut, seed, style, files, self.reported_at(cut), self.phase_at(cut), fates)


def _covers(sync: Op, op: Op) -> bool:
    """Whether ``sync`` makes ``op`` (on the same file) durable."""
    if op.kind != "write":
        return True  # either kind of sync persists size changes
    if sync.channel != op.channel:
        return False
    if sync.channel == "map":
        return sync.offset <= op.offset and op.offset + len(op.data) <= sync.offset + sync.length
    return True


def _rename_apply(names: dict[str, int], op: Op) -> None:
    if op.kind == "create":
        names[op.name] = op.inode
    elif op.kind == "unlink":
        names.pop(op.name, None)
    elif op.kind == "rename" and op.name in names:
        names[op.target] = names.pop(op.name)


def _apply(buf: bytearray, op: Op, torn: random.Random | None) -> None:
    """Apply a data operation to a file's bytes; ``torn``: keep each 4 KiB page of a write or not."""
    if op.kind == "truncate":
        if op.size < len(buf):
            del buf[op.size :]
        else:
            buf.extend(bytes(op.size - len(buf)))
        return
    if op.kind == "extend":
        if op.size > len(buf):
            buf.extend(bytes(op.size - len(buf)))
        return
    start, stop = op.offset, op.offset + len(op.data)
    pieces = [(start, stop)]
    if torn is not None:
        edges = [start] + list(range((start // PAGE + 1) * PAGE, stop, PAGE)) + [stop]
        pieces = [(a, b) for a, b in zip(edges, edges[1:]) if torn.random() < 0.5]
    for a, b in pieces:
        if len(buf) < b:
            buf.extend(bytes(b - len(buf)))
        buf[a:b] = op.data[a - start : b - start]
