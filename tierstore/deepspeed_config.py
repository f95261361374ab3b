"""Map the DeepSpeed config a user already has to a tiered front and its arguments.

``tierstore.from_deepspeed_config(params, config, **overrides)`` builds the
front ``optimizer.type`` names (:mod:`tierstore.fronts.deepspeed`);
``TieredAdamW.from_deepspeed_config`` builds a TieredAdamW (Adam and AdamW
configs). The rest of this module is the mapping they use (pure: it reads the
config and the parameters, builds nothing).

Only two sections of a DeepSpeed config concern the optimizer, and only they
are read: ``optimizer`` (``type`` and ``params``) and ``zero_optimization``
(``stage``, ``offload_optimizer``, ``offload_param``). Everything else
(batch sizes, ``fp16``/``bf16``, ``scheduler``, ``aio``, ...) belongs to the
training loop and is ignored.

The rule for every key read: a key that changes the maths or where memory
goes is honoured or rejected with :class:`~tierstore.errors.ConfigError`; a
key that only tunes speed (``pipeline_read``, ``fast_init``, communication
buckets) is accepted and has no effect, and is listed in
:attr:`DeepSpeedMapping.ignored`.

=====================================================  =====================================================
DeepSpeed key                                          tiered front and its arguments
=====================================================  =====================================================
``optimizer.type`` ``"AdamW"``                         ``TieredAdamW`` (decoupled weight decay)
``optimizer.type`` ``"Adam"``                          ``TieredAdamW``: DeepSpeed's ``adam_w_mode`` defaults to
                                                       true, i.e. decoupled decay; ``adam_w_mode: false`` (L2
                                                       decay) is ``TieredAdam`` (``torch.optim.Adam``); to
                                                       ``TieredAdamW.from_deepspeed_config`` it is refused
                                                       unless ``weight_decay`` is 0
``optimizer.type`` ``"Adagrad"``                       ``TieredAdagrad`` (``lr``, ``eps``, ``weight_decay``,
                                                       ``lr_decay``, ``initial_accumulator_value``)
``optimizer.type`` ``"Lion"``                          ``TieredLion`` with DeepSpeed's defaults (``lr`` 1e-3,
                                                       ``betas`` (0.9, 0.999), ``weight_decay`` 0)
``optimizer.type`` a ``torch.optim`` class name        its front (``"SGD"``: ``TieredSGD``, ``"RMSprop"``, ...),
                                                       ``params`` as its arguments, as DeepSpeed passes them
``optimizer.type`` ``OneBitAdam``, ``ZeroOneAdam``,    refused, with the reason (1-bit communication; a
``OneBitLamb``, ``Lamb``, ``Muon``, ``MuAdam``, ...    layer-wise trust ratio or orthogonalisation, which
                                                       are not elementwise; mup's width scaling)
``optimizer.params.lr/betas/eps/amsgrad``              ``lr``/``betas``/``eps``/``amsgrad``
``optimizer.params.weight_decay``                      ``weight_decay``; absent: 0.0, DeepSpeed's default
                                                       (0.01 with ``torch_adam: true``, torch's default)
``offload_optimizer.device`` ``"none"``/``"cpu"``      all state in RAM (``ram_budget=None``)
``offload_optimizer.device`` ``"nvme"``                state in files under ``nvme_path``
``offload_optimizer.nvme_path``                        ``state_dir`` (per rank: ``state_dir/rank{N}``); a list
                                                       of paths: one directory per drive, the first the home
``offload_optimizer.ratio`` (nvme)                     the fraction of the state on disk, as in DeepSpeed
                                                       (fraction offloaded, default 1.0): ``ram_budget``
                                                       = arena + staging + ``(1 - ratio)`` x state bytes
``offload_optimizer.buffer_count``                     ``prefetch_depth``
``offload_optimizer.buffer_size`` (elements)           ``shard_numel`` (a slot is tierstore's swap buffer)
``offload_optimizer.pin_memory``                       ``pin_memory``
=====================================================  =====================================================

Example
-------
>>> import torch
>>> model = torch.nn.Linear(8, 8)
>>> config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
...           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
>>> mapping = map_deepspeed_config(config)
>>> mapping.kwargs["lr"], mapping.kwargs["weight_decay"], mapping.offload_ratio
(0.001, 0.01, None)
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from ._config.deepspeed_types import ADAM_TYPES, map_optimizer
from ._config.deepspeed_types import (
    PARAM_KEYS as PARAM_KEYS,  # the optimizer.params of an Adam/AdamW config
)
from ._config.deepspeed_types import flag as _flag
from ._config.deepspeed_types import number as _number
from ._config.knobs import Knobs
from ._layout.budget import staging_nbytes
from ._layout.layout import DEFAULT_SHARD_NUMEL, Layout
from ._layout.spec import decide_for
from ._platform.dtensor import local_tensor
from .errors import ConfigError
from .sizes import format_size

__all__ = [
    "DeepSpeedMapping",
    "load_config",
    "map_deepspeed_config",
    "deepspeed_kwargs",
    "optimizer_arguments",
    "ram_budget_for_ratio",
    "materialize_params",
]

log = logging.getLogger(__name__)

OPTIMIZER_TYPES = ADAM_TYPES  # the types TieredAdamW.from_deepspeed_config builds
DEVICES = ("none", "cpu", "nvme")
# offload_optimizer keys that only tune DeepSpeed's swapping speed; tierstore always pipelines.
SPEED_ONLY_OFFLOAD_KEYS = ("pipeline_read", "pipeline_write", "pipeline", "fast_init")
OFFLOAD_KEYS = ("device", "nvme_path", "pin_memory", "ratio", "buffer_count", "buffer_size", *SPEED_ONLY_OFFLOAD_KEYS)


@dataclass(frozen=True)
class DeepSpeedMapping:
    """What a DeepSpeed config asks of the optimizer, as a tiered front's keyword arguments.

    Attributes
    ----------
    kwargs
        Keyword arguments for the front (without ``ram_budget`` for nvme
        offload: that depends on the parameters, see :func:`ram_budget_for_ratio`).
    offload_ratio
        Fraction of the state DeepSpeed would offload to NVMe (``None``: all
        state stays in RAM).
    ignored
        Dotted names of keys accepted without effect (speed-only knobs).
    algorithm
        The registered name of the optimizer algorithm ``optimizer.type``
        asks for (its front is built: ``"adamw"`` is ``TieredAdamW``).
    """

    kwargs: dict[str, Any]
    offload_ratio: float | None = None
    ignored: tuple[str, ...] = field(default_factory=tuple)
    algorithm: str = "adamw"


def load_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """Return the config as a dict: given one, or read from a JSON file path.

    Raises
    ------
    ConfigError
        If the file cannot be read or is not a JSON object.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise ConfigError(
            f"config={config!r} must be a dict or the path of a DeepSpeed JSON file, not a {type(config).__name__}"
        )
    path = Path(config)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the DeepSpeed config {str(path)!r}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise ConfigError(f"the DeepSpeed config {str(path)!r} is not valid JSON: {exc}; pass a DeepSpeed JSON file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the DeepSpeed config {str(path)!r} holds a {type(data).__name__}, expected a JSON object")
    return data


def _section(parent: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}{key}={value!r} must be a JSON object")
    return dict(value)


def _count(value: Any, name: str, minimum: int) -> int:
    # Not int(value) first: a JSON 1e999 is inf (OverflowError) and NaN raises ValueError.
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
        raise ConfigError(f"{name}={value!r} must be a whole number >= {minimum}")
    return int(value)


def map_deepspeed_config(
    config: Mapping[str, Any] | str | Path, *, overrides: Mapping[str, Any] | None = None, algorithm: str | None = None
) -> DeepSpeedMapping:
    """Validate the optimizer part of a DeepSpeed config and translate it (pure; no parameters needed).

    Parameters
    ----------
    config
        A DeepSpeed config dict, or the path of its JSON file.
    overrides
        The front's arguments the caller sets itself: their DeepSpeed keys
        are not read (so ``"lr": "auto"`` is fine with ``lr`` given), but the
        values are still checked against the config (L2 weight decay).
    algorithm
        The algorithm of the front being built (``"adamw"``: a config of
        another optimizer is refused, and Adam's L2 mode unless it has no
        weight decay); ``None``: whichever ``optimizer.type`` asks for
        (:attr:`DeepSpeedMapping.algorithm`).

    Raises
    ------
    ConfigError
        For keys tierstore cannot honour (an optimizer type it has no front
        for, with the reason for DeepSpeed's own; L2 weight decay for
        TieredAdamW; offloading parameters, unknown offload keys, a ZeRO stage
        that contradicts the offload settings, ...), naming the key and the fix.

    Example
    -------
    >>> m = map_deepspeed_config({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    ...     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
    ...     "nvme_path": "/nvme", "buffer_count": 3}}})
    >>> m.kwargs["lr"], m.kwargs["state_dir"], m.kwargs["prefetch_depth"], m.offload_ratio
    (0.0003, '/nvme', 3, 1.0)
    """
    from ._compute.algorithms import ALGORITHMS

    cfg = load_config(config)
    skip = dict(overrides or {})
    ignored: list[str] = []
    section = _section(cfg, "optimizer", "")
    chosen, kwargs = map_optimizer(section, skip, wanted=algorithm, algorithms=ALGORITHMS)
    if algorithm is not None and chosen != algorithm:
        asked, mine = ALGORITHMS.get(chosen), ALGORITHMS.get(algorithm)
        front = asked.label if asked is not None else repr(chosen)
        raise ConfigError(
            f"optimizer.type={section.get('type')!r} asks for {front}, not {mine.front if mine else algorithm}: build it "
            "with tierstore.from_deepspeed_config(params, config), which builds the front the type names"
        )
    ratio = _map_zero(_section(cfg, "zero_optimization", ""), kwargs, ignored)
    return DeepSpeedMapping(kwargs=kwargs, offload_ratio=ratio, ignored=tuple(ignored), algorithm=chosen)


def _map_zero(zero: dict[str, Any], kwargs: dict[str, Any], ignored: list[str]) -> float | None:
    stage = _count(zero.get("stage", 0), "zero_optimization.stage", 0)
    if stage > 3:
        raise ConfigError(f"zero_optimization.stage={stage} is unknown; DeepSpeed's stages are 0, 1, 2 and 3")
    offload = _section(zero, "offload_optimizer", "zero_optimization.")
    if zero.get("cpu_offload") is True and not offload:
        offload = {"device": "cpu"}  # DeepSpeed's deprecated spelling of offload_optimizer.device=cpu
    param_offload = _section(zero, "offload_param", "zero_optimization.")
    if param_offload.get("device", "none") != "none" or zero.get("cpu_offload_params") is True:
        raise ConfigError(
            "zero_optimization.offload_param asks to offload the parameters; tierstore offloads "
            "optimizer state only. Remove offload_param (or set its device to 'none'): keep the "
            "parameters on the GPU, or shard them across GPUs with FSDP2"
        )
    ignored.extend(
        f"zero_optimization.{k}"
        for k in sorted(zero)
        if k not in ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params")
    )
    unknown = sorted(set(offload) - set(OFFLOAD_KEYS))
    if unknown:
        raise ConfigError(
            f"zero_optimization.offload_optimizer has keys tierstore does not know: {unknown}; "
            f"it knows {list(OFFLOAD_KEYS)}"
        )
    where = "zero_optimization.offload_optimizer."
    ignored.extend(where + k for k in SPEED_ONLY_OFFLOAD_KEYS if k in offload)
    device = offload.get("device", "none")
    if device not in DEVICES:
        raise ConfigError(f"{where}device={device!r} is not supported; choose one of {list(DEVICES)}")
    if device != "none" and stage == 0:
        raise ConfigError(
            f"{where}device={device!r} with zero_optimization.stage=0: DeepSpeed offloads the "
            "optimizer only under ZeRO stage 1, 2 or 3. Set the stage you train with, or remove "
            "offload_optimizer"
        )
    if "pin_memory" in offload:
        kwargs["pin_memory"] = _flag(offload["pin_memory"], where + "pin_memory")
    if "buffer_count" in offload:
        kwargs["prefetch_depth"] = _count(offload["buffer_count"], where + "buffer_count", 1)
    if "buffer_size" in offload:
        kwargs["shard_numel"] = _count(offload["buffer_size"], where + "buffer_size", 1)
    ratio = 1.0
    if "ratio" in offload:
        ratio = _number(offload["ratio"], where + "ratio", "ram_budget")
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"{where}ratio={ratio} must be in [0, 1] (the fraction of the state offloaded)")
    if device != "nvme":
        if ratio != 1.0 and device == "cpu":
            raise ConfigError(
                f"{where}ratio={ratio} with device 'cpu' asks DeepSpeed to keep {1 - ratio:.0%} of the "
                "optimizer state on the GPU; TieredAdamW keeps all of it in host RAM. Remove ratio, "
                "or use device 'nvme' where ratio is the fraction of the state on disk"
            )
        if "nvme_path" in offload:
            ignored.append(where + "nvme_path")
        return None  # TieredAdamW's default ram_budget=None: all state in RAM
    path = offload.get("nvme_path")
    paths = path if isinstance(path, list) else [path]
    if not paths or not all(isinstance(p, (str, Path)) and str(p) for p in paths):
        raise ConfigError(
            f"{where}device='nvme' needs nvme_path, the directory for the state files (or a list of them, one "
            f"per drive); got {path!r}"
        )
    # Several paths: one state over several drives, shards placed by each drive's bandwidth.
    kwargs["state_dir"] = [str(p) for p in paths] if isinstance(path, list) else str(path)
    return ratio


def materialize_params(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[Any]:
    """``params`` as a list whose groups hold lists, so it can be walked twice (generators cannot)."""
    params = list(params)
    if params and isinstance(params[0], Mapping):
        return [
            dict(g, params=[g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])) for g in params
        ]
    return params


def _groups(params: list[Any]) -> list[dict[str, Any]]:
    if params and isinstance(params[0], Mapping):
        return params
    return [{"params": params}]


def ram_budget_for_ratio(
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    ratio: float,
    *,
    shard_numel: int = DEFAULT_SHARD_NUMEL,
    prefetch_depth: int = 2,
    amsgrad: bool = False,
    keep_master: bool | None = None,
    moment_dtype: str = "float32",
    workers: int | None = None,
    algorithm: str = "adamw",
    options: Iterable[str] | None = None,
) -> int:
    """The ``ram_budget`` that leaves about ``ratio`` of the state on disk.

    Builds the layout the front of ``algorithm`` (``TieredAdamW`` by default)
    will build, with the fields of ``options`` (``None``: the options the
    groups use; ``amsgrad=True`` adds ``"amsgrad"``) (the same fields, moment
    format, shard size and arena) and returns arena + staging + decode
    scratch + ``(1 - ratio)`` of the state's bytes (as stored: a compressed
    ``moment_dtype`` needs less); whole shards stay resident, so the resident
    part is rounded down to whole shards. When the part on disk would be
    smaller than the arena, the optimizer keeps everything in RAM (streaming
    would save nothing). ``workers``: the update's threads (``None``: every core).

    Raises
    ------
    ConfigError
        If ``ratio`` is outside [0, 1].

    Example
    -------
    >>> import torch
    >>> w = torch.zeros(16 * 1024, requires_grad=True)
    >>> ram_budget_for_ratio([w], 0.5, shard_numel=1024, prefetch_depth=1)  # 3 slots + 8 of 16 shards
    90112
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"ratio={ratio!r} must be a number in [0, 1] (the fraction of the state on disk)")
    from ._compute.algorithms import algorithm_named

    groups = _groups(materialize_params(params))
    chosen = algorithm_named(algorithm)
    in_use = set(chosen.options(groups) if options is None else options) | ({"amsgrad"} if amsgrad else set())
    spec = decide_for(
        [p for g in groups for p in g["params"]],
        algorithm=chosen,
        options=frozenset(in_use),
        keep_master=keep_master,
        arena_slots=prefetch_depth + 2,
        ram_budget=None,
        shard_numel=shard_numel,
        moment_dtype=moment_dtype,
        workers=workers or Knobs().max_update_threads,
    )
    layout = Layout.build(
        [[local_tensor(p) if p.requires_grad else p for p in g["params"]] for g in groups],
        shard_numel=spec.shard_numel,
        fields=spec.fields,
        moment_dtype=spec.moment_format,
        algorithm=spec.algorithm,
    )
    arena = spec.arena_slots * layout.slot_nbytes
    fixed = arena + staging_nbytes(layout, spec.staging_buffers) + layout.scratch_nbytes(spec.workers)
    return fixed + math.floor((1.0 - ratio) * layout.state_nbytes)


def optimizer_arguments(init: Any) -> set[str]:
    """The keyword arguments an optimizer's ``__init__`` takes besides ``params``."""
    return {n for n in inspect.signature(init).parameters if n not in ("self", "params")}


def deepspeed_kwargs(
    params: list[Any],
    config: Mapping[str, Any] | str | Path,
    *,
    accepted: set[str] | None = None,
    algorithm: str | None = "adamw",
    **overrides: Any,
) -> tuple[dict[str, Any], DeepSpeedMapping]:
    """The keyword arguments of a tiered front for ``params`` under a DeepSpeed config, and the mapping.

    ``overrides`` (keyword arguments of the optimizer) win over the config.
    ``accepted`` (the optimizer's argument names, see :func:`optimizer_arguments`)
    makes an unknown override or config key an error here rather than when the
    optimizer is built. ``algorithm``: the front's (``"adamw"``, TieredAdamW's,
    by default; ``None``: whichever ``optimizer.type`` asks for, see
    :func:`map_deepspeed_config`).

    Raises
    ------
    ConfigError
        For keys that cannot be honoured, or an override not in ``accepted``.
    """
    from ._compute.algorithms import ALGORITHMS

    def front(name: str | None) -> str:
        return ALGORITHMS[name].front if name in ALGORITHMS else "the optimizer's"

    unknown = sorted(set(overrides) - accepted) if accepted is not None else []
    if unknown:
        raise ConfigError(f"overrides {unknown} are not {front(algorithm)} arguments; it takes {sorted(accepted)}")
    mapping = map_deepspeed_config(config, overrides=overrides, algorithm=algorithm)
    kwargs = dict(mapping.kwargs)
    unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
    if unknown:
        raise ConfigError(
            f"optimizer.params has keys {unknown} that {front(mapping.algorithm)} does not take; it takes {sorted(accepted)}"
        )
    if mapping.offload_ratio is not None and "ram_budget" not in overrides:
        # A fixed shard size: the budget below is computed for it (the automatic choice depends on the budget).
        kwargs.setdefault("shard_numel", DEFAULT_SHARD_NUMEL)
        shard_numel = overrides.get("shard_numel", kwargs["shard_numel"])
        budget = ram_budget_for_ratio(
            params,
            mapping.offload_ratio,
            shard_numel=shard_numel,
            prefetch_depth=overrides.get("prefetch_depth", kwargs.get("prefetch_depth", 2)),
            keep_master=overrides.get("keep_master"),
            algorithm=mapping.algorithm,
            # The options the groups use, with the constructor's values as every group's defaults.
            options=ALGORITHMS[mapping.algorithm].options(
                [{**kwargs, **overrides, **g} for g in _groups(materialize_params(params))]
            ),
            moment_dtype=overrides.get("moment_dtype", "float32"),
            workers=overrides.get("update_threads"),
        )
        kwargs["ram_budget"] = budget
        log.info("DeepSpeed ratio=%s -> ram_budget=%s", mapping.offload_ratio, format_size(budget))
    if mapping.ignored:
        log.info("DeepSpeed keys accepted without effect (speed or communication only): %s", ", ".join(mapping.ignored))
    kwargs.update(overrides)
    return kwargs, mapping

