"""Nothing tierstore reads is unpickled: a file that would run code when unpickled runs nothing.

Two halves. A scan of the package's source (``ast``) fails on any import of a
module that unpickles (``pickle``, ``marshal``, ``shelve``, ``dill``, ...;
importing an exception class such as ``UnpicklingError`` is allowed), on any
``torch.load`` without ``weights_only=True``, and on the other doors to code
in a file (``numpy.load(allow_pickle=True)``, ``torch.jit.load``, widening
``weights_only``'s allow-list). Then the behaviour: a torch file whose pickle
would create a sentinel file when unpickled is given to every tierstore
reader that could be handed a ``.pt`` file; each ends in a tierstore error
(or a usage error from the CLI), and the sentinel never appears. The fixture
first proves the payload is live: ``torch.load(weights_only=False)`` creates
the sentinel.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import pickle  # the test builds the hostile files; tierstore itself may not import it
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tierstore import TieredAdamW, TierstoreError
from tierstore.errors import CorruptStateError

PACKAGE = Path(__file__).resolve().parents[1] / "tierstore"

UNPICKLING_MODULES = frozenset({"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"})
EXCEPTIONS_ONLY = frozenset({"UnpicklingError", "PickleError", "PicklingError"})  # importing these runs nothing


# -- the scan --------------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def findings(source: str, where: str = "<source>") -> list[str]:
    """Every way ``source`` could unpickle or run code from a file, as ``where:line: what``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> what it names ("torch.load", "numpy", ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNPICKLING_MODULES:
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module.split(".")[0] in UNPICKLING_MODULES and alias.name not in EXCEPTIONS_ONLY:
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        full = full.replace("np.", "numpy.", 1) if full.startswith("np.") else full
        if full in ("importlib.import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in UNPICKLING_MODULES:
                found.append(f"{where}:{node.lineno}: {full}({arg.value!r})")
        elif full in ("torch.load", "torch.serialization.load"):
            if not _keyword_is(node, "weights_only", True):
                found.append(f"{where}:{node.lineno}: {full}(...) without weights_only=True")
        elif full == "numpy.load" and any(
            k.arg in ("allow_pickle", None) and not _keyword_is(node, "allow_pickle", False) for k in node.keywords
        ):
            found.append(f"{where}:{node.lineno}: numpy.load(allow_pickle=...)")
        elif full in ("torch.jit.load", "torch.package.PackageImporter") or full.endswith(".read_pickle"):
            found.append(f"{where}:{node.lineno}: {full}(...) runs code from the file")
        elif full.endswith(("add_safe_globals", "serialization.safe_globals")):
            found.append(f"{where}:{node.lineno}: {full}(...) widens what weights_only unpickles")
    return found


def test_nothing_in_the_package_can_unpickle() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 50, f"the scan found only {len(sources)} files under {PACKAGE}"
    found = [f for path in sources for f in findings(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "source, caught",
    [
        ("import pickle", True),
        ("import pickle as p", True),
        ("import marshal", True),
        ("import shelve", True),
        ("import dill", True),
        ("from pickle import loads", True),
        ("from _pickle import Unpickler", True),
        ("import importlib\nimportlib.import_module('pickle')", True),
        ("import torch\ntorch.load(f)", True),
        ("import torch\ntorch.load(f, weights_only=False)", True),
        ("import torch\ntorch.load(f, **kwargs)", True),
        ("from torch import load\nload(f, map_location='cpu')", True),
        ("from torch import load as tl\ntl(f)", True),
        ("import torch.serialization\ntorch.serialization.load(f)", True),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", True),
        ("import torch\ntorch.jit.load(f)", True),
        ("import torch\ntorch.serialization.add_safe_globals([object])", True),
        ("import torch\ntorch.load(f, mmap=True, weights_only=True)", False),
        ("from pickle import UnpicklingError", False),
        ("import numpy as np\nnp.load(f)", False),
        ("import json\njson.load(f)", False),
        ("opt.load_state_dict(sd)", False),
    ],
)
def test_the_scan_catches_each_way_to_unpickle(source: str, caught: bool) -> None:
    """The scan is only as good as what it recognises: each door it must find, and calls it must let be."""
    assert bool(findings(source)) == caught, findings(source)


# -- the behaviour ---------------------------------------------------------------------------


class _RunsCode:
    """Unpickled, creates ``path``: what a hostile ``optimizer.pt`` would do (with ``os.system`` instead)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


@dataclass
class Hostile:
    sentinel: Path
    files: dict[str, Path]  # how it was written -> the file


def _adamw_state_dict() -> dict:
    w = torch.nn.Parameter(torch.ones(64))
    ref = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(64)
    ref.step()
    return ref.state_dict()


@pytest.fixture
def hostile(tmp_path: Path) -> Hostile:
    """An optimizer state dict with the code-running object inside, written three ways; the payload proven live."""
    sentinel = tmp_path / "outside" / "ran"
    sentinel.parent.mkdir()
    sd = _adamw_state_dict()
    sd["state"][0]["exp_avg"] = _RunsCode(sentinel)  # where a moment tensor belongs
    (tmp_path / "in").mkdir()
    files = {"zip": tmp_path / "in" / "optimizer.pt", "legacy": tmp_path / "in" / "legacy.pt",
             "raw-pickle": tmp_path / "in" / "raw.pt"}  # fmt: skip
    torch.save(sd, files["zip"])
    torch.save(sd, files["legacy"], _use_new_zipfile_serialization=False)
    files["raw-pickle"].write_bytes(pickle.dumps(sd))
    for how, path in files.items():  # each file runs its code when unpickled without weights_only
        if how == "raw-pickle":
            pickle.loads(path.read_bytes())
        else:
            torch.load(path, weights_only=False)
        assert sentinel.exists(), f"the payload of {path.name} is not live: the test would prove nothing"
        sentinel.unlink()
    return Hostile(sentinel, files)


def _never_ran(h: Hostile) -> None:
    assert not h.sentinel.exists(), "a hostile pickle ran code"


@pytest.mark.parametrize("how", ["zip", "legacy", "raw-pickle"])
def test_load_torch_optimizer_file_refuses_it_and_runs_nothing(hostile: Hostile, how: str) -> None:
    from tierstore.integrations.torch_file import load_torch_optimizer_file

    w = torch.nn.Parameter(torch.ones(64))
    with TieredAdamW([w], lr=0.1) as opt:
        with pytest.raises(Exception) as info:  # noqa: PT011 - the sentinel is checked first, then the type
            load_torch_optimizer_file(opt, hostile.files[how])
        _never_ran(hostile)
        assert isinstance(info.value, CorruptStateError), repr(info.value)
        assert str(hostile.files[how]) in str(info.value)
        assert "weights_only=False" not in str(info.value), "the message must not advise loading it unsafely"
        w.grad = torch.ones(64)
        opt.step()  # refused before any change: still usable
        assert opt.step_count == 1


@pytest.mark.parametrize("how", ["zip", "legacy", "raw-pickle"])
def test_checkpoint_readers_refuse_it_and_run_nothing(hostile: Hostile, how: str, tmp_path: Path) -> None:
    from tierstore._state.reader import StateReader
    from tierstore.checkpoint import (
        checkpoint_to_state_dict,
        load_checkpoint,
        statedir_to_state_dict,
        verify_checkpoint,
    )

    path = hostile.files[how]
    for read in (checkpoint_to_state_dict, verify_checkpoint, statedir_to_state_dict, lambda p: StateReader(p).close()):
        with pytest.raises(TierstoreError):
            read(path)
    with TieredAdamW([torch.nn.Parameter(torch.ones(64))], lr=0.1) as opt, pytest.raises(TierstoreError):
        load_checkpoint(opt, path)
    _never_ran(hostile)


@pytest.mark.parametrize(
    "argv",
    [
        ["to-torch", "--from-zarr", "{src}", "{out}/sd.pt"],
        ["to-torch", "{src}", "{out}/sd.pt"],
        ["inspect", "{src}"],
        ["verify", "{src}"],
        ["export", "{src}", "{out}/ck.zarr"],
    ],
    ids=["to-torch-from-zarr", "to-torch", "inspect", "verify", "export"],
)
def test_the_cli_refuses_a_pt_file_as_input_and_runs_nothing(hostile: Hostile, tmp_path: Path, argv: list[str]) -> None:
    from tierstore.cli import main

    (tmp_path / "out").mkdir()
    args = [a.format(src=hostile.files["zip"], out=tmp_path / "out") for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as exc:
            rc = exc.code
    assert rc == 2, (rc, out.getvalue(), err.getvalue())  # usage: a .pt file is not what these commands read
    assert "Traceback" not in out.getvalue() + err.getvalue()
    assert os.listdir(tmp_path / "out") == []
    _never_ran(hostile)


def _trainer_checkpoint(where: Path, optimizer_pt: Path, scheduler_pt: Path) -> Path:
    """A checkpoint folder as Trainer writes it with torch's AdamW: optimizer.pt and scheduler.pt."""
    ck = where / "checkpoint-4"
    ck.mkdir(parents=True)
    shutil.copy(optimizer_pt, ck / "optimizer.pt")
    shutil.copy(scheduler_pt, ck / "scheduler.pt")
    return ck


def test_a_trainer_resume_from_hostile_optimizer_or_scheduler_files_runs_nothing(hostile: Hostile, tmp_path: Path) -> None:
    """TieredTrainer's resume from a checkpoint folder written by torch's AdamW reads optimizer.pt and
    scheduler.pt, both torch files: neither runs what it holds."""
    pytest.importorskip("transformers")
    hf = pytest.importorskip("tierstore.integrations.hf")

    w = torch.nn.Parameter(torch.ones(64))
    good = tmp_path / "good.pt"
    torch.save(_adamw_state_dict(), good)
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), lambda s: 1.0)
    with TieredAdamW([w], lr=0.1) as opt:

        class Resuming:  # what _load_optimizer_and_scheduler uses of a Trainer
            lr_scheduler = sched

            def _tiered(self):
                return opt

        resume = hf.TieredTrainer._load_optimizer_and_scheduler
        with pytest.raises(CorruptStateError, match="optimizer.pt"):
            resume(Resuming(), str(_trainer_checkpoint(tmp_path / "a", hostile.files["zip"], good)))
        _never_ran(hostile)
        # scheduler.pt is read as Trainer reads it (torch.load(weights_only=True)); torch's refusal
        # becomes a tierstore error naming the checkpoint (torch's own advises weights_only=False).
        with pytest.raises(CorruptStateError, match=r"checkpoint-4.*scheduler\.pt holds more than tensors"):
            resume(Resuming(), str(_trainer_checkpoint(tmp_path / "b", good, hostile.files["zip"])))
        _never_ran(hostile)
