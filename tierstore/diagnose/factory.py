"""What a ``--model`` factory returns, as ``(model, batch, loss_fn)``: :func:`build_from_factory`.

Example
-------
>>> import torch
>>> batch = to_device({"x": torch.ones(2), "n": 3}, torch.device("cpu"))
>>> batch["x"].device.type, batch["n"]
('cpu', 3)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._platform.factory import resolve
from ..errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: `tierstore diagnose --help` stays fast
    import torch
    from torch import nn

__all__ = ["build_from_factory", "to_device"]


def build_from_factory(spec: str, *, batch_size: int | None = None) -> tuple[nn.Module, Any, Callable | None]:
    """Call a ``--model`` factory and normalise what it returns to ``(model, batch, loss_fn)``.

    The factory may return ``(model, batch, loss_fn)``, ``(model, batch)``
    (the loss then comes from the model's output, see
    :func:`~tierstore.diagnose.default_loss`), or a model with an
    ``example_input_array`` attribute (Lightning's convention) used as the
    batch. With ``batch_size`` the factory is called as
    ``factory(batch_size=N)`` and must accept that keyword.

    Raises
    ------
    ConfigError
        If the factory cannot be called so, fails, or returns something else.

    Example
    -------
    >>> build_from_factory("torch.nn:Identity")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: --model 'torch.nn:Identity' returned a model without a batch; ...
    """
    from torch import nn

    factory = resolve(spec, flag="--model")
    kwargs = {}
    if batch_size is not None:
        try:
            takes = "batch_size" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            takes = True
        if not takes:
            raise ConfigError(f"--batch-size given, but {spec} takes no batch_size argument; add one or drop --batch-size")
        kwargs["batch_size"] = batch_size
    try:
        made = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"--model {spec!r}: calling it failed: {exc!r}") from None
    if isinstance(made, nn.Module):
        if not hasattr(made, "example_input_array"):
            raise ConfigError(
                f"--model {spec!r} returned a model without a batch; return (model, batch, loss_fn) or "
                "(model, batch), or give the model an example_input_array"
            )
        return made, made.example_input_array, None
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        return made[0], made[1], made[2] if len(made) == 3 else None
    raise ConfigError(
        f"--model {spec!r} returned {type(made).__name__}; expected (model, batch, loss_fn), (model, batch) "
        "or a model with example_input_array"
    )


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (in dicts, lists and tuples too) moved to ``device``."""
    from torch import Tensor

    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj
