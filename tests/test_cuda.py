"""The CUDA path, on a machine with a GPU (skipped elsewhere): parameters on ``cuda``.

The fp32 masters must equal ``torch.optim.AdamW(fused=True)`` run on the CPU
on fp32 copies fed the same gradients cast to fp32, bitwise; each CUDA
parameter must equal its master cast to its dtype; host buffers are pinned.
``bench/gpu_check.py`` adds timings.
"""

from __future__ import annotations

import pytest
import torch

from tierstore import TieredAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(257, 33), (4096,), (1,), (64, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget", [None, "96KiB"], ids=["ram", "disk"])
def test_cuda_params_match_fused_adamw_on_fp32_copies(dtype, budget, tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    gpu = [torch.nn.Parameter(t.to("cuda")) for t in init]
    ref = [torch.nn.Parameter(t.float()) for t in init]  # the master starts from the parameter's value
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, fused=True)
    with TieredAdamW(gpu, lr=1e-2, weight_decay=0.01, state_dir=tmp_path / "s", ram_budget=budget, shard_numel=2048) as opt:
        assert opt.pinned_bytes == opt.ram_bytes > 0
        for _ in range(3):
            grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            for p, r, g in zip(gpu, ref, grads):
                p.grad, r.grad = g.to("cuda"), g.float()
            opt.step()
            ref_opt.step()
            torch.cuda.synchronize()
        sd = opt.state_dict()
    for i, (p, r) in enumerate(zip(gpu, ref)):
        assert torch.equal(sd["state"][i]["master_param"], r.detach())
        assert torch.equal(sd["state"][i]["exp_avg"], ref_opt.state[r]["exp_avg"])
        assert torch.equal(p.detach().cpu(), r.detach().to(dtype))
