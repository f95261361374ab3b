"""``torch.distributed.checkpoint`` (DCP) for the tiered optimizers, streamed shard by shard.

:class:`TieredStateful` is a DCP ``Stateful``: put it in the dict given to
``dcp.save``/``dcp.load`` and the optimizer's state is written and read in
the FQN-keyed layout of its algorithm's torch class (what
``get_optimizer_state_dict`` produces; here ``torch.optim.AdamW``'s)::

    {"state": {fqn: {"step", "exp_avg", "exp_avg_sq", ["max_exp_avg_sq"], ["master_param"]}},
     "param_groups": [{..., "params": [fqn, ...]}],
     "tierstore_step_count": int64 scalar}

(another algorithm's fields instead of the moments, ``step`` only where its
torch class keeps one, and ``"tierstore_algorithm": name`` for any algorithm
but AdamW, so that state loads only into an optimizer of its algorithm).

Every moment is presented with its *global* shape and the offsets of this
rank's part (FSDP2's ``DTensor`` shard, a ``ZeroRedundancyOptimizer``
partition, or the whole tensor), so DCP reshards it on load: a checkpoint
written by 2 ranks loads on 1 and back, and loads into (or from)
``torch.optim.AdamW`` under ``get/set_optimizer_state_dict``.

Nothing is materialised up front. The values are placeholders (tensor
subclasses without storage) implementing DCP's ``_Checkpointable`` hooks,
so the *default* planners work:

- save: each rank's part is cut into blocks: boxes of at most 2 MiB that
  are contiguous in memory and lie in one optimizer shard. DCP asks for one
  block at a time (``__get_tensor_shard__``); the block's shard is visited
  through the optimizer's arena (``visit_shards``: the shard stays in its
  arena slot for the blocks after it) and copied into a reused buffer
  (:class:`~tierstore._storage.dcp_memory.BlockRing`) that DCP's writer writes out
  before it asks for the next block. :class:`TieredSavePlanner` orders the
  blocks so that every shard is read once.
- load: DCP copies each piece it reads into a staging file (a shared,
  unlinked memory map in the state directory, the size of this rank's
  state); ``load_state_dict`` then streams it into the shards and commits.
  Pages leave the process once filled and once streamed
  (:class:`~tierstore._storage.dcp_memory.Staging`).

RAM beyond ``ram_budget`` (inside tierstore's fixed 16 MiB overhead):
saving, one 2 MiB block buffer per writer thread; loading, the chunk DCP's
reader unpickles (it keeps the previous one until the next is read: two
blocks) and the staged piece being filled. Torch's plan and metadata add
about 2 KB per block (0.1% of the state) during either. A writer that copies
ahead (``FileSystemWriter`` on a GPU host with ``thread_count=1``) keeps up to
twice ``per_thread_copy_ahead`` bytes of blocks (one warning; pass
``per_thread_copy_ahead=0``). Loading needs room on the state directory's
drive for one more copy of the rank's state, and its page cache.
Details in ``docs/distributed.md``.

The package's modules, one job each: ``_stateful`` (:class:`TieredStateful`:
its state dict and the load into the shards), ``_session`` (the placeholders
and the session that serves their hooks), ``_parts`` (each parameter's part:
FQN, global box, blocks), ``_staging`` (the load's staging-file tensor) and
``_planner`` (:class:`TieredSavePlanner`).

Example
-------
>>> import tempfile, torch
>>> import torch.distributed.checkpoint as dcp
>>> from tierstore import TieredAdamW
>>> model = torch.nn.Linear(4, 3)
>>> path = tempfile.mkdtemp()
>>> with TieredAdamW(model.parameters(), lr=0.1) as opt:
...     model(torch.ones(2, 4)).sum().backward(); _ = opt.step()
...     _ = dcp.save({"optim": TieredStateful(opt, model)}, checkpoint_id=path, no_dist=True)
>>> sd = {"optim": {"state": {"weight": {"exp_avg": torch.zeros(3, 4)}}}}
>>> dcp.load(sd, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
>>> sd["optim"]["state"]["weight"]["exp_avg"][0].tolist()
[0.20000000298023224, 0.20000000298023224, 0.20000000298023224, 0.20000000298023224]
"""

from __future__ import annotations

from ._planner import TieredSavePlanner
from ._session import Stats
from ._stateful import ALGORITHM_KEY, STEP_COUNT_KEY, TieredStateful

__all__ = ["TieredStateful", "TieredSavePlanner", "Stats", "STEP_COUNT_KEY", "ALGORITHM_KEY"]
