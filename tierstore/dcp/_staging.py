"""A box of one parameter's part inside the DCP load's staging file, as a tensor DCP's reader copies into.

Example
-------
>>> import tempfile, torch
>>> from tierstore._storage.dcp_memory import StagingFile
>>> file = StagingFile(12, tempfile.mkdtemp())
>>> staged = Staged(file, 0, (3, 4), (0, 0), (3, 4))
>>> _ = staged[1:].copy_(torch.ones(2, 4))  # what dcp.load does with a piece it read
>>> staged[1:].runs()
[(4, 8)]
>>> file.close()
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from .._platform import torch_private
from .._storage.dcp_memory import StagingFile

__all__ = ["Staged"]


class Staged(torch.Tensor):
    """A box of one parameter's part inside the DCP staging file: what DCP's reader copies into.

    DCP narrows it to the piece it read (``aten.slice``) and ``copy_``-s the
    piece in, which writes it into the file; :meth:`Session.copy` reads a
    flat box of it back into a shard. Nothing else is supported, and no
    memory holds its values.
    """

    @staticmethod
    def __new__(cls, file: StagingFile, base: int, full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Staged:
        return torch_private.make_wrapper_subclass(cls, sizes, dtype=torch.float32, device="cpu")

    def __init__(self, file: StagingFile, base: int, full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self._file, self._first, self._full, self._offsets, self._sizes = file, base, full, offsets, sizes

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002
        return f"TieredStaging(offsets={self._offsets}, sizes={self._sizes} of {self._full})"

    def _narrow(self, dim: int, start: int, length: int) -> Staged:
        offsets, sizes = list(self._offsets), list(self._sizes)
        offsets[dim] += start
        sizes[dim] = length
        return Staged(self._file, self._first, self._full, tuple(offsets), tuple(sizes))

    def runs(self) -> list[tuple[int, int]]:
        """``(first element in the file, elements)`` of each contiguous run of the box, in order."""
        full, off, size = self._full, self._offsets, self._sizes
        if not full:
            return [(self._first, 1)]
        strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
        k = len(full) - 1
        while k > 0 and size[k] == full[k]:  # trailing whole dimensions join the run
            k -= 1
        length = size[k] * strides[k]
        out = []
        for index in itertools.product(*(range(o, o + n) for o, n in zip(off[:k], size[:k]))):
            start = sum(i * st for i, st in zip(index, strides)) + off[k] * strides[k]
            out.append((self._first + start, length))
        return out

    def read_into(self, out: torch.Tensor) -> None:
        """Read the box (one contiguous run, as a flat view is) from the file into ``out``."""
        runs = self.runs()
        if len(runs) != 1 or not out.is_contiguous() or out.numel() != runs[0][1]:
            raise ValueError(f"{self!r} is not one contiguous run of {out.numel()} elements")
        self._file.read_into(runs[0][0], out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return args[0]
        if func is aten.slice.Tensor:
            t = args[0]
            dim, start, end, step = (
                args[i] if i < len(args) else kwargs.get(name, default)
                for i, (name, default) in enumerate((("dim", 0), ("start", None), ("end", None), ("step", 1)), start=1)
            )
            n = t.shape[dim]
            start = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
            end = n if end is None else min(max(end + n if end < 0 else end, start), n)
            if step != 1:
                raise RuntimeError("a TieredStateful staging tensor is sliced with step 1 only")
            return t._narrow(dim, start, end - start)
        if func is aten.narrow.default:
            t, dim, start, length = args
            return t._narrow(dim, start, length)
        if func is aten.copy_.default:
            target, src = args[0], args[1]
            flat = src.detach().to(torch.float32).contiguous().view(-1)
            done = 0
            for at, n in target.runs():
                target._file.write(at, flat[done : done + n])
                done += n
            return target
        raise RuntimeError(
            f"{func} on a TieredStateful staging tensor: it stands for a part of the DCP staging file "
            "and only receives what dcp.load reads"
        )

