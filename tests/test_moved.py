"""Old module paths (``tierstore/_moved.py``): a split module's old names still resolve, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

from tierstore._compute import codecs, formats

#: Every public name of ``tierstore.codecs`` before it was split into codecs and formats.
OLD_CODECS_NAMES = [
    "ALIASES", "BLOCK_NUMEL", "BUCKET_SHIFT", "CAPACITY_MULTIPLE", "CHUNK_NUMEL", "DEFAULT_FORMAT", "FIELDS",
    "FIELD_ALIGN", "FORMATS", "IMPLS", "MomentFormat", "NONFINITE_CODE", "RoundingKey", "decode", "decode_chunk",
    "encode", "encode_chunk", "int8_boundaries", "int8_map", "kernel_tables", "moment_format", "native_kernel", "split",
]  # fmt: skip


def test_the_old_codecs_path_resolves_every_old_name_from_its_new_home_with_a_warning(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "tierstore.codecs", raising=False)  # a first import: the warning fires
    with pytest.warns(DeprecationWarning, match=r"tierstore\.codecs moved to tierstore\._compute\.codecs and tierstore\._compute\.formats"):
        old = importlib.import_module("tierstore.codecs")
    for name in OLD_CODECS_NAMES:
        home = codecs if name in codecs.__all__ else formats
        assert name in home.__all__, f"{name} has no home"
        assert getattr(old, name) is getattr(home, name), name
    from tierstore.codecs import encode, moment_format  # the from-import form a user wrote

    assert encode is codecs.encode and moment_format is formats.moment_format
    with pytest.raises(AttributeError, match="no attribute 'nope'.*tierstore._compute.formats"):
        old.nope  # noqa: B018
