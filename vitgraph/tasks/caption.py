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
* Native resolution (plan.pack): a microbatch is one image pack with its slots' text ids
  [M, text_length]; ``prepare`` lays out the language model's pack on the host
  (vitgraph.models.caption.text_layout) and the model returns [M, text_length] logits, so
  the loss and the metrics are the fixed path's, over the slots holding an image.
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
from vitgraph.models import packed as pk
from vitgraph.models.build import transformer_config
from vitgraph.models.caption import (TextPackSpec, build_caption, text_layout,
                                     vocab_parallel_argmax)
from vitgraph.models.vit import unwrap, vit_flops_per_image, vit_flops_per_token
from vitgraph.output import plural
from vitgraph.tasks.base import Task, reduce_stats, require_captions, stats
from vitgraph.tasks.classification import prepare_pack
from vitgraph.text import make_tokenizer

log = logging.getLogger("vitgraph")

IGNORE = -100  # a target out of the loss (F.cross_entropy's ignore_index)
SHOWN = 3  # greedy captions written to the log at each eval
GENERATE_PACKS = 64  # held-out packs whose greedy captions are decoded together


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
        self.pack = plan.pack  # native resolution: the image pack (None: fixed size)
        self.text_pack = None if self.pack is None else \
            TextPackSpec.of(self.pack, self.lm.text_length)

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
        if a.enabled and self.pack is None:  # crops, flips, RandAugment, erasing (no mixing)
            self.augment = BatchAugment(a, self.image_size, self.num_classes, 0.0,
                                        self.plan.train.seed, self.d.dp_rank)

    def build_model(self, with_init_from: bool = True) -> list:
        plan, m, lm, d = self.plan, self.plan.model, self.lm, self.d
        model = build_caption(self.arch, transformer_config(plan, m, d), plan.spec, lm,
                              lm.vocab_size, seed=plan.train.seed, class_token=m.class_token,
                              num_registers=m.num_registers, fused_norm=plan.fused_norm,
                              drop_path_rate=m.drop_path_rate, tp_rank=d.tp_rank,
                              first_stage=d.is_first_stage, last_stage=d.is_last_stage,
                              pad_to=plan.token_padding if plan.pads else None, pack=self.pack,
                              pos_interp=plan.pos_interp)
        # FLOPs: the tower's, S (6N + 12 L h S) over the LM's sequence of S = image tokens +
        # the text budget (N: its layers' and the projector's weights), the output layer's
        # over the text
        s, h, lt = model.image_len + lm.text_length, lm.hidden_size, lm.text_length
        n_lm = lm.num_layers * (4 * h * h + 2 * h * lm.ffn_hidden_size) + \
            self.arch.hidden_size * h + (h * h if lm.projector == "mlp" else 0)
        att = 12 * lm.num_layers * h
        if self.pack is not None:  # the same per image of n tokens: S = n + lt, expanded in n
            per_token, per_pair = vit_flops_per_token(self.arch, model.visual.num_prefix, 0)
            self.pack_flops = (per_token + 6 * n_lm + 2 * att * lt, per_pair + att,
                               lt * (6 * n_lm + att * lt + 6 * h * lm.vocab_size))
        self.flops_per_sample = (
            vit_flops_per_image(self.arch, int(m.class_token) + m.num_registers, 0)
            + s * (6 * n_lm + att * s) + 6 * lt * h * lm.vocab_size)
        # a whole caption model's export, or the tower's weights (vitgraph, timm, open_clip, hf)
        if m.init_from and with_init_from:
            init_caption(model, m.init_from, m.init_format, lm.tokenizer)
        return [model]

    def describe(self, chunks, micro_batch):
        m, lm = unwrap(chunks[0]), self.lm
        n = sum(p.numel() for p in m.parameters())
        head = (f"{self.plan.model.name} -> {lm.projector} projector -> GPT ("
                f"{plural(lm.num_layers, 'layer')}, width {lm.hidden_size}, "
                f"{plural(lm.num_heads, 'head')}, {lm.vocab_size} "
                f"{lm.tokenizer} ids), spec {self.plan.spec}, {n} params on this rank, ")
        if self.pack is not None:
            k, t = self.pack, self.text_pack
            return head + (f"image packs of {k.tokens} tokens ({m.visual.packed_attention}: at "
                           f"most {k.max_images} images of <= {k.max_patches} patches + "
                           f"{k.num_prefix} prefix tokens), language-model packs of {t.tokens} "
                           f"tokens (thd: each image's tokens, then its text of <= "
                           f"{lm.text_length}; {t.max_len} positions a sample at most)")
        return head + (f"{m.image_len} image + {lm.text_length} text positions, "
                       f"{self.flops_per_sample / 1e9:.2f} GFLOP/sample (train)")

    def seq_length(self, chunks, micro_batch):
        return unwrap(chunks[0]).seq_len(micro_batch)

    def prepare(self, raw, key, device, first_stage):
        if self.pack is not None:
            return self._prepare_pack(raw, key, device, first_stage)
        images, labels, tokens = raw
        x, _ = prepare_batch(self.augment, images, labels, key, self.image_size, device,
                             torch.float32, first_stage)
        return (x, tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True))

    def host_fields(self, raw: tuple) -> tuple:
        """A pack's language-model layout (``text_layout``), from its seg and text ids on
        the host: made in the prefetcher's thread, it costs the step no wait on the device
        for fields already staged there."""
        if self.pack is None:
            return ()
        return text_layout(raw[2], raw[5], self.tokenizer.eot_id, self.text_pack)

    def _prepare_pack(self, raw, key, device, first_stage):
        """(x, coords, seg, cu_seqlens, tokens, labels, *text layout) of one pack on the
        device: the image pack as the classifier's (augmented per image when training), the
        language model's pack laid out from its CPU fields (``host_fields``: the prefetcher
        has appended it to a training pack; made here for others); an empty slot's label is
        fill_label."""
        tokens = raw[5]
        layout = raw[6:] or self.host_fields(raw)
        x, coords, seg, cu, labels = prepare_pack(raw[:5], key, device, first_stage, self.plan,
                                                  self.d)
        labels = torch.where(pk.slot_valid(seg, self.pack.max_images), labels, self.fill_label)
        return (x, coords, seg, cu, tokens.to(device, non_blocking=True), labels,
                *(t.to(device, non_blocking=True) for t in layout))

    def forward(self, model, inputs):
        if self.pack is not None:
            return model(tuple(inputs[:4]), inputs[4], tuple(inputs[6:10]))
        return model(inputs[0], inputs[1])

    def _text(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids [b, L], labels [b]) of a prepared microbatch (a pack's: per slot)."""
        return (inputs[4], inputs[5]) if self.pack is not None else (inputs[1], inputs[2])

    def loss(self, inputs, output):
        tokens, labels = self._text(inputs)
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
        images = tuple(inputs[:4]) if self.pack is not None else inputs[0]
        return {"stats": self.loss(inputs, output)[1], "images": images,
                "labels": self._text(inputs)[1]}

    @torch.no_grad()
    def eval_metrics(self, outputs, chunks):
        model = unwrap(chunks[0])
        # [images, class hits, images with a class (WebDataset pairs may have none)]
        hits = torch.zeros(3, device=self.d.device)
        shown = []
        tok = self.tokenizer
        generate = self.d.pp == 1  # greedy captions need the whole model on one stage
        if generate and self.pack is not None:  # every pack's captions at once (generate_packs)
            ids = [None] * len(outputs)
            for lo in range(0, len(outputs), GENERATE_PACKS):
                part = outputs[lo:lo + GENERATE_PACKS]
                ids[lo:lo + len(part)] = model.generate_packs(
                    [o["images"] for o in part], tok.sot_id, tok.eot_id, self.lm.text_length,
                    tok.pad_id)
        for i, o in enumerate(outputs):
            hits[0] += int((o["labels"] != self.fill_label).sum())
            keep = o["labels"] >= 0
            if not generate or not keep.any():
                continue
            labels = o["labels"][keep]
            if self.pack is not None:  # a pack's captions per slot: its empty slots out
                out = ids[i][keep]
            else:
                out = model.generate(o["images"][keep], tok.sot_id, tok.eot_id,
                                     self.lm.text_length, tok.pad_id)
            texts = [tok.decode(row) for row in out.cpu()]
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
