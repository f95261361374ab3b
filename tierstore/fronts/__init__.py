"""The tiered fronts of torch's elementwise optimizers besides AdamW, one module each.

Each front is a :class:`~tierstore.tiered_optimizer.TieredOptimizer` subclass
with its torch class's constructor and one registered algorithm
(:mod:`tierstore._compute.algorithms`); ``TieredAdamW`` lives in
:mod:`tierstore.optimizer`. ``tierstore`` exports every front.
"""

from __future__ import annotations

from .adadelta import TieredAdadelta
from .adagrad import TieredAdagrad
from .adam import TieredAdam
from .adamax import TieredAdamax
from .generic import TieredGeneric, tiered
from .lion import TieredLion
from .nadam import TieredNAdam
from .radam import TieredRAdam
from .rmsprop import TieredRMSprop
from .sgd import TieredSGD

__all__: list[str] = [
    "TieredAdadelta", "TieredAdagrad", "TieredAdam", "TieredAdamax", "TieredGeneric", "TieredLion", "TieredNAdam",
    "TieredRAdam", "TieredRMSprop", "TieredSGD", "tiered",
]  # fmt: skip
