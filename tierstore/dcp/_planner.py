"""``TieredSavePlanner``: DCP's default save planner with tierstore's blocks put in shard order."""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from ._session import StateTensor

__all__ = ["TieredSavePlanner"]


class TieredSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes tierstore blocks shard by shard.

    DCP writes a tensor's chunks one field after another, which reads a
    parameter's shards once per field when they do not fit the
    :class:`TieredStateful` cache; this planner orders the blocks by shard
    (all fields of a block together) so that every shard is read once.
    Other entries keep their order.

    Example
    -------
    >>> import torch.distributed.checkpoint as dcp
    >>> planner = TieredSavePlanner()  # dcp.save(state, checkpoint_id=path, planner=planner)
    """

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        positions, keyed = [], []
        for n, item in enumerate(plan.items):
            value = self.state_dict.get(item.index.fqn)
            if isinstance(value, StateTensor):
                positions.append(n)
                keyed.append((value._order(item.index), item))
        if not positions:
            return plan
        items = list(plan.items)
        for n, (_, item) in zip(positions, sorted(keyed, key=lambda kv: kv[0])):
            items[n] = item
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan
