"""accelerate's ``save_state``/``load_state`` with ``TieredAdamW``: the optimizer by snapshot, within the budget.

``Accelerator.save_state(dir)`` saves every prepared optimizer as
``torch.save(optimizer.state_dict())`` into ``dir/optimizer.bin``, and
``load_state(dir)`` reads it back with ``torch.load`` and
``load_state_dict``: for a ``TieredAdamW`` the whole state (12 bytes per
parameter with masters) built in RAM, the one thing a run that needs
tierstore cannot afford. One call, :func:`checkpoint_by_snapshot`, made
right after the ``Accelerator`` is created, changes the optimizer's part
of every checkpoint folder and nothing else:

- ``save_state`` streams the optimizer's state into the folder as a
  snapshot plus its reference file (``tierstore_optimizer.zarr/`` and
  ``tierstore_optimizer.json``, :mod:`tierstore.integrations.snapshot`:
  through the arena, within ``ram_budget``), and ``optimizer.bin`` holds a
  copy of that reference, a few hundred bytes and no tensors. Disk: the
  state's bytes once per checkpoint. The model, scheduler, RNG, sampler
  and custom states are saved by accelerate as before.
- ``load_state`` finds that reference in ``optimizer.bin``, checks it
  against the folder's reference file and loads the snapshot shard by shard
  (every chunk's checksum checked; a durable state directory then follows
  the checkpoint). A snapshot that is missing, damaged or not the one
  ``optimizer.bin`` names is a :class:`~tierstore.errors.CorruptStateError`
  naming the folder, never a fresh start. A folder whose ``optimizer.bin``
  holds a real state dict (saved by plain accelerate, with
  ``torch.optim.AdamW`` or without this call) loads as accelerate loads it:
  read whole by ``torch.load``, then copied in shard by shard.
- ``prepare`` wraps a ``TieredAdamW`` without accelerate's device
  placement, which is a ``state_dict()``/``load_state_dict()`` round trip
  (the whole state through RAM); its state stays where it is.

Everything lives inside the checkpoint folder, so accelerate's rotation
(``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=N)``, which deletes the oldest ``checkpoint_K`` folders) frees
each snapshot with its folder, and a copied folder carries its optimizer
state. ``tierstore verify`` checks the folders and names orphans.

Optimizers that are not a ``TieredAdamW`` take accelerate's path unchanged,
and so does every optimizer under FSDP (FSDP2 saves it through
``torch.distributed.checkpoint``, which :mod:`tierstore.dcp` streams),
DeepSpeed and Megatron-LM, which save optimizers their own way.

Example
-------
>>> import tempfile, torch, accelerate
>>> from tierstore import TieredAdamW
>>> accelerator = accelerate.Accelerator(cpu=True)
>>> hooks = checkpoint_by_snapshot(accelerator)
>>> model = torch.nn.Linear(4, 4)
>>> model, opt = accelerator.prepare(model, TieredAdamW(model.parameters(), lr=0.1))
>>> accelerator.backward(model(torch.ones(2, 4)).sum()); opt.step()
>>> folder = tempfile.mkdtemp() + "/ckpt"
>>> _ = accelerator.save_state(folder)
>>> sorted(name for name in os.listdir(folder) if "optimizer" in name)
['optimizer.bin', 'tierstore_optimizer.json', 'tierstore_optimizer.zarr']
>>> accelerator.load_state(folder); opt.optimizer.step_count
1
>>> opt.optimizer.close()
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from accelerate.utils import DistributedType

from .._layout.torch_format import REFERENCE_KEY as _REFERENCE_KEY
from ..errors import ConfigError, CorruptStateError
from ..optimizer import TieredAdamW
from .snapshot import (
    REFERENCE_NAME,
    SNAPSHOT_NAME,
    load_trainer_snapshot,
    read_reference,
    save_trainer_snapshot,
    tiered_optimizer,
)

__all__ = ["REFERENCE_KEY", "SnapshotCheckpoints", "checkpoint_by_snapshot"]

#: The key of ``optimizer.bin``'s dict that holds the reference (``tierstore_optimizer.json``'s fields);
#: its one home is torch_format, which refuses to load such a reference as a state.
REFERENCE_KEY = _REFERENCE_KEY
# accelerate saves the optimizers of these runs its own way (FSDP: save_fsdp_optimizer, DCP under FSDP2;
# DeepSpeed and Megatron-LM: inside their engines), never through optimizer.bin: left as they are.
_OWN_PATHS = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
# What must agree between optimizer.bin's copy of the reference and the folder's reference file.
_MATCH_KEYS = ("step_count", "fingerprint", "zarr_json_sha256")


class _NextStateDict:
    """Stands in for one ``TieredAdamW``'s ``state_dict()`` for its next call, then removes itself.

    Note: accelerate offers no hook around its optimizer save: ``save_state``
    runs its pre-hooks, then ``save_accelerator_state`` calls
    ``AcceleratedOptimizer.state_dict()``, which is
    ``self.optimizer.state_dict()`` (accelerate 1.16), and ``torch.save``s
    what it returns. So the save hook writes the snapshot and sets this
    object as the optimizer's *instance* attribute ``state_dict``, which
    shadows the class's method for that one call (accelerate patches
    ``optimizer.step`` the same way for its GradScaler).
    """

    def __init__(self, opt: TieredAdamW, payload: dict[str, Any]) -> None:
        self._opt = weakref.ref(opt)  # an instance attribute must not keep the optimizer alive (a cycle)
        self._payload = payload
        self._step = opt.step_count

    def __call__(self) -> dict[str, Any]:
        opt = self._opt()
        if opt is None:  # pragma: no cover - an attribute of a collected optimizer cannot be called
            raise RuntimeError("the optimizer is gone")
        opt.__dict__.pop("state_dict", None)
        if opt.step_count != self._step:
            # A save_state that failed before it reached the optimizer left this behind, and training went
            # on: this call is someone else's, who gets the real state dict.
            return opt.state_dict()
        return self._payload


class _NextLoadStateDict:
    """Stands in for one ``TieredAdamW``'s ``load_state_dict()`` for its next call, then removes itself.

    ``load_state`` runs its pre-hooks (which know the folder), then
    ``load_accelerator_state`` ``torch.load``s ``optimizer.bin`` and calls
    ``AcceleratedOptimizer.load_state_dict``, which is
    ``self.optimizer.load_state_dict(...)``: the reference arrives here, with
    the folder it came from. A real state dict goes to the real method.
    """

    def __init__(self, opt: TieredAdamW, folder: str) -> None:
        self._opt = weakref.ref(opt)
        self._folder = folder

    def __call__(self, state_dict: dict[str, Any]) -> None:
        opt = self._opt()
        if opt is None:  # pragma: no cover
            raise RuntimeError("the optimizer is gone")
        opt.__dict__.pop("load_state_dict", None)
        if isinstance(state_dict, dict) and REFERENCE_KEY in state_dict:
            _load_by_reference(opt, self._folder, state_dict[REFERENCE_KEY])
        else:
            opt.load_state_dict(state_dict)  # saved by plain accelerate: accelerate's path


def _load_by_reference(opt: TieredAdamW, folder: str | os.PathLike, reference: Any) -> None:
    """Load the snapshot of ``folder`` into ``opt``, after checking that it is the one ``reference`` names.

    ``reference`` is what ``optimizer.bin`` holds under :data:`REFERENCE_KEY`.

    Raises
    ------
    CorruptStateError
        Naming the folder, if the reference file or the snapshot is missing or
        damaged, or is not the one ``optimizer.bin`` names (a folder assembled
        from two saves).
    """
    folder = os.fspath(folder)
    if not isinstance(reference, dict) or not all(k in reference for k in _MATCH_KEYS):
        raise CorruptStateError(
            f"checkpoint {folder!r}: optimizer.bin holds a damaged tierstore reference ({reference!r:.200}); "
            "resume from another checkpoint"
        )
    current = read_reference(folder)
    if any(current[k] != reference[k] for k in _MATCH_KEYS):
        raise CorruptStateError(
            f"checkpoint {folder!r}: optimizer.bin names the optimizer snapshot of step {reference['step_count']} "
            f"(zarr.json sha256 {str(reference['zarr_json_sha256'])[:12]}...), but {REFERENCE_NAME} beside it "
            f"names step {current['step_count']} ({current['zarr_json_sha256'][:12]}...): the folder mixes two "
            f"saves. Copy the checkpoint folder whole (optimizer.bin, {REFERENCE_NAME} and {SNAPSHOT_NAME}/ "
            "together), or resume from another checkpoint"
        )
    load_trainer_snapshot(opt, folder)


class SnapshotCheckpoints:
    """The hooks :func:`checkpoint_by_snapshot` installs on one ``Accelerator`` (see the module docs).

    ``optimizer``: the ``TieredAdamW`` that ``accelerator.prepare`` has
    wrapped (``None`` until then). :meth:`remove` takes the hooks away.
    """

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        self._opt: weakref.ref[TieredAdamW] | None = None
        self._prepare = accelerator.prepare_optimizer
        # Note: accelerate's prepare() calls self.prepare_optimizer for every optimizer; an instance
        # attribute is how TieredTrainer (tierstore.integrations.hf) takes out the placement too.
        accelerator.prepare_optimizer = self.prepare_optimizer
        self._handles = [
            accelerator.register_save_state_pre_hook(self._before_save),
            accelerator.register_load_state_pre_hook(self._before_load),
        ]

    @property
    def optimizer(self) -> TieredAdamW | None:
        """The prepared ``TieredAdamW`` whose checkpoints go by snapshot, or ``None``."""
        return None if self._opt is None else self._opt()

    def _active(self) -> TieredAdamW | None:
        """The prepared TieredAdamW when accelerate saves it through optimizer.bin, else None."""
        opt = self.optimizer
        if opt is None or self._accelerator.distributed_type in _OWN_PATHS:
            return None
        return opt

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
        """``Accelerator.prepare_optimizer``, with a ``TieredAdamW`` wrapped without device placement.

        Raises
        ------
        ConfigError
            If a second ``TieredAdamW`` is prepared on the same ``Accelerator``.
        """
        opt = tiered_optimizer(optimizer)
        if opt is not None and self._accelerator.distributed_type not in _OWN_PATHS:
            mine = self.optimizer
            if mine is not None and mine is not opt:
                raise ConfigError(
                    "checkpoint_by_snapshot handles one TieredAdamW per Accelerator (its snapshot is "
                    f"{SNAPSHOT_NAME}/ in the checkpoint folder); a second one was prepared. Build one "
                    "TieredAdamW over all parameter groups"
                )
            self._opt = weakref.ref(opt)
            # accelerate "places" an optimizer with state_dict() then load_state_dict(): the whole state
            # through RAM. A TieredAdamW's state stays where it is (host RAM and its files).
            device_placement = False
        return self._prepare(optimizer, device_placement=device_placement)

    def _before_save(self, models: Any, weights: Any, output_dir: str) -> None:
        opt = self._active()
        if opt is None:
            return
        config = self._accelerator.project_configuration
        # accelerate writes optimizer.bin only from this process (accelerate.utils.save): so does the snapshot.
        if self._accelerator.is_local_main_process if config.save_on_each_node else self._accelerator.is_main_process:
            save_trainer_snapshot(opt, output_dir)
            reference = read_reference(output_dir)
        else:
            reference = {"step_count": opt.step_count}  # not written: accelerate saves nothing from here
        payload = {
            REFERENCE_KEY: reference,
            "note": f"the optimizer state is {SNAPSHOT_NAME}/ beside this file; load it with accelerator.load_state "
            "after tierstore.integrations.accelerate.checkpoint_by_snapshot(accelerator)",
        }
        opt.__dict__["state_dict"] = _NextStateDict(opt, payload)

    def _before_load(self, models: Any, input_dir: str) -> None:
        opt = self._active()
        if opt is not None:
            opt.__dict__["load_state_dict"] = _NextLoadStateDict(opt, os.fspath(input_dir))

    def remove(self) -> None:
        """Take the hooks away: later saves and loads go through ``state_dict()`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._accelerator.__dict__.get("prepare_optimizer") == self.prepare_optimizer:
            del self._accelerator.__dict__["prepare_optimizer"]
        opt = self.optimizer
        if opt is not None:
            opt.__dict__.pop("state_dict", None)
            opt.__dict__.pop("load_state_dict", None)


def checkpoint_by_snapshot(accelerator: Any) -> SnapshotCheckpoints:
    """Make ``accelerator.save_state``/``load_state`` keep a ``TieredAdamW`` by snapshot, within ``ram_budget``.

    Call it once, right after creating the ``Accelerator`` and before
    ``accelerator.prepare(...)``; then save and load as accelerate
    documents. What it changes (only for a ``TieredAdamW``, outside FSDP,
    DeepSpeed and Megatron-LM) is in the module docs: ``optimizer.bin``
    holds a small reference, the state is a snapshot beside it (the state's
    bytes once per checkpoint), loading checks it.

    Parameters
    ----------
    accelerator
        An ``accelerate.Accelerator``.

    Returns
    -------
    SnapshotCheckpoints
        The installed hooks (``.remove()`` takes them away).

    Raises
    ------
    ConfigError
        If ``accelerator`` already has this call's hooks, or has already
        prepared a ``TieredAdamW`` (its state went through RAM for device
        placement, and it would be saved through ``state_dict()``).

    Example
    -------
    >>> import accelerate
    >>> hooks = checkpoint_by_snapshot(accelerate.Accelerator(cpu=True))
    >>> hooks.optimizer is None  # nothing prepared yet
    True
    """
    if isinstance(getattr(accelerator.prepare_optimizer, "__self__", None), SnapshotCheckpoints):
        raise ConfigError("checkpoint_by_snapshot(accelerator) was already called for this Accelerator; call it once")
    # Note: accelerate keeps what it prepared in the private list _optimizers; it is read here only to
    # refuse a call that comes too late, never to find the optimizer (prepare_optimizer hands it over).
    if any(tiered_optimizer(o) is not None for o in getattr(accelerator, "_optimizers", ())):
        raise ConfigError(
            "checkpoint_by_snapshot(accelerator) was called after accelerator.prepare(...) took a TieredAdamW: "
            "call it right after creating the Accelerator, before prepare"
        )
    return SnapshotCheckpoints(accelerator)
