"""Prepared for the next session's first device call (issue 6), not run yet: what would a
fused residual-add + LayerNorm save per ViT-L step at micro-batch 256?

Today each of the 48 residual / LayerNorm pairings of a ViT-L step runs, forward, a torch add
(x + residual) and TE's LayerNorm, and backward, TE's LayerNorm backward, an autograd add of the
residual-stream gradient and (for the projection before it) cuBLASLt's bias-gradient kernel
(`globalKernelBgradAB`, 72.5 us a call in the seventh session's profile). The fused pair here:
- forward: s = x + residual (+ bias), y = LN(s), in one pass (reads 2 tensors, writes 2);
- backward: ds = LN'(dy) + d_residual, with LN's weight, bias and the projection's bias
  gradients summed from the same registers (reads 3, writes 1).
It checks both against fp32 torch and times them against today's kernels (CUDA events, median
of 30). usage: python add_ln_probe.py [--tokens 50432] [--hidden 1024]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _fwd(X, R, B, W, BETA, S, Y, MEAN, RSTD, M, N, eps,
         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cm = cols < N
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    beta = tl.load(BETA + cols, mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        m = cm & (row < M)
        off = row.to(tl.int64) * N + cols
        s = tl.load(X + off, mask=m, other=0.0).to(tl.float32) + tl.load(R + off, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += b
        s16 = s.to(S.dtype.element_ty)
        tl.store(S + off, s16, mask=m)
        s = s16.to(tl.float32)  # normalise what is stored: the backward sees the same input
        mean = tl.sum(s, axis=0) / N
        d = tl.where(cm, s - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / N + eps)
        tl.store(Y + off, (d * rstd * w + beta).to(Y.dtype.element_ty), mask=m)
        tl.store(MEAN + row, mean, mask=row < M)
        tl.store(RSTD + row, rstd, mask=row < M)


@triton.jit
def _bwd(DY, DR, S, W, MEAN, RSTD, DS, PW, PB, PBIAS, M, N,
         HAS_DR: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cm = cols < N
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK_N], tl.float32)
    acc_b = tl.zeros([BLOCK_N], tl.float32)
    acc_bias = tl.zeros([BLOCK_N], tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        m = cm & (row < M)
        off = row.to(tl.int64) * N + cols
        mean = tl.load(MEAN + row, mask=row < M, other=0.0)
        rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
        xhat = tl.where(m, (tl.load(S + off, mask=m, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
        dy = tl.load(DY + off, mask=m, other=0.0).to(tl.float32)
        g = dy * w
        c1 = tl.sum(xhat * g, axis=0) / N
        c2 = tl.sum(g, axis=0) / N
        ds = (g - (xhat * c1 + c2)) * rstd
        if HAS_DR:
            ds += tl.load(DR + off, mask=m, other=0.0).to(tl.float32)
        tl.store(DS + off, ds.to(DS.dtype.element_ty), mask=m)
        acc_w += dy * xhat
        acc_b += dy
        acc_bias += ds
    tl.store(PW + pid * N + cols, acc_w, mask=cm)
    tl.store(PB + pid * N + cols, acc_b, mask=cm)
    tl.store(PBIAS + pid * N + cols, acc_bias, mask=cm)


def fused_fwd(x, r, bias, w, beta, eps=1e-6, rows=4):
    M, N = x.shape
    s, y = torch.empty_like(x), torch.empty_like(x)
    mean = torch.empty(M, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _fwd[(triton.cdiv(M, rows),)](x, r, bias if bias is not None else w, w, beta, s, y, mean, rstd,
                                  M, N, eps, HAS_BIAS=bias is not None,
                                  BLOCK_N=triton.next_power_of_2(N), ROWS=rows, num_warps=4)
    return s, y, mean, rstd


def fused_bwd(dy, dr, s, w, mean, rstd, rows=64):
    M, N = dy.shape
    g = triton.cdiv(M, rows)
    ds = torch.empty_like(dy)
    pw, pb, pbias = (torch.empty(g, N, device=dy.device, dtype=torch.float32) for _ in range(3))
    _bwd[(g,)](dy, dr if dr is not None else dy, s, w, mean, rstd, ds, pw, pb, pbias, M, N,
               HAS_DR=dr is not None, BLOCK_N=triton.next_power_of_2(N), ROWS=rows, num_warps=4)
    return ds, pw.sum(0), pb.sum(0), pbias.sum(0)


def timed(fn, n=30):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2] * 1e3  # us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256 * 197)
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args()
    M, N, dev, bf = a.tokens, a.hidden, "cuda", torch.bfloat16
    torch.manual_seed(0)
    x, r, dy, dr = (torch.randn(M, N, device=dev, dtype=bf) for _ in range(4))
    bias, w, beta = (torch.randn(N, device=dev, dtype=bf) * 0.1 for _ in range(3))
    w += 1

    # correctness against fp32 torch
    s, y, mean, rstd = fused_fwd(x, r, bias, w, beta)
    sf = (x.float() + r.float() + bias.float()).to(bf).float().requires_grad_()
    wf, bf_ = w.float().requires_grad_(), beta.float().requires_grad_()
    yf = F.layer_norm(sf, (N,), wf, bf_, 1e-6)
    yf.backward(dy.float())
    ds, dw, db, dbias = fused_bwd(dy, dr, s, w, mean, rstd)
    ref_ds = sf.grad + dr.float()
    err = lambda u, v: ((u.float() - v).abs().max() / v.abs().max()).item()
    print(f"max relative error: y {err(y, yf.detach()):.2e}  ds {err(ds, ref_ds):.2e}  "
          f"dw {err(dw, wf.grad):.2e}  db {err(db, bf_.grad):.2e}  dbias {err(dbias, ref_ds.sum(0)):.2e}")

    # today's kernels: torch add + TE LayerNorm forward; TE LayerNorm backward + autograd add +
    # a bias-gradient column sum
    import transformer_engine.pytorch as te
    ln = te.LayerNorm(N, eps=1e-6, params_dtype=bf, device=dev)
    base_in = x.clone().requires_grad_()

    def base_fwd():
        return ln(base_in + r)

    def base_fwd_bwd():
        # TE's LayerNorm frees what it saved after one backward: run the forward each time and
        # subtract the forward's own time below
        g, = torch.autograd.grad(base_fwd(), base_in, dy)
        return (g + dr).sum(0)

    def fused_f():
        return fused_fwd(x, r, None, w, beta)

    def fused_b():
        return fused_bwd(dy, dr, s, w, mean, rstd)

    t_fwd = timed(base_fwd)
    res = {"today fwd (add + TE LN)": t_fwd,
           "today bwd (TE LN bwd + add + bias sum)": timed(base_fwd_bwd) - t_fwd,
           "fused fwd": timed(fused_f), "fused bwd": timed(fused_b)}
    for k, v in res.items():
        print(f"{k:42s} {v:8.1f} us")
    saved = (res["today fwd (add + TE LN)"] + res["today bwd (TE LN bwd + add + bias sum)"]
             - res["fused fwd"] - res["fused bwd"])
    print(f"saved per pairing {saved:.1f} us; x 48 pairings (ViT-L, 24 layers): {saved * 48 / 1e3:.2f} ms "
          f"a step (about 200 ms at mb 256)")
    mb = M * N * 2 / 1e6
    print(f"one pass over a [{M}, {N}] bf16 tensor: {mb:.0f} MB")


if __name__ == "__main__":
    main()
