"""Captioning: the vision tower trained inside a VLM (vitgraph.models.caption: the tower, a
projector, a GPT language model), by next-token loss on each image's caption.

* Data: every image's caption, tokenized once (lm.tokenizer, lm.text_length positions:
  [BOS, caption..., EOS, padding]) into the dataset's ``tokens``; microbatches carry them.
  A dataset without captions is a data error (the shapes data or WebDataset jpg+txt).
* Loss: cross-entropy of each text position's logits against the next text token, over the
  caption and its EOS only: image positions get no logits (the model returns the text's) and
  padding after EOS is ignored. The stats count text tokens: the logged loss is per token,
  the logged top-1 next-token accuracy.
* Held-out: the caption loss per token and its perplexity, and greedy captions of every
  held-out image (BOS, then argmax tokens to EOS or the budget), scored by whether the first
  class name they mention is the image's (``class_word_accuracy``, ``class_word_chance``:
  1 / classes), over the held-out images with a class.
"""
from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn.functional as F

from vitgraph.convert.vlm import init_caption
from vitgraph.data.augment import BatchAugment, prepare_batch
from vitgraph.models.build import transformer_config
from vitgraph.models.caption import build_caption
from vitgraph.models.vit import unwrap, vit_flops_per_image
from vitgraph.tasks.base import Task, reduce_stats, require_captions, stats
from vitgraph.text import make_tokenizer

log = logging.getLogger("vitgraph")

IGNORE = -100  # a target out of the loss (F.cross_entropy's ignore_index)
SHOWN = 3  # greedy captions written to the log at each eval


def text_targets(tokens: torch.Tensor, eos: int, ignore: int = IGNORE) -> torch.Tensor:
    """[b, L] text ids -> [b, L - 1] targets: position j's is token j + 1 while no EOS is at
    or before j after BOS (the caption and its EOS), else ``ignore`` (the padding after EOS).
    BOS may be the EOS id (GPT-2's tokenizer)."""
    ends = tokens == eos
    ends[:, 0] = False
    ended = ends.long().cumsum(dim=1)[:, :-1] > 0
    return torch.where(ended, ignore, tokens[:, 1:])


def first_class(text: str, patterns: list) -> int:
    """The index of the class whose name ``text`` mentions first (-1: none)."""
    found = [(m.start(), i) for i, p in enumerate(patterns) for m in [p.search(text)] if m]
    return min(found)[1] if found else -1


class CaptionTask(Task):
    name = "caption"
    fill_label = -2  # -1 is an unlabelled pair (WebDataset txt without cls): trained on

    def __init__(self, plan, d, total_steps=None):
        super().__init__(plan, d, total_steps)
        self.arch = plan.arch
        self.image_size = self.arch.image_size
        self.lm = plan.caption
        self.tokenizer = None  # made by attach
        self.augment = None
        self.class_patterns: list = []  # each class name as the tokenizer decodes it

    def attach(self, train_set, val_set) -> None:
        super().attach(train_set, val_set)
        self.tokenizer = make_tokenizer(self.lm.tokenizer, self.lm.vocab_size,
                                        self.lm.text_length)
        require_captions(self.plan, train_set, val_set)
        for ds in (train_set, val_set):
            if ds.tokens is None or ds.tokens.shape[-1] != self.lm.text_length:
                ds.tokens = self.tokenizer(ds.captions)
        # a name as generated text spells it ("L-shape" comes back from BPE as "l - shape")
        self.class_patterns = [
            re.compile(rf"(?<!\w){re.escape(self.tokenizer.decode(self.tokenizer.encode(c)))}"
                       rf"(?!\w)") for c in val_set.classes]
        a = self.plan.data.augment
        if a.enabled:  # crops, flips, RandAugment, erasing (no mixing: validated)
            self.augment = BatchAugment(a, self.image_size, self.num_classes, 0.0,
                                        self.plan.train.seed, self.d.dp_rank)

    def build_model(self, with_init_from: bool = True) -> list:
        plan, m, lm = self.plan, self.plan.model, self.lm
        model = build_caption(self.arch, transformer_config(plan, m, self.d), plan.spec, lm,
                              lm.vocab_size, seed=plan.train.seed, class_token=m.class_token,
                              num_registers=m.num_registers, fused_norm=plan.fused_norm,
                              drop_path_rate=m.drop_path_rate)
        # FLOPs: the tower's, T (6N + 12 L d T) over the LM's sequence, the output layer's
        s = model.image_len + lm.text_length
        n_lm = sum(p.numel() for p in model.language_model.decoder.parameters()) + \
            sum(p.numel() for p in model.projector.parameters())
        self.flops_per_sample = (
            vit_flops_per_image(self.arch, model.visual.num_prefix, 0)
            + s * (6 * n_lm + 12 * lm.num_layers * lm.hidden_size * s)
            + 6 * lm.text_length * lm.hidden_size * lm.vocab_size)
        # a whole caption model's export, or the tower's weights (vitgraph, timm, open_clip, hf)
        if m.init_from and with_init_from:
            init_caption(model, m.init_from, m.init_format, lm.tokenizer)
        return [model]

    def describe(self, chunks, micro_batch):
        m, lm = unwrap(chunks[0]), self.lm
        n = sum(p.numel() for p in m.parameters())
        return (f"{self.plan.model.name} -> {lm.projector} projector -> GPT ({lm.num_layers} "
                f"layers, width {lm.hidden_size}, {lm.num_heads} heads, {lm.vocab_size} "
                f"{lm.tokenizer} ids), spec {self.plan.spec}, {n} params on this rank, "
                f"{m.image_len} image + {lm.text_length} text positions, "
                f"{self.flops_per_sample / 1e9:.2f} GFLOP/sample (train)")

    def prepare(self, raw, key, device, first_stage):
        images, labels, tokens = raw
        x, _ = prepare_batch(self.augment, images, labels, key, self.image_size, device,
                             torch.float32, first_stage)
        return (x, tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True))

    def forward(self, model, inputs):
        return model(inputs[0], inputs[1])

    def loss(self, inputs, output):
        tokens, labels = inputs[1], inputs[2]
        targets = text_targets(tokens, self.tokenizer.eot_id)
        # samples that only fill an eval microbatch up are out
        targets = torch.where(labels[:, None] == self.fill_label, IGNORE, targets)
        logits = output[:, :-1].float()  # the last position predicts past the budget
        valid = targets != IGNORE
        n = valid.sum()
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
        loss = total / n.clamp(min=1)
        correct = ((logits.argmax(-1) == targets) & valid).sum()
        # the schedule divides `loss` in place by the number of microbatches: count a clone
        return loss, stats(loss.detach().clone() * n, correct, n)

    # ------------------------------------------------------------------ held-out

    def eval_outputs(self, inputs, output):
        return {"stats": self.loss(inputs, output)[1], "images": inputs[0],
                "labels": inputs[2]}

    @torch.no_grad()
    def eval_metrics(self, outputs, chunks):
        model = unwrap(chunks[0])
        # [images, class hits, images with a class (WebDataset pairs may have none)]
        hits = torch.zeros(3, device=self.d.device)
        shown = []
        for o in outputs:
            hits[0] += int((o["labels"] != self.fill_label).sum())
            keep = o["labels"] >= 0
            images, labels = o["images"][keep], o["labels"][keep]
            if not len(labels):
                continue
            ids = model.generate(images, self.tokenizer.sot_id, self.tokenizer.eot_id,
                                 self.lm.text_length, self.tokenizer.pad_id)
            texts = [self.tokenizer.decode(row) for row in ids.cpu()]
            found = [first_class(t, self.class_patterns) for t in texts]
            hits[1] += sum(int(f == int(y)) for f, y in zip(found, labels.tolist()))
            hits[2] += len(labels)
            shown += texts[:SHOWN - len(shown)]
        total = sum((o["stats"] for o in outputs), torch.zeros(3, device=self.d.device))
        loss_sum, _, tokens = reduce_stats(total, self.d).tolist()
        images, class_hits, classed = reduce_stats(hits, self.d).tolist()
        loss = loss_sum / max(tokens, 1)
        if shown:
            log.info("greedy captions: %s", " | ".join(repr(t) for t in shown))
        out = {"eval_caption_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
        if classed:
            out.update(eval_class_word_accuracy=class_hits / classed,
                       eval_class_word_chance=1 / len(self.class_patterns))
        return {**out, "eval_images": int(images)}
