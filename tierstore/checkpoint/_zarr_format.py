"""The zarr v3 layout of a checkpoint: its format name and version, its group attributes, its arrays per field.

What a checkpoint *is* on disk, shared by the writer and the reader: the
group's attributes (:class:`CheckpointHeader`), the arrays that hold a field
in the layout's moment format and the attributes each carries
(:func:`array_specs`), and the size of a chunk file. The layout itself is
described in the package docstring and ``docs/checkpoints.md``.

Example
-------
>>> w = torch.zeros(3, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"), moment_dtype="int8")
>>> scales_name(layout, "exp_avg"), numpy_codes(torch.ones(2, dtype=torch.bfloat16)).tolist()  # bfloat16 as its bits
('exp_avg_scales', [16256, 16256])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from zarr.codecs import Crc32cCodec

from .._compute import formats
from .._compute.algorithms import ADAMW
from .._layout.layout import Layout
from .._layout.scalar_record import RECORD_KEY
from .._version import __version__
from ._files import read_regular

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "COMPRESSED_VERSION",
    "ALGORITHM_VERSION",
    "SCALES_SUFFIX",
    "CHECKSUMS",
    "MAX_METADATA_NBYTES",
    "CheckpointHeader",
    "scales_name",
    "numpy_codes",
    "array_specs",
    "chunk_file_nbytes",
    "is_checkpoint",
    "least_version",
    "algorithm_attribute",
]

FORMAT_NAME = "tierstore-checkpoint"
# 2: compressed moments (written only for them; float32 AdamW checkpoints stay version 1); 3: the state of an
# optimizer algorithm other than AdamW, named by the "algorithm" attribute (AdamW checkpoints stay 1 or 2).
FORMAT_VERSION = 3
#: The format version each feature first needs (a checkpoint is written with the least that holds it).
COMPRESSED_VERSION, ALGORITHM_VERSION = 2, 3
SCALES_SUFFIX = "_scales"
CHECKSUMS = ("xxh3", "crc32c", None)
MAX_METADATA_NBYTES = 256 << 20  # 256 MiB: a zarr.json (the group's holds ~200 B per parameter)


@dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint records besides the arrays."""

    layout: Layout
    step_count: int
    param_groups: list[dict[str, Any]]  # encoded (manifest.encode_groups), without "params"
    param_steps: list[float | None]
    source: str  # "optimizer", "state_dir" or "torch"
    known_shapes: list[bool] | None = None  # torch-made checkpoints: shapes of stateless params are unknown
    has_master: list[bool] | None = None  # torch-made checkpoints: which params came with a master
    # Each parameter's scalars besides its step (tierstore._layout.scalar_record: NAdam's mu_product); None, and
    # no attribute, for an algorithm without such scalars (AdamW's checkpoints keep their bytes).
    param_scalars: dict[str, list[float | None]] | None = None

    def attributes(self, checksum: str | None) -> dict[str, Any]:
        layout = self.layout
        index = []
        for p in layout.params:
            entry = {
                "index": p.index,
                "group": p.group,
                "shape": list(p.shape) if self.known_shapes is None or self.known_shapes[p.index] else None,
                "dtype": p.dtype,
                "start": p.start,
                "numel": p.numel,
                "trainable": p.trainable,
            }
            if "master" in layout.fields:
                entry["has_master"] = p.trainable and (self.has_master is None or self.has_master[p.index])
            index.append(entry)
        fmt = layout.format
        scalars = {} if self.param_scalars is None else {RECORD_KEY: {k: list(v) for k, v in self.param_scalars.items()}}
        extra = {}
        if layout.encoded:
            extra = {
                "moment_dtype": fmt.name,
                "scale_arrays": {
                    layout.state_key(f): scales_name(layout, f) for f in layout.encoded_fields if fmt.block_numel
                },
            }
        return {
            "format": FORMAT_NAME,
            "format_version": least_version(layout),
            **algorithm_attribute(layout),
            **extra,
            "tierstore_version": __version__,
            "source": self.source,
            "fingerprint": layout.fingerprint,
            "layout": layout.to_dict(),
            "total_numel": layout.total_numel,
            "shard_numel": layout.shard_numel,
            "arrays": [layout.state_key(f) for f in layout.fields],
            "checksum": checksum,
            "step_count": int(self.step_count),
            "param_groups": self.param_groups,
            "param_steps": [None if s is None else float(s) for s in self.param_steps],
            **scalars,
            "params": index,
        }


def least_version(layout: Layout) -> int:
    """The format version a checkpoint of ``layout`` is written with: the least that holds it.

    1 for AdamW in float32, :data:`COMPRESSED_VERSION` for compressed moments, :data:`ALGORITHM_VERSION`
    for another optimizer algorithm (a tierstore that predates it says "upgrade" instead of "damaged").
    """
    if layout.algorithm.name != ADAMW.name:
        return ALGORITHM_VERSION
    return COMPRESSED_VERSION if layout.encoded else 1


def algorithm_attribute(layout: Layout) -> dict[str, str]:
    """The group attributes naming the state's optimizer algorithm: none for AdamW (its checkpoints keep
    their bytes), else ``algorithm`` (the name its layout records) and ``torch_class`` (for plain zarr readers)."""
    algorithm = layout.algorithm
    if algorithm.name == ADAMW.name:
        return {}
    return {"algorithm": algorithm.name, "torch_class": algorithm.torch_class}


def scales_name(layout: Layout, field: str) -> str:
    """The name of the array of ``field``'s int8 block scales (beside the array of its codes)."""
    return layout.state_key(field) + SCALES_SUFFIX


def numpy_codes(codes: torch.Tensor) -> np.ndarray:
    """Codes as NumPy (bfloat16 as the uint16 of its bits: NumPy has no bfloat16)."""
    if codes.dtype == torch.bfloat16:
        return codes.view(torch.int16).numpy().view(np.uint16)
    return codes.numpy()


def array_specs(layout: Layout, field: str) -> dict[str, tuple[str, int, int, dict[str, Any]]]:
    """The arrays holding ``field`` in a checkpoint of ``layout``: name -> (dtype, length, chunk, attributes)."""
    total, chunk, fmt = layout.total_numel, layout.shard_numel, layout.format
    key = layout.state_key(field)
    if field not in layout.encoded_fields or fmt.exact:
        return {key: ("float32", total, chunk, {"field": field})}
    if fmt.code_itemsize == 2:
        return {key: ("uint16", total, chunk, {
            "field": field, "encoding": "bfloat16",
            "decode": "(codes.astype('uint32') << 16).view('float32')",
        })}
    bn = fmt.block_numel
    values = formats.int8_map(fmt, field)
    return {
        key: ("uint8", total, chunk, {
            "field": field, "encoding": "int8-blockwise", "block_numel": bn, "scales": scales_name(layout, field),
            "nonfinite_code": formats.NONFINITE_CODE, "map": [float(v) for v in values],
            "decode": "numpy.append(map, numpy.nan).astype('float32')[codes] * scales[i // block_numel] (i: the flat index)",
        }),
        scales_name(layout, field): ("float32", total // bn, chunk // bn, {"field": field, "scales_of": key, "block_numel": bn}),
    }


def chunk_file_nbytes(arr: Any) -> int:
    """Bytes of every chunk file of a checkpoint array (edge chunks are stored whole; crc32c adds 4)."""
    crc = any(isinstance(c, Crc32cCodec) for c in arr.metadata.codecs)
    return arr.chunks[0] * arr.dtype.itemsize + (4 if crc else 0)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory whose own ``zarr.json`` (a regular file, read without following
    links and bounded in size) names the tierstore checkpoint format."""
    try:
        raw = read_regular(path / "zarr.json", MAX_METADATA_NBYTES)
        attrs = json.loads(raw).get("attributes", {})
        return isinstance(attrs, dict) and attrs.get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable or not JSON: not a checkpoint
        return False
