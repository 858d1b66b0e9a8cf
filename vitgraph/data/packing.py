"""Native-resolution images packed along the sequence: the size rule, the pack layout, the packer.

An image keeps its aspect ratio and its size, unless its patch grid would exceed
``max_patches`` (then it is shrunk to the largest grid that fits) or fall below
``min_patches`` (then it is enlarged to the smallest that reaches it): ``native_grid``.

A pack is one training microbatch of a fixed token budget ``T`` (``PackSpec.tokens``): the
images' token runs back to back, each run its prefix tokens (class token, registers) and then
its patches in row-major order, the rest of the budget padding. Its fields, fixed in shape
for every pack of one spec (a CUDA graph captured on one pack replays any other):

* ``patches`` uint8 [T, 3 * p * p]: each patch's pixels in (channel, row, column) order, the
  order of the patch embedding's convolution weight; zero for prefix and padding tokens;
* ``coords`` int64 [T, 4]: (row, column, grid rows, grid columns) of a patch in its image;
  a prefix token has row ``-1 - k`` (k: its place among the prefix tokens) and its image's
  grid; padding has (0, 0, 0, 0);
* ``seg`` int64 [T]: the image slot (0 .. max_images - 1) of each token, ``max_images`` for
  padding;
* ``cu_seqlens`` int32 [num_segments + 1]: the token offsets of the segments attention keeps
  apart (TE's ``thd`` format): the images in slot order, then the padding cut into runs of at
  most ``max_len`` tokens, then empty segments (repeated offsets) up to the fixed count, so
  no segment is longer than ``max_len`` (attention's ``max_seqlen``);
* ``labels`` int64 [max_images]: -1 for an empty slot.

A padded spec (``PackSpec.padded``, data.packing.layout=padded) gives each image a slot of
its own: image ``i`` at token ``i * max_len``, the rest of its slot padding, ``tokens`` =
``max_images * max_len`` and ``cu_seqlens`` the ``max_images + 1`` slot boundaries (an empty
slot's too). The same fields, so the loader, the augmentation and the model's embedding and
pooling serve both; the model runs the slots as a dense batch with a key-padding mask.

The packer fills packs first-fit from a window of images in (shuffled) order: images that
fit nowhere wait at the head of the next window, so none is dropped and the order stays
deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def grid_at(h: int, w: int, patch: int, scale: float) -> tuple[int, int]:
    """The patch grid of an ``h`` x ``w`` image resized by ``scale`` (each side rounded to
    whole patches, at least one)."""
    return max(1, round(h * scale / patch)), max(1, round(w * scale / patch))


def native_grid(h: int, w: int, patch: int, max_patches: int, min_patches: int = 1
                ) -> tuple[int, int]:
    """The patch grid (rows, columns) an ``h`` x ``w`` image trains at: its own size when that
    fits in [min_patches, max_patches], else the nearest scale that does, the aspect ratio
    kept (to whole patches)."""
    if h < 1 or w < 1:
        raise ValueError(f"image size {h}x{w}")
    gh, gw = grid_at(h, w, patch, 1.0)
    n = gh * gw
    if min_patches <= n <= max_patches:
        return gh, gw
    lo, hi = (0.0, 1.0) if n > max_patches else (1.0, 2.0)
    if n < min_patches:  # enlarge: find an upper bound first
        while math.prod(grid_at(h, w, patch, hi)) < min_patches and hi < 1e6:
            hi *= 2
    for _ in range(60):  # bisect the scale; the grid grows with it
        mid = (lo + hi) / 2
        g = math.prod(grid_at(h, w, patch, mid))
        if n > max_patches:  # the largest scale that fits: lo
            lo, hi = (mid, hi) if g <= max_patches else (lo, mid)
        else:  # the smallest that reaches min_patches: hi
            lo, hi = (lo, mid) if g >= min_patches else (mid, hi)
    scale = lo if n > max_patches else hi
    gh, gw = grid_at(h, w, patch, scale)
    if gh * gw > max_patches:  # rounding at the boundary: step down a patch on the long side
        gh, gw = (gh - 1, gw) if gh >= gw else (gh, gw - 1)
    return max(gh, 1), max(gw, 1)


@dataclass(frozen=True)
class PackSpec:
    tokens: int  # T: the token budget of a pack
    max_images: int  # M: images in a pack at most
    max_patches: int  # patches of one image at most
    num_prefix: int  # class token + registers before each image's patches
    patch_size: int
    min_patches: int = 1
    padded: bool = False  # each image in a slot of max_len tokens (tokens = M * max_len)

    def __post_init__(self):
        if self.tokens < self.max_len:
            raise ValueError(f"a pack of {self.tokens} tokens cannot hold one image of "
                             f"{self.max_patches} patches and {self.num_prefix} prefix tokens")
        if self.padded and self.tokens != self.max_images * self.max_len:
            raise ValueError(f"padded slots: {self.tokens} tokens for {self.max_images} slots "
                             f"of {self.max_len}")

    @property
    def max_len(self) -> int:
        """The longest segment: one image at max_patches with its prefix (attention's
        max_seqlen)."""
        return self.num_prefix + self.max_patches

    @property
    def pad_segments(self) -> int:
        return 0 if self.padded else -(-self.tokens // self.max_len)

    @property
    def num_segments(self) -> int:
        return self.max_images + self.pad_segments

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    def image_tokens(self, grid: tuple[int, int]) -> int:
        return self.num_prefix + grid[0] * grid[1]


def patchify(image: np.ndarray | torch.Tensor, patch: int) -> torch.Tensor:
    """uint8 [gh * p, gw * p, 3] -> [gh * gw, 3 * p * p], patches row-major, each in
    (channel, row, column) order."""
    x = torch.as_tensor(image)
    h, w, c = x.shape
    gh, gw = h // patch, w // patch
    x = x[:gh * patch, :gw * patch].reshape(gh, patch, gw, patch, c)
    return x.permute(0, 2, 4, 1, 3).reshape(gh * gw, c * patch * patch)


def layout(grids: list[tuple[int, int]], spec: PackSpec) -> tuple[torch.Tensor, ...]:
    """(coords, seg, cu_seqlens, offsets) of a pack holding images of ``grids`` in slot order;
    ``offsets[i]``: where image i's patch tokens start."""
    if len(grids) > spec.max_images:
        raise ValueError(f"{len(grids)} images for a pack of at most {spec.max_images}")
    T, M, P, L = spec.tokens, spec.max_images, spec.num_prefix, spec.max_len
    # as arrays (a Python loop of tensor ops per image cost ~3 ms of a CPU demo's pack)
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 2)
    n = P + g[:, 0] * g[:, 1]
    runs = np.cumsum(n) - n  # each image's start in its images' tokens back to back
    if spec.padded:
        if len(n) and n.max() > L:
            raise ValueError(f"an image of {int(n.max())} tokens overflows a slot of {L}")
        starts = np.arange(len(n), dtype=np.int64) * L
    else:
        ends = runs + n
        if len(ends) and ends[-1] > T:
            first = int(np.argmax(ends > T))
            raise ValueError(f"images of {int(ends[first])} tokens overflow a pack of {T}")
        starts = runs
    c = np.zeros((T, 4), dtype=np.int64)
    sg = np.full(T, M, dtype=np.int64)
    total = int(n.sum())
    if total:
        within = np.arange(total) - np.repeat(runs, n)  # place in the image's run
        pos = np.repeat(starts, n) + within  # its token in the pack
        sg[pos] = np.repeat(np.arange(len(n)), n)
        gh, gw = np.repeat(g[:, 0], n), np.repeat(g[:, 1], n)
        r = within - P
        prefix = r < 0
        c[pos, 0] = np.where(prefix, -1 - within, r // gw)
        c[pos, 1] = np.where(prefix, 0, r % gw)
        c[pos, 2], c[pos, 3] = gh, gw
    coords, seg = torch.from_numpy(c), torch.from_numpy(sg)
    offsets = (starts + P).tolist()
    if spec.padded:  # the slots, empty ones too
        bounds = (np.arange(M + 1) * L).tolist()
    else:
        bounds, at = [0, *(starts + n).tolist()], total
        while at < T:  # padding, in runs no longer than an image's longest
            at = min(at + L, T)
            bounds.append(at)
        bounds += [T] * (spec.num_segments + 1 - len(bounds))
    return coords, seg, torch.tensor(bounds, dtype=torch.int32), offsets


def assemble(patches: list[torch.Tensor], grids: list[tuple[int, int]], labels: list[int],
             spec: PackSpec) -> tuple[torch.Tensor, ...]:
    """One pack's fields (patches, coords, seg, cu_seqlens, labels) from its images' patch
    rows (``patchify``; uint8 [gh * gw, 3 p^2] each, or float: the patches come out in their
    dtype, zero on prefix and padding tokens)."""
    coords, seg, cu, offsets = layout(grids, spec)
    dtype = patches[0].dtype if patches else torch.uint8
    out = torch.zeros(spec.tokens, spec.patch_dim, dtype=dtype)
    for rows, start, (gh, gw) in zip(patches, offsets, grids):
        if rows.shape != (gh * gw, spec.patch_dim):
            raise ValueError(f"patch rows {tuple(rows.shape)} for a {gh}x{gw} grid")
        out[start:start + gh * gw] = rows
    lab = torch.full((spec.max_images,), -1, dtype=torch.int64)
    lab[:len(labels)] = torch.as_tensor(labels, dtype=torch.int64)
    return out, coords, seg, cu, lab


def fill_packs(order: list[int], tokens_of, spec: PackSpec, n_packs: int
               ) -> tuple[list[list[int]], list[int]]:
    """``n_packs`` packs filled first-fit from ``order`` (image indices, in the order they
    should train; ``tokens_of(i)``: image i's token count with its prefix): each image goes
    to the first pack it fits in (budget and max_images). Returns the packs (lists of image
    indices) and the images that fit in none, in their order."""
    packs: list[list[int]] = [[] for _ in range(n_packs)]
    free = [spec.tokens] * n_packs
    left = []
    for i in order:
        n = tokens_of(i)
        for k in range(n_packs):
            if n <= free[k] and len(packs[k]) < spec.max_images:
                packs[k].append(i)
                free[k] -= n
                break
        else:
            left.append(i)
    return packs, left
