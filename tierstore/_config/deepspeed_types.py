"""DeepSpeed's ``optimizer`` section (``type`` and ``params``) as a tiered front's algorithm and arguments.

DeepSpeed builds the optimizer a config names as follows (its engine's
``_configure_basic_optimizer``): ``Adam``/``AdamW`` (case-insensitive) are
its own Adam, decoupled (AdamW) unless ``type`` is ``Adam`` with
``adam_w_mode: false`` (L2 decay: ``torch.optim.Adam``); ``Adagrad`` is its
``DeepSpeedCPUAdagrad`` (offloaded) or ``torch.optim.Adagrad``; ``Lion`` its
``DeepSpeedCPULion``/``FusedLion`` (defaults ``lr`` 1e-3, ``betas`` (0.9,
0.999), ``weight_decay`` 0: not lion-pytorch's, so they are passed
explicitly); any other name is looked up in ``torch.optim`` and given
``params`` as its keyword arguments (``SGD``, ``RMSprop``, ...). Each maps to
the registered algorithm whose front implements it (:func:`map_optimizer`).
DeepSpeed's optimizers that are not elementwise, or that do more than
update a parameter from its own state, are refused with the reason
(:data:`REFUSED`).

Example
-------
>>> map_optimizer({"type": "Lion", "params": {"lr": 3e-4}}, {}, algorithms={})
('lion', {'lr': 0.0003, 'betas': (0.9, 0.999), 'weight_decay': 0.0})
>>> map_optimizer({"type": "OneBitLamb"}, {}, algorithms={})
Traceback (most recent call last):
...
tierstore.errors.ConfigError: optimizer.type='OneBitLamb' is not supported: OneBitLamb compresses the gradients ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["ADAM_TYPES", "PARAM_KEYS", "ADAGRAD_KEYS", "LION_KEYS", "REFUSED", "flag", "map_optimizer", "number"]

ADAM_TYPES = ("adam", "adamw")
#: optimizer.params an Adam/AdamW config may hold.
PARAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "bias_correction",
              "fp32_optimizer_states")  # fmt: skip
#: optimizer.params of an Adagrad config: DeepSpeedCPUAdagrad's and torch.optim.Adagrad's.
ADAGRAD_KEYS = ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value", "maximize", "amsgrad",
                "fp32_optimizer_states")  # fmt: skip
#: optimizer.params of a Lion config (DeepSpeedCPULion's), and DeepSpeed's defaults for the first three.
LION_KEYS = ("lr", "betas", "weight_decay", "fp32_optimizer_states")
LION_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}

_NOT_ELEMENTWISE = (
    "tierstore updates a shard of the flat state at a time and never sees a whole tensor. Use Adam/AdamW (or "
    "another elementwise optimizer), or keep this one outside tierstore"
)
_ONE_BIT = (
    "compresses the gradients the ranks exchange (error-compensated 1-bit communication) inside the optimizer, "
    "and DeepSpeed runs it without ZeRO only; tierstore offloads an optimizer's state and leaves communication to "
    "torch. Use Adam (its uncompressed update) or AdamW"
)
_MUP = (
    "is mup's: it scales each parameter's learning rate by its width multiplier (the infshape mup.set_base_shapes "
    "gives it). Put those learning rates in the param groups and use Adam, AdamW or SGD"
)
#: DeepSpeed's optimizer types tierstore refuses (by DeepSpeed's lower-case name), with the reason.
REFUSED = {
    "onebitadam": _ONE_BIT,
    "zerooneadam": _ONE_BIT,
    "onebitlamb": _ONE_BIT,
    "lamb": "scales each tensor's update by its weight norm over its update norm (a layer-wise trust ratio), "
    "so it is not elementwise: " + _NOT_ELEMENTWISE,
    "muon": "orthogonalises each weight matrix's momentum (Newton-Schulz iterations over the whole matrix), so it "
    "is not elementwise: " + _NOT_ELEMENTWISE,
    "muadam": _MUP,
    "muadamw": _MUP,
    "musgd": _MUP,
}


def number(value: Any, name: str, arg: str) -> float:
    """``value`` as a float, or a ``ConfigError`` naming ``name`` and the override ``arg`` that fixes it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " ('auto' is filled in by Hugging Face's DeepSpeed integration)" if value == "auto" else ""
        raise ConfigError(
            f"{name}={value!r} must be a number{hint}; fix the config or pass the value as an "
            f"override: from_deepspeed_config(params, config, {arg}=...)"
        )
    return float(value)


def flag(value: Any, name: str) -> bool:
    """``value`` if it is a JSON boolean, else a ``ConfigError`` naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")
    return value


def _pair(value: Any, name: str, arg: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{name}={value!r} must be a pair such as [0.9, 0.999]")
    return (number(value[0], f"{name}[0]", arg), number(value[1], f"{name}[1]", arg))


def _section(parent: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}{key}={value!r} must be a JSON object")
    return dict(value)


def _known(params: Mapping[str, Any], keys: tuple[str, ...], kind: str) -> None:
    unknown = sorted(set(params) - set(keys))
    if unknown:
        raise ConfigError(
            f"optimizer.params has keys tierstore cannot honour: {unknown}; for {kind} it knows {list(keys)}"
        )


def _fp32_states(params: Mapping[str, Any], front: str) -> None:
    where = "optimizer.params."
    if not flag(params.get("fp32_optimizer_states", True), where + "fp32_optimizer_states"):
        raise ConfigError(
            f"{where}fp32_optimizer_states=false asks for low-precision moments; {front} keeps "
            "them in fp32. Remove the key (fp32 state is what tierstore offloads to RAM and disk)"
        )


def _adam(kind: str, params: dict[str, Any], skip: Mapping[str, Any], wanted: str | None) -> tuple[str, dict[str, Any]]:
    """Adam/AdamW: AdamW unless ``type`` is Adam with ``adam_w_mode: false`` (torch.optim.Adam's L2 decay)."""
    _known(params, PARAM_KEYS, f"type {kind!r}")
    kwargs: dict[str, Any] = {}
    where = "optimizer.params."
    adam_w_mode = flag(params.get("adam_w_mode", True), where + "adam_w_mode")
    torch_adam = flag(params.get("torch_adam", False), where + "torch_adam")
    decoupled = kind.lower() == "adamw" or adam_w_mode  # DeepSpeed's effective_adam_w_mode
    if "lr" in params and "lr" not in skip:
        kwargs["lr"] = number(params["lr"], where + "lr", "lr")
    if "betas" in params and "betas" not in skip:
        kwargs["betas"] = _pair(params["betas"], where + "betas", "betas")
    if "eps" in params and "eps" not in skip:
        kwargs["eps"] = number(params["eps"], where + "eps", "eps")
    if "weight_decay" in skip:
        decay = skip["weight_decay"]
    else:
        # DeepSpeed's FusedAdam and DeepSpeedCPUAdam default to 0; torch_adam uses torch's AdamW (0.01).
        default = 0.01 if torch_adam and decoupled else 0.0
        decay = kwargs["weight_decay"] = number(params.get("weight_decay", default), where + "weight_decay", "weight_decay")
    algorithm = "adamw" if decoupled else "adam"
    if not decoupled and wanted == "adamw":
        if decay != 0.0:
            raise ConfigError(
                f"optimizer.type={kind!r} with adam_w_mode=false applies weight_decay={decay} as L2 "
                "regularisation (added to the gradient); TieredAdamW decays weights decoupled (AdamW). "
                "Set adam_w_mode to true (DeepSpeed's default), use type 'AdamW', set weight_decay to 0, or build "
                "TieredAdam (torch.optim.Adam's L2 decay) with tierstore.from_deepspeed_config(params, config)"
            )
        algorithm = "adamw"  # without weight decay, Adam's update is AdamW's
    if "amsgrad" in params and "amsgrad" not in skip:
        kwargs["amsgrad"] = flag(params["amsgrad"], where + "amsgrad")
    if not flag(params.get("bias_correction", True), where + "bias_correction"):
        raise ConfigError(
            f"{where}bias_correction=false is not supported: TieredAdamW always applies Adam's bias "
            "correction (as torch.optim.AdamW does). Remove the key"
        )
    _fp32_states(params, "TieredAdamW")
    return algorithm, kwargs


def _adagrad(params: dict[str, Any], skip: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Adagrad: DeepSpeed's defaults are torch's (``lr`` 1e-2, ``eps`` 1e-10, no decay), so only given keys pass."""
    _known(params, ADAGRAD_KEYS, "type 'Adagrad'")
    where = "optimizer.params."
    if flag(params.get("amsgrad", False), where + "amsgrad"):
        raise ConfigError(f"{where}amsgrad=true: Adagrad has no amsgrad (DeepSpeed's CPU Adagrad ignores it). Remove the key")
    _fp32_states(params, "TieredAdagrad")
    kwargs: dict[str, Any] = {}
    for key in ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
        if key in params and key not in skip:
            kwargs[key] = number(params[key], where + key, key)
    if "maximize" in params and "maximize" not in skip:
        kwargs["maximize"] = flag(params["maximize"], where + "maximize")
    return "adagrad", kwargs


def _lion(params: dict[str, Any], skip: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Lion: DeepSpeed's defaults, passed explicitly (lion-pytorch's, TieredLion's, are ``lr`` 1e-4 and ``betas`` (0.9, 0.99))."""
    _known(params, LION_KEYS, "type 'Lion'")
    _fp32_states(params, "TieredLion")
    where = "optimizer.params."
    kwargs: dict[str, Any] = {}
    for key, default in LION_DEFAULTS.items():
        if key in skip:
            continue
        value = params.get(key, default)
        kwargs[key] = _pair(value, where + key, key) if key == "betas" else number(value, where + key, key)
    return "lion", kwargs


def _torch_class(kind: str, params: dict[str, Any], skip: Mapping[str, Any], algorithms: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Any other type: the ``torch.optim`` class DeepSpeed looks up by name, with ``params`` as its arguments."""
    matches = [a for a in algorithms.values() if a.torch_class.lower() == f"torch.optim.{kind}".lower()]
    if not matches:
        fronts = sorted(a.torch_class.rsplit(".", 1)[-1] for a in algorithms.values() if a.torch_class.startswith("torch.optim."))
        raise ConfigError(
            f"optimizer.type={kind!r} is not supported: tierstore maps DeepSpeed's Adam, AdamW, Adagrad and Lion, and "
            f"the torch.optim classes it has a front for ({', '.join(fronts)}). Use one of those, or keep that "
            "optimizer outside tierstore"
        )
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key in skip:
            continue
        if value == "auto":
            number(value, f"optimizer.params.{key}", key)  # the Hugging Face hint
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return matches[0].name, kwargs


def map_optimizer(
    opt: Mapping[str, Any], skip: Mapping[str, Any], *, algorithms: Mapping[str, Any], wanted: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The registered algorithm an ``optimizer`` section asks for, and its front's keyword arguments.

    ``skip`` are arguments the caller sets itself (their keys are not read,
    but ``weight_decay`` is still checked against L2 mode). ``wanted`` is the
    algorithm of the front being built (``"adamw"`` for
    ``TieredAdamW.from_deepspeed_config``: Adam's L2 mode is then refused
    unless it has no weight decay); ``None``: whichever the config asks for.
    ``algorithms``: the registry (:data:`tierstore._compute.algorithms.ALGORITHMS`), whose torch classes
    a ``torch.optim`` type name is looked up among.

    Raises
    ------
    ConfigError
        For a type tierstore has no front for (with the reason for DeepSpeed's
        own: 1-bit Adam, LAMB, Muon, mup's), keys it cannot honour, or values
        of the wrong kind, naming the key and the fix.
    """
    if not opt:
        return "adamw", {}  # no optimizer section: TieredAdamW's (torch AdamW's) defaults
    unknown = sorted(set(opt) - {"type", "params"})
    if unknown:
        raise ConfigError(f"optimizer has unknown keys {unknown}; tierstore reads optimizer.type and optimizer.params")
    kind = opt.get("type", "AdamW")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"optimizer.type={kind!r} is not supported: name an optimizer, e.g. 'AdamW'")
    params = _section(opt, "params", "optimizer.")
    lower = kind.lower()
    if lower in REFUSED:
        raise ConfigError(f"optimizer.type={kind!r} is not supported: {kind} {REFUSED[lower]}")
    if lower in ADAM_TYPES:
        return _adam(kind, params, skip, wanted)
    if lower == "adagrad":
        return _adagrad(params, skip)
    if lower == "lion":
        return _lion(params, skip)
    return _torch_class(kind, params, skip, algorithms)
