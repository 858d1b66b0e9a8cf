"""The pieces of the packed (native-resolution) ViT forward that are not megatron's: per-token
position resampling, prefix tokens, the block-diagonal attention mask of the torch spec,
pooling per image slot, and the key mask of the padded slots.

A pack (vitgraph.data.packing) is ``T`` tokens of up to ``M`` images back to back; every
function here takes the pack's fixed-shape fields (``coords`` [T, 4], ``seg`` [T],
``cu_seqlens`` [S + 1]) and works with device ops of fixed shapes only: no host reads, no
shape that depends on the data, so one CUDA graph serves every pack.

Pooling sums over an image's tokens as a matrix product with the [M, T] slot-membership
matrix: deterministic (no atomics), and one GEMM each way.

A padded spec (``PackSpec.padded``, data.packing.layout=padded) is what a fixed-shape batch
needs without packing: image ``i`` in tokens ``[i L, (i + 1) L)`` (``L = spec.max_len``), its
prefix, patches and then padding, run as a dense [L, M, d] batch with a key-padding mask. Its
fields have the packed format, ``cu_seqlens`` the slot starts, so embedding and pooling are
shared.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # the fused row gather on the GPU (torch ships Triton with its CUDA builds)
    import triton
    import triton.language as tl
except ImportError:
    triton = None


POS_INTERP = ("bicubic", "bilinear")


def segment_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The attention segment of each of ``tokens`` tokens (empty segments skipped)."""
    pos = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)


class _Gather(torch.autograd.Function):
    """``x.index_select(0, idx)`` (rows where ``mask`` [n] is False set to zero, when given)
    whose backward is the gather ``(back_idx, back_mask)`` instead of a scatter: for two maps
    that invert each other where the gradients are not zero (token -> slot place and slot
    place -> token, ``Slots``), the same numbers as indexing's accumulating scatter
    (index_put), which on CPU cost as much as the attention itself; deterministic and
    atomic-free anywhere."""

    @staticmethod
    def forward(ctx, x, idx, mask, back_idx, back_mask):
        ctx.save_for_backward(idx, mask, back_idx, back_mask)
        return _take(x, idx, mask)

    @staticmethod
    def backward(ctx, grad):
        idx, mask, back_idx, back_mask = ctx.saved_tensors
        return _Gather.apply(grad, back_idx, back_mask, idx, mask), None, None, None, None


def _take(x: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if triton is not None and x.is_cuda:
        return _take_fused(x, idx, mask)
    # rows of a contiguous 2-D view: index_select of a strided [T, h, d] (a slice of the
    # QKV projection, a permuted gradient) ran ~20x slower on CPU than a copy and this
    out = x.reshape(x.shape[0], -1).index_select(0, idx)
    if mask is not None:
        # a select, not a product: a row nothing wrote (an attention kernel leaves a slot's
        # rows past its length alone) may hold NaN from a graph pool, and NaN * 0 is NaN
        out = torch.where(mask[:, None], out, 0)
    return out.view(idx.shape[0], *x.shape[1:])


def _take_fused(x: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``_take`` in one pass on the GPU: index_select then where cost two passes over the
    rows (SO400M/16's packed step: 18 ms of gathers and 29 ms of where in 410 ms), and a
    masked row is never read, so a NaN it holds cannot reach the output. A [T, h, d] view
    with any strides is read in place (no copy of a strided gradient)."""
    shape = (idx.shape[0], *x.shape[1:])
    if x.dim() != 3:
        x = x.reshape(x.shape[0], 1, -1) if x.dim() != 2 else x[:, None]
    n, (_, a, b) = idx.shape[0], x.shape
    out = torch.empty((n, a * b), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(a * b))
    keep = idx if mask is None else mask.view(torch.uint8)
    _take_rows[(n, triton.cdiv(a * b, block))](
        x, idx, keep, out, a * b, b, x.stride(0), x.stride(1), x.stride(2),
        HAS_MASK=mask is not None, BLOCK=block)
    return out.view(shape)


if triton is not None:
    @triton.jit
    def _take_rows(x, idx, keep, out, cols, inner, s_row, s_outer, s_inner,
                   HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inb = c < cols
        read = inb
        if HAS_MASK:
            read = inb & (tl.load(keep + r) != 0)
        src = tl.load(idx + r).to(tl.int64)
        v = tl.load(x + src * s_row + (c // inner) * s_outer + (c % inner) * s_inner,
                    mask=read, other=0.0)
        tl.store(out + r.to(tl.int64) * cols + c, v, mask=inb)


@dataclass(frozen=True)
class Slots:
    """The segments of a pack laid out as ``rows`` slots of ``max_len`` places, each segment
    from the start of its slot: ``idx`` [S L] the token at each place (clamped where there is
    none), ``valid`` [S L] whether the place holds its segment's token, ``place`` [T] each
    token's place, ``inside`` [T] whether the token is in one of the slotted segments."""
    idx: torch.Tensor
    valid: torch.Tensor
    place: torch.Tensor
    inside: torch.Tensor
    rows: int
    max_len: int

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[T, ...] tokens -> [S L, ...] rows in slot order (a place past its segment's end
        holds some token)."""
        return _Gather.apply(t, self.idx, None, self.place, self.inside)

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[S L, ...] rows in slot order -> [T, ...] tokens; a token in no slot gets zeros."""
        return _Gather.apply(t, self.place, self.inside, self.idx, self.valid)


def segment_slots(cu_seqlens: torch.Tensor, tokens: int, max_len: int,
                  rows: int | None = None) -> Slots:
    """``Slots`` of the first ``rows`` segments of ``cu_seqlens`` (all of them by default),
    by device ops of fixed shapes. A pack's images are its first segments
    (vitgraph.data.packing.layout), so with rows = max_images its padding runs are left out:
    their outputs are never read."""
    if rows is not None:
        cu_seqlens = cu_seqlens[:rows + 1]
    starts = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - starts
    S = starts.shape[0]
    j = torch.arange(max_len, device=cu_seqlens.device)
    valid = j[None, :] < lens[:, None]  # [S, L]
    idx = torch.where(valid, starts[:, None] + j[None, :], 0).clamp_(max=tokens - 1).view(-1)
    seg = segment_ids(cu_seqlens, tokens)  # S for tokens after the last slotted segment
    inside = seg < S
    seg = seg.clamp(max=S - 1)
    pos = (torch.arange(tokens, device=cu_seqlens.device) - starts[seg]).clamp_(0, max_len - 1)
    return Slots(idx, valid.view(-1), seg * max_len + pos, inside, S, max_len)


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Slots,
                   dropout: float = 0.0, scale: float | None = None,
                   causal: bool = False) -> torch.Tensor:
    """Self-attention within each slot by SDPA: [S L, h, d] rows in slot order (``Slots``)
    -> [T, h, d] tokens. Fixed shapes, segments x max_len^2 work instead of the T^2 of a
    block-diagonal mask (20x less for the tiny CPU config's packs of 2,048 tokens in runs of
    <= 65). ``causal``: a token attends to its segment's tokens up to itself (a packed
    language model: every segment starts at its slot's first place)."""
    S, L = slots.rows, slots.max_len
    q, k, v = (t.view(S, L, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
    valid = slots.valid.view(S, L)
    # an empty segment's slot attends to its (unused) tail rather than to nothing (0 / 0)
    keep = (valid | ~valid.any(-1, keepdim=True))[:, None, None, :]
    if causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout,
                                         scale=scale)
    return slots.scatter(out.transpose(1, 2).reshape(S * L, *out.shape[1::2]))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor, max_len: int, dropout: float = 0.0,
                      scale: float | None = None, rows: int | None = None) -> torch.Tensor:
    """Self-attention within segments (TE's thd format): [T, h, d] -> [T, h, d], each
    segment's tokens in a slot of ``max_len`` (``segment_slots``; ``rows``: the first this
    many segments only, later tokens get zeros) through ``slot_attention``. The two gathers
    are each other's backward (``_Gather``): a slot's tail and the tokens past the last slot
    get zero gradients, as by indexing."""
    slots = segment_slots(cu_seqlens, q.shape[0], max_len, rows)
    return slot_attention(*(slots.gather(t) for t in (q, k, v)), slots, dropout, scale)


def block_diagonal(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[T, T] bool, True where query and key are in one segment (SDPA's keep mask)."""
    s = segment_ids(cu_seqlens, tokens)
    return s[:, None] == s[None, :]


_CUBIC_A = -0.75  # the cubic convolution kernel torch's bicubic grid_sample uses


def _taps(coord: torch.Tensor, size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample positions ``coord`` (in grid cells, align_corners=False) of a 1-D grid of
    ``size``: the tap indices [T, k] and weights [T, k] of F.grid_sample with border padding
    (bilinear: the coordinate clipped, 2 taps; bicubic: 4 taps, each index clipped)."""
    if mode == "bilinear":
        x = coord.clamp(0, size - 1)
        x0 = x.floor()
        t = (x - x0)[:, None]
        idx = torch.stack([x0, x0 + 1], 1)
        w = torch.cat([1 - t, t], 1)
    else:
        x0 = coord.floor()
        t = coord - x0
        a = _CUBIC_A

        def near(z):  # |z| <= 1
            return ((a + 2) * z - (a + 3)) * z * z + 1

        def far(z):  # 1 < |z| < 2
            return ((a * z - 5 * a) * z + 8 * a) * z - 4 * a

        idx = torch.stack([x0 - 1, x0, x0 + 1, x0 + 2], 1)
        w = torch.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], 1)
    return idx.clamp(0, size - 1).long(), w


def interpolation_matrix(coords: torch.Tensor, G: int, mode: str, dtype) -> torch.Tensor:
    """[T, G * G]: row t holds the weights of the learned G x G grid's cells in token t's
    position (see ``resample_positions``), so the positions are one GEMM with the grid and
    their gradient another: a gather's backward would add T x 16 rows into G^2 cells by
    atomics (and grid_sample's does), which contend on a GPU and are not deterministic."""
    if mode not in POS_INTERP:
        raise ValueError(f"pos_interp {mode!r}: {' | '.join(POS_INTERP)}")
    rc = coords[:, :2].clamp(min=0).to(dtype)
    size = coords[:, 2:].clamp(min=1).to(dtype)
    src = (rc + 0.5) * G / size - 0.5  # the cell centre in the learned grid's cells
    axes = []
    for a in (0, 1):  # rows, columns: [T, G] weights each, the taps summed per cell
        idx, w = _taps(src[:, a], G, mode)
        axes.append((F.one_hot(idx, G).to(dtype) * w[..., None]).sum(1))
    wy, wx = axes
    return (wy[:, :, None] * wx[:, None, :]).reshape(coords.shape[0], G * G)


def resample_positions(grid: torch.Tensor, coords: torch.Tensor, mode: str) -> torch.Tensor:
    """The learned position grid ``grid`` [G, G, d] at each token's patch: [T, d], in the
    grid's dtype where that is 16-bit, else fp32.

    Token (row, col) of a (gh, gw) grid samples the grid at the centre of its cell,
    ((col + 0.5) / gw, (row + 0.5) / gh) in [0, 1]^2 (align_corners=False, border padding):
    at gh = gw = G exactly the grid, otherwise the same numbers as F.grid_sample (and as
    F.interpolate of the grid to (gh, gw)) with this mode, computed as one GEMM
    (``interpolation_matrix``). Prefix and padding tokens get a value to be overwritten."""
    G = grid.shape[0]
    half = grid.dtype in (torch.bfloat16, torch.float16)
    dtype = grid.dtype if half else torch.promote_types(grid.dtype, torch.float32)
    # the weights from fp32 coordinates (16-bit ones would misplace a tap), then rounded:
    # a 16-bit grid's GEMMs run on tensor cores, accumulating in fp32. In fp32 they ran as
    # SIMT GEMMs: SO400M/14's 729 cells, 5.4 ms of a 492 ms packed step on an H100
    weights = interpolation_matrix(coords, G, mode, torch.float32).to(dtype)
    cells = grid.to(dtype).reshape(G * G, -1)
    pad = -(G * G) % 8  # whole 16-byte rows for the tensor-core kernels (729 cells: 736)
    if half and pad:
        weights, cells = F.pad(weights, (0, pad)), F.pad(cells, (0, 0, 0, pad))
    return weights @ cells


def embed_tokens(x: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, pos_grid: torch.Tensor, prefix: torch.Tensor | None,
                 mode: str) -> torch.Tensor:
    """[T, d] token embeddings of a pack: each patch row of ``x`` [T, 3 p^2] through the
    patch embedding (``weight`` [d, 3 p^2]) plus its resampled position; a prefix token
    (coords row -1 - k) is ``prefix[k]`` (class token / register + its position entry)."""
    out = F.linear(x, weight, bias)
    out = out + resample_positions(pos_grid, coords, mode).to(out.dtype)
    if prefix is None:
        return out
    # the prefix rows by a one-hot GEMM: an index's backward would add all T rows into
    # prefix[0] by atomics (16,384 x 768 of them a ViT-B pack)
    is_prefix = coords[:, 0] < 0
    onehot = (-1 - coords[:, 0])[:, None] == torch.arange(prefix.shape[0], device=x.device)
    rows = (onehot & is_prefix[:, None]).to(out.dtype) @ prefix.to(out.dtype)
    return torch.where(is_prefix[:, None], rows, out)


def slot_valid(seg: torch.Tensor, max_images: int) -> torch.Tensor:
    """[M] bool: whether a slot holds an image (any token with its slot id)."""
    hit = torch.zeros(max_images + 1, dtype=torch.bool, device=seg.device)
    return hit.scatter(0, seg, torch.ones_like(seg, dtype=torch.bool))[:max_images]


def membership(seg: torch.Tensor, coords: torch.Tensor, max_images: int,
               dtype: torch.dtype) -> torch.Tensor:
    """[M, T]: 1 where a token is a patch (not a prefix or padding token) of the slot's image."""
    patch_seg = torch.where(coords[:, 0] >= 0, seg, max_images)
    slots = torch.arange(max_images, device=seg.device)
    return (patch_seg[None, :] == slots[:, None]).to(dtype)


def pool_cls(hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_images: int) -> torch.Tensor:
    """[M, d]: each slot's first token (its class token); an empty slot gets some token."""
    idx = cu_seqlens[:max_images].long().clamp(max=hidden.shape[0] - 1)
    return hidden[idx]


def pool_mean(hidden: torch.Tensor, seg: torch.Tensor, coords: torch.Tensor,
              max_images: int) -> torch.Tensor:
    """[M, d]: the mean over each image's patch tokens (zero for an empty slot)."""
    member = membership(seg, coords, max_images, hidden.dtype)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    count = member.to(acc).sum(1, keepdim=True).clamp(min=1)
    return ((member @ hidden).to(acc) / count).to(hidden.dtype)


def pool_attention(pool, hidden: torch.Tensor, seg: torch.Tensor, coords: torch.Tensor,
                   max_images: int) -> torch.Tensor:
    """SigLIP's attention pooling (vitgraph.models.vit.AttentionPool ``pool``) per slot: its
    learned query attends over each image's patch tokens alone, a softmax per segment by
    scatter (max) and membership products (sums). [T, d] -> [M, d]; an empty slot pools
    zeros through the MLP."""
    t, d = hidden.shape
    h = pool.heads
    dh = d // h
    q = pool.q(pool.latent).reshape(h, dh)
    k, v = pool.kv(hidden).reshape(t, 2, h, dh).unbind(1)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = (k.to(acc) * q.to(acc)).sum(-1) * dh ** -0.5  # [T, h]
    patch_seg = torch.where(coords[:, 0] >= 0, seg, max_images)
    # the softmax is shift-invariant: the segment max needs no gradient
    top = torch.full((max_images + 1, h), float("-inf"), device=hidden.device, dtype=acc)
    top = top.scatter_reduce(0, patch_seg[:, None].expand(t, h), logits.detach(), "amax",
                             include_self=False)
    e = torch.exp(logits - top[patch_seg])  # each token's own segment max: finite
    member = membership(seg, coords, max_images, acc)
    den = (member @ e).clamp(min=1e-30)  # [M, h]
    num = member @ (e[:, :, None] * v.to(acc)).reshape(t, d)  # [M, d]
    out = (num.view(max_images, h, dh) / den[:, :, None]).reshape(max_images, d)
    out = pool.proj(out.to(hidden.dtype))
    return out + pool.fc2(pool.act(pool.fc1(pool.norm(out))))


def key_padding_mask(seg: torch.Tensor, max_images: int, slot_len: int) -> torch.Tensor:
    """[M, 1, 1, L] True = a masked key (megatron's convention): tokens of a slot that are not
    its image's."""
    own = seg.view(max_images, slot_len) == torch.arange(max_images, device=seg.device)[:, None]
    return (~own).view(max_images, 1, 1, slot_len)


