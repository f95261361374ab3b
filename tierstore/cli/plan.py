"""``tierstore plan``: parse the flags, plan (:func:`tierstore.planner.plan_memory`), print.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser)
>>> args = parser.parse_args(["--params", "7B", "--ram-budget", "1/8", "--commit-every", "100,10min"])
>>> args.ram_budget, commit_every(args.commit_every)
('1/8', (100, '10min'))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .._config.registry import KNOBS
from ..errors import ConfigError
from ..planner.inputs import PRECISION_DTYPES, existing_ancestor
from ..planner.results import DEFAULT_LIFETIME_MONTHS, DEFAULT_UPDATE_GPARAMS, EXIT_DOES_NOT_FIT

# The planner's arithmetic imports torch: it is imported when the command runs, so `tierstore plan
# --help` answers without it (tests/test_cli_fast.py).

__all__ = ["add_arguments", "run", "commit_every"]


def _moment_dtype(value: str) -> str:
    """``--moment-dtype``: a format's name or alias (``bf16``), as its canonical name."""
    from .._compute.codecs import moment_format  # torch: only when a value is parsed

    try:
        return moment_format(value).name
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def commit_every(text: str) -> int | str | tuple:
    """``--commit-every``'s text as ``TieredAdamW(commit_every=...)`` takes it: ``auto``, ``100``, ``5min``, ``100,10min``.

    The value is checked by :meth:`~tierstore._state.commit_policy.CommitPolicy.parse` (in the plan).
    """
    parts = tuple(p.strip() for p in text.split(","))
    values = tuple(int(p) if p.isdigit() else p for p in parts)
    return values if len(values) > 1 else values[0]


def _state_dir_note(state_dir: str) -> str | None:
    """Say where the free space was read when ``--state-dir`` does not exist (yet)."""
    target = Path(state_dir).expanduser().absolute()
    measured = existing_ancestor(target)
    if measured == target:
        return None
    return (
        f"--state-dir {state_dir} does not exist: the free space is that of {measured}, its nearest existing "
        "parent; if the drive is not mounted there yet, pass --disk-free instead"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore plan``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="trainable parameter count: 7e9, 7B, 70B, 125M")
    what.add_argument("--model", metavar="MODULE:FACTORY", help="a factory returning an nn.Module, or a tuple starting with one (diagnose's (model, batch, loss_fn) works); the model is built on the meta device and its parameters counted")
    parser.add_argument("--frozen", default="0", help="frozen parameters (with --params): weights only")
    parser.add_argument("--precision", choices=sorted(PRECISION_DTYPES), help="fp32, or bf16/fp16 mixed precision with an fp32 master (default: fp32, or the model's dtype)")
    parser.add_argument("--optimizer", default="adamw", metavar="NAME", help="the optimizer algorithm, by its tierstore name: adamw (default), adam, sgd, adagrad, ... (an unknown name is refused, naming the known ones); its fields are the state")
    parser.add_argument("--option", action="append", default=[], metavar="OPTION", help="an option of the optimizer that adds a state field (+4 B/param each): amsgrad (adamw, adam), momentum (sgd); repeat for several")
    parser.add_argument("--amsgrad", action="store_true", help="AdamW with amsgrad (+4 B/param): --option amsgrad")
    parser.add_argument("--moment-dtype", default="float32", type=_moment_dtype, help="how the moments are stored (default float32: bitwise torch AdamW; bfloat16 or bf16: 2 B, int8: 1.016 B per moment element)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="the model trains on a GPU with this much memory, e.g. 80GB")
    parser.add_argument("--gpu", action="store_true", help="the model trains on a GPU of unknown size")
    parser.add_argument("--host-ram", metavar="SIZE", help="host RAM, e.g. 512GiB (default: this machine's)")
    parser.add_argument("--ram-budget", metavar="SIZE", help="host RAM given to tierstore, as TieredAdamW(ram_budget=...) takes it: bytes, 8GiB, or a share of the state such as 1/8, 12.5%%, 0.125 (default: 90%% of host RAM, minus the model for CPU training; never more than the whole state takes)")
    parser.add_argument("--state-dir", metavar="PATH", help="where the state would live; its drive's free space is checked (a path that does not exist yet: its nearest existing parent, named in the notes)")
    parser.add_argument("--disk-free", metavar="SIZE", help="free space on the drive (instead of reading --state-dir)")
    parser.add_argument("--durable", action=argparse.BooleanOptionalAction, default=None, help="keep a second copy of every shard on disk (default: on with --state-dir, as TieredAdamW)")
    parser.add_argument("--commit-every", default="auto", metavar="POLICY", help="the commit policy, as TieredAdamW(commit_every=...): auto (default; assumed to commit every step for drive wear), a step count such as 100, a duration such as 5min, or both: 100,10min")
    parser.add_argument("--lifetime", metavar="MONTHS", default=str(DEFAULT_LIFETIME_MONTHS), help=f"how long the drive should last, in months (default {DEFAULT_LIFETIME_MONTHS:g}); the plan prints the commit_every that makes it")
    parser.add_argument("--shard-numel", type=int, help="elements per shard (default: TieredAdamW's automatic choice)")
    parser.add_argument("--prefetch-depth", type=int, default=KNOBS["prefetch_depth"].default, help="shards read ahead; the arena has prefetch_depth + 2 slots")
    parser.add_argument("--io-json", metavar="FILE", help="bandwidths from `tierstore bench io --json` (of several "
                        "drives: each drive's, and those drives when no --drive is given)")
    parser.add_argument("--drive", action="append", default=None, metavar="PATH_OR_NAME[:SIZE[:READ[/WRITE]]]",
                        help="one drive of a state over several directories, in state_dir's order (repeat it): "
                        "its path or a name, its free space (empty: read at PATH) and GB/s, e.g. "
                        "/nvme0/run::7/5; the plan says what each holds and the step's disk time over them")
    parser.add_argument("--knobs", metavar="FILE", help="drive bandwidths from a `tierstore tune` knobs file, for "
                        "--drive paths it measured")
    parser.add_argument("--read-gbps", help="drive read bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--write-gbps", help="drive write bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--pcie-gbps", help="host<->GPU bandwidth per direction, GB/s")
    parser.add_argument("--memory-gbps", help="host memory copy bandwidth, GB/s (overrides --io-json)")
    parser.add_argument("--update-gparams", default=str(DEFAULT_UPDATE_GPARAMS), help="CPU update rate of the optimizer, Gparam/s (default 1, fused AdamW's order of magnitude)")
    parser.add_argument("--drive-tbw", help="the drive's rated endurance, TB written, e.g. 600")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (every number, the verdict and the shortfalls)")
    parser.add_argument(
        "--fail-if-not-fit",
        action="store_true",
        help=f"exit with status {EXIT_DOES_NOT_FIT} when the verdict is 'does not fit' (the plan is printed either way)",
    )
    parser.epilog = (
        "Exit status: 0 for any plan, whatever its verdict ('fits in host RAM', 'needs the disk tier', "
        f"'does not fit') and however soon the drive wears out; {EXIT_DOES_NOT_FIT} for 'does not fit' with "
        "--fail-if-not-fit; 2 for a usage error (unknown options, invalid values, a --model or --io-json that "
        "cannot be read: the error says which); 1 for other failures."
    )


#: Flags that set a knob of TieredAdamW, checked by the knob's own check (tierstore._config.registry), so
#: a bad value gets the message the API gives, naming the flag: "--prefetch-depth=0 must be an int >= 1".
KNOB_FLAGS = {"shard_numel": "--shard-numel", "prefetch_depth": "--prefetch-depth", "ram_budget": "--ram-budget"}


def check_knob_flags(args: argparse.Namespace) -> dict[str, object]:
    """The values of :data:`KNOB_FLAGS` in ``args``, each checked by its knob in the registry.

    Raises
    ------
    ConfigError
        Naming the flag, the value and the fix, in the API's words.

    Example
    -------
    >>> check_knob_flags(argparse.Namespace(shard_numel=None, prefetch_depth=0, ram_budget=None))
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: --prefetch-depth=0 must be an int >= 1
    """
    return {name: KNOBS[name].validate(getattr(args, name), flag) for name, flag in KNOB_FLAGS.items()}


def _drives(args: argparse.Namespace) -> list | None:
    """The drives of ``--drive`` (or of a several-drive ``--io-json``), or ``None`` for one state directory.

    Raises
    ------
    ConfigError
        For a flag that describes one drive given with several.
    """
    from ..planner.drive_specs import resolve_drives

    if args.knobs and not args.drive:
        raise ConfigError("--knobs gives the bandwidths of drives named by --drive; add a --drive for each")
    drives = resolve_drives(args.drive or [], io_json=args.io_json, knobs=args.knobs) if args.drive or args.io_json else []
    if not drives:
        return None
    for flag, value in (("--state-dir", args.state_dir), ("--disk-free", args.disk_free),
                        ("--read-gbps", args.read_gbps), ("--write-gbps", args.write_gbps)):
        if value is not None:
            raise ConfigError(f"{flag} describes one drive; with --drive (or a several-drive --io-json) give each "
                              "drive's path, free space and speeds in its --drive PATH:SIZE:READ/WRITE")
    return drives


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore plan``: parse, plan, print."""
    from ..planner import Bandwidth, format_plan, load_model, plan_memory, read_io_json
    from ..planner.inputs import disk_free, parse_count, parse_nbytes, parse_rate

    knobs = check_knob_flags(args)
    drives = _drives(args)
    speeds = {"read_gbps": None, "write_gbps": None, "memory_gbps": None}
    if args.io_json:
        speeds.update(read_io_json(args.io_json))
    for key in ("read_gbps", "write_gbps", "memory_gbps"):
        given = parse_rate(getattr(args, key), "--" + key.replace("_", "-"))
        if given is not None:
            speeds[key] = given
    bandwidth = Bandwidth(
        **speeds,
        pcie_gbps=parse_rate(args.pcie_gbps, "--pcie-gbps"),
        update_gparams=parse_rate(args.update_gparams, "--update-gparams"),
    )
    if args.host_ram is not None:
        host_ram = parse_nbytes(args.host_ram, "--host-ram")
    else:
        import psutil

        host_ram = psutil.virtual_memory().total
    free = parse_nbytes(args.disk_free, "--disk-free", allow_zero=True)
    if free is None and args.state_dir:
        free = disk_free(args.state_dir)
    if args.model:
        if args.frozen not in (None, "0"):
            raise ConfigError("--frozen is only for --params; --model counts frozen parameters itself")
        params, frozen = load_model(args.model), 0
    else:
        params = parse_count(args.params, name="--params")
        frozen = 0 if args.frozen in (None, "0") else parse_count(args.frozen, name="--frozen")
    plan = plan_memory(
        params,
        host_ram=host_ram,
        frozen=frozen,
        precision=args.precision,
        optimizer=args.optimizer,
        options=args.option,
        amsgrad=args.amsgrad,
        gpu=args.gpu or None,
        gpu_memory=parse_nbytes(args.gpu_memory, "--gpu-memory"),
        ram_budget=knobs["ram_budget"],
        disk_free=free,
        durable=bool(args.state_dir) if args.durable is None else args.durable,
        commit_every=commit_every(args.commit_every),
        shard_numel=knobs["shard_numel"],
        prefetch_depth=knobs["prefetch_depth"],
        bandwidth=bandwidth,
        drive_tbw=parse_rate(args.drive_tbw, "--drive-tbw"),
        moment_dtype=args.moment_dtype,
        lifetime_months=parse_rate(args.lifetime, "--lifetime"),
        drives=drives,
    )
    note = _state_dir_note(args.state_dir) if args.state_dir and args.disk_free is None else None
    if note:
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return EXIT_DOES_NOT_FIT if args.fail_if_not_fit and not plan.fits else 0
