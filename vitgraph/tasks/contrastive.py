"""Image-text contrastive training (CLIP / SigLIP) with zero-shot and retrieval evaluation.

* Data: every image's caption, tokenized once (byte-level, vitgraph.text) into the dataset's
  ``tokens``; microbatches carry them. A dataset without captions is a data error. With
  ``data.caption_dropout`` (shapes) the training set carries every variant of each caption
  (without size and/or colour) and ``prepare`` draws one per pair and step.
* Model: an image-text pair from the registry (vitgraph.models.clip), on one pipeline stage.
* Loss: InfoNCE (``clip``) or the sigmoid loss with its bias (``siglip``), negatives from every
  data-parallel rank of the microbatch (vitgraph.tasks.contrastive_loss). The logged top-1 is
  image->text accuracy within this rank's microbatch.
* After each update the logit scale is clamped to [0, ln 100] as open_clip does, the fp32
  master copy of the optimizer included (megatron's ``main_param``).
* Held-out: image and text features of the whole split, gathered over data-parallel ranks;
  zero-shot top-1 from class-name prompts (templates averaged) and image<->text recall@1/5.
* Native resolution (plan.pack): a microbatch is one pack of images with their captions
  ([M, ctx] token ids, one per image slot); the image tower runs packed, the text tower on
  every slot, and empty slots (no image tokens) are left out of the loss (``valid``,
  vitgraph.tasks.contrastive_loss) and marked ``fill_label`` for the held-out metrics.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from vitgraph.convert import init_from
from vitgraph.data.augment import BatchAugment, prepare_batch
from vitgraph.models import packed as pk
from vitgraph.models.build import transformer_config
from vitgraph.models.clip import build_clip
from vitgraph.models.vit import unwrap
from vitgraph.tasks.base import Task, require_captions, stats
from vitgraph.tasks.classification import prepare_pack
from vitgraph.tasks.contrastive_loss import clip_loss, siglip_loss
from vitgraph.tasks.contrastive_metrics import (TEMPLATES, class_embeddings, retrieval_recall,
                                                 zero_shot_top1)
from vitgraph.text import make_tokenizer

log = logging.getLogger("vitgraph")


def _tower_flops(n_params: int, tokens: int, layers: int, width: int) -> float:
    """Training FLOPs of one sample through a tower, T * (6N + 12 L d T) (docs/design.md)."""
    return tokens * (6 * n_params + 12 * layers * width * tokens)


def draw_caption_variants(tokens: torch.Tensor, p: float, seed: int, step: int | None,
                          offset: int = 0, global_batch: int | None = None) -> torch.Tensor:
    """One caption per pair from ``tokens`` [b, variants, s] (bitmask-indexed as
    vitgraph.data.shapes.caption_variants: 1 drops the size, 2 the colour): each bit set with
    probability ``p``, independently. The draws are made for the whole global batch of
    ``global_batch`` pairs of ``step`` from (seed, step), and these pairs are its
    ``offset``-th on: the same whatever the data-parallel layout, and whenever the step is
    run (resumed runs included). ``step`` None (eval): the captions as written."""
    b, n = tokens.shape[:2]
    if step is None or p <= 0:
        idx = np.zeros(b, np.int64)
    else:
        if n < 4:
            raise ValueError(f"caption dropout needs 4 variants per caption, got {n}")
        g = global_batch or offset + b
        if offset + b > g:
            raise ValueError(f"pairs {offset}..{offset + b} outside a global batch of {g}")
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 4, int(step)])
        drop = (rng.random((2, g)) < p)[:, offset:offset + b]
        idx = drop[0].astype(np.int64) + 2 * drop[1].astype(np.int64)
    idx = torch.from_numpy(idx).to(tokens.device)
    return tokens[torch.arange(b, device=tokens.device), idx]


class ContrastiveTask(Task):
    name = "contrastive"
    fill_label = -2  # -1 is an unlabelled pair (WebDataset txt without cls): kept for retrieval

    def __init__(self, plan, d, total_steps=None):
        super().__init__(plan, d, total_steps)
        self.arch = plan.pair
        self.image_size = self.arch.vision.image_size
        self.context_length = plan.contrastive.context_length
        self.tokenizer = None  # made by attach
        self.loss_name = plan.contrastive.loss
        self.augment = None
        self.classes: list[str] = []
        self.pack = plan.pack
        self.text_flops = 0.0  # one caption through the text tower

    def attach(self, train_set, val_set) -> None:
        super().attach(train_set, val_set)
        self.tokenizer = make_tokenizer(self.plan.contrastive.tokenizer,
                                        self.arch.text.vocab_size, self.context_length)
        self.classes = list(val_set.classes)
        require_captions(self.plan, train_set, val_set)
        for ds in (train_set, val_set):
            if ds.tokens is None and ds.caption_variants is not None:
                n = len(ds.caption_variants[0])
                ds.tokens = torch.stack([self.tokenizer([v[i] for v in ds.caption_variants])
                                         for i in range(n)], dim=1)  # [N, variants, s]
            elif ds.tokens is None:
                ds.tokens = self.tokenizer(ds.captions)
        a = self.plan.data.augment
        if a.enabled and self.pack is None:  # crops, flips, RandAugment, erasing (no mixing)
            self.augment = BatchAugment(a, self.image_size, self.num_classes, 0.0,
                                        self.plan.train.seed, self.d.dp_rank)

    def build_model(self, with_init_from: bool = True) -> list:
        plan, d = self.plan, self.d
        bias = None
        if self.loss_name == "siglip" and self.arch.init_logit_bias is None:
            bias = -10.0  # SigLIP's initial bias, for a pair registered without one
        model = build_clip(self.arch, transformer_config(plan, plan.model, d), plan.spec,
                           seed=plan.train.seed, tp_rank=d.tp_rank, tp_size=d.tp,
                           context_length=self.context_length,
                           pad_to=plan.token_padding if plan.pads else None,
                           init_logit_bias=bias, fused_norm=plan.fused_norm,
                           drop_path_rate=plan.model.drop_path_rate,
                           # the image tower takes packs (its text tower is as ever)
                           pack=self.pack, pos_interp=plan.pos_interp)
        v, t = self.arch.vision, self.arch.text
        n_text = sum(p.numel() for p in model.text.parameters()) - t.vocab_size * t.hidden_size
        n_image = sum(p.numel() for p in model.visual.parameters())
        self.text_flops = _tower_flops(n_text, self.context_length, t.num_layers, t.hidden_size)
        if self.pack is not None:
            # an image's tokens through the image tower, its caption through the text tower
            self.pack_flops = (6.0 * n_image, 12.0 * v.num_layers * v.hidden_size,
                               self.text_flops)
        else:
            self.flops_per_sample = _tower_flops(n_image, model.visual.seq_len, v.num_layers,
                                                 v.hidden_size) + self.text_flops
        if plan.model.init_from and with_init_from:
            init_from(model, plan.model.init_from, plan.model.init_format)
        return [model]

    def describe(self, chunks, micro_batch):
        m = chunks[0]
        head = (f"{self.plan.model.name} ({self.loss_name} loss), spec "
                f"{self.plan.spec}, "
                f"{sum(p.numel() for p in m.parameters())} params on this rank, ")
        if self.pack is not None:
            k = self.pack
            return head + (f"packs of {k.tokens} image tokens (at most {k.max_images} images "
                           f"of <= {k.max_patches} patches + {k.num_prefix} prefix tokens), "
                           f"{self.context_length} text positions, "
                           f"{self.pack_flops[0] / 1e9:.3f} GFLOP/image token + "
                           f"{self.pack_flops[1] / 1e6:.3f} MFLOP/token pair in attention "
                           f"+ {self.text_flops / 1e9:.2f} GFLOP/caption (train)"
                           + self._caption_dropout_line())
        return head + (f"{m.visual.seq_len} image tokens, {self.context_length} text positions, "
                       f"{self.flops_per_sample / 1e9:.2f} GFLOP/pair (train)"
                       + self._caption_dropout_line())

    def _caption_dropout_start(self) -> int:
        """The 0-based step from which data.caption_dropout applies."""
        return int(self.plan.data.caption_dropout_start * (self.total_steps or 0))

    def _caption_dropout_line(self) -> str:
        d = self.plan.data
        if not d.caption_dropout:
            return ""
        start = self._caption_dropout_start()
        return (f"; caption dropout {d.caption_dropout:g} "
                + (f"after step {start} (data.caption_dropout_start {d.caption_dropout_start:g})"
                   if start else "from the first step"))

    def caption_dropout(self, key) -> float:
        """data.caption_dropout at training step ``key[0]`` (0-based): 0 before
        data.caption_dropout_start of the run's steps, and for eval (key None). Its first
        step says so in the log: the training loss rises there."""
        d = self.plan.data
        start = self._caption_dropout_start()
        if d.caption_dropout and start and key is not None and key == (start, 0):
            log.info("caption dropout %g begins after step %d (data.caption_dropout_start): "
                     "training captions lose words, the training loss rises", d.caption_dropout,
                     start)
        return d.caption_dropout if key is not None and key[0] >= start else 0.0

    def _draw_captions(self, tokens, key, pairs_per_microbatch: int | None = None):
        """One caption variant per pair (data.caption_dropout); ``pairs_per_microbatch``: a
        pack's slots (its global batch counts packs), else the microbatch's pairs."""
        if tokens.ndim != 3:
            return tokens
        t = self.plan.train
        per = pairs_per_microbatch or 1  # pairs per unit of train.global_batch_size
        per_rank = t.global_batch_size // self.d.dp  # this rank's share of the step
        offset = (self.d.dp_rank * per_rank * per + key[1] * len(tokens)) if key else 0
        return draw_caption_variants(tokens, self.caption_dropout(key), t.seed,
                                     key[0] if key else None, offset,
                                     t.global_batch_size * per)

    def _prepare_pack(self, raw, key, device, first_stage):
        """(x, coords, seg, cu_seqlens, tokens, labels) of one pack on the device; an empty
        slot's label is fill_label (no image: out of the loss and the metrics)."""
        tokens = self._draw_captions(raw[5], key, self.pack.max_images)
        x, coords, seg, cu, labels = prepare_pack(raw[:5], key, device, first_stage, self.plan,
                                                  self.d)
        labels = torch.where(pk.slot_valid(seg, self.pack.max_images), labels, self.fill_label)
        return x, coords, seg, cu, tokens.to(device, non_blocking=True), labels

    def prepare(self, raw, key, device, first_stage):
        if self.pack is not None:
            return self._prepare_pack(raw, key, device, first_stage)
        images, labels, tokens = raw
        tokens = self._draw_captions(tokens, key)
        x, _ = prepare_batch(self.augment, images, labels, key, self.image_size, device,
                             torch.float32, first_stage)
        return (x, tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True))

    def forward(self, model, inputs):
        if self.pack is not None:
            return model(tuple(inputs[:4]), inputs[4])
        return model(inputs[0], inputs[1])

    def _features(self, output):
        image, text, scale = (t.float() for t in output[:3])
        bias = output[3].float() if len(output) > 3 else None
        return image, text, scale, bias

    def loss(self, inputs, output):
        image, text, scale, bias = self._features(output)
        group = ps.get_data_parallel_group() if dist.is_initialized() else None
        # a pack's empty slots are out (fixed shapes: masked, not dropped)
        valid = inputs[-1] != self.fill_label if self.pack is not None else None
        if self.loss_name == "siglip":
            if bias is None:  # pragma: no cover - build_model gives such a model a bias
                raise ValueError("the sigmoid loss needs a model with a logit bias")
            loss = siglip_loss(image, text, scale, bias, group=group, valid=valid)
        else:
            loss = clip_loss(image, text, scale, group=group, valid=valid)
        b = image.shape[0]
        with torch.no_grad():
            sims = image @ text.T
            if valid is not None:
                sims = sims.masked_fill(~valid[None, :], float("-inf"))
            hit = sims.argmax(dim=1) == torch.arange(b, device=image.device)
            if valid is None:
                n = torch.full((), b, device=image.device)  # no host-to-device copy: capturable
            else:
                hit, n = hit & valid, valid.sum()
            correct = hit.sum()
        return loss, stats(loss.detach().clone() * n, correct, n)

    @torch.no_grad()
    def after_update(self, chunks):
        for chunk in chunks:
            unwrap(chunk).clamp_logit_scale_()

    # ------------------------------------------------------------------ held-out

    def eval_outputs(self, inputs, output):
        image, text, _, _ = self._features(output)
        return {"image": image, "text": text, "labels": inputs[-1], "tokens": inputs[-2]}

    @torch.no_grad()
    def eval_metrics(self, outputs, chunks):
        names = ("image", "text", "labels", "tokens")
        fields = [torch.cat([o[k] for o in outputs]) for k in names]
        keep = fields[2] != self.fill_label  # filler samples of a padded eval microbatch
        fields = [f[keep] for f in fields]
        if dist.is_initialized() and self.d.dp > 1:  # every rank's share of the split
            parts = [None] * self.d.dp
            dist.all_gather_object(parts, [f.cpu() for f in fields],
                                   group=ps.get_data_parallel_group())
            fields = [torch.cat([p[i] for p in parts]).to(self.d.device)
                      for i in range(len(names))]
        image, text, labels, tokens = fields
        model = unwrap(chunks[0])

        def encode(tokens):
            return model.encode_text(tokens.to(self.d.device)).float()

        out = {"eval_images": len(labels)}
        labelled = labels >= 0
        if self.classes and labelled.any():  # zero-shot over the labelled pairs
            templates = self.plan.contrastive.templates or TEMPLATES
            classes = class_embeddings(encode, self.tokenizer, self.classes, templates)
            out["eval_zero_shot_top1"] = zero_shot_top1(image[labelled], classes,
                                                        labels[labelled])
        recall = retrieval_recall(image, text, tokens=tokens)
        out.update({f"eval_{k}": v for k, v in recall.items()})
        return out

