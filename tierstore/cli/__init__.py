"""The ``tierstore`` command: one subcommand per module, parsed with ``argparse``.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported only when their subcommand
runs, so ``tierstore --help`` stays fast.

Every failure ends in one line on stderr and an exit status, never a
traceback (:data:`EXIT_STATUS`, shown by ``--help``): 0 ok, 1 a check failed
or an input is damaged (a tierstore error about what was read), 2 a usage
error or missing input (argparse's own errors, a value tierstore cannot use:
:class:`~tierstore.errors.ConfigError`, an output that exists, a path that
does not exist). An error that is not tierstore's is reported as a bug with
its type, and ``-vv`` shows its traceback.

Example
-------
>>> main(["--version"])  # doctest: +SKIP
tierstore 0.1.0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import CheckpointExistsError, ConfigError, TierstoreError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_FAILED = 1  # a check failed (verify found damage, demo found a difference), or an input is damaged
EXIT_USAGE = 2  # a usage error or missing input: bad flags or values, no such path, an existing output
EXIT_STATUS = (
    "exit status: 0 ok; 1 a check failed (verify found damage) or an input is damaged; 2 usage error or "
    "missing input (bad flags or values, no such directory, a file where a directory is needed, an output "
    "that exists without --overwrite). Some commands add their own (see COMMAND --help): verify 3 when only "
    "stale copies are damaged, plan 3 with --fail-if-not-fit."
)

# name -> (module, one-line help). Nested "bench" commands use "bench io" style names.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tierstore.cli.demo.run", "train a small transformer with a tight ram_budget and compare with torch AdamW"),
    "bench io": ("tierstore.cli.bench.io", "read/write bandwidth of the drive behind --dir, per backend and setting"),
    "bench step": ("tierstore.cli.bench.step", "time per optimizer step in RAM and on disk against torch AdamW"),
    "plan": ("tierstore.cli.plan", "memory, I/O and drive-wear arithmetic for a model before training it"),
    "tune": ("tierstore.cli.tune", "measure the drives and the CPU, write a knobs file TieredAdamW(knobs=FILE) reads"),
    "inspect": ("tierstore.cli.inspection.inspect", "show the committed step, layout, tiers and hyperparameters of a state directory"),
    "verify": ("tierstore.cli.inspection.verify", "check every checksum of a state directory (non-zero exit on corruption)"),
    "export": ("tierstore.cli.inspection.export", "stream a state directory into a zarr v3 checkpoint"),
    "to-torch": ("tierstore.cli.inspection.to_torch", "convert a state directory into its torch class's state dict (.pt): torch.optim.AdamW's for TieredAdamW"),
    "move": ("tierstore.cli.move", "copy a state onto another set of drives (more, fewer, others), shard by shard within a RAM budget"),
    "diagnose": ("tierstore.cli.diagnose", "measure where training memory peaks for a module factory"),
}


def _available(module: str) -> bool:
    """Whether ``module`` is installed, found without importing it or its parent packages.

    ``importlib.util.find_spec("a.b.c")`` imports ``a.b``; walking the
    search path part by part keeps ``tierstore plan --help`` from importing
    the packages of other commands (``tierstore.cli.bench``).
    """
    root, *parts = module.split(".")
    try:
        spec = importlib.util.find_spec(root)
    except (ImportError, ValueError):
        return False
    for part in parts:
        locations = None if spec is None else spec.submodule_search_locations
        if not locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(locations))
    return spec is not None


def _requested(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (``"plan"``, ``"bench step"``), or ``None`` (``--help``, ``--version``, none).

    >>> _requested(["-v", "bench", "step", "--dir", "x"]), _requested(["--version"]), _requested(["plan"])
    ('bench step', None, 'plan')
    """
    words = [a for a in argv if not a.startswith("-")][:2]
    for n in (2, 1):
        if len(words) >= n and " ".join(words[:n]) in COMMANDS:
            return " ".join(words[:n])
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``tierstore`` parser; only the command ``argv`` names gets its arguments (and its module imported).

    A command's module is what imports torch, so ``tierstore --help`` and
    ``--version`` import none of them. ``argv=None``: every command's arguments.
    """
    wanted = None if argv is None else _requested(argv)
    parser = argparse.ArgumentParser(
        prog="tierstore", description="Tiered AdamW optimizer state: RAM + local disk.", epilog=EXIT_STATUS
    )
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
        cmd.set_defaults(_module=module, _name=parts[-1])
        if argv is not None and name != wanted:
            continue  # not asked for: its module stays unimported
        mod = importlib.import_module(module)
        add = getattr(mod, f"add_{parts[-1].replace('-', '_')}_arguments", None) or mod.add_arguments
        add(cmd)
        cmd.epilog = cmd.epilog or EXIT_STATUS  # a command with codes of its own lists them all
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
    except (ConfigError, CheckpointExistsError) as exc:  # a value or path given cannot be used
        return _fail(exc, EXIT_USAGE)
    except TierstoreError as exc:
        return _fail(exc, EXIT_FAILED)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`tierstore inspect DIR | head`): exit quietly, as Unix tools do.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return 141
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError) as exc:  # a path given
        return _fail_path(exc, EXIT_USAGE)
    except OSError as exc:  # the environment: permissions, a full or failing drive
        return _fail_path(exc, EXIT_FAILED)
    except Exception as exc:
        if args.verbose >= 2:
            raise
        print(
            f"tierstore: internal error: {type(exc).__name__}: {_one_line(exc)}; this is a bug in tierstore: "
            "rerun with -vv to see where it happened, and report it",
            file=sys.stderr,
        )
        return EXIT_FAILED


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _fail(exc: BaseException, code: int) -> int:
    print(f"tierstore: error: {_one_line(exc)}", file=sys.stderr)
    return code


#: What to do about an OS error on a path the user gave (the commands check their paths first; this is the net).
_PATH_ADVICE = {
    FileNotFoundError: "does not exist; check the path",
    NotADirectoryError: "a part of this path is a file, not a directory; pass a path whose folders are directories",
    IsADirectoryError: "is a directory where a file is needed; pass a file path",
    FileExistsError: "already exists; choose another path, remove it, or pass --overwrite where the command has it",
    PermissionError: "permission denied; pass a path you may read and write",
}


def _path_message(exc: OSError) -> str:
    """An OS error as one line that names the path and what to do, instead of ``[Errno 17] File exists: 'x'``.

    >>> _path_message(FileExistsError(17, "File exists", "out.json"))
    "'out.json' already exists; choose another path, remove it, or pass --overwrite where the command has it"
    """
    advice = next((text for kind, text in _PATH_ADVICE.items() if isinstance(exc, kind)), None)
    if exc.filename is None or advice is None:
        return _one_line(exc)
    return f"{str(exc.filename)!r} {advice}"


def _fail_path(exc: OSError, code: int) -> int:
    print(f"tierstore: error: {_path_message(exc)}", file=sys.stderr)
    return code

