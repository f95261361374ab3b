"""PyTorch Lightning with ``TieredAdamW``: checkpoints by snapshot, resume within the budget.

Lightning saves a checkpoint by building one dict (``dump_checkpoint``: the
model's weights, the loops, and ``optimizer.state_dict()`` for every
optimizer) and writing it with its ``CheckpointIO``. For a ``TieredAdamW``
that dict would hold the whole state in RAM (12 bytes per parameter with
masters). Add one callback, :class:`TieredCheckpoints`, and every
checkpoint Lightning takes (``ModelCheckpoint`` with top-k, ``save_last``,
``every_n_train_steps``; ``trainer.save_checkpoint``) keeps the optimizer
beside the ``.ckpt`` file instead:

- ``epoch=1-step=40.ckpt``: Lightning's file, as usual, whose
  ``optimizer_states`` entry is a small reference (no tensors);
- ``epoch=1-step=40.ckpt.tierstore/``: the snapshot, written by
  :func:`tierstore.integrations.snapshot.save_trainer_snapshot` (a zarr
  copy streamed through the optimizer's arena, within ``ram_budget``, a
  checksum per chunk). Disk: the state's bytes once per checkpoint.

A checkpoint saved again under its name (``last.ckpt``) writes its new
snapshot into ``last.ckpt.tierstore.next`` first and renames it only once the
new file is written; the file pins its snapshot's digest, so after a crash at
any instant the file on disk loads the snapshot of its own step, never the
other save's. Removing a checkpoint through Lightning (top-k rotation) removes its
snapshot; ``trainer.fit(ckpt_path=...)`` loads it back shard by shard
(checked: a missing or damaged snapshot is a ``CorruptStateError`` naming the
checkpoint, never a fresh start). A ``.ckpt`` deleted by hand leaves its
snapshot behind, and ``tierstore verify`` on the checkpoint folder names it
as an orphan. ``last.ckpt`` as a link (``save_last="link"``) resolves to the
checkpoint it points at. A ``.ckpt`` whose optimizer was saved by plain
Lightning (a torch state dict) still loads, as Lightning loads it.

When fit ends (``teardown``) the callback closes the optimizer: threads,
files and the state directory's lock are released (``close_at_end=False``
keeps it open, e.g. to save again after ``fit``).

Example
-------
>>> import lightning
>>> isinstance(TieredCheckpoints(), lightning.pytorch.Callback)
True
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .._layout.torch_format import REFERENCE_KEY as _REFERENCE_KEY
from .._state.statedir import fsync_dir
from ..checkpoint import write_output_file
from ..errors import ConfigError, CorruptStateError, TierstoreError
from .snapshot import (
    DIGEST_KEYS,
    has_trainer_snapshot,
    load_trainer_snapshot,
    read_reference,
    read_reference_digest,
    refuse_stale_start,
    save_trainer_snapshot,
    tiered_optimizer,
)

__all__ = ["TieredCheckpoints", "SnapshotCheckpointIO", "SNAPSHOT_SUFFIX", "REFERENCE_KEY", "snapshot_folder"]

log = logging.getLogger(__name__)

#: The snapshot of ``x.ckpt`` lives in the folder ``x.ckpt.tierstore`` (``x.ckpt.tierstore-1`` for a second optimizer).
SNAPSHOT_SUFFIX = ".tierstore"
#: The key of the reference that stands in a checkpoint's ``optimizer_states`` for a ``TieredAdamW``;
#: its one home is torch_format, which refuses to load such a reference as a state.
REFERENCE_KEY = _REFERENCE_KEY


def snapshot_folder(ckpt_path: str | os.PathLike, index: int = 0) -> Path:
    """The folder that holds the snapshot of optimizer ``index`` of the checkpoint file ``ckpt_path``.

    Example
    -------
    >>> snapshot_folder("ckpt/epoch=0-step=3.ckpt").name, snapshot_folder("last.ckpt", 1).name
    ('epoch=0-step=3.ckpt.tierstore', 'last.ckpt.tierstore-1')
    """
    path = Path(ckpt_path)
    return path.with_name(path.name + SNAPSHOT_SUFFIX + (f"-{index}" if index else ""))


class _Pending:
    """Stands in ``optimizer_states`` between ``dump_checkpoint`` and the write, when the path is known."""

    def __init__(self, optimizer: Any, index: int) -> None:
        self.optimizer = optimizer
        self.index = index

    def __reduce__(self) -> Any:
        # Reached only when a CheckpointIO other than SnapshotCheckpointIO writes the checkpoint.
        raise ConfigError(
            "a TieredAdamW checkpoint reference reached a CheckpointIO that is not tierstore's: pass "
            "TieredCheckpoints() in Trainer(callbacks=...) and do not replace strategy.checkpoint_io after fit starts"
        )


class SnapshotCheckpointIO(CheckpointIO):
    """A ``CheckpointIO`` that writes each ``TieredAdamW``'s snapshot beside the file ``inner`` writes.

    Installed by :class:`TieredCheckpoints`; wraps the strategy's own
    ``CheckpointIO`` (``TorchCheckpointIO`` by default), which still writes
    and reads the ``.ckpt`` file itself.
    """

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        states = checkpoint.get("optimizer_states")
        written: list[tuple[Path, Path]] = []  # (folder written, its final name) of each snapshot
        if isinstance(states, list) and any(isinstance(s, _Pending) for s in states):
            if "://" in str(path):
                # A snapshot streams through local files (O_DIRECT, fsync, rename); a remote URL would become a
                # local folder named like it. Refused before anything is written.
                raise ConfigError(
                    f"TieredCheckpoints writes the optimizer's snapshot beside the checkpoint file on a local "
                    f"filesystem; {str(path)!r} is a remote URL: give ModelCheckpoint a local dirpath (copy the "
                    "folder to remote storage after the save, .ckpt and .ckpt.tierstore/ together)"
                )
            checkpoint = dict(checkpoint)
            checkpoint["optimizer_states"] = [self._write_snapshot(s, path, written) if isinstance(s, _Pending) else s
                                              for s in states]  # fmt: skip
        if _streams_to_file(self.inner, path, storage_options):
            # Lightning's TorchCheckpointIO serialises the whole checkpoint into a BytesIO first (then a
            # second copy with getvalue()): RAM for every weight of the model at each save. The same
            # torch.save bytes go straight into a temporary beside the file instead, synced and renamed
            # over it (atomic, as Lightning's save is).
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_output_file(path, lambda f: torch.save(checkpoint, f), overwrite=True)
        else:
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        # The new file names its new snapshots: only now may the snapshots it replaced go.
        for folder, final in written:
            _settle(folder, final)

    @staticmethod
    def _write_snapshot(pending: _Pending, path: Any, written: list[tuple[Path, Path]]) -> dict[str, Any]:
        final = snapshot_folder(path, pending.index)
        # A checkpoint saved again under its name (last.ckpt) keeps its old snapshot until the new file is
        # written: the new snapshot goes beside it, so a crash at any instant leaves the old file with the old
        # snapshot or the new file with the new one (it names the folder and pins its digest).
        folder = final if not os.path.lexists(final) else _spare(final)
        reference = read_reference_digest(save_trainer_snapshot(pending.optimizer, folder, owner=Path(path).name))
        written.append((folder, final))
        # Plain values only: Lightning loads checkpoints with weights_only where it can.
        return {REFERENCE_KEY: {"folder": folder.name, "step_count": int(pending.optimizer.step_count), **reference}}

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        # A reference names its folder relative to the file it came from; a link (last.ckpt) points
        # at the checkpoint whose snapshot it shares, so the folder is found beside the link's target.
        home = Path(os.path.realpath(path)).parent
        for state in checkpoint.get("optimizer_states", ()) or ():
            if isinstance(state, dict) and isinstance(state.get(REFERENCE_KEY), dict):
                state[REFERENCE_KEY] = {**state[REFERENCE_KEY], "checkpoint": str(path), "home": str(home)}
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        index = 0
        # A link (last.ckpt) has no snapshot of its own: only folders named after this path go.
        while True:
            folders = [f for f in (snapshot_folder(path, index), _spare(snapshot_folder(path, index)))
                       if os.path.isdir(f) and not os.path.islink(f)]  # fmt: skip
            if not folders:
                break
            for folder in folders:
                shutil.rmtree(folder)
            index += 1

    def teardown(self) -> None:
        self.inner.teardown()


#: Where a checkpoint saved again under its own name writes its new snapshot until the file names it.
SPARE_SUFFIX = ".next"


def _spare(final: Path) -> Path:
    """The folder beside ``final`` that a second save under the same name writes into first."""
    return final.with_name(final.name + SPARE_SUFFIX)


def _settle(folder: Path, final: Path) -> None:
    """Once the checkpoint file names ``folder``: drop the snapshot it replaced and give ``folder`` its final name.

    A crash between the two steps is safe: the file's reference finds its snapshot under either name by its
    digest (:func:`_load_reference`).
    """
    other = _spare(final) if folder == final else final
    if os.path.isdir(other) and not os.path.islink(other):
        shutil.rmtree(other)
    if folder != final:
        os.rename(folder, final)
        fsync_dir(final.parent)


def _streams_to_file(inner: CheckpointIO, path: Any, storage_options: Any) -> bool:
    """Whether a save that ``inner`` would make can be written by ``torch.save`` into a local file instead.

    Only for Lightning's own ``TorchCheckpointIO`` (not a subclass or another
    plugin, whose behaviour is theirs) and a local path.
    """
    return (
        type(inner) is TorchCheckpointIO
        and storage_options is None
        and "://" not in str(path)
    )


def _reference_of(state: Any) -> dict[str, Any] | None:
    if isinstance(state, Mapping) and isinstance(state.get(REFERENCE_KEY), Mapping):
        return dict(state[REFERENCE_KEY])
    return None


def _load_reference(optimizer: Any, reference: dict[str, Any]) -> None:
    """Load the snapshot a checkpoint's reference names into the tiered ``optimizer``."""
    name, home, ckpt = reference.get("folder"), reference.get("home"), reference.get("checkpoint", "?")
    if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not isinstance(home, str):
        raise CorruptStateError(
            f"checkpoint {ckpt!r}: its optimizer reference is damaged ({reference!r}); resume from another checkpoint"
        )
    named = Path(home) / name
    digest = {k: reference[k] for k in DIGEST_KEYS if k in reference}
    if not digest:  # a reference from before digests were pinned: the named folder, as it is
        folder = named
    else:
        # The file pins its snapshot's digest; the snapshot may sit under its spare name or its final one
        # (a save crashed between writing the file and renaming the folder: SnapshotCheckpointIO).
        final = named.with_name(name.removesuffix(SPARE_SUFFIX))
        found = [f for f in (named, final, _spare(final)) if has_trainer_snapshot(f)]
        folder = next((f for f in found if _digest_matches(f, digest)), None)
        if folder is None and found:
            raise CorruptStateError(
                f"checkpoint {ckpt!r}: the optimizer snapshot beside it ({found[0]}) is not the one this checkpoint "
                "saved (its digest differs: a later save under the same name, or a copy mixed from two "
                "checkpoints); resume from another checkpoint"
            )
        folder = folder or named
    if not has_trainer_snapshot(folder):
        raise CorruptStateError(
            f"checkpoint {ckpt!r} keeps its optimizer in {str(folder)!r}, which is missing or holds no snapshot: "
            f"copy the .ckpt file together with its {name}/ folder, or resume from another checkpoint"
        )
    load_trainer_snapshot(optimizer, folder)


def _digest_matches(folder: Path, digest: Mapping[str, Any]) -> bool:
    try:
        reference = read_reference(folder)
    except TierstoreError:
        return False
    return all(reference.get(k) == v for k, v in digest.items())


class TieredCheckpoints(pl.Callback):
    """Lightning checkpoints hold a ``TieredAdamW`` by snapshot beside the ``.ckpt`` file (see the module docs).

    Pass it in ``Trainer(callbacks=[...])``, to the run that saves and to the
    run that resumes. Optimizers that are not a ``TieredAdamW`` are saved and
    loaded as Lightning does.

    Parameters
    ----------
    close_at_end
        Close every ``TieredAdamW`` when ``fit`` ends (default). ``False``
        keeps them open (``trainer.save_checkpoint`` after ``fit`` needs
        that); they are closed at exit then.

    Example
    -------
    >>> cb = TieredCheckpoints(close_at_end=False)
    >>> cb.close_at_end
    False
    """

    def __init__(self, *, close_at_end: bool = True) -> None:
        self.close_at_end = close_at_end

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, SnapshotCheckpointIO):
            strategy.checkpoint_io = SnapshotCheckpointIO(strategy.checkpoint_io)
        if getattr(strategy, "_tierstore_wired", False):
            return
        # Note: Lightning has no public hook between collecting optimizer states and writing them, and
        # Strategy.optimizer_state calls state_dict() (the whole state in RAM). The strategy's two
        # methods are wrapped on this instance only; every other optimizer takes Lightning's own path.
        own_state, own_load = strategy.optimizer_state, strategy.load_optimizer_state_dict

        def optimizer_state(optimizer: Any) -> Any:
            tiered = tiered_optimizer(optimizer)
            if tiered is None:
                return own_state(optimizer)
            index = next((i for i, o in enumerate(trainer.optimizers) if tiered_optimizer(o) is tiered), 0)
            return _Pending(tiered, index)

        def load_optimizer_state_dict(checkpoint: Mapping[str, Any]) -> None:
            states = list(checkpoint.get("optimizer_states", ()))
            plain = [s for s in states if _reference_of(s) is None]
            for optimizer, state in zip(strategy.optimizers, states):
                reference = _reference_of(state)
                if reference is None:
                    continue
                tiered = tiered_optimizer(optimizer)
                if tiered is None:
                    raise ConfigError(
                        f"checkpoint {reference.get('checkpoint', '?')!r} keeps a TieredAdamW's state by snapshot, "
                        f"but this run's optimizer is {type(optimizer).__name__}: configure a TieredAdamW to resume it"
                    )
                _load_reference(tiered, reference)
            if len(plain) == len(states):
                own_load(checkpoint)
            elif plain:  # torch state dicts beside snapshots: Lightning loads those, in their places
                for optimizer, state in zip(strategy.optimizers, states):
                    if _reference_of(state) is None:
                        optimizer.load_state_dict(state)

        strategy.optimizer_state = optimizer_state
        strategy.load_optimizer_state_dict = load_optimizer_state_dict
        strategy._tierstore_wired = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A fit that starts at step 0 with an optimizer that resumed a committed state (resume="auto")
        # would train the model on from moments of another step: refused (see refuse_stale_start).
        for optimizer in trainer.optimizers:
            refuse_stale_start(tiered_optimizer(optimizer), int(trainer.global_step),
                               "Pass trainer.fit(..., ckpt_path=...) the checkpoint of that step (or 'last')")  # fmt: skip

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.close_at_end:
            return
        for optimizer in trainer.optimizers:
            tiered = tiered_optimizer(optimizer)
            if tiered is not None:
                tiered.close_for("TieredCheckpoints closed it when fit ended: pass TieredCheckpoints(close_at_end=False) "
                                 "to keep it open, e.g. to save or fit again")  # fmt: skip
