"""Tile sweep of the fused residual-add + LayerNorm kernels (vitgraph/models/fused_norm.py) at
ViT-L and ViT-B widths (1024, 768) on 256 x 197 = 50,432 rows, against the unfused path for the
same work (torch add + TE LayerNorm; its backward with the add of the two gradients and the
bias gradient's column sum). Device time from torch.profiler, no host time counted. Needs a CUDA
GPU with Triton and TE.

    python scripts/norm_sweep.py OUT.json

Prints the unfused, default and best times per width; OUT.json holds every tile's time
(record: benchmarks/h200/fused_norm-kernels.json). Use it to re-pick FORWARD / BACKWARD in
fused_norm.py on another GPU.
"""
import itertools
import json
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from vitgraph.models import fused_norm as fn


def device_us(fn_, iters=20):
    for _ in range(3):
        fn_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn_()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA)
    return total / iters


def main():
    import transformer_engine.pytorch as te
    out = {}
    for n in (1024, 768):
        m, dev, bf = 256 * 197, "cuda", torch.bfloat16
        torch.manual_seed(0)
        x, r, dy, dsum = (torch.randn(m, n, device=dev, dtype=bf) for _ in range(4))
        bias, w, b = (torch.randn(n, device=dev, dtype=bf) * 0.1 for _ in range(3))
        w += 1
        s, _, mean, rstd = fn.launch_forward(x, r, bias, w, b, 1e-6)
        row = {"tokens": m, "hidden": n, "forward": {}, "backward": {}}
        for bm, warps in itertools.product((1, 2, 4, 8), (4, 8)):
            cfg = dict(BLOCK_M=bm, num_warps=warps)
            row["forward"][json.dumps(cfg)] = device_us(
                lambda: fn.launch_forward(x, r, bias, w, b, 1e-6, cfg))
        for bm, warps, per_sm in itertools.product((1, 2, 4, 8), (4, 8), (2, 4, 8)):
            cfg = dict(BLOCK_M=bm, num_warps=warps, per_sm=per_sm)
            row["backward"][json.dumps(cfg)] = device_us(
                lambda: fn.launch_backward(dy, dsum, s, w, mean, rstd, True, cfg))
        # unfused: torch add + TE LayerNorm; TE LayerNorm backward + the add of the two gradients
        # + the bias gradient's column sum
        ln = te.LayerNorm(n, eps=1e-6, params_dtype=bf, device=dev)
        xin = x.clone().requires_grad_()
        row["unfused_forward"] = device_us(lambda: ln(xin + r))

        def fwd_bwd():
            g, = torch.autograd.grad(ln(xin + r), xin, dy)
            return (g + dsum).sum(0)
        row["unfused_forward_backward"] = device_us(fwd_bwd)
        row["default_forward"] = device_us(lambda: fn.launch_forward(x, r, bias, w, b, 1e-6))
        row["default_backward"] = device_us(
            lambda: fn.launch_backward(dy, dsum, s, w, mean, rstd, True))
        bf_, bb_ = min(row["forward"].items(), key=lambda kv: kv[1]), \
            min(row["backward"].items(), key=lambda kv: kv[1])
        row["best_forward"], row["best_backward"] = bf_, bb_
        mb = m * n * 2 / 1e6
        print(f"hidden {n}: one [{m}, {n}] bf16 pass = {mb:.0f} MB")
        print(f"  unfused fwd {row['unfused_forward']:.1f} us, fwd+bwd {row['unfused_forward_backward']:.1f} us")
        print(f"  fused default fwd {row['default_forward']:.1f} us, bwd {row['default_backward']:.1f} us")
        print(f"  best fwd {bf_[0]} {bf_[1]:.1f} us ({4 * mb / bf_[1] / 1e3:.2f} TB/s for 4 passes)")
        print(f"  best bwd {bb_[0]} {bb_[1]:.1f} us ({4 * mb / bb_[1] / 1e3:.2f} TB/s for 4 passes)")
        saved = row["unfused_forward_backward"] - bf_[1] - bb_[1]
        print(f"  saved per pairing {saved:.1f} us; x 47 in a 24-layer step: {saved * 47 / 1e3:.2f} ms")
        out[n] = row
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
