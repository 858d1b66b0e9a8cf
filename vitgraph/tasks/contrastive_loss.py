"""Image–text contrastive losses over every data-parallel rank's batch.

Both take L2-normalised features of this rank's pairs ([b, e] each) and return this rank's
loss. Negatives come from every rank of ``group`` (the data-parallel group): the features
are all-gathered, and the gather's backward sums every rank's gradient for a rank's features
and hands it back to that rank, so the gradient flows through the local features as if one
process had the whole batch. With equal local batches the mean of the ranks' losses is the
full-batch loss, and the data-parallel mean of the parameter gradients (what megatron DDP /
``CpuOptimizer`` do) is the full-batch gradient.

- ``clip_loss``: InfoNCE in both directions with the logit scale (open_clip's ClipLoss with
  local loss and gradient-carrying gather);
- ``siglip_loss``: the sigmoid loss with a learnable bias, summed over every image–text pair
  and divided by the local batch (SigLIP's normalisation). The negatives are exchanged with
  one all-gather of the text features, not yet in chunks around a ring as in the SigLIP paper;
  the result is the same, the memory is that of the all-gather (B_global x b_local logits).
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


def gather_features(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order; gradient flows back to each
    rank's own slice. Without a process group (or a group of one) ``x`` itself."""
    if _world(group)[1] == 1:
        return x
    return _GatherWithGrad.apply(x, group)


def clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
              group=None) -> torch.Tensor:
    """InfoNCE over the global batch for this rank's rows; ``logit_scale`` is the scale itself
    (exp of the parameter, as CLIP.forward returns it)."""
    rank, _ = _world(group)
    all_image, all_text = gather_features(image, group), gather_features(text, group)
    b = image.shape[0]
    labels = torch.arange(b, device=image.device) + rank * b
    per_image = logit_scale * image @ all_text.T
    per_text = logit_scale * text @ all_image.T
    return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


def siglip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor, group=None) -> torch.Tensor:
    """Sigmoid loss: every (image, text) pair of the global batch is a binary problem, the
    matching pairs positive; summed over this rank's images and divided by their number."""
    rank, _ = _world(group)
    all_text = gather_features(text, group)
    b = image.shape[0]
    logits = logit_scale * image @ all_text.T + logit_bias
    signs = -torch.ones_like(logits)
    rows = torch.arange(b, device=image.device)
    signs[rows, rows + rank * b] = 1.0
    return -F.logsigmoid(signs * logits).sum() / b
