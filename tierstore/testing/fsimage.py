"""The images a power cut could leave of a directory, from the operations recorded on it.

:class:`Recording` holds what :class:`~tierstore.testing.fsrecord.Recorder`
saw (one :class:`Op` per event, ordered by the global counter value taken
before its system call, ``begin``; ``end`` is taken after it returned) and
builds :class:`Image` s: the files a cut at a point of that log would leave.

The model
---------
- A write, truncate or allocation is durable once a sync of the same file
  that began after it ended has returned: ``fsync``/``fdatasync`` of any
  descriptor of the file for writes through descriptors; for stores into a
  mapping, only an ``msync`` whose range covers them (an ``fsync`` does not
  count). Either sync makes size changes durable (``msync`` is a ranged
  ``fdatasync`` on Linux).
- A create, rename or unlink in the directory is durable once an ``fsync``
  of the directory that began after it ended has returned; the directory's
  own creation, once its parent was so synced. With several directories
  (:class:`~tierstore.testing.fsrecord.Recorder` of a list), each name is
  durable only by a sync of its own directory (a file of directory ``k > 0``
  is named ``"k/name"``), and each image holds every directory.
- A cut falls before some event's start, or after the last. Durable
  operations that started before it are in the image; every other one is,
  by a seeded draw, kept, dropped or (a write) torn: each 4 KiB page of it
  kept or not. Name operations apply in order, a rename or unlink whose
  source is gone being skipped. Each image has a style: ``kept`` (every
  unsynced operation reached the drive: what a process kill leaves),
  ``dropped`` (none did: the worst case) or ``mixed`` (random odds).

Example
-------
>>> ops = [Op(1, 2, "create", inode=1, name="f"), Op(3, 4, "write", inode=1, data=b"abc"),
...        Op(5, 6, "sync", inode=1), Op(7, 8, "dirsync")]
>>> recording = Recording(ops, initial={}, initial_names={}, root_existed=True, unsupported=[], end=9)
>>> recording.image(9, seed=0, style="dropped").files  # synced data, synced name
{'f': b'abc'}
>>> recording.image(7, seed=0, style="dropped").files  # the name not yet durable
{}
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Op", "Image", "Recording"]

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
    where: str = "root"  # dirsync: whose ("root", "root{k}", "parent", "parent{k}", comma-joined); mkroot: "root{k}"
    step: int | None = None  # report: the step reported committed (None: nothing resumable)
    label: str = ""  # phase


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
    members: list[dict[str, bytes] | None] = field(default_factory=list)  # directories 1, 2, ... of several

    def materialize(self, path: str | Path, members: list[str | Path] | tuple[str | Path, ...] = ()) -> None:
        """Write the image to ``path`` (which must not exist); nothing when the directory was lost.

        ``members``: where to write directories 1, 2, ... of a recording of several (each must not exist).
        """
        for files, where in ((self.files, path), *zip(self.members, members, strict=True)):
            if files is None:
                continue
            where = Path(where)
            where.mkdir(parents=True)
            for name, data in files.items():
                (where / name).write_bytes(data)

    def describe(self) -> str:
        fates = ", ".join(f"{k} {v}" for k, v in sorted(self.fates.items()) if v)
        files = "directory lost" if self.files is None else f"{len(self.files)} files"
        for k, member in enumerate(self.members, 1):
            files += f", directory {k} lost" if member is None else f", {len(member)} in directory {k}"
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
    members_existed: tuple[bool, ...] = ()  # directories 1, 2, ... of a recording of several, when it started

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
                for whose in op.where.split(","):  # a parent several directories share syncs each one's name
                    dirsyncs.setdefault(whose, []).append(op)
        out: list[float] = []
        for op in self.ops:
            if op.kind in DATA_KINDS:
                candidates = [s for s in syncs.get(op.inode, ()) if s.begin > op.end and _covers(s, op)]
            elif op.kind in NAME_KINDS:
                candidates = [s for s in dirsyncs.get(_directory_of(op.name), ()) if s.begin > op.end]
            elif op.kind == "mkroot":
                parent = "parent" + op.where.removeprefix("root")
                candidates = [s for s in dirsyncs.get(parent, ()) if s.begin > op.end]
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
        exists = {"root": self.root_existed} | {f"root{k}": e for k, e in enumerate(self.members_existed, 1)}
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
                    exists[op.where] = True
                else:
                    _apply_name(names, op)
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
        trees: list[dict[str, bytes] | None] = []
        for k in range(1 + len(self.members_existed)):
            tag = "root" if k == 0 else f"root{k}"
            prefix = "" if k == 0 else f"{k}/"
            trees.append(None if not exists[tag] else {
                name.removeprefix(prefix): bytes(contents.get(inode, self.initial.get(inode, b"")))
                for name, inode in names.items() if _directory_of(name) == tag
            })  # fmt: skip
        return Image(cut, seed, style, trees[0], self.reported_at(cut), self.phase_at(cut), fates, trees[1:])


def _directory_of(name: str) -> str:
    """The tag of the directory a logged name is in: ``"root"``, or ``"root{k}"`` for ``"k/name"``."""
    head, slash, _ = name.partition("/")
    return f"root{head}" if slash else "root"


def _covers(sync: Op, op: Op) -> bool:
    """Whether ``sync`` makes ``op`` (on the same file) durable."""
    if op.kind != "write":
        return True  # either kind of sync persists size changes
    if sync.channel != op.channel:
        return False
    if sync.channel == "map":
        return sync.offset <= op.offset and op.offset + len(op.data) <= sync.offset + sync.length
    return True


def _apply_name(names: dict[str, int], op: Op) -> None:
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
