"""In-memory image datasets, the training and eval iterators, and the batch transform.

Every dataset here lives in memory as one uint8 tensor ``[N, H, W, 3]``; iterators hand out
uint8 microbatches (cheap to index and to move to the GPU) and ``to_model_input`` turns them
into normalized float tensors on the device.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from vitgraph.data.dataset import DataError, ImageDataset
from vitgraph.data.decode import EncodedImages, finish_on_device

# Inputs are mapped to [-1, 1]; the data is synthetic or arbitrary, so ImageNet statistics
# would buy nothing.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)




def _epoch_seed(seed: int, epoch: int) -> int:
    # Mix (seed, epoch) into one 63-bit seed so that neighbouring seeds do not give shifted
    # copies of the same sequence of permutations.
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    return x % 2**63


def _shard_window_permutation(shard_ids: torch.Tensor, window: int, seed: int) -> torch.Tensor:
    """Shards in a random order, samples shuffled within each window of ``window`` shards: a
    permutation of all samples whose consecutive global batches read from few shards."""
    gen = torch.Generator().manual_seed(seed)
    num_shards = int(shard_ids.max()) + 1 if len(shard_ids) else 0
    order = torch.randperm(num_shards, generator=gen)
    by_shard = torch.argsort(shard_ids, stable=True)
    counts = torch.bincount(shard_ids, minlength=num_shards)
    starts = torch.cumsum(counts, 0) - counts
    parts = []
    for w in range(0, num_shards, window):
        members = torch.cat([by_shard[starts[s]:starts[s] + counts[s]] for s in order[w:w + window]])
        parts.append(members[torch.randperm(len(members), generator=gen)])
    return torch.cat(parts) if parts else torch.arange(0)


class MicrobatchLoader:
    """Deterministic, resumable, data-parallel-sharded microbatches.

    Each epoch draws a fresh permutation from ``torch.Generator`` seeded by (seed, epoch).
    Step ``s`` takes the contiguous global batch ``perm[s*G:(s+1)*G]`` with
    ``G = micro_batch_size * num_microbatches * dp_size``; rank ``r`` gets the ``r``-th slice
    of ``micro_batch_size * num_microbatches`` samples, cut into microbatches in order. So the
    union over ranks of one step depends only on G, not on how it is split.

    Sharded data (``dataset.images.shuffle_shards`` > 0, WebDataset) is permuted shard-wise
    instead: shards in random order, samples shuffled within windows of that many shards.

    ``drop_last=True`` drops the tail of each epoch that does not fill a global batch.
    ``drop_last=False`` keeps it and fills the last global batch by wrapping round to the
    start of the same permutation, so every microbatch keeps the same shape (CUDA graphs
    are captured per shape).
    """

    def __init__(self, dataset: ImageDataset, micro_batch_size: int, num_microbatches: int,
                 dp_rank: int, dp_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True):
        if micro_batch_size < 1 or num_microbatches < 1 or dp_size < 1:
            raise ValueError("micro_batch_size, num_microbatches and dp_size must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.global_batch_size = micro_batch_size * num_microbatches * dp_size
        n = len(dataset)
        if n < self.global_batch_size:
            raise DataError(f"dataset of {n} samples is smaller than one global batch "
                            f"({micro_batch_size} x {num_microbatches} x dp {dp_size} = "
                            f"{self.global_batch_size})")
        g = self.global_batch_size
        self.steps_per_epoch = n // g if drop_last else -(-n // g)
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            n = len(self.dataset)
            window = getattr(self.dataset.images, "shuffle_shards", 0)
            if self.shuffle and window:
                self._perm = _shard_window_permutation(self.dataset.images.shard_ids, window,
                                                       _epoch_seed(self.seed, self.epoch))
            elif self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
                self._perm = torch.randperm(n, generator=gen)
            else:
                self._perm = torch.arange(n)
            self._perm_epoch = self.epoch
        return self._perm

    def next_step(self) -> list[tuple]:
        """The ``num_microbatches`` (images uint8 [b,H,W,3], labels int64 [b][, tokens]) of
        this rank (``ImageDataset.fields``)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        perm = self._permutation()
        g = self.global_batch_size
        start = self.step_in_epoch * g
        idx = perm[start:start + g]
        if idx.numel() < g:  # only with drop_last=False: wrap round
            idx = torch.cat([idx, perm[:g - idx.numel()]])
        per_rank = self.micro_batch_size * self.num_microbatches
        idx = idx[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        self.step_in_epoch += 1
        out = []
        for mb in idx.split(self.micro_batch_size):
            out.append(self.dataset.fields(mb))
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["seed"]) != self.seed:
            raise ValueError(f"loader state was saved with seed {sd['seed']}, this loader has "
                             f"seed {self.seed}; resuming would not continue the same sequence")
        step = int(sd["step_in_epoch"])
        if not 0 <= step <= self.steps_per_epoch:
            raise ValueError(f"step_in_epoch {step} out of range [0, {self.steps_per_epoch}] "
                             "(did the global batch size or the dataset change?)")
        self.epoch = int(sd["epoch"])
        self.step_in_epoch = step


def iterate_eval(dataset: ImageDataset, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1) -> Iterator[tuple]:
    """Fixed-order (images uint8, labels[, tokens]) batches; every sample is seen by exactly
    one rank.

    Rank ``r`` takes the contiguous block ``[N*r//dp_size, N*(r+1)//dp_size)``; its last batch
    may be smaller and nothing is padded, so ranks may see different numbers of batches:
    reduce correct/total counts across ranks once after the loop, not per batch.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    n = len(dataset)
    lo, hi = n * dp_rank // dp_size, n * (dp_rank + 1) // dp_size
    for start in range(lo, hi, batch_size):
        end = min(start + batch_size, hi)
        yield dataset.fields(slice(start, end))


def to_device_uint8(images, device) -> torch.Tensor:
    """A microbatch's images as uint8 [b,H,W,3] on ``device``: moved (uint8: 4x fewer bytes
    than float), or decoded and resized there (``data.decode=cuda``)."""
    if isinstance(images, torch.Tensor):
        return images.to(device, non_blocking=True)
    if isinstance(images, EncodedImages):
        return finish_on_device(images, device)
    raise TypeError(f"images must be a uint8 tensor or EncodedImages, got {type(images).__name__}")


def to_model_input(images_uint8: torch.Tensor, image_size: int, device, dtype) -> torch.Tensor:
    """uint8 [b,H,W,3] -> normalized [b,3,image_size,image_size] of ``dtype`` on ``device``."""
    x = to_device_uint8(images_uint8, device)
    x = x.permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    if x.shape[-2:] != (image_size, image_size):
        # antialias only matters when shrinking; it is a no-op cost when enlarging 32 -> 224
        shrink = x.shape[-1] > image_size or x.shape[-2] > image_size
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear",
                          align_corners=False, antialias=shrink)
    return x.to(dtype).contiguous()
