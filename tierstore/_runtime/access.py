"""The access protocol adapters use: visit the shards, replace the shards.

Checkpoint formats (:mod:`tierstore.checkpoint`), DCP (:mod:`tierstore.dcp`)
and anything else that moves a ``TieredAdamW``'s whole state in or out do it
through this public, documented protocol, never through the optimizer's
private methods, and never import the optimizer (so no import cycle can
form). ``TieredAdamW`` implements it.

- :meth:`ShardAccess.visit_shards` calls ``visit(shard, flat)`` once per
  shard with the shard's current fp32 values (all its fields back to back,
  see :meth:`~tierstore._layout.layout.Layout.field_view`), read-only. Disk shards
  stream through the optimizer's arena, so a visit needs no RAM beyond the
  optimizer's budget; ``flat`` is valid only during the call. It returns
  how many shards it read from the drive: the shards visited last stay in
  their arena slots, and visiting one of them again reads nothing.
  In a compressed moment format the values are decoded first.
- :meth:`ShardAccess.visit_stored` calls ``visit(shard, extent)`` with the
  shard's stored bytes instead (the extent, in the layout's moment format,
  see :meth:`~tierstore._layout.layout.Layout.stored_field`): what a checkpoint of
  the same format copies without decoding.
- :meth:`ShardAccess.replace_shards` calls ``fill(shard, flat)`` once per
  shard; ``fill`` must set every element (``flat`` arrives with stale
  bytes), and in a compressed format the values are then encoded (with
  ``stored=True``, ``fill`` gets the extent and sets every stored byte).
  Then step counts (and the scalars besides them, ``param_scalars``: NAdam's
  ``mu_product``), param-group hyperparameters and ``step_count`` are
  replaced, master copies are seeded from the parameters (or the parameters
  take the loaded master values), and the result is committed as one step.
  A failure part-way leaves the optimizer refusing use; the committed state
  on disk is untouched.

Example
-------
>>> import torch
>>> from tierstore import TieredAdamW
>>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.ones(4)
>>> with TieredAdamW([w], lr=0.1) as opt:
...     _ = opt.step()
...     sums = []
...     _ = opt.visit_shards(lambda shard, flat: sums.append(float(opt.layout.field_view(flat, shard, "exp_avg").sum())))
>>> isinstance(opt, ShardAccess), [round(s, 3) for s in sums]
(True, [0.4])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from .._layout.layout import Layout, ShardSpec

ShardVisit = Callable[[ShardSpec, Tensor], object]


@runtime_checkable
class ShardAccess(Protocol):
    """What an adapter may use of an optimizer whose state lives in shards."""

    @property
    def layout(self) -> Layout:
        """The state's layout: parameters, shards, fields."""

    @property
    def step_count(self) -> int:
        """Completed steps (the step a checkpoint records)."""

    @property
    def state_dir(self) -> str | None:
        """The state directory, or ``None`` when all state lives in RAM."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups, as ``torch.optim.Optimizer`` has them."""

    def param_steps(self) -> list[float | None]:
        """Each parameter's step count in layout order (``None`` before its first)."""

    def param_scalars(self) -> dict[str, list[float | None]] | None:
        """Each parameter's scalars besides its step, ``{name: [value or None per parameter]}`` in layout
        order (NAdam's ``mu_product``; :mod:`tierstore._layout.scalar_record`), ``None`` where the
        algorithm keeps none. An adapter records them beside :meth:`param_steps`."""

    def check_usable(self) -> None:
        """Raise ``ClosedError``/``StepFailedError`` if the state cannot be read or replaced."""

    def visit_shards(self, visit: ShardVisit, shards: Iterable[int] | None = None) -> int:
        """Call ``visit(shard, flat)`` with every shard's current fp32 values (or those listed), read-only; return the shards read."""

    def visit_stored(self, visit: ShardVisit, shards: Iterable[int] | None = None) -> None:
        """Call ``visit(shard, extent)`` with every shard's stored bytes (or those listed), read-only."""

    def replace_shards(
        self,
        fill: ShardVisit,
        *,
        param_steps: dict[int, float],
        groups: list[dict[str, Any]] | None = None,
        masters_given: set[int] | None = None,
        step_count: int | None = None,
        stored: bool = False,
        param_scalars: dict[str, list[float | None]] | None = None,
    ) -> None:
        """Overwrite the whole state shard by shard, then its steps (and ``param_scalars``, as
        :meth:`param_scalars` gives them: needed where the algorithm keeps some) and groups, and commit it."""
