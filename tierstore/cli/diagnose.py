"""``tierstore diagnose``: build a model from a factory, measure one training iteration, print the report.

The measuring is :func:`tierstore.diagnose.diagnose`; this module parses the
flags (without importing torch, so ``--help`` answers fast), builds the model
and batch from ``--model`` and prints the report as text or JSON.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore diagnose")
>>> add_arguments(parser)
>>> parser.parse_args(["--model", "mlp.py:build", "--batch-size", "64"]).batch_size
64
"""

from __future__ import annotations

import argparse
import json

from .._platform.factory import resolve
from ..errors import ConfigError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore diagnose``."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a factory returning (model, batch, loss_fn), (model, batch), or a model with example_input_array; "
        "loss_fn(model, batch) returns the scalar loss",
    )
    parser.add_argument("--batch-size", type=int, help="passed to the factory as batch_size=N")
    parser.add_argument("--device", help="move the model and batch here first (cpu, cuda, cuda:1); default: where the factory put them")
    parser.add_argument("--optimizer", metavar="MODULE:FACTORY|NAME", help="optimizer(params) to measure, or an optimizer algorithm's name (adamw, adagrad, ...: its torch class with lr=0); default: torch.optim.AdamW, lr=0. The advice names that algorithm's tiered front")
    parser.add_argument("--memory-limit", metavar="SIZE", help="memory you have where the peak happens (GPU memory or RAM), e.g. 24GiB; sizes the suggested ram_budget")
    parser.add_argument("--no-steady", action="store_true", help="skip the second iteration (with the optimizer state alive)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (every figure with its kind: measured, counted or estimated)")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore diagnose``: build, measure, print."""
    import torch

    from ..diagnose import build_from_factory, diagnose
    from ..diagnose.factory import to_device

    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    model, batch, loss_fn = build_from_factory(args.model, batch_size=args.batch_size)
    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            raise ConfigError(f"--device {args.device!r}: {exc}") from None
        model, batch = model.to(device), to_device(batch, device)
    optimizer = args.optimizer  # a registered name (no ':'), measured as its torch class
    if optimizer and ":" in optimizer:
        optimizer = resolve(args.optimizer, flag="--optimizer")
    report = diagnose(
        model, batch, loss_fn, optimizer=optimizer, memory_limit=args.memory_limit, steady=not args.no_steady
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0
