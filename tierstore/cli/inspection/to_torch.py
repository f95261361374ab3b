"""``tierstore to-torch DIR OUT.pt``: a torch state dict of a state directory or zarr checkpoint.

The state dict is that of the state's optimizer algorithm's torch class
(``torch.optim.AdamW`` for a ``TieredAdamW``'s state, ``torch.optim.SGD``
for a ``TieredSGD``'s, ...); the line printed names it.

The whole state is built in RAM and saved with ``torch.save``; ``--from-zarr``
converts a zarr checkpoint instead. The output is checked before the state
is read (:func:`~tierstore.cli.paths.file_output_problem`); ``--overwrite``
replaces only a regular file.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore to-torch")
>>> add_arguments(parser)
>>> parser.parse_args(["/tmp/state", "adamw.pt", "--from-zarr"]).from_zarr
True
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import CheckpointExistsError, ConfigError
from .. import EXIT_OK
from ..paths import file_output_problem, flag_text, input_kind, usage_error

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore to-torch``."""
    parser.add_argument("src", help="a tierstore state directory (or, with --from-zarr, a zarr checkpoint)")
    parser.add_argument("out", help="the .pt file to write (torch.save of the state dict of the state's torch class, e.g. torch.optim.AdamW)")
    parser.add_argument("--from-zarr", action="store_true", help="SRC is a zarr checkpoint, not a state directory")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a regular file")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore to-torch``: check the output and the input's kind, convert, save."""
    out = Path(args.out)
    problem = file_output_problem(out, args.overwrite, Path(args.src))
    if problem:
        return usage_error(problem)
    try:
        kind = input_kind(args.src, "to-torch")
    except ConfigError as exc:
        return usage_error(str(exc))
    if not args.from_zarr and kind == "checkpoint":
        return usage_error(f"{args.src} is a zarr checkpoint, not a state directory; pass --from-zarr to convert it")
    if args.from_zarr and kind == "state_dir":
        return usage_error(f"{args.src} is a state directory, not a zarr checkpoint; drop --from-zarr to convert it")
    import torch

    from ...checkpoint import checkpoint_to_state_dict, statedir_to_state_dict, write_output_file

    state_dict = checkpoint_to_state_dict(args.src) if args.from_zarr else statedir_to_state_dict(args.src)
    try:
        write_output_file(out, lambda f: torch.save(state_dict, f), overwrite=args.overwrite)
    except CheckpointExistsError as exc:
        return usage_error(flag_text(exc))
    print(
        f"wrote {out}: a {_torch_class(args.src, args.from_zarr)} state dict, {len(state_dict['state'])} parameter "
        f"states, {len(state_dict['param_groups'])} param groups"
    )
    return EXIT_OK


def _torch_class(src: str, from_zarr: bool) -> str:
    """The torch class whose state dict ``src`` converts to (its layout's algorithm's; read again, it is small)."""
    from ..._layout.layout import Layout
    from ...checkpoint import open_state_reader, read_checkpoint_attributes

    if from_zarr:
        return Layout.from_dict(read_checkpoint_attributes(src)["layout"]).algorithm.torch_class
    with open_state_reader(src) as reader:
        return reader.layout.algorithm.torch_class
