"""What every data source makes: an ``ImageDataset`` (uint8 images, labels, class names and,
for image-text data, captions); the one error type of the data layer; the folder data.path
names."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


class DataError(Exception):
    """A dataset cannot be built; the message names the offending path or setting."""


def data_root(data_cfg) -> str:
    """The folder data.path names, ``~`` expanded (as the config's check expands it); DataError
    when it is unset or no folder."""
    if not data_cfg.path:
        raise DataError(f"data.kind={data_cfg.kind}: data.path is not set")
    root = os.path.expanduser(data_cfg.path)
    if not os.path.isdir(root):
        raise DataError(f"data.path={data_cfg.path!r}: no such directory")
    return root


@dataclass
class ImageDataset:
    images: torch.Tensor  # uint8 [N, H, W, 3]
    labels: torch.Tensor  # int64 [N]
    classes: list[str]
    captions: list[str] | None = None
    # token ids of the captions, int64 [N, context] (set by the contrastive task); with
    # caption_variants, [N, variants, context] and the task draws one variant per pair
    tokens: torch.Tensor | None = None
    # shapes training split with data.caption_dropout > 0: each caption's variants without
    # its size and/or colour words (vitgraph.data.shapes.caption_variants, bitmask-indexed)
    caption_variants: list[tuple[str, ...]] | None = None

    def __post_init__(self):
        if self.images.dtype != torch.uint8 or self.images.ndim != 4 or self.images.shape[-1] != 3:
            raise ValueError(f"images must be uint8 [N, H, W, 3], got {self.images.dtype} "
                             f"{tuple(self.images.shape)}")
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must be int64 [{self.images.shape[0]}], got "
                             f"{self.labels.dtype} {tuple(self.labels.shape)}")
        if self.captions is not None and len(self.captions) != len(self):
            raise ValueError(f"{len(self.captions)} captions for {len(self)} images")
        if self.caption_variants is not None and len(self.caption_variants) != len(self):
            raise ValueError(f"{len(self.caption_variants)} caption variants for "
                             f"{len(self)} images")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def fields(self, idx) -> tuple:
        """The samples ``idx`` as a microbatch: (images, labels) and, when the dataset has
        them, their caption tokens."""
        out = (self.images[idx], self.labels[idx])
        return out if self.tokens is None else (*out, self.tokens[idx])
