"""One home for configuration: every knob declared once in ``tierstore._config.registry``, and read through it.

- every ``TieredAdamW`` and ``attach()`` keyword that is not an AdamW
  hyperparameter is a knob, with the signature's type and default; the
  tuning knobs (``Knobs``) take their defaults and checks from it;
- ``env()`` is the one reader of ``TIERSTORE_*`` variables (the source is
  scanned) and its errors name the variable, the value and the fix;
- the flags and DeepSpeed keys a knob lists exist;
- ``docs/tuning.md``'s table of knobs is the registry's
  (``python tests/test_config_registry.py`` rewrites it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from tierstore import TieredAdamW
from tierstore._config import registry
from tierstore._config.knobs import Knobs
from tierstore._config.registry import HYPERPARAMETERS, KNOBS, MAX_ENV_CHARS, Knob, env
from tierstore.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tierstore"
DOC = ROOT / "docs" / "tuning.md"
MARK = re.compile(r"(<!-- knob-table:start -->\n)(.*?)(<!-- knob-table:end -->)", re.S)
ENV_KNOBS = [k for k in KNOBS.values() if k.env]
# Scripts that are not `tierstore` subcommands, by the name a knob's flags use.
SCRIPTS = {"bench/overlap.py": "tierstore.cli.bench.overlap"}


# -- declared once, truthfully --------------------------------------------------------------
def test_a_knob_declared_twice_is_refused() -> None:
    knob = KNOBS["prefetch_depth"]
    with pytest.raises(AssertionError, match="prefetch_depth declared twice"):
        registry._knobs(knob, dataclasses.replace(knob, default=3))
    variables = [k.env for k in ENV_KNOBS]
    assert len(variables) == len(set(variables)), "a TIERSTORE_ variable set by two knobs"
    assert all(k.kind in ("identity", "resource") for k in KNOBS.values())
    assert all(k.check is not None or k.checked_by for k in KNOBS.values()), "a knob nothing checks"
    assert all(k.argument or k.env for k in KNOBS.values()), "a knob nothing sets"


@pytest.mark.parametrize(("owner", "function", "skip"), [
    ("TieredAdamW", TieredAdamW.__init__, {"self", "params", *HYPERPARAMETERS}),
    ("attach", TieredAdamW.attach, {"self", "model"}),
])  # fmt: skip
def test_every_keyword_is_a_knob_with_the_signatures_type_and_default(owner, function, skip) -> None:
    params = {n: p for n, p in inspect.signature(function).parameters.items() if n not in skip}
    declared = {k.name: k for k in KNOBS.values() if k.argument == owner}
    assert sorted(params) == sorted(declared), f"{owner}'s keywords and the registry's {owner} knobs differ"
    for name, p in params.items():
        assert (declared[name].type, declared[name].default) == (p.annotation, p.default), name


def test_the_tuning_knobs_take_their_defaults_and_checks_from_the_registry() -> None:
    for field in dataclasses.fields(Knobs):
        knob = KNOBS[field.name]
        assert (field.default, knob.argument) == (knob.default, "TieredAdamW"), field.name
        assert knob.check is not None, field.name
    bad = {"backend": "nvme", "prefetch_depth": 0, "io_workers": 2.5, "request_bytes": 4097,
           "update_threads": True, "pin_memory": "yes"}  # fmt: skip
    assert sorted(bad) == sorted(f.name for f in dataclasses.fields(Knobs))
    for name, value in bad.items():
        with pytest.raises(ConfigError) as by_registry:
            KNOBS[name].validate(value)
        with pytest.raises(ConfigError) as by_knobs:
            Knobs(**{name: value})
        assert str(by_knobs.value) == str(by_registry.value)
        assert f"{name}={value!r}" in str(by_knobs.value)


def test_the_flags_and_deepspeed_keys_a_knob_names_exist() -> None:
    from tierstore.cli import COMMANDS
    from tierstore.deepspeed_config import OFFLOAD_KEYS, PARAM_KEYS

    options: dict[str, set[str]] = {}
    for knob in KNOBS.values():
        for flag in knob.flags:
            command, option = flag.rsplit(" ", 1)
            if command not in options:
                parser = argparse.ArgumentParser()
                importlib.import_module(SCRIPTS.get(command) or COMMANDS[command][0]).add_arguments(parser)
                options[command] = {s for a in parser._actions for s in a.option_strings}
            assert option in options[command], f"{knob.name}: {flag} is not an option of {command}"
        if knob.deepspeed:
            section, key = knob.deepspeed.rsplit(".", 1)
            known = {"zero_optimization.offload_optimizer": OFFLOAD_KEYS, "optimizer.params": PARAM_KEYS}[section]
            assert key in known, f"{knob.name}: {knob.deepspeed} is not a key deepspeed_config reads"


def test_moment_dtype_names_the_formats_there_are() -> None:
    from tierstore._compute.codecs import FORMATS

    for name in FORMATS:
        assert name in KNOBS["moment_dtype"].doc


# -- env(): the one reader of TIERSTORE_* ---------------------------------------------------
@pytest.mark.parametrize(("variable", "value", "fix"), [
    ("TIERSTORE_HUGEPAGES", "Lots", "use '1' (default) or '0'"),
    ("TIERSTORE_NATIVE", "fastest", "use 'auto' (default), '0' or 'require'"),
    ("TIERSTORE_CC", "gcc '-O2", "set it to a compiler"),
    *[(k.env, "x" * (MAX_ENV_CHARS + 1), "unset it or give a shorter value") for k in ENV_KNOBS],
])  # fmt: skip
def test_env_errors_name_the_variable_the_value_and_the_fix(monkeypatch, variable, value, fix) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as e:
        env(variable)
    message = str(e.value)
    assert message.startswith(f"{variable}={value[:40]!r}"), message
    assert fix in message
    assert len(message) < 400, "a crafted value is cut short in the message"


@pytest.mark.parametrize("knob", ENV_KNOBS, ids=lambda k: k.env)
def test_env_unset_or_blank_is_the_default(monkeypatch, knob: Knob) -> None:
    monkeypatch.delenv(knob.env, raising=False)
    assert env(knob.env) == knob.default
    monkeypatch.setenv(knob.env, "  ")
    assert env(knob.env) == knob.default


def test_env_reads_the_values_as_the_code_uses_them(monkeypatch, tmp_path) -> None:
    for text, mode in (("0", "off"), ("OFF", "off"), ("require", "require"), ("1", "auto")):
        monkeypatch.setenv("TIERSTORE_NATIVE", text)
        assert env("TIERSTORE_NATIVE") == mode
    monkeypatch.setenv("TIERSTORE_CC", "gcc -O2")
    assert env("TIERSTORE_CC") == ("gcc", "-O2")
    monkeypatch.setenv("TIERSTORE_CACHE_DIR", str(tmp_path / "~x"))
    assert env("TIERSTORE_CACHE_DIR") == tmp_path / "~x"  # as written: no expansion


def _environ_reads(source: str) -> list[tuple[int, str]]:
    """``(line, key)`` of each ``os.environ``/``os.getenv`` access to a ``TIERSTORE_*`` key in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            if target in ("os.getenv", "os.environ.get", "os.environ.pop", "os.environ.setdefault", "environ.get"):
                keys = node.args[:1]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) in ("os.environ", "environ") for c in node.comparators):
            keys = [node.left]
        for key in keys:
            text = ast.unparse(key)
            if "TIERSTORE_" in text:
                found.append((node.lineno, text))
    return found


def test_the_scan_finds_direct_reads() -> None:
    source = 'import os\na = os.environ.get("TIERSTORE_X", "1")\nb = os.environ["TIERSTORE_Y"]\n'
    source += 'c = "TIERSTORE_Z" in os.environ\nd = os.getenv(f"TIERSTORE_{n}")\n'
    assert [line for line, _ in _environ_reads(source)] == [2, 3, 4, 5]


def test_every_tierstore_variable_is_read_through_env() -> None:
    direct, undeclared = [], []
    declared = {k.env for k in ENV_KNOBS}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "TIERSTORE_" not in source:
            continue  # no key to read; parsing only the others keeps the scan fast
        rel = path.relative_to(ROOT)
        direct += [f"{rel}:{line} reads {key} itself" for line, key in _environ_reads(source)]
        for name in sorted(set(re.findall(r"TIERSTORE_[A-Z0-9_]*[A-Z0-9]", source)) - declared):
            undeclared.append(f"{rel} names {name}, which no knob declares")
    assert not direct, "read TIERSTORE_ variables with tierstore._config.registry.env():\n" + "\n".join(direct)
    assert not undeclared, "\n".join(undeclared)


# -- the docs' table ------------------------------------------------------------------------
def _code(value: object) -> str:
    return f"`{value!r}`" if not isinstance(value, int) or isinstance(value, bool) or value < 1 << 20 else (
        f"`{value >> 20} << 20` ({value >> 20} MiB)")  # fmt: skip


def render_table() -> str:
    """The markdown table of every knob, as docs/tuning.md shows it."""
    rows = ["| knob | kind | default | unit | set by | what it does |", "|---|---|---|---|---|---|"]
    for knob in sorted(KNOBS.values(), key=lambda k: (k.kind != "identity", k.env is not None)):
        where = [f"`{knob.argument}({knob.name}=)`" if knob.argument else f"`{knob.env}`"]
        where += [f"DeepSpeed `{knob.deepspeed}`"] if knob.deepspeed else []
        where += [f"`{flag}`" for flag in knob.flags]
        default = knob.default_doc or _code(knob.default)
        rows.append(f"| `{knob.name}` | {knob.kind} | {default} | {knob.unit or '-'} | {'<br>'.join(where)} | "
                    f"{knob.doc} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_the_registrys() -> None:
    match = MARK.search(DOC.read_text())
    assert match, f"no <!-- knob-table:start --> ... <!-- knob-table:end --> block in {DOC}"
    assert match.group(2) == render_table(), "docs/tuning.md's knob table is stale: run python tests/test_config_registry.py"


if __name__ == "__main__":  # rewrite the table in docs/tuning.md
    text = DOC.read_text()
    DOC.write_text(MARK.sub(lambda m: m.group(1) + render_table() + m.group(3), text))
    print(f"wrote the knob table into {DOC}")
