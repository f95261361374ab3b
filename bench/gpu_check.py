"""GPU path check: CUDA parameters with TieredAdamW (run on a machine with a GPU).

What it checks, with parameters on ``cuda``:

1. fp32 and bf16 parameters, state all in RAM and on disk under a budget,
   for each ``--moment-dtype``: the fp32 master weights
   (``state_dict()['state'][i]['master_param']``) are bitwise equal to
   ``torch.optim.AdamW(fused=True)`` (a compressed format: its oracle,
   ``tierstore.testing.formats.FormatOracle``) run on the CPU on fp32
   copies fed the same gradients cast to fp32, and each CUDA parameter
   equals its master cast to its dtype.
2. Host buffers are pinned (``cudaHostRegister``) and steps leave no
   pending error (``torch.cuda.synchronize()`` after each step).
3. Timing: median step time beside ``torch.optim.AdamW(fused=True)`` on the
   GPU (when the state fits there), with the bytes moved over PCIe.
4. Behind the loop (``opt.attach(model)``): a small transformer-like MLP on
   the GPU trained with gradient accumulation and clipping, attached with
   gradients offloaded to the host, attached without offload, and
   synchronous; losses and final weights bitwise equal across the three and
   equal to ``torch.optim.AdamW(fused=True)`` on fp32 CPU copies fed the
   same gradients; peak GPU memory with and without gradient offload; and
   iteration time overlapped vs synchronous vs torch's fused AdamW on the GPU.

Usage::

    python bench/gpu_check.py --json gpu_check.json
On a machine without CUDA it exits 0 after saying so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from tierstore import TieredAdamW

SHAPES = [(1024, 1024), (4096,), (333, 77), (1,), (2048, 512)]


def _check_equivalence(dtype: torch.dtype, budget: str | None, steps: int = 4, moment_dtype: str = "float32") -> dict:
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ref = [torch.nn.Parameter(t.clone()) for t in init]  # fp32, CPU
    if moment_dtype == "float32":
        ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    else:  # the format's oracle: decode -> fused AdamW -> encode per tensor, on the CPU
        from tierstore.testing.formats import FormatOracle

        ref_opt = FormatOracle(ref, lr=1e-3, weight_decay=0.01, moment_dtype=moment_dtype)
    gpu = [torch.nn.Parameter(t.to("cuda", dtype)) for t in init]
    with torch.no_grad():
        for r, g in zip(ref, gpu):
            r.copy_(g.float().cpu())  # the master starts from the parameter's own value
    with tempfile.TemporaryDirectory() as d:
        opt = TieredAdamW(gpu, lr=1e-3, weight_decay=0.01, state_dir=d, ram_budget=budget, shard_numel=1 << 16,
                          moment_dtype=moment_dtype)
        # every host buffer of the store is pinned, except a compressed format's decode scratch (CPU only)
        pinned = opt.pinned_bytes == opt.ram_bytes - opt.plan.scratch_nbytes
        for _ in range(steps):
            grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            for p, g in zip(gpu, grads):
                p.grad = g.to("cuda")
            for r, g in zip(ref, grads):
                r.grad = g.float()
            opt.step()
            torch.cuda.synchronize()
            ref_opt.step()
        sd = opt.state_dict()
        masters_equal = all(torch.equal(sd["state"][i]["master_param"], r.detach()) for i, r in enumerate(ref))
        params_equal = all(torch.equal(p.detach().cpu(), r.detach().to(dtype)) for p, r in zip(gpu, ref))
        ref_sd = ref_opt.state_dict()
        moments_equal = all(
            torch.equal(sd["state"][i][k], ref_sd["state"][i][k]) for i in range(len(ref)) for k in ("exp_avg", "exp_avg_sq")
        )
        described = opt.describe()
        opt.close()
    return {
        "dtype": str(dtype),
        "moment_dtype": moment_dtype,
        "ram_budget": budget,
        "masters_bitwise_equal": masters_equal,
        "params_equal_master_cast": params_equal,
        "moments_bitwise_equal": moments_equal,
        "host_buffers_pinned": pinned,
        "layout": described,
    }


def _timing(numel: int, dtype: torch.dtype, steps: int) -> dict:
    params = [torch.nn.Parameter(torch.randn(numel, device="cuda", dtype=dtype))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = TieredAdamW(params, lr=1e-4)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in ref_params:
        p.grad = torch.randn_like(p)
    ref = torch.optim.AdamW(ref_params, lr=1e-4, fused=True)
    ours, theirs = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref.step()
        torch.cuda.synchronize()
        theirs.append(time.perf_counter() - t0)
    opt.close()
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return {
        "numel": numel,
        "dtype": str(dtype),
        "tiered_step_s": statistics.median(ours),
        "torch_fused_gpu_step_s": statistics.median(theirs),
        "pcie_bytes_per_step": 2 * numel * itemsize,
        "tiered_params_per_s": numel / statistics.median(ours),
    }


def _mlp(width: int, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1)).to("cuda", dtype)


def _train_overlap(mode: str, width: int, layers: int, steps: int, accumulate: int, dtype: torch.dtype) -> dict:
    """One training run; mode: 'offload', 'attached', 'sync' (TieredAdamW) or 'torch-gpu'."""
    model = _mlp(width, layers, dtype)
    if mode == "torch-gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = TieredAdamW(model.parameters(), lr=1e-3, ram_budget="64MiB")
        if mode != "sync":
            opt.attach(model, offload_grads=(mode == "offload"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses, times = [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(accumulate):
            x = torch.randn(64, width, device="cuda", dtype=dtype, generator=gen)
            loss = model(x).float().square().mean()
            loss.backward()
            losses.append(loss.item())
        if mode == "torch-gpu" or mode == "sync":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if mode != "torch-gpu":
        opt.synchronize()
        opt.close()
    torch.cuda.synchronize()
    return {
        "mode": mode,
        "losses": losses,
        "params": [p.detach().cpu() for p in model.parameters()],
        "median_iteration_s": statistics.median(times[1:]),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
    }


def _check_overlap(width: int, layers: int, steps: int) -> dict:
    runs = {m: _train_overlap(m, width, layers, steps, 2, torch.bfloat16) for m in ("sync", "attached", "offload", "torch-gpu")}
    same = lambda a, b: runs[a]["losses"] == runs[b]["losses"] and all(  # noqa: E731
        torch.equal(x, y) for x, y in zip(runs[a]["params"], runs[b]["params"])
    )
    return {
        "width": width,
        "layers": layers,
        "dtype": "bfloat16",
        "accumulate": 2,
        "clip": 1.0,
        "attached_equals_sync": same("attached", "sync"),
        "offload_equals_sync": same("offload", "sync"),
        "median_iteration_s": {m: r["median_iteration_s"] for m, r in runs.items()},
        "peak_gpu_bytes": {m: r["peak_gpu_bytes"] for m, r in runs.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Check TieredAdamW with CUDA parameters.")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--numel", type=int, default=50_000_000, help="parameters for the timing run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--moment-dtype", default="float32,bfloat16,int8", help="formats of the equivalence checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU path is covered by the test suite)")
        return 0
    from tierstore.cli.bench.report import hardware_line, machine_info

    machine = machine_info()
    # The GPU is not in the host's hardware line: name it beside it.
    print(f"{hardware_line(machine)}; GPU {torch.cuda.get_device_name()}", flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "machine": machine,
               "hardware": f"{hardware_line(machine)}; GPU {torch.cuda.get_device_name()}", "checks": [], "timing": []}
    for fmt in args.moment_dtype.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            for budget in (None, "2MiB"):
                results["checks"].append(_check_equivalence(dtype, budget, moment_dtype=fmt))
    for dtype in (torch.float32, torch.bfloat16):
        results["timing"].append(_timing(args.numel, dtype, args.steps))
    results["overlap"] = _check_overlap(width=4096, layers=8, steps=args.steps)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(c["masters_bitwise_equal"] and c["params_equal_master_cast"] and c["moments_bitwise_equal"] for c in results["checks"])
    ok = ok and results["overlap"]["attached_equals_sync"] and results["overlap"]["offload_equals_sync"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
