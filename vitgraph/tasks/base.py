"""A task: what one kind of training brings to the one Trainer (vitgraph.train.loop).

The Trainer owns everything a task does not vary: process groups, the schedule (megatron-core's
forward-backward), DDP and the optimizer, graphs, checkpoints, logging and the eval loop. A task
supplies, through this interface only:

* ``attach(train, val)``: anything it adds to the datasets (the contrastive task tokenizes the
  captions once, so every microbatch carries its token ids);
* ``build_model(with_init_from=True)``: this rank's model chunks (one per virtual pipeline
  stage), as the plan (vitgraph.plan.Plan: architecture, layers, precision, padding) says,
  with model.init_from's weights (False: the caller loads others, or none);
* ``prepare(raw, key, device, first_stage)``: one microbatch as the model takes it, on the
  device (augmented when ``key`` is a training (step, microbatch) pair);
* ``forward(model, inputs)`` and ``loss(inputs, output) -> (loss, stats)``, where stats is
  the float tensor [loss x n, correct, n, *extra x n] summed into the logged loss, top-1 and
  the terms named by ``extra_stats`` (each logged as its mean over the samples);
* ``after_update(chunks)``: in-place fixes after each optimizer update (inside a captured
  step too, so device ops only);
* ``eval_outputs(inputs, output)`` (one forward-only microbatch's results) and
  ``eval_metrics(outputs, chunks)`` (the held-out numbers, reduced over the ranks).

Task code never calls back into the Trainer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from vitgraph.data import DataError
from vitgraph.parallel.dist import Dist
from vitgraph.plan import Plan


class Task:
    name = "abstract"
    fill_label = -1  # the label of samples that only fill an eval microbatch up
    # names of the loss terms a training step adds after [loss x n, correct, n] (the same on
    # every rank: the sums are reduced over the world)
    extra_stats: tuple[str, ...] = ()

    def __init__(self, plan: Plan, d: Dist, total_steps: int | None = None):
        self.plan, self.d = plan, d
        self.num_classes = 0
        self.total_steps = total_steps  # the run's length (None: evaluation only)

    def attach(self, train_set, val_set) -> None:
        self.num_classes = self.plan.model.num_classes or len(train_set.classes)

    def build_model(self, with_init_from: bool = True) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    # what the log and the schedule need to know about the model
    image_size: int = 0
    flops_per_sample: float = 0.0  # training FLOPs per sample (image or image-text pair)
    # native resolution: training FLOPs of a pack per (token, attended token pair, image), so
    # that an image of n tokens costs what the fixed path's formula gives at n tokens
    pack_flops: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def describe(self, chunks: list, micro_batch: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def seq_length(self, chunks: list, micro_batch: int) -> int:
        """The activation length between pipeline stages (megatron's ``seq_length``)."""
        return 1

    # a step
    def host_fields(self, raw: tuple) -> tuple:
        """Fields a training microbatch also needs that are made from its CPU fields, made
        by the prefetcher's thread while the loader's fields are still on the host and
        appended to them (``prepare`` finds them there): nothing here."""
        return ()

    def prepare(self, raw: tuple, key, device, first_stage: bool) -> tuple:  # pragma: no cover
        raise NotImplementedError

    def forward(self, model, inputs: tuple):  # pragma: no cover - interface
        raise NotImplementedError

    def loss(self, inputs: tuple, output) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def after_update(self, chunks: list) -> None:
        pass

    # held-out evaluation
    def eval_outputs(self, inputs: tuple, output) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def eval_metrics(self, outputs: list[dict], chunks: list) -> dict:  # pragma: no cover
        raise NotImplementedError


def require_captions(plan: Plan, train_set, val_set) -> None:
    """A data error unless both sets carry captions (the image-text tasks)."""
    for name, ds in (("training", train_set), ("held-out", val_set)):
        if ds.captions is None:
            raise DataError(f"data.kind={plan.data.kind}: the {name} images have no "
                            f"captions; task.kind={plan.task} needs image-text pairs (the "
                            "shapes data or WebDataset jpg+txt shards)")


def reduce_stats(stats: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum [loss x n, correct, n] over the world: only last-stage ranks hold values, and each
    tensor-parallel rank holds the same ones."""
    stats = stats.to(d.device, torch.float64)
    dist.all_reduce(stats)
    return stats / d.tp


def stats(loss_sum: torch.Tensor, correct: torch.Tensor, n: torch.Tensor,
          *extra_sums: torch.Tensor) -> torch.Tensor:
    """The [loss x n, correct, n, *extra x n] vector the loop sums; an empty microbatch adds
    nothing."""
    return torch.stack([torch.where(n > 0, loss_sum, 0.0), correct.float(), n.float(),
                        *(torch.where(n > 0, e, 0.0) for e in extra_sums)])
