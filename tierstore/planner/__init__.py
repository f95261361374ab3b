"""``tierstore plan``: the memory, I/O and drive-wear arithmetic of a training run, before running it.

:func:`plan_memory` answers "will this model fit on my box, how fast can a
step be, and how long does the drive last?" for a parameter count or a real
``nn.Module``. It builds the same layout and RAM split that
:class:`~tierstore.TieredAdamW` would build, over tensors on the ``meta``
device, so the planner and the optimizer never disagree about bytes;
:func:`format_plan` writes the report the CLI (:mod:`tierstore.cli.plan`)
prints. The modules, one job each:

- :mod:`~tierstore.planner.results`: the records a plan holds;
- :mod:`~tierstore.planner.memory`: bytes per tier (GPU, host RAM, drive)
  and the verdict;
- :mod:`~tierstore.planner.shortfalls`: what a plan lacks, and what would
  make it fit;
- :mod:`~tierstore.planner.traffic`: bytes moved per step, the step-time
  bound, and drive wear under the commit policy;
- :mod:`~tierstore.planner.report`: the text report;
- :mod:`~tierstore.planner.inputs`: parameter counts, sizes, speeds, a
  ``bench io`` file, a model factory;
- :mod:`~tierstore.planner.drives`: a state over several drives: what each
  holds under the optimizer's placement, the step's disk time over them
  (``plan_memory(drives=[DriveSpec(...), ...])``), and
  :mod:`~tierstore.planner.drive_specs`: the ``--drive`` values.

The formulas, for P trainable parameters with ``b`` bytes each (4 in fp32,
2 in bf16/fp16):

- optimizer state: per field 4 B/param for an fp32 field, the moment
  format's bytes for a moment (``moment_dtype``: float32 4, bfloat16 2, int8
  1.016 with its scales, where the algorithm lets a format store the field);
  fields are the optimizer algorithm's (``optimizer=``, AdamW by default:
  ``exp_avg`` and ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad; SGD with
  momentum ``momentum_buffer``, Adagrad ``sum``), and an fp32 ``master`` when the
  parameters are bf16/fp16 *or live on a GPU* (AdamW in float32: 8, +4, +4 B/param);
- GPU: weights ``b·(P + frozen)`` and grads ``b·P`` (activations excluded);
- host: arena ``(prefetch_depth + 2)`` slots of the largest shard, staging
  buffers, a compressed format's decode scratch, resident shards (stored
  compressed): what ``ram_budget`` bounds, never more than the whole state
  takes; plus the fixed overhead :data:`~tierstore._layout.budget.OVERHEAD_BYTES`
  (16 MiB; on a GPU it holds the two 4 MiB gradient buckets); plus the
  model's weights and grads when it trains on the CPU. On a GPU the
  budget's buffers and the buckets are pinned;
- disk: the on-disk shards once; with durability every shard twice;
- per step: PCIe ``b·P`` down (grads) and ``b·P`` up (params) with a GPU;
  disk reads every on-disk shard once and writes it once; durable, each
  commit also writes the resident shards (each has changed: it has a
  gradient) and the manifest, in the background, once per ``commit_every``;
- step time >= max(disk_read/read_bw + disk_write/write_bw,
  max(down, up)/pcie_bw, P/update_rate, state/memory_copy_bw), over the
  terms whose bandwidth is known;
- drive wear: ``streamed + (resident + manifest) / commit_every`` bytes a
  step against the rated TBW, at the lower-bound step time: days to the
  rating, whether it lasts ``lifetime_months``, and the smallest
  ``commit_every`` that does (``"auto"`` is assumed to commit every step).

The planner always answers: whatever the host, it shows the arithmetic and a
verdict, ``"fits in host RAM"``, ``"needs the disk tier"`` or ``"does not
fit"``, with one :class:`Shortfall` per missing resource (GPU memory, host
RAM, ``ram_budget``, drive space) naming what would make it fit, and the
drive's wear (:attr:`MemoryPlan.wear`, with a fix when the drive wears out
before its lifetime). Only malformed input is an error.

Example
-------
>>> from tierstore.planner import plan_memory
>>> plan = plan_memory(7_000_000_000, precision="bf16", host_ram=512 << 30, gpu_memory=80 * 10**9)
>>> plan.state_bytes_per_param, plan.torch.total // plan.trainable_params
(12, 16)
>>> plan.verdict
'fits in host RAM'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ gives, for readers and type checkers
    from .inputs import load_model, read_io_json
    from .memory import plan_memory
    from .report import format_plan
    from .results import (
        EXIT_DOES_NOT_FIT,
        VERDICTS,
        Bandwidth,
        DiskTier,
        DriveShare,
        DriveSpec,
        Endurance,
        GpuTier,
        HostTier,
        MemoryPlan,
        Shortfall,
        StepTime,
        StripedStep,
        TorchBaseline,
        Traffic,
    )

__all__ = [
    "MemoryPlan",
    "plan_memory",
    "format_plan",
    "Bandwidth",
    "GpuTier",
    "HostTier",
    "DiskTier",
    "DriveSpec",
    "DriveShare",
    "StripedStep",
    "Traffic",
    "StepTime",
    "Endurance",
    "TorchBaseline",
    "Shortfall",
    "load_model",
    "read_io_json",
    "VERDICTS",
    "EXIT_DOES_NOT_FIT",
]

# Each name -> the module that defines it. They are imported on first use: the arithmetic imports
# torch, and `tierstore plan --help` reads only the records and defaults (results, inputs). The
# names beyond __all__ (parse_count, disk_free, PRECISIONS, ...) are what was importable from
# tierstore.planner before it became a package of modules; they keep working.
_HOMES = {
    **dict.fromkeys(("PRECISION_DTYPES", "disk_free", "existing_ancestor", "load_model", "parse_count",
                     "read_io_json", "read_io_json_drives"), "inputs"),
    **dict.fromkeys(("DEFAULT_PREFETCH_DEPTH", "MAX_SHARDS", "PRECISIONS", "plan_memory"), "memory"),
    **dict.fromkeys(("MOMENT_BYTES", "format_plan"), "report"),
    **dict.fromkeys(("DEFAULT_UPDATE_GPARAMS", "DOES_NOT_FIT", "EXIT_DOES_NOT_FIT", "FITS_IN_RAM", "GB", "HOST_RAM_SHARE", "NEEDS_DISK",
                     "TB", "VERDICTS", "Bandwidth", "DiskTier", "DriveShare", "DriveSpec", "Endurance", "GpuTier", "HostTier", "MemoryPlan",
                     "Shortfall", "StepTime", "StripedStep", "TorchBaseline", "Traffic"), "results"),
    **dict.fromkeys(("SECONDS_PER_DAY", "STEP_TIME_FORMULA"), "traffic"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: the next lookup is a plain global
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})

