"""Load a ``torch.optim.AdamW`` state-dict file (``optimizer.pt``) into ``TieredAdamW`` without holding it in RAM.

A run migrating from ``torch.optim.AdamW`` has checkpoints whose optimizer
part is ``torch.save(optimizer.state_dict())``. ``torch.load(path)`` would
read the whole file into anonymous memory. Here it is opened with
``torch.load(..., mmap=True)``: every tensor is a view of a private,
read-only mapping of the file, and :meth:`TieredAdamW.load_state_dict
<tierstore.TieredAdamW.load_state_dict>` copies it shard by shard into the
state. File pages that a shard has consumed would still count in the
process's RSS until the mapping goes, so the moments are wrapped in
:class:`ReleasingTensor`: after each copy out of one, the whole pages it
covered are handed back to the Linux kernel (``madvise(MADV_DONTNEED)``: clean
pages of a private file mapping, which a later touch reads again from the
file, so no data can change). RSS then grows by about one shard's worth of
the file, not the file.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.ones(4)
>>> ref = torch.optim.AdamW([w], lr=0.1); ref.step()
>>> path = tempfile.mkdtemp() + "/optimizer.pt"; torch.save(ref.state_dict(), path)
>>> with TieredAdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1) as opt:
...     load_torch_optimizer_file(opt, path); opt.step_count
1
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pickle import UnpicklingError  # the exception only: nothing here unpickles
from typing import Any

import torch

from ..errors import CorruptStateError

__all__ = ["TORCH_OPTIMIZER_NAMES", "MOMENT_KEYS", "ReleasingTensor", "load_torch_optimizer_file"]

#: The names Trainer gives a torch optimizer's state dict in a checkpoint folder.
TORCH_OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.bin")
#: The large tensors of an AdamW state entry (the ones streamed and released).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_PAGE = mmap.PAGESIZE


def _libc_madvise() -> Any:
    name = ctypes.util.find_library("c")
    if name is None or not hasattr(os, "sched_getaffinity"):  # Linux only: elsewhere nothing is released
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _file_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (``/proc/self/maps``)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


class ReleasingTensor(torch.Tensor):
    """A view of a read-only file mapping whose pages are released once a copy has read them.

    Only :func:`load_torch_optimizer_file` makes these, over the mapping
    ``torch.load(mmap=True)`` made; the pages released are only those inside
    that file's mappings (``_ranges``), so anonymous memory is never touched.
    Views of it (slices, reshapes) are ``ReleasingTensor`` too.
    """

    _ranges: list[tuple[int, int]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], ReleasingTensor):
            _release(args[1])
        return out


def _release(t: torch.Tensor) -> None:
    if _madvise is None or t.numel() == 0 or not t.is_contiguous():
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE  # whole pages inside the piece only
    if hi <= lo:
        return
    for a, b in ReleasingTensor._ranges:
        if a <= lo and hi <= b:
            _madvise(lo, hi - lo, _MADV_DONTNEED)  # clean private file pages: refaulted from the file if read again
            return


def load_torch_optimizer_file(opt: Any, path: str | os.PathLike) -> None:
    """``opt.load_state_dict(torch.load(path, mmap=True))``, releasing file pages as shards consume them.

    Parameters
    ----------
    opt
        An open :class:`~tierstore.TieredAdamW`.
    path
        A file written by ``torch.save(optimizer.state_dict())`` of
        ``torch.optim.AdamW`` (or of ``TieredAdamW``), e.g. Trainer's
        ``checkpoint-N/optimizer.pt``.

    Raises
    ------
    CorruptStateError
        If the file cannot be read as a torch state dict (naming it), or holds any object
        besides tensors, numbers and plain containers (read with ``weights_only=True``: never run).
    ConfigError
        As :meth:`~tierstore.TieredAdamW.load_state_dict`: another model's groups or sizes.
    """
    path = os.fspath(path)
    try:
        state_dict = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except UnpicklingError:
        # weights_only refused an object (a class, a function call): reading it would run code from the file.
        # torch's own message suggests weights_only=False, which is what must not be done with a file of
        # unknown origin, so it is not repeated.
        raise CorruptStateError(
            f"{path!r} holds objects other than tensors, numbers and plain containers, which an optimizer state "
            "dict never does; it is not loaded (unpickling it could run code from the file). Resume from a "
            "checkpoint you trust"
        ) from None
    except (OSError, RuntimeError, ValueError, EOFError) as exc:  # torch reports a damaged zip as RuntimeError
        raise CorruptStateError(
            f"{path!r} cannot be read as a torch optimizer state dict ({exc}); resume from another checkpoint"
        ) from exc
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        raise CorruptStateError(f"{path!r} is not an optimizer state dict (no 'state' mapping)")
    ReleasingTensor._ranges = _file_ranges(path)
    try:
        for entry in state_dict["state"].values():
            if isinstance(entry, dict):
                for key in MOMENT_KEYS:
                    value = entry.get(key)
                    if type(value) is torch.Tensor and value.device.type == "cpu":
                        entry[key] = value.as_subclass(ReleasingTensor)
        opt.load_state_dict(state_dict)
    finally:
        ReleasingTensor._ranges = []
        del state_dict  # the mapping goes with its last tensor
