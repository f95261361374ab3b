"""Every knob declared once: its type, default, unit, kind, where it is set, its check and its doc.

A knob is a setting of tierstore that is not a hyperparameter of AdamW (``lr``,
``betas``, ``eps``, ``weight_decay`` and ``maximize`` are torch's, checked as torch
checks them). Each has one :class:`Knob` in :data:`KNOBS`, which says:

- its **kind**: ``"identity"`` (what the state *is*: part of the layout
  fingerprint in the manifest, compared on resume) or ``"resource"`` (how fast
  or where it runs, or how this run starts: free to change between runs, and
  never changes results);
- where it is **set**: a keyword of :class:`tierstore.TieredAdamW` or of its
  ``attach()``, a ``TIERSTORE_*`` environment variable, a key of a DeepSpeed
  config file (the knobs file :mod:`tierstore.deepspeed_config` maps), and the
  command-line flags that set it;
- its **check**, where the check is a pure function of the value; knobs whose
  check needs the concept they configure (``moment_dtype``: the formats;
  ``commit_every``: the commit policy; ``state_dir``: the directory) name the
  function that checks them in :attr:`Knob.checked_by`.

:func:`env` is the one reader of the ``TIERSTORE_*`` variables; a bad value is a
:class:`~tierstore.errors.ConfigError` naming the variable, the value and the fix.
``docs/tuning.md``'s table of knobs is generated from :data:`KNOBS`
(``python tests/test_config_registry.py`` rewrites it).

Example
-------
>>> KNOBS["prefetch_depth"].default, KNOBS["prefetch_depth"].kind, KNOBS["shard_numel"].kind
(2, 'resource', 'identity')
>>> KNOBS["io_workers"].validate(0)
Traceback (most recent call last):
...
tierstore.errors.ConfigError: io_workers=0 must be an int >= 1
>>> import os; os.environ["TIERSTORE_HUGEPAGES"] = "0"
>>> env("TIERSTORE_HUGEPAGES")
False
>>> os.environ["TIERSTORE_HUGEPAGES"] = "lots"
>>> env("TIERSTORE_HUGEPAGES")
Traceback (most recent call last):
...
tierstore.errors.ConfigError: TIERSTORE_HUGEPAGES='lots' is unknown; use '1' (default) or '0'
>>> del os.environ["TIERSTORE_HUGEPAGES"]
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, ConfigTypeError
from ..sizes import budget_request

__all__ = ["Knob", "KNOBS", "HYPERPARAMETERS", "BACKEND_NAMES", "MAX_ENV_CHARS", "Default", "env", "check_int"]

BACKEND_NAMES = ("auto", "direct", "buffered", "mmap")
#: Longest ``TIERSTORE_*`` value read (PATH_MAX): the environment may be crafted, and a
#: value is echoed in error messages and handed to the OS.
MAX_ENV_CHARS = 4096
#: ``TieredAdamW`` arguments that are AdamW's maths, not knobs: checked as torch checks them
#: (:mod:`tierstore._compute.hyper`), per param group.
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "maximize")

Check = Callable[[Any, str], Any]


class Default(int):
    """An int knob's default, told apart by identity from the same number passed on purpose.

    ``TieredAdamW(knobs="tuned.json")`` takes a value from the knobs file only
    for a knob whose argument *is* its default object: an argument given
    explicitly wins, even when it equals the default. Everywhere else it is
    the plain int it prints as.

    Example
    -------
    >>> d = Default(8)
    >>> d == 8, repr(d), d is KNOBS["io_workers"].default, KNOBS["io_workers"].default is KNOBS["io_workers"].default
    (True, '8', False, True)
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


@dataclass(frozen=True)
class Knob:
    """One knob's declaration (see the module docs).

    Attributes
    ----------
    name
        The keyword argument's name, or the environment variable's for a knob
        set only there.
    type
        The Python type, as the constructor's annotation writes it.
    default
        The value when not set (``None`` often means "decided from the rest";
        :attr:`default_doc` says how).
    unit
        ``"bytes"``, ``"elements"``, ``"shards"``, ``"threads"``, ... or ``""``.
    kind
        ``"identity"`` or ``"resource"``.
    doc
        One line: what it does.
    argument
        The callable whose keyword it is (``"TieredAdamW"`` or ``"attach"``), or ``None``.
    env
        The ``TIERSTORE_*`` variable that sets it, or ``None``.
    deepspeed
        The DeepSpeed config key mapped to it, or ``None``.
    flags
        Command-line flags that set it, as ``"bench step --io-workers"``.
    check
        ``check(value, label) -> value`` (normalized), raising ``ConfigError``
        naming ``label``, the value and the fix; ``None`` where :attr:`checked_by` checks.
    checked_by
        Where the check lives when it is not :attr:`check`.
    default_doc
        The default in words, when the value alone does not say it.
    """

    name: str
    type: str
    default: Any
    unit: str
    kind: Literal["identity", "resource"]
    doc: str
    argument: str | None = None
    env: str | None = None
    deepspeed: str | None = None
    flags: tuple[str, ...] = ()
    check: Check | None = None
    checked_by: str | None = None
    default_doc: str | None = None

    def validate(self, value: Any, label: str | None = None) -> Any:
        """``value`` checked and normalized by :attr:`check` (unchanged where there is none).

        Raises
        ------
        ConfigError
            Naming ``label`` (default: the knob's name), the value and the fix.
        """
        return value if self.check is None else self.check(value, label or self.name)


# -- checks: ``check(value, label) -> value`` ----------------------------------------------
def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``.

    Raises
    ------
    ConfigError
        Naming the value and the minimum (a ``ConfigTypeError`` for a value that is no int).

    Example
    -------
    >>> check_int("io_workers", 4, 1)
    4
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name}={value!r} must be an int >= {minimum}, not {type(value).__name__}")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def _whole(minimum: int, *, multiple: int = 1, optional: bool = False) -> Check:
    def check(value: Any, label: str) -> Any:
        if value is None and optional:
            return None
        check_int(label, value, minimum)
        if value % multiple:
            raise ConfigError(f"{label}={value} must be a multiple of {multiple}, e.g. {multiple << 8}")
        return value

    return check


def _flag(value: Any, label: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigTypeError(f"{label}={value!r} must be True, False or None (decided from the rest), not {type(value).__name__}")


def _backend(value: Any, label: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{label}={value!r} must be a string such as 'auto', 'direct' or 'mmap'")
    if value not in BACKEND_NAMES:
        raise ConfigError(f"{label}={value!r} is unknown; choose 'auto', 'direct', 'buffered' or 'mmap'")
    return value


def _budget(value: Any, label: str) -> Any:
    return budget_request(value, name=label)


# Environment checks get the stripped text of a set, non-empty variable (unset or empty: the default).
def _env_hugepages(text: str, label: str) -> bool:
    value = text.lower()
    if value == "1":
        return True
    if value == "0":
        return False
    raise ConfigError(f"{label}={text!r} is unknown; use '1' (default) or '0'")


def _env_native(text: str, label: str) -> str:
    mode = text.lower()
    if mode in ("auto", "1", "on"):
        return "auto"
    if mode in ("0", "off", "no", "false"):
        return "off"
    if mode == "require":
        return "require"
    raise ConfigError(f"{label}={text!r} is unknown; use 'auto' (default), '0' or 'require'")


def _env_command(text: str, label: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(text))
    except ValueError as e:
        raise ConfigError(f"{label}={text!r} is not a command line ({e}); set it to a compiler, e.g. gcc") from None
    if not argv:
        raise ConfigError(f"{label}={text!r} names no command; set it to a compiler, e.g. gcc, or unset it")
    return argv


def _env_bandwidths(text: str, label: str) -> tuple[float, ...]:
    parts = text.replace(",", " ").split()
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if not values or not all(v > 0 and v < float("inf") for v in values):
        raise ConfigError(
            f"{label}={text!r} is not a list of bandwidths; give bytes per second for each directory of "
            "state_dir, in order, e.g. '3e9,1.5e9'"
        )
    return values


def _env_directory(text: str, label: str) -> Path:
    # The path is taken as written (no ~ or $VAR expansion): what native.py checks before
    # trusting it with code (owned by this user, mode 0700) is the path the OS resolves.
    return Path(text)


def _knobs(*knobs: Knob) -> dict[str, Knob]:
    out: dict[str, Knob] = {}
    for knob in knobs:
        if knob.name in out:
            raise AssertionError(f"knob {knob.name} declared twice")  # a programming error, at import
        out[knob.name] = knob
    return out


_T, _A = "TieredAdamW", "attach"

#: Every knob, by name (the keyword argument's name, or the environment variable's).
KNOBS: dict[str, Knob] = _knobs(
    # -- identity: the layout fingerprint in the manifest, compared on resume
    Knob("shard_numel", "int | None", None, "elements", "identity",
         "elements per shard, rounded up to a multiple of 1024: the unit of state files, checksums and streaming",
         argument=_T, deepspeed="zero_optimization.offload_optimizer.buffer_size",
         flags=("bench step --shard-numel", "plan --shard-numel"), check=_whole(1, optional=True),
         default_doc="`None`: 4 Mi elements, smaller for small budgets, 16 Mi when all state is resident and no "
                     "gradient is staged (compressed formats, all resident: the size with the least RAM); on resume, the saved one"),
    Knob("keep_master", "bool | None", None, "", "identity",
         "keep an fp32 master copy in the state (4 B per element)",
         argument=_T, flags=("bench step --keep-master",), checked_by="tierstore._layout.spec.decide_for",
         default_doc="`None`: when some parameter is not fp32 or not on the CPU"),
    Knob("amsgrad", "bool", False, "", "identity",
         "AdamW with amsgrad: one more field (max_exp_avg_sq) in the state",
         argument=_T, deepspeed="optimizer.params.amsgrad", flags=("plan --amsgrad",),
         checked_by="torch.optim.Optimizer (per param group)"),
    Knob("moment_dtype", "str | torch.dtype", "float32", "", "identity",
         "how the moments are stored, in RAM and on disk: float32, bfloat16 or int8 (docs/formats.md)",
         argument=_T, flags=("bench step --moment-dtype", "plan --moment-dtype"),
         checked_by="tierstore._compute.codecs.moment_format"),
    # -- resources: may change between runs, never change results
    Knob("ram_budget", "int | float | str | None", None, "bytes or a share of the state", "resource",
         "host RAM the state may use: bytes, '8GiB', or a share of the state's size ('1/8', '12.5%', 0.125)",
         argument=_T, deepspeed="zero_optimization.offload_optimizer.ratio",
         flags=("bench step --ram-budget", "bench/overlap.py --ram-budget", "plan --ram-budget", "demo --ram-budget"),
         check=_budget, default_doc="`None`: all state in RAM"),
    Knob("backend", "str", "auto", "", "resource",
         "how state files are read and written: auto, direct (O_DIRECT), buffered or mmap",
         argument=_T, flags=("bench step --backend",), check=_backend),
    Knob("prefetch_depth", "int", Default(2), "shards", "resource",
         "shards read ahead of the one being updated (the arena has prefetch_depth + 2 slots)",
         argument=_T, deepspeed="zero_optimization.offload_optimizer.buffer_count",
         flags=("bench step --prefetch-depth", "plan --prefetch-depth"), check=_whole(1)),
    Knob("io_workers", "int", Default(8), "threads per direction", "resource",
         "I/O threads for reads and, separately, for writes",
         argument=_T, flags=("bench step --io-workers",), check=_whole(1)),
    Knob("request_bytes", "int", Default(1 << 20), "bytes", "resource",
         "size of one read or write request (a multiple of 4096, rounded up to whole 1 MiB checksum blocks)",
         argument=_T, flags=("bench step --request-bytes",), check=_whole(4096, multiple=4096)),
    Knob("update_threads", "int | None", None, "threads", "resource",
         "intra-op threads of the update while shards stream from disk",
         argument=_T, check=_whole(1, optional=True), default_doc="`None`: all cores but one"),
    Knob("knobs", "str | os.PathLike | None", None, "", "resource",
         "a knobs file written by `tierstore tune`: sets io_workers, request_bytes, prefetch_depth and update_threads "
         "where left at their defaults, and a new state's drive bandwidths",
         argument=_T, checked_by="tierstore._config.knobs_file.read_knobs_file",
         default_doc="`None`: the arguments and their defaults"),
    Knob("pin_memory", "bool | None", None, "", "resource",
         "pin host buffers for CUDA copies (within ram_budget)",
         argument=_T, deepspeed="zero_optimization.offload_optimizer.pin_memory", check=_flag,
         default_doc="`None`: when CUDA is available"),
    Knob("state_dir", "str | list[str] | None", None, "", "resource",
         "the directory of the disk tier, or a list of them (one per drive; the first holds the manifest), one per rank under torch.distributed",
         argument=_T, deepspeed="zero_optimization.offload_optimizer.nvme_path",
         flags=("plan --state-dir", "demo --state-dir"), checked_by="tierstore._state.statedir",
         default_doc="`None`: a private temporary directory, made only when state must stream"),
    Knob("durable", "bool | None", None, "", "resource",
         "keep state_dir crash-consistent: commits a crash or power cut never loses",
         argument=_T, flags=("bench step --durable", "plan --durable"), checked_by="tierstore._state.journal.Journal",
         default_doc="`None`: on when a `state_dir` is given"),
    Knob("commit_every", "Any", "auto", "steps and/or a duration", "resource",
         "how often a durable optimizer commits: 'auto', a step count, a duration such as '10min', or both",
         argument=_T, flags=("plan --commit-every",), checked_by="tierstore._state.commit_policy.CommitPolicy.parse"),
    Knob("resume", "bool | str", False, "", "resource",
         "continue the committed state in state_dir: True, 'auto' (when there is one) or False (must hold none)",
         argument=_T, checked_by="tierstore._state.journal.Journal"),
    Knob("resume_step", "int | None", None, "steps", "resource",
         "resume at this committed step instead of the last",
         argument=_T, checked_by="tierstore._state.journal.Journal", default_doc="`None`: the last commit"),
    Knob("restore_params", "bool", True, "", "resource",
         "on resume, write the committed master weights back into the parameters",
         argument=_T, checked_by="not checked: read as a truth value"),
    Knob("offload_grads", "bool | None", None, "", "resource",
         "gradients leave the GPU during backward, into host buckets",
         argument=_A, checked_by="not checked: read as a truth value", default_doc="`None`: when parameters are on a GPU"),
    Knob("grad_bucket_bytes", "int", 4 << 20, "bytes", "resource",
         "size of one pinned gradient bucket (two alternate)",
         argument=_A, checked_by="tierstore._runtime.grad_offload.GradOffload"),
    Knob("overlap", "bool | None", None, "", "resource",
         "run the step behind the training loop",
         argument=_A, checked_by="not checked: read as a truth value",
         default_doc="`None`: when something can hide (streamed shards, GPU copies)"),
    # -- environment: read by env()
    Knob("TIERSTORE_HUGEPAGES", "bool", True, "", "resource",
         "transparent huge pages for host buffers of 2 MiB and more: '1' or '0'",
         env="TIERSTORE_HUGEPAGES", check=_env_hugepages, default_doc="`1`"),
    Knob("TIERSTORE_NATIVE", "str", "auto", "", "resource",
         "the compiled kernel of the compressed formats: 'auto', '0' (torch ops) or 'require' (an error if missing)",
         env="TIERSTORE_NATIVE", check=_env_native, default_doc="`auto`"),
    Knob("TIERSTORE_DRIVE_BANDWIDTHS", "tuple[float, ...] | None", None, "bytes per second", "resource",
         "each directory's bandwidth when a state over several is created: where its shards go, instead of a probe",
         env="TIERSTORE_DRIVE_BANDWIDTHS", check=_env_bandwidths,
         default_doc="unset: a quick probe of each drive (up to 64 MiB read back and rewritten)"),
    Knob("TIERSTORE_CC", "tuple[str, ...] | None", None, "", "resource",
         "the C compiler command of a first-use build of that kernel",
         env="TIERSTORE_CC", check=_env_command, default_doc="unset: `$CC`, else `cc`, `gcc` or `clang`"),
    Knob("TIERSTORE_CACHE_DIR", "Path | None", None, "", "resource",
         "where first-use builds are kept (owned by this user, mode 0700)",
         env="TIERSTORE_CACHE_DIR", check=_env_directory,
         default_doc="unset: `$XDG_CACHE_HOME/tierstore`, else `~/.cache/tierstore`"),
)  # fmt: skip

_BY_VARIABLE = {k.env: k for k in KNOBS.values() if k.env}


def env(variable: str) -> Any:
    """The value of the ``TIERSTORE_*`` environment ``variable``, checked (its default when unset or empty).

    Raises
    ------
    ConfigError
        For a value its knob refuses, or one longer than :data:`MAX_ENV_CHARS`:
        the message names the variable, the value (cut short when long) and the fix.
    KeyError
        For a variable no knob declares (a programming error).

    Example
    -------
    >>> env("TIERSTORE_NATIVE") in ("auto", "off", "require")
    True
    """
    knob = _BY_VARIABLE[variable]
    raw = os.environ.get(variable)
    text = None if raw is None else raw.strip()
    if not text:
        return knob.default
    if len(text) > MAX_ENV_CHARS:
        raise ConfigError(
            f"{variable}={text[:40]!r}... is {len(text)} characters, more than {MAX_ENV_CHARS}; "
            f"unset it or give a shorter value ({knob.doc})"
        )
    return knob.validate(text, variable)
