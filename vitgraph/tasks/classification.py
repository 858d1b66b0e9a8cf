"""Image classification: the ViT with a class head, cross-entropy with optional label smoothing
and mixed (mixup / cutmix) targets, held-out loss and top-1.

A training microbatch with data.augment on is (uint8 images, targets, labels, *AugmentParams):
``forward`` augments the images first (vitgraph.data.augment.BatchAugment.apply), so a step
graph holds the augmentation and takes the drawn parameters as inputs.

At native resolution (plan.pack) a microbatch is one pack (vitgraph.data.packing): prepared
as (x [T, 3 p^2] normalised, coords, seg, cu_seqlens, labels [M]) on the device, or for
training with data.augment on as (uint8 rows, coords, seg, cu_seqlens, labels, *PackParams),
``forward`` augmenting the rows first (vitgraph.data.native.PackAugment.apply: inside the
step, as at fixed resolution); the model's output is one row per image slot, and the loss,
top-1 and counts are over the slots holding an image (label -1: an empty slot).

With train.distill.teacher (vitgraph.tasks.distill) a training microbatch is prepared with
the teacher's logits on the same (augmented, mixed) images as a fourth field, on the
pipeline's last stage (which then prepares the images too): the loss mixes the task's and the
distillation loss there. Evaluation (no key) has no teacher: the plain loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vitgraph.config import ConfigError, head_problem
from vitgraph.convert import init_from
from vitgraph.data.augment import AugmentParams, BatchAugment, prepare_batch
from vitgraph.data.loader import to_device_uint8
from vitgraph.data.native import PackAugment, PackParams, pack_inputs, pack_to_device
from vitgraph.models.build import build_model
from vitgraph.models.vit import vit_flops_per_image, vit_flops_per_token
from vitgraph.tasks.base import Task, reduce_stats, stats
from vitgraph.tasks.distill import build_teacher, distill_loss


class ClassificationTask(Task):
    name = "classification"

    def __init__(self, plan, d, total_steps=None):
        super().__init__(plan, d, total_steps)
        self.arch = plan.arch
        self.image_size = self.arch.image_size
        self.augment = None
        self.pack_augment = None  # native resolution: a pack's per-image augmentation
        self.pack = plan.pack
        self.teacher = None
        self._teacher_out = {}  # key -> the teacher's logits (this step's, vpp > 1)

    def attach(self, train_set, val_set) -> None:
        super().attach(train_set, val_set)
        plan = self.plan
        # a folder's class count is known once it is read: checked here, before any model
        # (the shapes' count is a key, checked with the config)
        why = head_problem(plan.model.num_classes, len(train_set.classes),
                           f"data.kind={plan.data.kind}, data.path={plan.data.path}")
        if why:
            raise ConfigError(f"model.num_classes={plan.model.num_classes}: {why}")
        if plan.data.augment.enabled and self.pack is None:
            self.augment = BatchAugment(plan.data.augment, self.image_size, self.num_classes,
                                        plan.train.label_smoothing, plan.train.seed,
                                        self.d.dp_rank)
        if plan.data.augment.enabled and self.pack is not None:
            self.pack_augment = PackAugment(plan.data.augment, plan.train.seed, self.d.dp_rank)
        if plan.distill is not None:
            self.extra_stats = ("loss_task", "loss_distill")
            self.teacher = build_teacher(plan.distill, plan, self.d, self.num_classes)

    def build_model(self, with_init_from: bool = True) -> list:
        chunks = build_model(self.plan, self.plan.model, self.d, self.num_classes,
                             self.plan.train.seed)
        classes = self.plan.model.num_classes or self.num_classes
        if self.pack is not None:  # images of every size: FLOPs are counted per pack
            self.pack_flops = (*vit_flops_per_token(self.arch, chunks[0].num_prefix, classes),
                               0.0)
        else:
            self.flops_per_sample = vit_flops_per_image(self.arch, chunks[0].num_prefix,
                                                        self.num_classes)
        m = self.plan.model
        if m.init_from and with_init_from:
            for chunk in chunks:
                init_from(chunk, m.init_from, m.init_format)
        return chunks

    def describe(self, chunks: list, micro_batch: int) -> str:
        m = chunks[0]
        if self.pack is not None:
            k = self.pack
            return (f"{self.plan.model.name}, spec {self.plan.spec}, "
                    f"{sum(p.numel() for c in chunks for p in c.parameters())} params on this "
                    f"rank, packs of {m.padded_len(1)} tokens ({m.packed_attention}: at most "
                    f"{k.max_images} images of <= {k.max_patches} patches + {k.num_prefix} "
                    f"prefix tokens), {self.pack_flops[0] / 1e9:.3f} GFLOP/token + "
                    f"{self.pack_flops[1] / 1e6:.3f} MFLOP/token pair in attention (train)")
        padded = m.padded_len(micro_batch)
        return (f"{self.plan.model.name}, spec {self.plan.spec}, "
                f"{sum(p.numel() for c in chunks for p in c.parameters())} params on this rank, "
                f"{m.seq_len} tokens"
                + (f" (padded to {padded}, masked)" if padded > m.seq_len else "")
                + f", {self.flops_per_sample / 1e9:.2f} GFLOP/image (train)"
                + (self._distill_line() if self.plan.distill is not None else ""))

    def _distill_line(self) -> str:
        dt = self.plan.distill
        who = self.teacher.describe if self.teacher is not None else dt.teacher
        where = ("" if self.teacher is None else
                 ", forward graphs" if self.teacher.graphs is not None else ", eager")
        return (f"; distilling ({dt.kind}, weight {dt.weight}, T {dt.temperature}) from "
                f"{who}{where}")

    def seq_length(self, chunks: list, micro_batch: int) -> int:
        return chunks[0].padded_len(micro_batch)

    def prepare(self, raw, key, device, first_stage):
        if self.pack is not None:
            return prepare_pack(raw, key, device, first_stage, self.plan, self.d,
                                self.pack_augment)
        images, labels = raw[0], raw[1]
        # the loss's stage distills: it makes the images too (the same augmentation: keyed)
        distill = self.teacher is not None and key is not None and self.d.is_last_stage
        if self.augment is not None and key is not None and not distill:
            return self._prepare_augmented(images, labels, key, device, first_stage)
        # Float16Module casts to bf16 on GPU; keep fp32 here. Targets may come back mixed (soft)
        x, targets = prepare_batch(self.augment, images, labels, key, self.image_size, device,
                                   torch.float32, first_stage or distill)
        out = (x if first_stage else None, targets, labels.to(device, non_blocking=True))
        if not distill:
            return out
        return (*out, self._teacher_logits(x, key))

    def _prepare_augmented(self, images, labels, key, device, first_stage):
        """(uint8 images, targets, labels, *AugmentParams): the images are augmented by
        ``forward``, inside the step (a step graph's inputs are these fixed-shape tensors);
        a later pipeline stage gets (None, targets, labels)."""
        targets = self.augment.targets(labels, key).to(device, non_blocking=True)
        out = (None, targets, labels.to(device, non_blocking=True))
        if not first_stage:
            return out
        params = self.augment.draw(len(labels), key).to(device)
        return (to_device_uint8(images, device), *out[1:], *params)

    def _teacher_logits(self, x, key):
        """The teacher's logits of microbatch ``key``: computed once per key on this rank
        (with virtual pipeline stages each chunk's data iterator prepares every microbatch)."""
        if self.d.vpp == 1:
            return self.teacher(x)
        if any(k[0] != key[0] for k in self._teacher_out):  # a new step: drop the last one's
            self._teacher_out.clear()
        if key not in self._teacher_out:
            self._teacher_out[key] = self.teacher(x)
        return self._teacher_out[key]

    def forward(self, model, inputs):
        if self.pack is not None:
            if len(inputs) > 5:  # uint8 rows and their PackParams (prepare_pack)
                x = self.pack_augment.apply(*inputs[:4], PackParams(*inputs[5:]))
                return model(x, *inputs[1:4])
            return model(*inputs[:4])
        if len(inputs) > 4:  # uint8 images and their AugmentParams (_prepare_augmented)
            return model(self.augment.apply(inputs[0], AugmentParams(*inputs[3:])))
        return model(inputs[0])

    def loss(self, inputs, output):
        if self.pack is not None:
            return self._pack_loss(inputs[4], output)
        _, targets, labels = inputs[:3]
        output = output.float()
        student = output  # what the distillation loss reads
        if output.dim() == 3:  # model.distill_token: [b, 2, classes], class head first
            # DeiT: with a teacher the class head takes the task's loss and the distillation
            # head the teacher's; otherwise, and for top-1, the heads' average
            predicted = output.mean(dim=1)
            if len(inputs) == 4:
                output, student = output[:, 0], output[:, 1]
            else:
                output = predicted
        else:
            predicted = output
        valid = labels >= 0  # -1: a sample that only fills an eval microbatch
        n = valid.sum()
        # mixed targets carry the label smoothing already
        smoothing = 0.0 if targets.is_floating_point() else self.plan.train.label_smoothing
        loss = F.cross_entropy(output, targets, label_smoothing=smoothing, ignore_index=-1)
        correct = ((predicted.argmax(-1) == labels) & valid).sum()
        if len(inputs) == 4:  # distillation: the teacher's logits of these images
            dt = self.plan.distill
            dl = distill_loss(dt.kind, student, inputs[3], dt.temperature, valid)
            task_loss, loss = loss.detach(), (1 - dt.weight) * loss + dt.weight * dl
            return loss, stats(loss.detach().clone() * n, correct, n, task_loss * n,
                               dl.detach() * n)
        # the schedule divides `loss` in place by the number of microbatches: count a clone
        return loss, stats(loss.detach().clone() * n, correct, n)

    def _pack_loss(self, labels, output):
        """Mean cross-entropy over a pack's images; an empty pack gives 0, not 0 / 0."""
        output = output.float()
        valid = labels >= 0
        n = valid.sum()
        per = F.cross_entropy(output, labels, label_smoothing=self.plan.train.label_smoothing,
                              ignore_index=-1, reduction="none")
        loss = per.sum() / n.clamp(min=1)
        correct = ((output.argmax(-1) == labels) & valid).sum()
        return loss, stats(loss.detach().clone() * n, correct, n)

    def eval_outputs(self, inputs, output):
        return {"stats": self.loss(inputs, output)[1]}

    def eval_metrics(self, outputs, chunks):
        total = sum((o["stats"] for o in outputs), torch.zeros(3, device=self.d.device))
        loss_sum, correct, n = reduce_stats(total, self.d).tolist()
        return {"eval_loss": loss_sum / max(n, 1), "eval_top1": correct / max(n, 1),
                "eval_images": int(n)}


def prepare_pack(raw, key, device, first_stage: bool, plan, d,
                 augment: PackAugment | None = None) -> tuple:
    """One raw pack (patches, coords, seg, cu_seqlens, labels, ...) as the packed model takes
    it on ``device``: (x or None on a later pipeline stage, coords, seg, cu_seqlens, labels,
    ...). The patches are normalised and, for a training ``key``, augmented per image by
    vitgraph.data.native.pack_inputs; with ``augment`` (a classifier's, a training ``key``,
    the first stage) they stay uint8 and the pack's drawn ``PackParams`` follow the labels,
    for the task's forward to augment inside the step."""
    if first_stage and augment is not None and key is not None:
        fields = pack_to_device(raw[:5], device)
        return (*fields, *augment.draw(fields[4].shape[0], key).to(device))
    if first_stage:
        out = tuple(pack_inputs(raw[:5], device, plan.data.augment, key, plan.train.seed,
                                d.dp_rank))[:5]
    else:  # a later stage needs the layout only
        coords, seg, cu, labels = (t.to(device, non_blocking=True) for t in raw[1:5])
        out = (None, coords.long(), seg.long(), cu.int(), labels)
    return (*out, *(t.to(device, non_blocking=True) for t in raw[5:]))
