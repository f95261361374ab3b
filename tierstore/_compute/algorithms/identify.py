"""Whose state is this? The registered algorithms a torch state dict's keys belong to.

A torch optimizer state dict does not name its optimizer, but its keys do:
a parameter's entry holds the algorithm's state keys (SGD's
``momentum_buffer``, Adagrad's ``sum``), a param group the algorithm's
hyperparameters (AdamW's ``betas``, SGD's ``momentum``). A state dict
loaded into an optimizer of another algorithm is refused with both names
(:func:`foreign_state`), where these keys tell the algorithms apart: Adam
and AdamW keep the same keys, and torch's AdamW loads Adam's state itself.

Only registered algorithms (:data:`tierstore._compute.algorithms.ALGORITHMS`)
are recognised; a key no algorithm keeps is the user's own, carried as
torch carries it.

Example
-------
>>> from tierstore._compute.algorithms import ADAMW
>>> state_owners({"step", "exp_avg", "exp_avg_sq"}, ADAMW), group_owners({"lr": 0.1, "betas": (0.9, 0.99)}, ADAMW)
([], [])
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ...errors import ConfigError
from .base import NUMBER, PAIR, Algorithm

__all__ = ["state_owners", "group_owners", "required_group_keys", "foreign_state", "check_loaded_group"]

MASTER_KEY = "master_param"  # tierstore's own key (tierstore._layout.layout.MASTER_KEY), in every algorithm's state


def _registered() -> list[Algorithm]:
    # Read at each call: the registry is the package's (a test may register an algorithm of its own).
    from . import ALGORITHMS

    return list(ALGORITHMS.values())


def state_owners(keys: Collection[str], mine: Algorithm) -> list[Algorithm]:
    """The registered algorithms other than ``mine`` whose torch state a parameter's entry with ``keys`` is.

    Empty when the entry holds no state key that ``mine`` lacks and another
    algorithm keeps (other keys are the user's). Where some of them find
    every field they always keep in the entry, only those are named (SGD's
    ``momentum_buffer`` alone is SGD's, not RMSprop's, which always keeps
    ``square_avg``), the one with the fewest fields first.
    """
    keys = set(keys)
    own = {*mine.field_names, *mine.state_scalars, MASTER_KEY}
    known = {f for a in _registered() for f in a.field_names}
    foreign = (keys & known) - own
    if not foreign:
        return []
    owners = [a for a in _registered() if a is not mine and foreign <= set(a.field_names)]
    complete = [a for a in owners if set(a.required_fields()) <= keys]
    return sorted(complete or owners, key=lambda a: len(a.fields))


def required_group_keys(algorithm: Algorithm) -> list[str]:
    """The hyperparameters every param group of ``algorithm`` holds (its numbers and pairs)."""
    return [k for k, kind in algorithm.group_kinds.items() if kind in (NUMBER, PAIR)]


def group_owners(group: Mapping[str, Any], mine: Algorithm) -> list[Algorithm]:
    """The registered algorithms other than ``mine`` whose param group ``group`` is, when it is not ``mine``'s.

    Empty when ``group`` holds every hyperparameter ``mine``'s groups hold, or
    no other algorithm's; else each algorithm whose groups' hyperparameters it holds.
    """
    if all(k in group for k in required_group_keys(mine)):
        return []
    return [a for a in _registered() if a is not mine and required_group_keys(a)
            and all(k in group for k in required_group_keys(a))]  # fmt: skip


def foreign_state(owners: list[Algorithm], mine: Algorithm, what: str, fix: str = "") -> str:
    """The message refusing ``what`` (a state dict, a parameter's entry) as another algorithm's state.

    Several ``owners`` (algorithms with the same keys) are all named.

    Example
    -------
    >>> from tierstore._compute.algorithms.adamw import ADAMW, AdamW
    >>> class SGD(AdamW): name, front, torch_class = "sgd", "TieredSGD", "torch.optim.SGD"
    >>> print(foreign_state([SGD()], ADAMW, "the loaded state of parameter 0 (momentum_buffer)"))
    ... # doctest: +NORMALIZE_WHITESPACE
    the loaded state of parameter 0 (momentum_buffer) is torch.optim.SGD state, as TieredSGD (sgd) keeps it; this is
    TieredAdamW (adamw): load it into a TieredSGD (or torch.optim.SGD), or load a state dict of TieredAdamW or
    torch.optim.AdamW
    """
    classes = " or ".join(a.torch_class for a in owners)
    labels = " or ".join(a.label for a in owners)
    fronts = " or ".join(f"a {a.front} (or {a.torch_class})" for a in owners)
    fix = fix or f"load it into {fronts}, or load a state dict of {mine.front} or {mine.torch_class}"
    return f"{what} is {classes} state, as {labels} keeps it; this is {mine.label}: {fix}"


def check_loaded_group(group: Mapping[str, Any], algorithm: Algorithm, where: str) -> None:
    """Refuse a param group loaded from a torch state dict that is not ``algorithm``'s, then check its values.

    ``where`` names the group (``"loaded group 1"``).

    Raises
    ------
    ConfigError
        If the group is another registered algorithm's (both named), lacks a
        hyperparameter every group of ``algorithm`` holds, or holds a value its
        torch class refuses (:meth:`~tierstore._compute.algorithms.base.Algorithm.check_group`).

    Example
    -------
    >>> from tierstore._compute.algorithms import ADAMW
    >>> check_loaded_group({"lr": 0.1, "eps": 1e-8, "weight_decay": 0.0}, ADAMW, "loaded group 0")
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: loaded group 0 has no ['betas'], which every param group of torch.optim.AdamW holds; load a state dict of TieredAdamW or torch.optim.AdamW
    """
    owners = group_owners(group, algorithm)
    if owners:
        keys = sorted(str(k) for k in group if k != "params")
        raise ConfigError(foreign_state(owners, algorithm, f"{where} (hyperparameters {keys})"))
    missing = [k for k in required_group_keys(algorithm) if k not in group]
    if missing:
        raise ConfigError(
            f"{where} has no {missing}, which every param group of {algorithm.torch_class} holds; load a state "
            f"dict of {algorithm.front} or {algorithm.torch_class}"
        )
    algorithm.check_group(group, f" in {where}")
