"""Where the compiled int8 update spends its time: the kernel with one part taken out at a time.

Builds variants of ``tierstore/codec_kernel.c`` by replacing one line each
(the way the broken-build tests do), loads each with ``tierstore._compute.native``, and
times its fused update on one thread over a cold array (bf16 gradients and
parameters, fp32 masters, int8 moments: the mixed-precision configuration),
rounds interleaved so the ratios hold on a noisy machine. Every variant but
``full`` computes wrong bytes: they are timing probes only, never loaded by
the library.

- ``no_decode`` / ``no_adamw`` / ``no_encode``: that part skipped;
- ``byte_store``: one store per code instead of eight codes per 8-byte store;
- ``l2_table``: lookups confined to 128 KiB of the 1 MiB table (what a table
  that stays in L2 would cost);
- ``multiply``: the encode's divide by the block scale made a multiply.

A diagnostic, not a claim: no target applies (the report says so under the
hardware line and each variant's time / full's as the median of per-round
ratios with its range).

Usage::

    python bench/kernel_parts.py --numel 16Mi --rounds 9 --json bench/results/kernel-parts.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

from tierstore._compute import formats, fused_update, native
from tierstore._compute.hyper import GroupHyper
from tierstore._platform import torch_private
from tierstore.cli.bench.report import hardware_line, machine_info, write_json
from tierstore.cli.bench.step_report import ratio_text
from tierstore.cli.bench.verdict import format_verdicts
from tierstore.cli.bench.workload import parse_elements

CHUNK = 1 << 18  # elements per kernel call, as the update's chunks

VARIANTS = {
    "full": (None, None),
    "no_decode": (b"for (int f = 0; f < nfields; ++f) decode_field(format, &fields[f], b, k, len, moment[f]);",
                  b"for (int f = 0; f < nfields; ++f) memset(moment[f], 0, 4 * len);"),
    "no_adamw": (b"if (hi > lo) update_range(q, b, lo, hi, m, v, nfields == 3 ? x : 0);", b"if (hi > lo) {}"),
    "no_encode": (b"for (int f = 0; f < nfields; ++f) encode_field(format, &fields[f], f == 0, b, k, len, moment[f]);",
                  b""),
    "byte_store": (b"#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__", b"#if 0"),
    "l2_table": (b"w |= (uint64_t)table[bucket[i + j]] << (8 * j);",
                 b"w |= (uint64_t)table[bucket[i + j] & 0x1FFFF] << (8 * j);"),
    "multiply": (b"const float y = x[i] / divisor;", b"const float y = x[i] * (1.0f / divisor);"),
}


def build(name: str) -> native.Kernel:
    """The kernel of variant ``name`` (compiled into tierstore's cache, keyed by its source)."""
    good, bad = VARIANTS[name]
    source = native._source()
    if good is not None:
        if source.count(good) != 1:
            raise SystemExit(f"kernel_parts.py: variant {name!r} no longer matches codec_kernel.c; update VARIANTS")
        source = source.replace(good, bad)
    cc = native._compiler()
    if cc is None:
        raise SystemExit("kernel_parts.py: needs a C compiler (set CC or TIERSTORE_CC)")
    path = native._compile(cc, source)
    return native.Kernel(ctypes.CDLL(str(path)), path)


class Workload:
    """Cold arrays of ``numel`` elements and the packed kernel arguments of every chunk."""

    def __init__(self, numel: int) -> None:
        fmt = formats.FORMATS["int8"]
        gen = torch.Generator().manual_seed(0)
        self.numel = numel
        self.target = torch.randn(numel, generator=gen)
        self.grad = (torch.randn(numel, generator=gen) * 1e-3).to(torch.bfloat16)
        self.out = torch.empty(numel, dtype=torch.bfloat16)
        self.stored = [formats.split(fmt, torch.zeros(fmt.encoded_nbytes(numel), dtype=torch.uint8), numel)
                       for _ in range(2)]  # fmt: skip
        hyper = GroupHyper(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        out_flags = fused_update.bf16_param_flags()
        if out_flags is None:  # the kernel would write fp32 into the bf16 parameter buffer
            raise SystemExit("kernel_parts.py: this torch build's bf16 copy_ is not the kernel's; "
                             "the fused update writes no bf16 parameters here, so there is nothing to time")
        flags = fused_update.GRAD_BF16 | out_flags
        const = fused_update.constants(hyper, 10.0)
        recipe = fused_update.candidates(torch_private.cpu_capability())[0]  # the capability's own
        self.calls = []
        for lo in range(0, numel, CHUNK):
            n = min(CHUNK, numel - lo)
            piece = fused_update.Piece(0, n, self.target.data_ptr() + 4 * lo, self.grad.data_ptr() + 2 * lo,
                                       self.out.data_ptr() + 2 * lo, const, flags)  # fmt: skip
            self.calls.append((n, fused_update.fields(fmt, self.stored, lo), piece.pack(recipe)))

    def run(self, k: native.Kernel) -> float:
        t0 = time.perf_counter()
        for n, fields, piece in self.calls:
            k.update(fused_update.FORMAT_CODES["int8"], n, 256, fields, 2, piece, 1)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="16Mi", help="elements (well above the L3 cache: cold, as a streamed shard)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    numel = parse_elements(args.numel)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or "full" not in names:
        raise SystemExit(f"kernel_parts.py: --variants {args.variants!r}: known are {', '.join(VARIANTS)}, full included")
    machine = machine_info(None)
    print(hardware_line(machine), flush=True)
    kernels = {name: build(name) for name in names}
    work = Workload(numel)
    for k in kernels.values():  # warm-up: moments become those of a few steps
        for _ in range(2):
            work.run(k)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[name].append(work.run(kernels[name]))
    full = times["full"]
    results = {name: {"ns_per_param": statistics.median(t) / numel * 1e9,
                      "params_per_s": numel / statistics.median(t),
                      "paired_vs_full": statistics.median(a / b for a, b in zip(t, full)),
                      "paired_rounds": [a / b for a, b in zip(t, full)], "seconds": t}
               for name, t in times.items()}  # fmt: skip
    fast = next(iter(kernels.values())).fast
    print(f"compiled int8 update, 1 thread, {numel:,} cold elements, {'AVX2+FMA' if fast else 'baseline'} variant:")
    for name, row in results.items():
        print(f"  {name:11s} {row['ns_per_param']:.2f} ns/param  {row['params_per_s'] / 1e6:6.0f} M params/s  "
              f"time / full's {ratio_text(row['paired_rounds'])}")
    print(format_verdicts([]) + " (a diagnostic: where the time goes, no stated target)")
    if args.json:
        doc = {"tool": "bench/kernel_parts.py", "argv": sys.argv, "numel": numel, "rounds": args.rounds,
               "avx2_variant": fast, "machine": machine, "hardware": hardware_line(machine), "results": results,
               "verdicts": []}
        print(f"wrote {write_json(args.json, doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
