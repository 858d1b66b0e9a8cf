"""Image–text contrastive losses over every data-parallel rank's batch.

Both take L2-normalised features of this rank's pairs ([b, e] each) and return this rank's
loss. Negatives come from every rank of ``group``: pass the data-parallel group
(``parallel_state.get_data_parallel_group()``); ``None`` is the whole world, which is right
only without tensor or pipeline parallelism. The features
are all-gathered, and the gather's backward sums every rank's gradient for a rank's features
and hands it back to that rank, so the gradient flows through the local features as if one
process had the whole batch. With equal local batches the mean of the ranks' losses is the
full-batch loss, and the data-parallel mean of the parameter gradients (what megatron DDP /
``CpuOptimizer`` do) is the full-batch gradient.

- ``clip_loss``: InfoNCE in both directions with the logit scale (open_clip's ClipLoss with
  local loss and gradient-carrying gather);
- ``siglip_loss``: the sigmoid loss with a learnable bias, summed over every image–text pair
  and divided by the local batch (SigLIP's normalisation). Its negatives are exchanged in
  chunks (``exchange="ring"``, the default, as the SigLIP paper and open_clip): for each
  k = 1 .. world-1 a rank sends its text features to rank + k and scores its images against
  those from rank - k, one b_local x b_local block at a time; the backward sends each block's
  text gradient back to its owner. ``exchange="all_gather"`` gathers every text feature at
  once instead; both give the same loss and gradients.

``valid`` (bool [b], optional): which of this rank's pairs are real. A packed microbatch has
empty image slots (vitgraph.data.packing): their pairs are neither positives nor negatives
and the loss is divided by the valid pairs, so it equals the loss over the valid pairs alone
(on one rank; over ranks, each rank's valid pairs against every rank's). Masking is by
selection, not indexing: the shapes stay fixed (CUDA graphs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0; backward: the sum over ranks of the gradient for this rank's
    slice (a reduce-scatter on NCCL, an all-reduce where the backend lacks one, e.g. gloo)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank, world = _world(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        n = grad.shape[0] // world
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank * n: (ctx.rank + 1) * n], None


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _shift(x: torch.Tensor, k: int, group) -> torch.Tensor:
    """Send ``x`` to group rank + k, return what rank - k sent (modulo the group size)."""
    rank, world = _world(group)
    out = torch.empty_like(x)
    reqs = [dist.isend(x.contiguous(), _peer(group, (rank + k) % world), group=group),
            dist.irecv(out, _peer(group, (rank - k) % world), group=group)]
    for r in reqs:
        r.wait()
    return out


class _ShiftWithGrad(torch.autograd.Function):
    """``_shift`` whose backward returns the gradient to the rank the tensor came from."""

    @staticmethod
    def forward(ctx, x, k, group):
        ctx.k, ctx.group = k, group
        return _shift(x, k, group)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, -ctx.k, ctx.group), None, None


def gather_features(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order; gradient flows back to each
    rank's own slice. Without a process group (or a group of one) ``x`` itself."""
    if _world(group)[1] == 1:
        return x
    return _GatherWithGrad.apply(x, group)


def clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
              group=None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """InfoNCE over the global batch for this rank's rows; ``logit_scale`` is the scale itself
    (exp of the parameter, as CLIP.forward returns it); ``valid``: see the module docstring."""
    rank, _ = _world(group)
    all_image, all_text = gather_features(image, group), gather_features(text, group)
    b = image.shape[0]
    labels = torch.arange(b, device=image.device) + rank * b
    per_image = logit_scale * image @ all_text.T
    per_text = logit_scale * text @ all_image.T
    if valid is None:
        return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2
    others = gather_features(valid.to(image.dtype), group) > 0
    # a finite floor, not -inf: a row with no valid column (an empty pack) stays finite
    floor = torch.finfo(per_image.dtype).min
    per_image = per_image.masked_fill(~others[None, :], floor)
    per_text = per_text.masked_fill(~others[None, :], floor)
    ce = (F.cross_entropy(per_image, labels, reduction="none")
          + F.cross_entropy(per_text, labels, reduction="none"))
    return torch.where(valid, ce, 0.0).sum() / (2 * valid.sum().clamp(min=1))


def _sigmoid_block(image, text, logit_scale, logit_bias, positives_at: int | None,
                   keep: torch.Tensor | None = None):
    """-sum log sigmoid(+-logits) of one block; ``positives_at``: the column offset of the
    matching pairs in ``text`` (None: every pair is a negative); ``keep``: the pairs counted."""
    logits = logit_scale * image @ text.T + logit_bias
    signs = -torch.ones_like(logits)
    if positives_at is not None:  # a fill, not an indexed store of a host scalar: capturable
        signs.diagonal(offset=positives_at).fill_(1.0)
    loss = -F.logsigmoid(signs * logits)
    if keep is not None:
        loss = torch.where(keep, loss, 0.0)
    return loss.sum()


def siglip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, group=None, exchange: str = "ring",
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """Sigmoid loss: every (image, text) pair of the global batch is a binary problem, the
    matching pairs positive; summed over this rank's images and divided by their number
    (``valid``: see the module docstring)."""
    rank, world = _world(group)
    b = image.shape[0]
    count = b if valid is None else valid.sum().clamp(min=1)

    def keep(texts_valid):
        return None if valid is None else valid[:, None] & texts_valid[None, :]

    if exchange == "all_gather" or world == 1:
        others = None if valid is None else gather_features(valid.to(image.dtype), group) > 0
        return _sigmoid_block(image, gather_features(text, group), logit_scale, logit_bias,
                              positives_at=rank * b, keep=keep(others)) / count
    if exchange != "ring":
        raise ValueError(f"exchange={exchange!r}: ring | all_gather")
    total = _sigmoid_block(image, text, logit_scale, logit_bias, positives_at=0,
                           keep=keep(valid))
    for k in range(1, world):
        others = _ShiftWithGrad.apply(text, k, group)
        mask = None if valid is None else _shift(valid.to(image.dtype), k, group) > 0
        total = total + _sigmoid_block(image, others, logit_scale, logit_bias, None,
                                       keep=keep(mask))
    return total / count
