"""Backward tiles past call 3's sweep edge (per_sm 8 was its largest), device time."""
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("sweep", "benchmarks/h200-2026-12-01-s10/call3/norm_sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)
import torch
from vitgraph.models import fused_norm as fn

for n in (1024, 768):
    m = 256 * 197
    torch.manual_seed(0)
    x, r, dy, dsum = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    bias, w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(3))
    s, _, mean, rstd = fn.launch_forward(x, r, bias, w, b, 1e-6)
    for warps in (2, 4):
        for per_sm in (8, 12, 16, 24):
            cfg = dict(BLOCK_M=1, num_warps=warps, per_sm=per_sm)
            us = sweep.device_us(lambda: fn.launch_backward(dy, dsum, s, w, mean, rstd, True, cfg))
            print(f"hidden {n} backward {cfg}: {us:.1f} us", flush=True)
    print(f"hidden {n} forward default {fn.FORWARD}: "
          f"{sweep.device_us(lambda: fn.launch_forward(x, r, bias, w, b, 1e-6)):.1f} us")
