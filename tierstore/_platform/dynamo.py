"""``torch._disable_dynamo`` that does not import ``torch._dynamo`` while nothing compiles.

``torch.optim.Optimizer`` marks ``add_param_group``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` with ``torch._disable_dynamo``, whose
first call imports ``torch._dynamo``: about 820 modules and 70 MiB of RSS
with torch 2.13 (measured: 45 MiB of Python object arenas, 22 MiB of malloc
heap, 3 MiB of library pages). ``Optimizer.__init__`` calls
``add_param_group``, so building *any* torch optimizer pays it, and for a
TieredAdamW with a small ``ram_budget`` that is most of the RSS it adds.

While ``torch._dynamo`` has not been imported nothing can be compiling, so
"run this function eagerly, never trace it" holds by itself: call the
function directly. Once something imports ``torch._dynamo`` (``torch.compile``
does), delegate to ``torch._disable_dynamo`` as torch does.

Example
-------
>>> import torch
>>> @disable_dynamo
... def add_one(x):
...     return x + 1
>>> int(add_one(torch.tensor(1)))
2
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from . import torch_private

F = TypeVar("F", bound=Callable[..., Any])

# The code object of torch._disable_dynamo's wrapper, to recognise (and unwrap) only that decorator
# (None where torch has no _disable_dynamo: then nothing is unwrapped).
_TORCH_WRAPPER_CODE = torch_private.disable_dynamo_wrapper_code()


def disable_dynamo(fn: F) -> F:
    """``fn`` never traced by dynamo, without importing dynamo while nothing uses it.

    Also accepts a function already wrapped by ``torch._disable_dynamo``
    (such as ``torch.optim.Optimizer.zero_grad``): its original is called
    while dynamo is absent. Other decorators are kept.
    """
    wrapped = _TORCH_WRAPPER_CODE is not None and getattr(fn, "__code__", None) is _TORCH_WRAPPER_CODE
    plain = fn.__wrapped__ if wrapped else fn
    disabled: list[Callable[..., Any]] = []  # torch's wrapper, made on the first call after dynamo arrives

    @functools.wraps(plain)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return plain(*args, **kwargs)
        if not disabled:
            disabled.append(torch_private.disable_dynamo(plain))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]
