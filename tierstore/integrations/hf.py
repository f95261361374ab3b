"""Hugging Face ``Trainer`` with ``TieredAdamW``: checkpoints by snapshot, resume within the budget.

``Trainer`` saves the optimizer with ``torch.save(optimizer.state_dict())``,
which builds the whole state in RAM (12 bytes per parameter with masters),
the one thing a run that needs tierstore cannot afford. :class:`TieredTrainer`
is ``transformers.Trainer`` with the optimizer's part of a checkpoint
replaced, nothing else: every ``checkpoint-N/`` folder holds the model,
scheduler, RNG and trainer state as Trainer writes them, and instead of
``optimizer.pt`` a small reference file plus a snapshot streamed through the
optimizer's arena (:mod:`tierstore.integrations.snapshot`). So
``save_steps``/``save_strategy``, ``save_total_limit`` rotation (deleting a
folder frees its snapshot), ``resume_from_checkpoint=True`` or a path,
``load_best_model_at_end`` and ``save_only_model`` work as Trainer documents
them, within ``ram_budget``. Resuming from a folder whose optimizer was saved
by plain ``Trainer`` (``optimizer.pt`` of ``torch.optim.AdamW``, a migrating
run) streams it through ``torch.load(..., mmap=True)``
(:mod:`tierstore.integrations.torch_file`). At the end of training
(``on_train_end``) the optimizer is closed: threads, files and the state
directory's lock are released.

Optimizers that are not a ``TieredAdamW``, DeepSpeed, FSDP and XLA runs take
Trainer's own code paths unchanged.

Example
-------
>>> import transformers
>>> issubclass(TieredTrainer, transformers.Trainer)
True
"""

from __future__ import annotations

import logging
import os
import warnings
from pickle import (
    UnpicklingError,  # torch.load(weights_only=True)'s refusal; nothing here unpickles
)
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_pt_utils import reissue_pt_warnings

from ..errors import CorruptStateError
from .snapshot import (
    has_trainer_snapshot,
    load_trainer_snapshot,
    refuse_stale_start,
    save_trainer_snapshot,
    tiered_optimizer,
)
from .torch_file import TORCH_OPTIMIZER_NAMES, load_torch_optimizer_file

__all__ = ["TieredTrainer", "CloseTieredOptimizer", "CheckTieredResume", "tiered_optimizer", "param_groups"]

log = logging.getLogger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups as ``Trainer.create_optimizer`` builds them: decay, and no decay on biases and norms.

    Uses Trainer's own ``get_decay_parameter_names`` (biases, LayerNorm and
    RMSNorm weights get ``weight_decay=0``), so an optimizer passed through
    ``optimizers=(opt, scheduler)`` decays exactly what Trainer's default
    optimizer would. Frozen parameters are left out, as Trainer leaves them.

    Example
    -------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> [len(g["params"]) for g in param_groups(model, 0.01)], [g["weight_decay"] for g in param_groups(model, 0.01)]
    ([1, 3], [0.01, 0.0])
    """
    # Note: get_decay_parameter_names is an instance method that reads no instance state (transformers
    # 5.25); tests/test_hf_checkpoints.py checks these groups against Trainer.create_optimizer's.
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


class CloseTieredOptimizer(TrainerCallback):
    """Close the ``TieredAdamW`` when training ends (``on_train_end``): threads, files and lock released.

    :class:`TieredTrainer` adds it; add it yourself to a plain ``Trainer``
    to get only this. A durable state directory keeps its last commit.
    """

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = tiered_optimizer(optimizer)
        if opt is not None:
            opt.close_for("CloseTieredOptimizer closed it when training ended (TieredTrainer adds it): build a new "
                          "optimizer, or remove the callback with trainer.remove_callback(CloseTieredOptimizer)")  # fmt: skip


class CheckTieredResume(TrainerCallback):
    """Refuse a fresh ``Trainer`` run whose optimizer resumed a committed state (``on_train_begin``).

    :class:`TieredTrainer` adds it (:func:`refuse_stale_start` says why).
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        refuse_stale_start(tiered_optimizer(optimizer), int(state.global_step),
                           "Pass trainer.train(resume_from_checkpoint=...) the checkpoint of that step (or True)")  # fmt: skip


class TieredTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints hold a ``TieredAdamW`` by snapshot, never through RAM.

    Built and used exactly as ``Trainer`` (``optimizers=(opt, scheduler)`` or
    ``optimizer_cls_and_kwargs=(TieredAdamW, {...})``). What differs, for a
    ``TieredAdamW`` only (see the module docs):

    - saving writes ``tierstore_optimizer.json`` and
      ``tierstore_optimizer.zarr/`` into ``checkpoint-N/`` instead of
      ``optimizer.pt``, streamed within ``ram_budget``; disk: the state's
      bytes once per checkpoint;
    - resuming loads that snapshot (checked: a missing or damaged one is a
      ``CorruptStateError`` naming the checkpoint), or streams a plain
      ``optimizer.pt`` from ``torch.optim.AdamW``; a checkpoint with neither
      (``save_only_model=True``, or copied without its optimizer files) is
      refused, never resumed with fresh moments;
    - a run that starts at step 0 while its optimizer resumed a committed
      state directory (``resume="auto"``) is refused, naming the fix;
    - the optimizer is closed at the end of training.

    Example
    -------
    >>> import transformers
    >>> TieredTrainer.__mro__[1] is transformers.Trainer
    True
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(CheckTieredResume())
        self.add_callback(CloseTieredOptimizer())

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        prepare = accelerator.prepare_optimizer

        def prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
            # accelerate "places" an optimizer with state_dict() then load_state_dict(): the whole
            # state through RAM (and its step counters onto the device). A TieredAdamW's state stays
            # where it is (host RAM and its files), so it is wrapped without placement.
            if tiered_optimizer(optimizer) is not None:
                device_placement = False
            return prepare(optimizer, device_placement=device_placement)

        accelerator.prepare_optimizer = prepare_optimizer

    def _tiered(self) -> Any:
        """The TieredAdamW this Trainer saves by snapshot, or None (Trainer's own path)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_v1_enabled", False):
            return None
        return tiered_optimizer(self.optimizer)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._tiered()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return None
        save_trainer_snapshot(opt, output_dir)
        with warnings.catch_warnings(record=True) as caught:  # as Trainer saves it
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self._tiered()
        if checkpoint is None or opt is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        snapshot = has_trainer_snapshot(checkpoint)
        torch_file = None if snapshot else next((os.path.join(checkpoint, n) for n in TORCH_OPTIMIZER_NAMES
                                                 if os.path.isfile(os.path.join(checkpoint, n))), None)  # fmt: skip
        if not snapshot and torch_file is None:
            raise CorruptStateError(
                f"checkpoint {checkpoint!r} holds no optimizer state (no tierstore_optimizer.json, no "
                "optimizer.pt): it was saved with save_only_model=True, or copied without its optimizer "
                "files. Resume from a checkpoint saved with save_only_model=False, or copy the folder whole"
            )
        # The scheduler is read before the optimizer is loaded: a refused resume leaves the optimizer as it was.
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(scheduler):
            raise CorruptStateError(f"checkpoint {checkpoint!r} has its optimizer state but no {SCHEDULER_NAME}: "
                                    "copy the checkpoint folder whole")  # fmt: skip
        try:
            with warnings.catch_warnings(record=True) as caught:  # as Trainer loads it
                saved = torch.load(scheduler, weights_only=True)
        except UnpicklingError as exc:  # weights_only refused it: torch's message advises weights_only=False
            raise CorruptStateError(
                f"checkpoint {checkpoint!r}: {SCHEDULER_NAME} holds more than tensors and plain values, so it is not "
                "loaded (it could run code); resume from a checkpoint saved by Trainer, or delete the file"
            ) from exc
        if snapshot:
            load_trainer_snapshot(opt, checkpoint)
        else:
            load_torch_optimizer_file(opt, torch_file)
        self.lr_scheduler.load_state_dict(saved)
        reissue_pt_warnings(caught)
        return None
