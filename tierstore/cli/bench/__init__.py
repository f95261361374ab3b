"""Benchmarks behind ``tierstore bench io`` and ``tierstore bench step``.

- :mod:`.io`: bandwidth of the drive per backend and setting, beside raw
  ``O_DIRECT`` and ``dd`` baselines and host memory bandwidth.
- :mod:`.step`: time per optimizer step in RAM and on disk, beside
  ``torch.optim.AdamW(fused=True)``, a re-creation of DeepSpeed ZeRO-Infinity's
  pipelined optimizer swapper (:mod:`.peer`) and the raw I/O floor
  (:mod:`.floor`), with the peak RSS of a disk run measured alone
  (:mod:`.footprint`).
- Shared pieces: :mod:`.rawio` (raw baselines), :mod:`.report` (tables,
  JSON, plots), :mod:`.rss` (peak RSS, page cache), :mod:`.workload` (the
  synthetic parameters and gradients).

Contenders are always measured in the same run and interleaved (the disk
drifts over minutes); medians are reported. ``bench/README.md`` has the
commands of the full runs.
"""
