"""DTensor (FSDP2) parameters: their local part, and state placed like them.

tierstore keeps the state of each rank's *local* part of a parameter. These
two functions are the only place that knows what a DTensor is; for a plain
tensor they are the identity.

Example
-------
>>> import torch
>>> w = torch.ones(3)
>>> local_tensor(w) is w, placed_like(w, w) is w
(True, True)
"""

from __future__ import annotations

from torch import Tensor


def local_tensor(tensor: Tensor) -> Tensor:
    """The local tensor of a DTensor (FSDP2), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def is_distributed(tensor: Tensor) -> bool:
    """True for a DTensor (a tensor with a local part)."""
    return callable(getattr(tensor, "to_local", None))


def placed_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` as a DTensor placed like the DTensor ``param`` (as torch's AdamW keeps FSDP2 state)."""
    if not is_distributed(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
