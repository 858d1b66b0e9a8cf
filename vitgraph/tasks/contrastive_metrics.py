"""Evaluation of an image–text model: zero-shot classification from prompts and retrieval
recall, on features already computed (L2-normalised, as CLIP.encode_* return them).

``class_embeddings`` turns class names into one text embedding per class: every template
(``"a photo of a {}."`` ...) is filled in, encoded, normalised, averaged over the templates
and normalised again (OpenAI CLIP's prompt ensembling).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

TEMPLATES = (
    "a photo of a {}.",
    "a picture of a {}.",
    "a drawing of a {}.",
    "a {} on a plain background.",
    "a small {}.",
    "a large {}.",
)


@torch.no_grad()
def class_embeddings(encode_text: Callable[[torch.Tensor], torch.Tensor], tokenizer,
                     class_names: Sequence[str],
                     templates: Sequence[str] = TEMPLATES) -> torch.Tensor:
    """[num_classes, e], normalised; ``encode_text``: token ids [n, s] -> features [n, e]."""
    out = []
    for name in class_names:
        feats = F.normalize(encode_text(tokenizer([t.format(name) for t in templates])), dim=-1)
        out.append(F.normalize(feats.mean(dim=0), dim=-1))
    return torch.stack(out)


def zero_shot_top1(image_features: torch.Tensor, classes: torch.Tensor,
                   labels: torch.Tensor) -> float:
    """The fraction of images whose nearest class embedding is their label."""
    pred = (image_features @ classes.T).argmax(dim=-1)
    return (pred == labels).float().mean().item()


def retrieval_recall(image_features: torch.Tensor, text_features: torch.Tensor,
                     ks: Sequence[int] = (1, 5), tokens: torch.Tensor | None = None
                     ) -> dict[str, float]:
    """Row i of each is a pair. ``image_to_text_r@k``: the fraction of images whose own text is
    among the k nearest texts; ``text_to_image_r@k`` the other way round. Ties count against
    (the true item must beat every other strictly to rank above it).

    ``tokens`` (the texts' ids, [n, L]): a text identical to an item's own counts as its own
    too (short captions repeat: "a large white star" is the caption of many images, and no
    model can tell which of them a given one was written for)."""
    sim = image_features @ text_features.T
    n = sim.shape[0]
    if tokens is None:
        same = torch.eye(n, dtype=torch.bool, device=sim.device)
    else:
        _, text_id = torch.unique(tokens, dim=0, return_inverse=True)
        text_id = text_id.to(sim.device)
        same = text_id[:, None] == text_id[None, :]
    low = torch.finfo(sim.dtype).min
    # the best-scoring correct item, then how many wrong ones score at least as high
    best_i2t = sim.masked_fill(~same, low).amax(dim=1)
    best_t2i = sim.masked_fill(~same, low).amax(dim=0)
    rank_i2t = ((sim >= best_i2t[:, None]) & ~same).sum(dim=1)
    rank_t2i = ((sim >= best_t2i[None, :]) & ~same).sum(dim=0)
    out = {}
    for k in ks:
        out[f"image_to_text_r@{k}"] = (rank_i2t < k).float().mean().item()
        out[f"text_to_image_r@{k}"] = (rank_t2i < k).float().mean().item()
    return out
