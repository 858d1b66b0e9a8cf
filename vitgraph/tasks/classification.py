"""Image classification: the ViT with a class head, cross-entropy with optional label smoothing
and mixed (mixup / cutmix) targets, held-out loss and top-1."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vitgraph.data.augment import BatchAugment, prepare_batch
from vitgraph.models.build import build_model
from vitgraph.models.vit import vit_flops_per_image
from vitgraph.tasks.base import Task, reduce_stats, stats


class ClassificationTask(Task):
    name = "classification"

    def __init__(self, plan, cfg, d, total_steps=None):
        super().__init__(plan, cfg, d, total_steps)
        self.arch = plan.arch
        self.image_size = self.arch.image_size
        self.augment = None

    def attach(self, train_set, val_set) -> None:
        super().attach(train_set, val_set)
        cfg = self.cfg
        if cfg.data.augment.enabled:
            self.augment = BatchAugment(cfg.data.augment, self.image_size, self.num_classes,
                                        cfg.train.label_smoothing, cfg.train.seed, self.d.dp_rank)

    def build_model(self) -> list:
        chunks = build_model(self.plan, self.cfg.model, self.d, self.num_classes,
                             self.cfg.train.seed)
        self.flops_per_sample = vit_flops_per_image(self.arch, chunks[0].num_prefix,
                                                    self.num_classes)
        return chunks

    def describe(self, chunks: list, micro_batch: int) -> str:
        m = chunks[0]
        padded = m.padded_len(micro_batch)
        return (f"{self.cfg.model.name}, spec {self.plan.spec}, "
                f"{sum(p.numel() for c in chunks for p in c.parameters())} params on this rank, "
                f"{m.seq_len} tokens"
                + (f" (padded to {padded}, masked)" if padded > m.seq_len else "")
                + f", {self.flops_per_sample / 1e9:.2f} GFLOP/image (train)")

    def seq_length(self, chunks: list, micro_batch: int) -> int:
        return chunks[0].padded_len(micro_batch)

    def prepare(self, raw, key, device, first_stage):
        images, labels = raw[0], raw[1]
        # Float16Module casts to bf16 on GPU; keep fp32 here. Targets may come back mixed (soft)
        x, targets = prepare_batch(self.augment, images, labels, key, self.image_size, device,
                                   torch.float32, first_stage)
        return x, targets, labels.to(device, non_blocking=True)

    def forward(self, model, inputs):
        return model(inputs[0])

    def loss(self, inputs, output):
        _, targets, labels = inputs
        output = output.float()
        valid = labels >= 0  # -1: a sample that only fills an eval microbatch
        n = valid.sum()
        # mixed targets carry the label smoothing already
        smoothing = 0.0 if targets.is_floating_point() else self.cfg.train.label_smoothing
        loss = F.cross_entropy(output, targets, label_smoothing=smoothing, ignore_index=-1)
        correct = ((output.argmax(-1) == labels) & valid).sum()
        # the schedule divides `loss` in place by the number of microbatches: count a clone
        return loss, stats(loss.detach().clone() * n, correct, n)

    def eval_outputs(self, inputs, output):
        return {"stats": self.loss(inputs, output)[1]}

    def eval_metrics(self, outputs, chunks):
        total = sum((o["stats"] for o in outputs), torch.zeros(3, device=self.d.device))
        loss_sum, correct, n = reduce_stats(total, self.d).tolist()
        return {"eval_loss": loss_sum / max(n, 1), "eval_top1": correct / max(n, 1),
                "eval_images": int(n)}
