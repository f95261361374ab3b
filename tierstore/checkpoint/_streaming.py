"""Streaming a state into and out of a checkpoint, shard by shard: from an optimizer, from a state directory, into an optimizer.

The state never passes through RAM whole: saving visits an optimizer's
shards through its arena (its public access protocol,
:mod:`tierstore._runtime.access`), exporting reads a state directory one
shard at a time, loading fills the optimizer's shards from the checkpoint
and commits. The file format is :mod:`tierstore.checkpoint._writer` and
:mod:`tierstore.checkpoint._reader`.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
>>> path = tempfile.mkdtemp() + "/ckpt.zarr"
>>> with TieredAdamW([w]) as opt:
...     _ = opt.step(); save_checkpoint(opt, path)
>>> with TieredAdamW([w]) as fresh:
...     load_checkpoint(fresh, path); fresh.step_count
1
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from .._layout.layout import Layout, ShardSpec
from .._layout.scalar_record import RECORD_KEY
from .._layout.torch_format import require_option_fields
from .._runtime.access import ShardAccess
from .._state import manifest as manifest_mod
from .._state.manifest import other_algorithm
from ..errors import CorruptStateError, LayoutMismatchError
from ._reader import CheckpointReader
from ._state_dir import check_manifest_header, open_state_reader, require_clean
from ._writer import CheckpointWriter
from ._zarr_format import CheckpointHeader

__all__ = ["save_checkpoint", "export_statedir", "load_checkpoint"]

log = logging.getLogger("tierstore.checkpoint")  # the package's logger, as before it was split into modules

def save_checkpoint(opt: ShardAccess, path: str | os.PathLike, *, overwrite: bool = False, checksum: str | None = "xxh3") -> None:
    """Stream an optimizer's state into a zarr v3 checkpoint at ``path``, one chunk per shard.

    Shards are visited read-only, disk shards through the optimizer's arena,
    so the RAM used beyond ``ram_budget`` is about one chunk of one field.
    The checkpoint appears at ``path`` only once it is complete and synced.

    Parameters
    ----------
    opt
        An open :class:`~tierstore.TieredAdamW` (any :class:`~tierstore._runtime.access.ShardAccess`).
    path
        Directory of the zarr group to create (local filesystem).
    overwrite
        Replace an existing checkpoint at ``path`` (only a tierstore
        checkpoint is ever replaced; the old one is removed after the new
        one is in place).
    checksum
        ``"xxh3"`` (default): a 64-bit xxHash of every chunk in the array's
        attributes, verified by :func:`load_checkpoint`; ``"crc32c"``: zarr's
        crc32c codec, verified by any zarr reader but about 7 ms slower per
        16 MiB chunk; ``None``: no checksum.

    Raises
    ------
    CheckpointExistsError
        If ``path`` exists and ``overwrite`` is false, or it is not a checkpoint.
    ConfigError
        For an unknown ``checksum``.
    ClosedError, StepFailedError
        If the optimizer is closed or failed.

    Example
    -------
    >>> import tempfile, torch, zarr
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> [round(float(x), 6) for x in zarr.open_group(path, mode="r")["exp_avg_sq"][:3]]
    [0.001, 0.001, 0.001]
    """
    layout = opt.layout
    header = CheckpointHeader(
        layout=layout,
        step_count=opt.step_count,
        param_groups=manifest_mod.encode_groups(opt.param_groups),
        param_steps=opt.param_steps(),
        source="optimizer",
        param_scalars=opt.param_scalars(),  # NAdam's mu_product beside each step; None for most algorithms
    )
    with CheckpointWriter(path, header, overwrite=overwrite, checksum=checksum) as writer:

        def visit(shard: ShardSpec, extent: torch.Tensor) -> None:
            for field in layout.fields:
                writer.write_stored(shard, field, layout.stored_field(extent, shard, field))

        opt.visit_stored(visit)  # the stored bytes: a compressed format is copied, not decoded
    log.info("saved checkpoint of step %d to %s", opt.step_count, path)


def export_statedir(
    state_dir: str | os.PathLike,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    checksum: str | None = "xxh3",
    progress: Callable[[int], object] | None = None,
) -> None:
    """Stream a state directory's last commit into a zarr v3 checkpoint (no optimizer, no model).

    Every shard is read once and verified against its checksum before it is
    written; about one shard of RAM is used.

    Parameters
    ----------
    state_dir
        A tierstore state directory (it may be in use: its committed copies
        stay intact for one more step; a checksum error means it moved on twice, rerun).
    path, overwrite, checksum
        As :func:`save_checkpoint`.
    progress
        Called with the bytes of each shard done (for a progress bar).

    Raises
    ------
    CorruptStateError
        If the manifest or any shard is corrupt, or the state was left dirty.
    FormatVersionError
        If the state directory was written by a newer tierstore.
    CheckpointExistsError
        As :func:`save_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> from tierstore.checkpoint import checkpoint_to_state_dict
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d + "/state") as opt:
    ...     _ = opt.step()
    >>> export_statedir(d + "/state", d + "/ckpt.zarr")
    >>> float(checkpoint_to_state_dict(d + "/ckpt.zarr")["state"][0]["step"])
    1.0
    """
    with open_state_reader(state_dir) as reader:
        require_clean(reader)
        step_count, param_steps, _ = check_manifest_header(reader)
        header = CheckpointHeader(
            layout=reader.layout,
            step_count=step_count,
            param_groups=list(reader.manifest["param_groups"]),  # checked, still encoded as saved
            param_steps=param_steps,
            source="state_dir",
            param_scalars=reader.manifest.get(RECORD_KEY),  # checked with the manifest (manifest.validate)
        )
        with CheckpointWriter(path, header, overwrite=overwrite, checksum=checksum) as writer:
            for shard, extent in reader.iter_extents():
                for field in reader.layout.fields:
                    writer.write_stored(shard, field, reader.layout.stored_field(extent, shard, field))
                if progress is not None:
                    progress(reader.layout.shard_nbytes(shard))


def _check_same_model(ck: CheckpointReader, mine: Layout, n_groups: int) -> None:
    """Refuse a checkpoint of another optimizer algorithm or another model (shard size, fields and dtypes may differ)."""
    fix = (
        "Load a checkpoint saved from this model, or build the optimizer over the same parameters "
        "and param groups, in the same order, as the run that saved it"
    )
    where = f"checkpoint {ck.path}"
    saved = ck.layout.algorithm
    if saved is not mine.algorithm:
        raise LayoutMismatchError(other_algorithm(where, saved, mine.algorithm, fix=(
            f"load it into a {saved.front}, or load into this {mine.algorithm.front} a checkpoint of its own "
            f"algorithm (save_checkpoint of a {mine.algorithm.front}, or state_dict_to_checkpoint of a "
            f"{mine.algorithm.torch_class} state dict)")))  # fmt: skip
    if len(ck.params) != len(mine.params):
        raise LayoutMismatchError(f"{where} has {len(ck.params)} parameters, this optimizer has {len(mine.params)}. {fix}")
    if len(ck.param_groups) != n_groups:
        raise LayoutMismatchError(f"{where} has {len(ck.param_groups)} param groups, this optimizer has {n_groups}. {fix}")
    for saved, p in zip(ck.params, mine.params):
        shape = None if saved["shape"] is None else tuple(saved["shape"])
        # Flat starts may differ (another moment format aligns parameters to its blocks):
        # the load maps each parameter's elements.
        differs = (
            saved["group"] != p.group
            or bool(saved["trainable"]) != p.trainable
            or (shape is not None and shape != p.shape)
        )
        if differs:
            def text(shape: Any, group: int, trainable: bool) -> str:
                return f"shape {shape if shape is not None else '(unknown)'} in group {group}{'' if trainable else ', frozen'}"

            hint = fix
            if shape is None:
                hint = (
                    "It was converted from a torch state dict in which this parameter had no state; "
                    "convert it again with state_dict_to_checkpoint(..., params=model.parameters())"
                )
            raise LayoutMismatchError(
                f"{where}: parameter {p.index} has {text(shape, saved['group'], saved['trainable'])}, in this "
                f"optimizer it has {text(p.shape, p.group, p.trainable)}. {hint}"
            )


def load_checkpoint(opt: ShardAccess, path: str | os.PathLike) -> None:
    """Stream a checkpoint back into an optimizer's state and commit it.

    Restores every moment, step count (and the scalars an algorithm keeps
    beside it: NAdam's ``mu_product``), the param groups' hyperparameters,
    ``opt.step_count`` and (when both have one) the fp32 master copy, which
    is then written into the parameters. The checkpoint may have been
    written with another ``shard_numel``, RAM budget or backend; it must
    come from the same optimizer algorithm (a ``TieredSGD`` checkpoint does
    not load into a ``TieredAdamW``) and the same model (parameter shapes,
    order, groups and frozen flags). Master weights in the checkpoint are ignored by an optimizer
    that keeps none (fp32 CPU parameters without ``keep_master``), as
    ``load_state_dict`` does; an optimizer that keeps them seeds them from
    its parameters when the checkpoint has none. A checkpoint always holds
    the fields its algorithm always keeps (AdamW: ``exp_avg`` and
    ``exp_avg_sq``; one that lacks either is refused, never read as zeros).
    One saved without amsgrad (a field an option adds) loads into an optimizer built
    with ``amsgrad=True`` as torch loads it: the saved groups are restored
    (``amsgrad=False``), so ``max_exp_avg_sq`` is not used; it is set to
    zeros, its initial value, should a group switch amsgrad on again (where
    torch's AdamW would fail at the next step for want of it). A checkpoint
    whose groups use amsgrad must hold ``max_exp_avg_sq``. The checkpoint's ``moment_dtype`` may
    differ from the optimizer's: the moments are decoded and encoded (with
    the same format and flat space, the stored bytes are copied, bit for
    bit). This is how a state directory changes format (``docs/formats.md``).

    Raises
    ------
    LayoutMismatchError
        If the checkpoint belongs to another model (names the first difference)
        or holds another optimizer algorithm's state (names both).
    FormatVersionError
        If it was written by a newer checkpoint format, or is not a tierstore checkpoint.
    CorruptStateError
        If a chunk fails its checksum or is missing (nothing is committed then).
    ValueError
        If the checkpoint uses amsgrad and the optimizer was built without it.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> with TieredAdamW([w], lr=0.5) as fresh:
    ...     load_checkpoint(fresh, path)
    ...     fresh.step_count, fresh.param_groups[0]["lr"]
    (1, 0.1)
    """
    ck = CheckpointReader(path)
    layout = opt.layout
    _check_same_model(ck, layout, len(opt.param_groups))
    require_option_fields(ck.param_groups, layout, f"checkpoint {ck.path}")
    if "master" in ck.arrays and "master" not in layout.fields:
        log.info("%s holds master weights; this optimizer keeps none (fp32 parameters), so they are not loaded", ck.path)

    # Only these may be absent (the checkpoint's own arrays are exactly its layout's fields, the
    # algorithm's required ones always among them): the master is seeded from the parameters, a field an
    # option adds (max_exp_avg_sq) starts at zeros as torch would start it, and is unused under the
    # restored groups.
    absent = [f for f in layout.fields if f not in ck.arrays]
    optional = {"master"} | {f.name for f in layout.algorithm.fields if f.option is not None}
    if not set(absent) <= optional:  # pragma: no cover - CheckpointReader refuses these
        raise CorruptStateError(f"checkpoint {ck.path} lacks {absent}; write it again")
    same_space = all(p.start == saved["start"] for p, saved in zip(layout.params, ck.params) if p.trainable)
    copy_stored = same_space and ck.format == layout.format

    def fill_stored(shard: ShardSpec, extent: torch.Tensor) -> None:
        for field in layout.fields:
            stored = layout.stored_field(extent, shard, field)
            if field in ck.arrays:
                ck.read_stored(field, shard, stored)
            else:
                stored.zero_()  # max_exp_avg_sq the checkpoint lacks (zero bytes: zeros); a master is seeded afterwards

    def fill(shard: ShardSpec, flat: torch.Tensor) -> None:
        for field, values in layout.field_views(flat, shard).items():
            out = values.numpy()
            if field not in ck.arrays:
                out.fill(0.0)  # as above
            elif same_space:
                ck.read_values(field, shard.start, out)
            else:  # parameter by parameter: the checkpoint's flat space is aligned differently
                out.fill(0.0)
                for seg in shard.segments:
                    start = ck.params[seg.param]["start"] + seg.param_offset
                    ck.read_values(field, start, out[seg.shard_offset : seg.shard_offset + seg.length])

    steps = {i: s for i, s in enumerate(ck.param_steps) if s is not None and layout.params[i].trainable}
    masters = set()
    if "master" in ck.arrays:
        masters = {i for i, (p, given) in enumerate(zip(layout.params, ck.has_master)) if p.trainable and given}
    # A failed load leaves the optimizer refusing use (its state is half-replaced).
    opt.replace_shards(
        fill_stored if copy_stored else fill,
        param_steps=steps,
        groups=ck.param_groups,
        masters_given=masters,
        step_count=ck.step_count,
        stored=copy_stored,
        param_scalars=ck.param_scalars,
    )
    log.info("loaded checkpoint %s (step %d)", ck.path, ck.step_count)
