"""``tierstore inspect | verify | export | to-torch``: look into a state directory without the model.

One module per command, each with ``add_arguments(parser)`` and ``run(args)``:

- :mod:`~tierstore.cli.inspection.inspect`: the committed step, whether the
  state is clean and durable, the layout, bytes per tier, the param groups;
- :mod:`~tierstore.cli.inspection.verify`: every checksum of the committed
  copies (errors) and of the intact stale copies (warnings); every chunk of
  a zarr checkpoint; every snapshot of trainer checkpoints;
- :mod:`~tierstore.cli.inspection.export`: the committed state streamed into
  a zarr v3 checkpoint;
- :mod:`~tierstore.cli.inspection.to_torch`: a state dict of the state's torch class (``torch.optim.AdamW``'s for a ``TieredAdamW``).

Every command stands on :class:`~tierstore._state.reader.StateReader` (the
manifest and the committed copy of each shard, verified) or on a zarr
checkpoint; none needs the optimizer, the model or a GPU. Every input is
classified before it is read and every output checked before anything is
written (:mod:`tierstore.cli.paths`): a path that does not exist, a file
where a directory is needed or a directory that is neither kind is a usage
error (exit 2) that names the path; a damaged or crafted input ends in one
line naming the file and exit 1. Outputs are written beside their target and
renamed over it. No module imports torch before its command runs, so each
command's ``--help`` answers fast.

The names this module had before it was split into one module per command
(``run_verify``, ``add_inspect_arguments``, ``describe_statedir``, ...)
still import from here.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore verify")
>>> add_verify_arguments(parser)
>>> parser.parse_args(["/tmp/state"]).dir
'/tmp/state'
"""

from __future__ import annotations

from .. import EXIT_FAILED as EXIT_ERROR
from .. import EXIT_OK, EXIT_USAGE
from ..paths import input_kind
from .export import add_arguments as add_export_arguments
from .export import run as run_export
from .inspect import add_arguments as add_inspect_arguments
from .inspect import describe_checkpoint, describe_statedir
from .inspect import run as run_inspect
from .to_torch import add_arguments as add_to_torch_arguments
from .to_torch import run as run_to_torch
from .verify import DAMAGED, EXIT_CORRUPT, EXIT_STALE_ONLY
from .verify import add_arguments as add_verify_arguments
from .verify import run as run_verify

__all__ = [
    "input_kind",
    "describe_statedir",
    "describe_checkpoint",
    "add_inspect_arguments",
    "run_inspect",
    "add_verify_arguments",
    "run_verify",
    "add_export_arguments",
    "run_export",
    "add_to_torch_arguments",
    "run_to_torch",
    "DAMAGED",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_CORRUPT",
    "EXIT_USAGE",
    "EXIT_STALE_ONLY",
]
