"""The MLP's bias + activation as one kernel forward and one backward (Triton, on CUDA).

megatron-core fuses bias + GELU only for the tanh approximation (``bias_gelu_impl``), and
cuBLASLt's GELU epilogue is tanh-only too; ViTs (timm, OpenAI CLIP, SigLIP) use exact GELU,
QuickGELU or tanh-GELU as trained. Unfused, an H200 ViT-L step at micro-batch 256 spent
17 ms in torch's GELU kernels and 4 ms in a separate bias-gradient pass over the same
activations. Here the forward reads the GEMM output once and writes the activation; the
backward reads the GEMM output and the incoming gradient once, writes the input gradient and
sums the bias gradient from the same registers.

Elsewhere (CPU, or no Triton) ``bias_act`` is ``act(x + bias)`` in torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: act(x + bias) in torch
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _rcp(x):
        # approximate reciprocal (div.full, ~2 ulp): an IEEE division is a dozen instructions,
        # and at ~20 instructions an element these kernels are as much compute- as memory-bound
        return tl.fdiv(1.0, x, ieee_rounding=False)

    @triton.jit
    def _sigmoid(x):
        return _rcp(1.0 + tl.exp(-x))

    @triton.jit
    def _erf(x, e):
        # erf(x) from e = exp(-x^2) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7): the
        # backward has that exponential anyway, and libdevice's erf made the exact-GELU
        # kernels compute-bound (forward 297 us against 209 for QuickGELU at ViT-L mb 256)
        a = tl.abs(x)
        t = _rcp(1.0 + 0.3275911 * a)
        p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        r = 1.0 - p * e
        return tl.where(x < 0, -r, r)

    @triton.jit
    def _act(z, KIND: tl.constexpr):
        if KIND == 0:  # exact GELU
            return 0.5 * z * (1.0 + _erf(z * 0.7071067811865476, tl.exp(-0.5 * z * z)))
        if KIND == 1:  # QuickGELU
            return z * _sigmoid(1.702 * z)
        # tanh approximation; tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return 0.5 * z * (1.0 + (2.0 * _sigmoid(2.0 * u) - 1.0))

    @triton.jit
    def _act_grad(z, KIND: tl.constexpr):
        if KIND == 0:
            e = tl.exp(-0.5 * z * z)
            return 0.5 * (1.0 + _erf(z * 0.7071067811865476, e)) + z * 0.3989422804014327 * e
        if KIND == 1:
            s = _sigmoid(1.702 * z)
            return s + 1.702 * z * s * (1.0 - s)
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * _sigmoid(2.0 * u) - 1.0
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du

    @triton.jit
    def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS_FIRST: tl.constexpr):
        # a 1-D grid over (row block, column block); COLS_FIRST: neighbouring programs take
        # neighbouring column blocks of the same rows
        pid = tl.program_id(0)
        if COLS_FIRST:
            nc = tl.cdiv(N, BLOCK_N)
            pr = pid // nc
            pc = pid % nc
        else:
            nr = tl.cdiv(M, BLOCK_M)
            pr = pid % nr
            pc = pid // nr
        return pr, pc

    @triton.jit
    def _offsets(rows, cols, N, I64: tl.constexpr):
        # 32-bit element offsets where they fit: 64-bit ones cost several instructions each
        if I64:
            return rows[:, None].to(tl.int64) * N + cols[None, :]
        return rows[:, None] * N + cols[None, :]

    @triton.jit
    def _forward(x_ptr, b_ptr, y_ptr, M, N, KIND: tl.constexpr, I64: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS_FIRST: tl.constexpr):
        pr, pc = _tile(M, N, BLOCK_M, BLOCK_N, COLS_FIRST)
        rows = pr * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pc * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = _offsets(rows, cols, N, I64)
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
        tl.store(y_ptr + offs, _act(z, KIND).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(x_ptr, b_ptr, dy_ptr, dx_ptr, db_part_ptr, M, N, KIND: tl.constexpr,
                  I64: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, COLS_FIRST: tl.constexpr):
        # each program takes ROWS rows of one column block and writes their bias gradient
        # (fp32) to its row of db_part; the sum over those rows is the caller's
        pr, pc = _tile(M, N, ROWS, BLOCK_N, COLS_FIRST)
        cols = pc * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        # summed over the rows once, at the end: a reduction across warps per tile is not free
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in tl.static_range(0, ROWS, BLOCK_M):
            rows = pr * ROWS + r + tl.arange(0, BLOCK_M)
            mask = (rows[:, None] < M) & cmask[None, :]
            offs = _offsets(rows, cols, N, I64)
            z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dz = dy * _act_grad(z, KIND)
            tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
            acc += tl.where(mask, dz, 0.0)
        tl.store(db_part_ptr + pr * N + cols, tl.sum(acc, axis=0), mask=cmask)


# tile sizes, fixed rather than autotuned so that the bias gradient's summation order (and
# so its bits) is the same in every run; chosen from a sweep on an H200 (ViT-L's MLP at mb 256:
# backward 404 us columns-first against 437 rows-first; benchmarks/BENCHMARKS.md)
FORWARD = dict(BLOCK_M=4, BLOCK_N=1024, num_warps=4, COLS_FIRST=True)
BACKWARD = dict(ROWS=32, BLOCK_M=32, BLOCK_N=64, num_warps=4, COLS_FIRST=True)


def launch_forward(x, bias, y, kind: int, cfg: dict = FORWARD) -> None:
    n = x.shape[-1]
    m = x.numel() // n
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _forward[grid](x, bias, y, m, n, KIND=kind, I64=(m + cfg["BLOCK_M"]) * n >= 2**31, **cfg)


def launch_backward(x, bias, dy, dx, kind: int, cfg: dict = BACKWARD) -> torch.Tensor:
    """Writes dx; returns the bias gradient (fp32)."""
    n = x.shape[-1]
    m = x.numel() // n
    parts = triton.cdiv(m, cfg["ROWS"])
    db_part = torch.empty((parts, n), dtype=torch.float32, device=x.device)
    grid = (parts * triton.cdiv(n, cfg["BLOCK_N"]),)
    _backward[grid](x, bias, dy, dx, db_part, m, n, KIND=kind,
                    I64=parts * cfg["ROWS"] * n >= 2**31, **cfg)
    return db_part.sum(0)


class _BiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, kind: int):
        x = x.contiguous()
        y = torch.empty_like(x)
        launch_forward(x, bias, y, kind)
        ctx.save_for_backward(x, bias)
        ctx.kind = kind
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx = torch.empty_like(x)
        db = launch_backward(x, bias, dy.contiguous(), dx, ctx.kind)
        return dx, db.to(bias.dtype), None


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's activation."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


# an architecture's activation by name (vitgraph.models.registry: CLIPArch, TowerArch)
ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": quick_gelu, "gelu_tanh": gelu_tanh}

_KIND_OF = {F.gelu: 0, quick_gelu: 1, gelu_tanh: 2}


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act) -> torch.Tensor:
    """``act(x + bias)`` over the last dimension; one Triton kernel each way on CUDA for
    exact GELU, QuickGELU and tanh-GELU."""
    kind = _KIND_OF.get(act)
    if (bias is None or kind is None or not x.is_cuda or triton is None
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return act(x if bias is None else x + bias)
    return _BiasAct.apply(x, bias, kind)

