"""Residual add + LayerNorm as one kernel forward and one backward (Triton, on CUDA).

In a pre-norm transformer every LayerNorm but the first reads a residual sum made just
before it: ``s = x + residual (+ bias)``, ``y = LN(s)``. Unfused, a ViT-L step at micro-batch
256 on an H200 spent 6.8 ms in those adds (forward, and the backward's sum of the two
gradients reaching ``s``), 7.4 ms in LayerNorm and 5.2 ms in cuBLASLt's bias-gradient
kernels over the same [tokens, hidden] tensors. Here:

* forward: reads ``x`` and ``residual`` once, writes ``s`` and ``y``;
* backward: reads ``dy``, ``s`` and the gradient reaching ``s`` from later in the residual
  stream, writes ``ds`` (the gradient of ``x`` and of ``residual``), and sums the
  LayerNorm's weight and bias gradients and the added bias's gradient from the same
  registers.

``s`` is rounded to the activation dtype before it is normalised, as the unfused add then
LayerNorm do, and the backward reads that rounded ``s``. Tile sizes are fixed (no autotune)
so that the parameter gradients' summation order, and so their bits, are the same in every
run. The same kernels give a plain LayerNorm (``layer_norm``, ``LayerNorm``) and a plain add of
a residual and a bias (``add``). Stochastic depth scales the added branch by a factor per row
(``keep``: a sample's 0 or 1 / (1 - p)) inside the same kernels, ``s = keep * (x + bias) +
residual``: unfused, the scale and the bias add were four more passes over the branch, forward
and backward. Elsewhere (CPU, no Triton, or another dtype) each is the same math in torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install
    triton = None


if triton is not None:
    @triton.jit
    def _add_ln_forward(x_ptr, r_ptr, bias_ptr, k_ptr, w_ptr, b_ptr, s_ptr, y_ptr, mean_ptr,
                        rstd_ptr, M, N, eps, HAS_R: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_KEEP: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        # HAS_R: add a residual and store the sum (else normalise x as it is); HAS_KEEP: scale
        # x (+ bias) by its row's factor first; NORM: normalise
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_KEEP:
            s *= tl.load(k_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        if HAS_R:
            s += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s_low = s.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + offs, s_low, mask=mask)
            s = s_low.to(tl.float32)
        if NORM:
            mean = tl.sum(s, axis=1) / N
            d = tl.where(mask, s - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            y = d * rstd[:, None] * w[None, :] + b[None, :]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(mean_ptr + rows, mean, mask=rmask)
            tl.store(rstd_ptr + rows, rstd, mask=rmask)

    @triton.jit
    def _add_ln_backward(dy_ptr, dsum_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, k_ptr, ds_ptr,
                         dx_ptr, part_ptr, M, N, HAS_DSUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_KEEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # a fixed number of programs, each striding over row blocks; each writes its partial
        # column sums (LN weight, LN bias, added bias; fp32) to its row of part[3, programs, N].
        # HAS_KEEP: the scaled branch's gradient, ds times the row's factor, goes to dx
        pid, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        acc_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_bias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = dy * w[None, :]
            c1 = tl.sum(xhat * g, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            ds = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HAS_DSUM:
                ds += tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ds_ptr + offs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
            if HAS_KEEP:
                ds *= tl.load(k_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
                tl.store(dx_ptr + offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
            acc_w += dy * xhat
            acc_b += dy
            if HAS_BIAS:
                acc_bias += tl.where(mask, ds, 0.0)
        part = part_ptr + pid * N + cols
        tl.store(part, tl.sum(acc_w, axis=0), mask=cmask)
        tl.store(part + programs * N, tl.sum(acc_b, axis=0), mask=cmask)
        if HAS_BIAS:
            tl.store(part + 2 * programs * N, tl.sum(acc_bias, axis=0), mask=cmask)


# tile sizes (rows per block, warps; backward: programs per SM), fixed: see the docstring.
# From a sweep on an H200 at ViT-L and ViT-B widths, 50,432 rows (scripts/norm_sweep.py;
# benchmarks/h200/fused_norm-kernels.json): forward 100.6 / 76.6 us, backward 126.7 / 110.2 us
# (4 passes over the tensor: 3.3-4.1 TB/s), against 104 / 151 us at ViT-L with 4-row blocks
# and 8 warps (backward: 4 programs per SM).
# min_rows: rows per backward program at least, so that a small batch (ViT-L at mb 8: 1,576
# rows) does not pay for a thousand partial-sum rows (no measurable change in that step)
FORWARD = dict(BLOCK_M=2, num_warps=4)
BACKWARD = dict(BLOCK_M=1, num_warps=4, per_sm=8, min_rows=8)


def launch_forward(x, r, bias, w, b, eps: float, cfg: dict = FORWARD, norm: bool = True,
                   keep=None):
    """x, r: [M, N] contiguous (r None: normalise x itself, s is x); keep: [M] contiguous or
    None. Returns s, y, mean, rstd (y, mean, rstd None without ``norm``)."""
    m, n = x.shape
    s = x if r is None else torch.empty_like(x)
    y = torch.empty_like(x) if norm else None
    mean = torch.empty(m, dtype=torch.float32, device=x.device) if norm else None
    rstd = torch.empty_like(mean) if norm else None
    grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
    _add_ln_forward[grid](x, x if r is None else r, x if bias is None else bias,
                          x if keep is None else keep, w, b, s, x if y is None else y,
                          mean if norm else x, rstd if norm else x, m, n, eps,
                          HAS_R=r is not None, HAS_BIAS=bias is not None,
                          HAS_KEEP=keep is not None, NORM=norm, BLOCK_M=cfg["BLOCK_M"],
                          BLOCK_N=triton.next_power_of_2(n), num_warps=cfg["num_warps"])
    return s, y, mean, rstd


def launch_backward(dy, dsum, s, w, mean, rstd, has_bias: bool, cfg: dict = BACKWARD,
                    keep=None):
    """Returns ds, the scaled branch's gradient ``keep * ds`` (None without ``keep``) and the
    fp32 gradients of the LN weight, LN bias and the added bias (None without one). ``dsum``:
    the gradient reaching ``s`` from later on, or None."""
    m, n = s.shape
    sms = torch.cuda.get_device_properties(s.device).multi_processor_count if s.is_cuda else 2
    rows = max(cfg["BLOCK_M"], cfg.get("min_rows", 1))
    programs = max(1, min(triton.cdiv(m, rows), sms * cfg["per_sm"]))
    ds = torch.empty_like(s)
    dx = None if keep is None else torch.empty_like(s)
    part = torch.empty((3, programs, n), dtype=torch.float32, device=s.device)
    _add_ln_backward[(programs,)](dy, dy if dsum is None else dsum, s, w, mean, rstd,
                                  s if keep is None else keep, ds, ds if dx is None else dx,
                                  part, m, n, HAS_DSUM=dsum is not None, HAS_BIAS=has_bias,
                                  HAS_KEEP=keep is not None, BLOCK_M=cfg["BLOCK_M"],
                                  BLOCK_N=triton.next_power_of_2(n), num_warps=cfg["num_warps"])
    sums = part[: 3 if has_bias else 2].sum(1)
    return ds, dx, sums[0], sums[1], sums[2] if has_bias else None


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, bias, w, b, eps: float, keep):
        n = x.shape[-1]
        s, y, mean, rstd = launch_forward(x.reshape(-1, n), r.reshape(-1, n), bias, w, b, eps,
                                          keep=keep)
        ctx.save_for_backward(s, w, mean, rstd, keep)
        ctx.has_bias = bias is not None
        ctx.dtypes = (None if bias is None else bias.dtype, w.dtype, b.dtype)
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds_out, dy):
        s, w, mean, rstd, keep = ctx.saved_tensors
        n = s.shape[-1]
        shape = ds_out.shape if ds_out is not None else dy.shape
        if dy is None:
            dy = torch.zeros_like(ds_out)
        ds, dx, dw, db, dbias = launch_backward(
            dy.reshape(-1, n).contiguous(),
            None if ds_out is None else ds_out.reshape(-1, n).contiguous(),
            s, w, mean, rstd, ctx.has_bias, keep=keep)
        bias_t, w_t, b_t = ctx.dtypes
        ds = ds.view(shape)
        return (ds if dx is None else dx.view(shape), ds,
                None if dbias is None else dbias.to(bias_t), dw.to(w_t), db.to(b_t), None, None)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps: float):
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        _, y, mean, rstd = launch_forward(x2, None, None, w, b, eps)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.dtypes = (w.dtype, b.dtype)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        n = x.shape[-1]
        dx, _, dw, db, _ = launch_backward(dy.reshape(-1, n).contiguous(), None, x, w, mean,
                                           rstd, False)
        return dx.view(dy.shape), dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, bias, keep):
        n = x.shape[-1]
        s, *_ = launch_forward(x.reshape(-1, n), r.reshape(-1, n), bias, x, x, 0.0, norm=False,
                               keep=keep)
        ctx.save_for_backward(keep)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return s.view(x.shape)

    @staticmethod
    def backward(ctx, ds):
        keep, = ctx.saved_tensors
        dx = ds if keep is None else ds * keep.view(*ds.shape[:-1], 1).to(ds.dtype)
        dbias = None
        if ctx.bias_dtype is not None:
            dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, ds, dbias, None


def fused_available(*tensors: torch.Tensor) -> bool:
    x = tensors[0]
    return (triton is not None and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(t.shape == x.shape and t.dtype == x.dtype for t in tensors[1:]))


def _rows(keep: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``keep``, a factor broadcasting over ``x`` with one value per row (last dimension 1), as
    a contiguous [rows] tensor."""
    return None if keep is None else keep.expand(*x.shape[:-1], 1).reshape(-1).contiguous()


def _branch(x: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None):
    """The unfused ``keep * (x + bias)``, in the order the kernels' torch twins compute it."""
    x = x if bias is None else x + bias
    return x if keep is None else x * keep


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None,
                   weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                   keep: torch.Tensor | None = None):
    """``s = keep * (x + bias) + residual`` and ``LN(s)`` over the last dimension; returns (s,
    LN(s)). ``keep``: None, or a factor per row broadcasting over ``x`` (stochastic depth's
    per-sample scale). One Triton kernel each way on CUDA."""
    if fused_available(x, residual):
        return _AddLayerNorm.apply(x.contiguous(), residual.contiguous(), bias, weight,
                                   norm_bias, eps, _rows(keep, x))
    s = _branch(x, bias, keep) + residual
    return s, F.layer_norm(s, (s.shape[-1],), weight, norm_bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    """LayerNorm over the last dimension with the same kernels (on an H200, torch's backward
    spent 245 us in its weight-gradient kernel alone for a ViT-L token tensor at mb 256)."""
    if fused_available(x) and weight is not None and bias is not None:
        return _LayerNorm.apply(x.contiguous(), weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add(x: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None,
        keep: torch.Tensor | None = None) -> torch.Tensor:
    """``keep * (x + bias) + residual`` in one pass (torch's broadcast add of a bias is a slow
    kernel of its own); the bias gradient is one column sum."""
    if fused_available(x, residual):
        return _Add.apply(x.contiguous(), residual.contiguous(), bias, _rows(keep, x))
    return _branch(x, bias, keep) + residual


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm (same parameters and state dict) through ``layer_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
