"""The ``tierstore`` command: one subcommand per module, parsed with ``argparse``.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported only when their subcommand
runs, so ``tierstore --help`` stays fast.

Example
-------
>>> main(["--version"])  # doctest: +SKIP
tierstore 0.1.0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from ._version import __version__
from .errors import TierstoreError

# name -> (module, one-line help). Nested "bench" commands use "bench io" style names.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tierstore.demo.run", "train a small transformer with a tight ram_budget and compare with torch AdamW"),
    "bench io": ("tierstore.benchmarks.io", "read/write bandwidth of the drive behind --dir, per backend and setting"),
    "bench step": ("tierstore.benchmarks.step", "time per optimizer step in RAM and on disk against torch AdamW"),
    "plan": ("tierstore.planner", "memory and I/O arithmetic for a model before training it"),
    "inspect": ("tierstore.inspection", "show the committed step, layout, tiers and hyperparameters of a state directory"),
    "verify": ("tierstore.inspection", "check every checksum of a state directory (non-zero exit on corruption)"),
    "export": ("tierstore.inspection", "stream a state directory into a zarr v3 checkpoint"),
    "to-torch": ("tierstore.inspection", "convert a state directory into a torch.optim.AdamW state dict (.pt)"),
    "diagnose": ("tierstore.diagnose", "measure where training memory peaks for a module factory"),
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered AdamW optimizer state: RAM + local disk.")
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    nested: dict[str, argparse._SubParsersAction] = {}
    for name, (module, help_text) in COMMANDS.items():
        if not _available(module):
            continue
        parts = name.split()
        target = sub
        if len(parts) == 2:
            if parts[0] not in nested:
                group = sub.add_parser(parts[0], help=f"{parts[0]} commands")
                nested[parts[0]] = group.add_subparsers(dest="subcommand", metavar="WHAT")
                group.set_defaults(_group_parser=group)
            target = nested[parts[0]]
        cmd = target.add_parser(parts[-1], help=help_text, description=help_text)
        mod = importlib.import_module(module)
        add = getattr(mod, f"add_{parts[-1].replace('-', '_')}_arguments", None) or mod.add_arguments
        add(cmd)
        cmd.set_defaults(_module=module, _name=parts[-1])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "_module", None) is None:
        group = getattr(args, "_group_parser", None)
        (group or parser).print_help()
        return 2
    mod = importlib.import_module(args._module)
    run = getattr(mod, f"run_{args._name.replace('-', '_')}", None) or mod.run
    try:
        return int(run(args) or 0)
    except TierstoreError as exc:
        print(f"tierstore: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tierstore inspect DIR | head`): exit quietly, as Unix tools do.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
