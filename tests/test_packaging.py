"""What the project says about itself agrees with what is installed and with the tree.

The torch range is declared once, in ``pyproject.toml``; the installed torch
must satisfy it, and every other place that names it (README, the
compatibility page, the message of a missing private API) names the same
range. The security and compatibility pages cite source files and tests by
path: each path must exist (a module moved into a package leaves a stale one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tierstore._platform import torch_private

ROOT = Path(__file__).resolve().parents[1]
# "torch 2.13", "torch==2.13.0", "torch>=2.13,<2.14": a torch version (or range) as prose or a pin
TORCH_MENTION = re.compile(r"torch(?:\s+|\s*==\s*)(\d+\.\d+(?:\.\d+)?)\b")
TORCH_RANGE = re.compile(r"torch((?:[<>]=?|~=)[\d.]+(?:,\s*(?:[<>!]=?|~=)[\d.]+)*)")  # "torch>=2.13,<2.14"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _declared() -> SpecifierSet:
    """The torch specifier of the project's dependencies (exactly one entry names torch)."""
    torch_reqs = [r for r in map(Requirement, _pyproject()["project"]["dependencies"]) if r.name == "torch"]
    assert len(torch_reqs) == 1, f"pyproject.toml names torch {len(torch_reqs)} times in its dependencies"
    return torch_reqs[0].specifier


def _minors(spec: SpecifierSet) -> set[str]:
    """The ``major.minor`` releases of torch 2 the range admits (any patch level)."""
    return {f"2.{m}" for m in range(100) if any(Version(f"2.{m}.{p}") in spec for p in range(20))}


def test_the_installed_torch_is_in_the_declared_range() -> None:
    spec = _declared()
    installed = Version(torch.__version__.split("+")[0])  # "2.13.0+cpu": the local label is the build
    assert installed in spec, f"torch {torch.__version__} is installed, pyproject.toml declares torch{spec}"


def test_the_declared_range_is_the_one_the_docs_and_messages_state() -> None:
    spec = _declared()
    minors = _minors(spec)
    assert minors, f"torch{spec} admits no torch 2 release"
    texts = {
        "README.md": (ROOT / "README.md").read_text(),
        "docs/compatibility.md": (ROOT / "docs/compatibility.md").read_text(),
        "torch_private._PINNED": torch_private._PINNED,
    }
    # The two that give the range as a pip requirement give the one pyproject.toml declares.
    for name in ("docs/compatibility.md", "torch_private._PINNED"):
        ranges = [SpecifierSet(r) for r in TORCH_RANGE.findall(texts[name])]
        assert ranges, f"{name} states no torch range"
        assert all(r == spec for r in ranges), f"{name} states torch{ranges}, pyproject.toml torch{spec}"
    # Every torch version anywhere in them (prose or pin) is inside the range, and each admitted
    # release is named where the user reads which torch to install.
    for name, text in texts.items():
        mentions = TORCH_MENTION.findall(text)
        assert mentions, f"{name} names no torch version"
        for version in mentions:
            minor = ".".join(version.split(".")[:2])
            assert minor in minors, f"{name} names torch {version}, outside the declared torch{spec}"
            if version.count(".") == 2:
                assert Version(version) in spec, f"{name} pins torch {version}, outside torch{spec}"
    for minor in minors:
        assert f"torch {minor}" in texts["README.md"], f"README.md does not say it supports torch {minor}"


# -- paths the docs cite ---------------------------------------------------------------------

# A repository path in backticks or a link: tierstore/..., tests/..., bench/..., docs/...
CITED_PATH = re.compile(r"(?<![\w./-])((?:tierstore|tests|bench|docs|\.ci)/[\w./*<>-]*[\w*])(?:::(\w+))?")


@pytest.mark.parametrize("page", ["docs/security.md", "docs/compatibility.md"])
def test_every_path_a_page_cites_exists(page: str) -> None:
    text = (ROOT / page).read_text()
    cited = CITED_PATH.findall(text)
    assert cited, f"{page} cites no file: the pattern is wrong"
    missing = []
    for path, test_name in cited:
        if "<" in path:  # a pattern such as .lock-<pid>-<random>.tmp, not a path
            continue
        found = sorted(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            missing.append(path)
        elif test_name and not re.search(rf"^def {test_name}\(", found[0].read_text(), re.M):
            missing.append(f"{path}::{test_name}")
    assert missing == [], f"{page} cites paths that do not exist: {missing}"
