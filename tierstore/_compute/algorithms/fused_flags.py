"""torch's implementation flags as a front that runs torch's fused CPU kernel takes them.

``foreach``, ``fused``, ``capturable`` and ``differentiable`` choose how a
torch optimizer runs its update, not what it computes. A tiered front always
runs torch's fused CPU kernel, so:

- ``capturable=True`` (CUDA graph capture) and ``differentiable=True``
  (autograd through the step) have no meaning for an update that runs on the
  CPU outside autograd: refused wherever a param group says so
  (:func:`refuse_cpu_meaningless`), loaded groups included;
- ``fused=False`` asks for another implementation than the one that runs, and
  ``foreach=True`` is what torch refuses beside ``fused=True``: refused when
  the constructor is given them (:func:`refuse_unfused`). A param group's own
  ``foreach``/``fused`` (a loaded one's, say) is kept as a label, as torch
  keeps it, and changes nothing.

Example
-------
>>> refuse_unfused({"foreach": None, "fused": None}, "TieredSGD", "torch.optim.SGD")
>>> refuse_cpu_meaningless({"differentiable": True}, "", "TieredSGD")
Traceback (most recent call last):
...
tierstore.errors.ConfigError: `fused` does not support `differentiable`: differentiable=True asks for autograd through the step, and TieredSGD runs torch's fused kernel on the CPU outside autograd; pass differentiable=False (the default)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError

__all__ = ["refuse_cpu_meaningless", "refuse_unfused"]


def refuse_cpu_meaningless(group: Mapping[str, Any], where: str, front: str) -> None:
    """Refuse ``capturable=True`` and ``differentiable=True`` in ``group`` (``where`` follows the value).

    Raises
    ------
    ConfigError
        Naming the flag and the fix.
    """
    if group.get("capturable", False):
        raise ConfigError(
            f"capturable=True{where}: CUDA graph capture has no meaning for {front}, whose update runs on the "
            "CPU; pass capturable=False (the default)"
        )
    if group.get("differentiable", False):
        raise ConfigError(
            f"`fused` does not support `differentiable`{where}: differentiable=True asks for autograd through "
            f"the step, and {front} runs torch's fused kernel on the CPU outside autograd; pass "
            "differentiable=False (the default)"
        )


def refuse_unfused(values: Mapping[str, Any], front: str, torch_class: str) -> None:
    """Refuse a constructor's ``fused=False`` and ``foreach=True`` (torch's order: ``foreach`` after ``differentiable``).

    Raises
    ------
    ConfigError
        Naming the flag and the fix.
    """
    if values.get("fused") is False:
        raise ConfigError(
            f"fused=False: {front} always runs torch's fused CPU kernel (its results are {torch_class}"
            "(fused=True)'s, bit for bit); pass fused=None or fused=True"
        )
    if values.get("foreach"):
        raise ConfigError(
            f"`fused` and `foreach` cannot be `True` together: {front} always runs torch's fused CPU kernel; "
            "pass foreach=None (the default) or foreach=False"
        )
