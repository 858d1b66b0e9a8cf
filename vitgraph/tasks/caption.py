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
  Greedy captions need the whole model on one stage: under parallel.pp > 1 the held-out
  numbers are the loss and perplexity only.
* Tensor parallel: the logits are split over the vocabulary (megatron's
  ``vocab_parallel_cross_entropy``, and an argmax across the ranks for top-1 and captions).
"""
from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from vitgraph.convert.vlm import init_caption
from vitgraph.data.augment import BatchAugment, prepare_batch
from vitgraph.models.build import transformer_config
from vitgraph.models.caption import build_caption, vocab_parallel_argmax
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
        self.said_no_captions = False

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
        plan, m, lm, d = self.plan, self.plan.model, self.lm, self.d
        model = build_caption(self.arch, transformer_config(plan, m, d), plan.spec, lm,
                              lm.vocab_size, seed=plan.train.seed, class_token=m.class_token,
                              num_registers=m.num_registers, fused_norm=plan.fused_norm,
                              drop_path_rate=m.drop_path_rate, tp_rank=d.tp_rank,
                              first_stage=d.is_first_stage, last_stage=d.is_last_stage,
                              pad_to=plan.token_padding if plan.pads else None)
        # FLOPs: the tower's, T (6N + 12 L d T) over the LM's sequence (N: its layers' and
        # the projector's weights), the output layer's over the text
        s, h = model.image_len + lm.text_length, lm.hidden_size
        n_lm = lm.num_layers * (4 * h * h + 2 * h * lm.ffn_hidden_size) + \
            self.arch.hidden_size * h + (h * h if lm.projector == "mlp" else 0)
        self.flops_per_sample = (
            vit_flops_per_image(self.arch, int(m.class_token) + m.num_registers, 0)
            + s * (6 * n_lm + 12 * lm.num_layers * h * s)
            + 6 * lm.text_length * h * lm.vocab_size)
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

    def seq_length(self, chunks, micro_batch):
        return unwrap(chunks[0]).seq_len(micro_batch)

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
        correct = ((vocab_parallel_argmax(logits) == targets) & valid).sum()
        if self.d.tp > 1:  # logits split over the vocabulary
            per = vocab_parallel_cross_entropy(logits.contiguous(),
                                               torch.where(valid, targets, 0))
            total = (per * valid).sum()
        else:
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                    ignore_index=IGNORE, reduction="sum")
        loss = total / n.clamp(min=1)
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
        generate = self.d.pp == 1  # greedy captions need the whole model on one stage
        for o in outputs:
            hits[0] += int((o["labels"] != self.fill_label).sum())
            keep = o["labels"] >= 0
            if not generate or not keep.any():
                continue
            images, labels = o["images"][keep], o["labels"][keep]
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
        if generate and classed:
            out.update(eval_class_word_accuracy=class_hits / classed,
                       eval_class_word_chance=1 / len(self.class_patterns))
        elif not generate and not self.said_no_captions:
            log.info("eval: no greedy captions under parallel.pp=%d (they need the whole "
                     "model on one stage): caption loss and perplexity only", self.d.pp)
            self.said_no_captions = True
        return {**out, "eval_images": int(images)}
