"""``tierstore.diagnose``: where does training memory peak, and what would lower it?

One training iteration is run and measured phase by phase: after the model
is loaded (the call's starting point), after the forward pass, after the
backward pass, at the optimizer step, and over a second, steady iteration
(the optimizer state now exists while activations are alive: what training
really sees). On a GPU the numbers come from ``torch.cuda`` memory stats; on
the CPU from the process RSS.

The report keeps apart what it **measured** (the phases, the peak, the
process baseline, the forward pass's growth), what it **counted** (exact
tensor bytes: weights, gradients, the optimizer's state, what autograd saved
for backward) and what it **estimated** (what offloading or a smaller batch
would save, a suggested ``ram_budget``): every figure says which, and the
advice tags each number it quotes. The verdict compares the two parts a user
can change:

- **optimizer state** (after a real step of ``torch.optim.AdamW``, or of the
  optimizer a factory builds): :class:`~tierstore.TieredAdamW` moves it off
  the GPU, or on the CPU keeps a ``ram_budget`` of it in RAM and streams the
  rest from disk; the peak's drop is estimated net of TieredAdamW's own RAM
  (its arena and fixed overhead, from the planner's arithmetic);
- **activations**: the larger of the forward pass's measured growth and the
  bytes autograd saved for backward (on the CPU, RSS can under-report because
  freed heap memory is reused); activation checkpointing or a smaller batch
  pays.

Weights and gradients are reported too; when they outweigh both, neither
remedy helps much and the advice says so. One module per job:

- :mod:`~tierstore.diagnose.probes`: what memory is measured with;
- :mod:`~tierstore.diagnose.measure`: the iteration, phase by phase
  (:func:`diagnose`, :func:`default_loss`);
- :mod:`~tierstore.diagnose.verdict`: which part to attack, and the estimates;
- :mod:`~tierstore.diagnose.report`: the records and how they print
  (:class:`MemoryReport`, :class:`Figure`, :class:`Phase`);
- :mod:`~tierstore.diagnose.factory`: a ``--model`` factory's result as
  ``(model, batch, loss_fn)``.

The command ``tierstore diagnose`` is :mod:`tierstore.cli.diagnose`.

Example
-------
>>> import torch
>>> model = torch.nn.Linear(256, 256)
>>> report = diagnose(model, torch.randn(4, 256), lambda m, b: m(b).square().mean())
>>> report.optimizer_state_bytes >= 2 * report.param_bytes, report.dominant
(True, 'optimizer_state')
>>> report.figure("optimizer state").kind, report.figure("peak").kind, report.figure("peak drop with TieredAdamW").kind
('counted', 'measured', 'estimated')
"""

from __future__ import annotations

from .factory import build_from_factory
from .measure import default_loss, diagnose
from .probes import CudaProbe, RssProbe, probe_for
from .report import Figure, MemoryReport, Phase

__all__ = [
    "diagnose",
    "MemoryReport",
    "Phase",
    "Figure",
    "default_loss",
    "build_from_factory",
    "CudaProbe",
    "RssProbe",
    "probe_for",
]
