"""Checkpoints inside the trainers people use: the optimizer's part of a trainer checkpoint by snapshot.

- :mod:`tierstore.integrations.snapshot`: the trainer-neutral part (a reference
  file and a zarr snapshot inside the trainer's checkpoint folder; orphans).
- :mod:`tierstore.integrations.hf`: Hugging Face ``Trainer`` (``TieredTrainer``).
- :mod:`tierstore.integrations.lightning`: Lightning (the ``TieredCheckpoints`` callback).
- :mod:`tierstore.integrations.accelerate`: accelerate's ``save_state``/``load_state``
  (``checkpoint_by_snapshot``).
- :mod:`tierstore.integrations.torch_file`: a torch ``optimizer.pt`` streamed in
  through ``torch.load(mmap=True)``.

Each trainer module imports its trainer, so import the one you use; this
package imports none of them.

Example
-------
>>> from tierstore.integrations import snapshot
>>> snapshot.REFERENCE_NAME
'tierstore_optimizer.json'
"""

from __future__ import annotations

__all__: list[str] = []
