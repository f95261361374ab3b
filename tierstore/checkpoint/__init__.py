"""Streaming checkpoints in zarr v3, and conversions to and from torch state dicts (``torch.optim.AdamW``'s, or the state's algorithm's torch class's).

A checkpoint is a zarr v3 group holding one 1-D array per state field
(``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` / ``master_param`` when
present) over the layout's flat index space, chunked so that every shard is
exactly one chunk. The group's attributes name the format, the layout, the
step counts, the param groups and a parameter index, so plain ``zarr`` reads
any parameter's state without tierstore::

    g = zarr.open_group(path, mode="r")
    p = g.attrs["params"][3]
    exp_avg = g["exp_avg"][p["start"] : p["start"] + p["numel"]].reshape(p["shape"])

Moments are stored in the optimizer's ``moment_dtype`` (the group attribute
``moment_dtype``; float32 when absent): float32 arrays as above; ``bfloat16``
as uint16 arrays of the bfloat16 bits (``(codes.astype("uint32") << 16).view("float32")``);
``int8`` as uint8 code arrays plus a float32 ``<key>_scales`` array (one
scale per 256 elements) and the 255-value map in the code array's ``map``
attribute (``map[code] * scales[i // 256]`` in float32 at flat index ``i``;
code 255 is NaN). Loading
converts: a checkpoint of any format loads into an optimizer of any format
(same format: the stored bytes are copied; otherwise decoded and encoded).

Saving streams shard by shard through the optimizer's arena (one chunk of
each field in flight), loading streams back; both go through the optimizer's
public access protocol (:mod:`tierstore._runtime.access`: ``visit_shards``,
``replace_shards``). The chunk files of float32 arrays (masters, fp32
moments, int8 scales) are written from and read into the arena itself
(:mod:`tierstore._storage.chunkfile`; zarr writes and reads the metadata), so they
need no RAM beyond ``ram_budget`` but a 1 MiB scratch buffer, used when the
loading optimizer cuts its shards elsewhere than the checkpoint's chunks;
the code arrays of a compressed format (a half or a quarter of a float32
chunk) go through zarr, one chunk in flight. The full layout is in
``docs/checkpoints.md``.

A checkpoint is written into a hidden sibling directory, synced, and renamed
into place, so ``path`` holds a complete checkpoint or none.

Example
-------
>>> import tempfile, torch
>>> from tierstore import TieredAdamW
>>> d = tempfile.mkdtemp()
>>> w = torch.nn.Parameter(torch.ones(10))
>>> with TieredAdamW([w], lr=0.1) as opt:
...     w.grad = torch.ones(10); _ = opt.step()
...     opt.save_checkpoint(f"{d}/ckpt.zarr")
>>> sd = checkpoint_to_state_dict(f"{d}/ckpt.zarr")
>>> sd["state"][0]["exp_avg"][:2].tolist(), float(sd["state"][0]["step"])
([0.10000000149011612, 0.10000000149011612], 1.0)
"""

from __future__ import annotations

# One module per job (none of them is a public path: import from here):
#   _zarr_format       the on-disk layout: format name and version, group attributes, arrays per field
#   _writer            writing a checkpoint: chunk files, syncs, the atomic rename into place
#   _reader            reading a checkpoint: opened, checked, chunks read and verified; verify, attributes
#   _validate          checks of what is read back: the directory tree, step counts, groups, parameter index
#   _state_dir         a state directory opened without an optimizer, its files and manifest checked
#   _streaming         save, export and load, streamed shard by shard (through the optimizer's arena)
#   _torch_state_dict  conversions to and from torch state dicts of the state's algorithm (states that fit in RAM)
#   _files             files read and written without following links; atomic output files
# Names outside __all__ that were importable from here before the split stay so (``name as name``):
# the CLI imports write_output_file, open_state_reader and check_manifest_header from here.
from ..errors import CheckpointExistsError as CheckpointExistsError
from ._files import write_output_file as write_output_file
from ._reader import read_checkpoint_attributes, verify_checkpoint
from ._state_dir import check_manifest_header as check_manifest_header
from ._state_dir import check_state_files as check_state_files
from ._state_dir import open_state_reader as open_state_reader
from ._streaming import export_statedir, load_checkpoint, save_checkpoint
from ._torch_state_dict import (
    checkpoint_to_state_dict,
    state_dict_to_checkpoint,
    statedir_to_state_dict,
)
from ._validate import MAX_STEP as MAX_STEP
from ._zarr_format import CHECKSUMS as CHECKSUMS
from ._zarr_format import FORMAT_NAME, FORMAT_VERSION
from ._zarr_format import MAX_METADATA_NBYTES as MAX_METADATA_NBYTES
from ._zarr_format import SCALES_SUFFIX as SCALES_SUFFIX

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "export_statedir",
    "checkpoint_to_state_dict",
    "statedir_to_state_dict",
    "state_dict_to_checkpoint",
    "verify_checkpoint",
    "read_checkpoint_attributes",
    "FORMAT_NAME",
    "FORMAT_VERSION",
]
