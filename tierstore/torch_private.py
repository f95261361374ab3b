"""Every private API of torch (and of the standard library) tierstore calls, in one place.

Private names change between releases without notice. Each is reached
through a function here that checks it exists and either falls back to a
public equivalent or raises :class:`~tierstore.errors.ConfigError` naming the
API, the installed version and the fix, so a torch release that drops one
fails in one known place instead of deep inside a step.

Example
-------
>>> cpu_capability() in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "SVE"} or cpu_capability()
True
"""

from __future__ import annotations

import functools

import torch

from .errors import ConfigError


def _missing(name: str, fix: str) -> ConfigError:
    return ConfigError(
        f"torch {torch.__version__} has no {name}, which tierstore needs; {fix} "
        f"(tierstore is tested with torch 2.13)"
    )


@functools.cache
def cpu_capability() -> str:
    """The CPU capability torch's kernels dispatch to in this process (``"DEFAULT"``, ``"AVX2"``, ``"AVX512"``, ...).

    ``ATEN_CPU_CAPABILITY`` lowers it; the answer is fixed for the process.
    Where torch has no ``torch.backends.cpu.get_cpu_capability`` the answer
    is ``"unknown"``, which no compiled-kernel recipe matches (the torch path
    then runs).
    """
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if get is None:
        return "unknown"
    return str(get())
