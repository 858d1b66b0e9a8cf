"""Held-out evaluation: the Trainer's during training, and ``vitgraph eval`` on its own.

``vitgraph eval`` builds the model as training builds it (any tp / pp layout; no optimizer,
no data parallelism, no graphs), loads the checkpoint's model weights through megatron-core's
dist_checkpointing and evaluates a split without augmentation. The result goes to a new file
in the run directory, and nothing else there is written:

* the run's own data: ``eval-<step>.json`` (``eval-<step>-train.json`` for the training split);
  evaluating the same data again gives the same file;
* other data (``data.kind`` / ``data.path`` / ... overridden): the file is named after it as
  well, ``eval-<step>-<kind>-<folder>-<hash>[-train].json``, so an eval of one data set never
  replaces the eval of another (as timm's validate writes one result per data set).

Every file says which data it scored: ``data`` = {kind, path, split, images}. ``--ema``
scores the checkpoint's EMA of the weights (train.ema): ``eval-<step>-ema...json``, its
metrics named as training logs them, ``eval_ema_top1`` beside the raw ``eval_top1``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch
import yaml

from megatron.core.pipeline_parallel import get_forward_backward_func

from vitgraph.config import Config
from vitgraph.convert.checkpoints import checkpoint_dir
from vitgraph.data import EncodedImages, build_datasets, iterate_eval, iterate_eval_packs
from vitgraph.models.vit import unwrap
from vitgraph.output import write_text
from vitgraph.parallel.setup import (for_inference, init_distributed, launched_world_size,
                                     shutdown)
from vitgraph.plan import resolve
from vitgraph.tasks import make_task
from vitgraph.train import checkpoint as ckpt
from vitgraph.train.metrics import eval_line

log = logging.getLogger("vitgraph")

# the data fields that decide which images a split holds (the rest: how they are read)
DATA_IDENTITY = ("kind", "path", "num_train", "num_val", "render_size", "num_classes",
                 "captions", "seed")


def split_padded(fields: tuple, k: int, multiple: int = 1, fill_label: int = -1) -> list:
    """One eval batch (images, labels, ...) as ``k`` equal microbatches of a multiple of
    ``multiple`` samples, filled up with copies of the first sample labelled ``fill_label``
    (the task leaves them out)."""
    labels = fields[1]
    m = -(-len(labels) // k)
    m = -(-m // multiple) * multiple
    pad = m * k - len(labels)
    def fill(i, f):
        if isinstance(f, EncodedImages):  # data.decode=cuda: finished on the device
            return f.padded(pad)
        return torch.cat([f, f.new_full((pad,), fill_label) if i == 1
                          else f[:1].expand(pad, *f.shape[1:])])
    if pad:
        fields = tuple(fill(i, f) for i, f in enumerate(fields))
    return list(zip(*(f.split(m) for f in fields)))


class Evaluator:
    """The task's held-out metrics of a dataset, never augmented: forward-only through
    megatron's schedule over this rank's ``wrapped`` chunks, reduced by the task."""

    def __init__(self, task, wrapped: list, chunks: list, d, batch_size: int, fp8: bool,
                 pack=None):
        self.task, self.wrapped, self.chunks, self.d = task, wrapped, chunks, d
        self.batch_size = batch_size
        self.forward_backward = get_forward_backward_func()
        # the interleaved schedule needs at least pp microbatches; FP8 GEMMs a token count that
        # is a multiple of 16: a model that does not pad its tokens gets filled-up batches
        self.k = d.pp if d.vpp > 1 else 1
        self.fill = 16 if fp8 and getattr(chunks[0], "pad_to", None) is None else 1
        self.pack = pack  # native resolution: held-out images in packs of this spec

    def _batches(self, dataset):
        """This rank's eval microbatches, ``k`` at a time (one schedule call each): packs at
        native resolution (the last group filled up with empty packs), else each eval batch
        split into equal microbatches."""
        if self.pack is None:
            for fields in iterate_eval(dataset, self.batch_size, self.d.dp_rank, self.d.dp):
                yield split_padded(fields, self.k, self.fill, self.task.fill_label)
            return
        group = []
        for fields in iterate_eval_packs(dataset, self.pack, self.d.dp_rank, self.d.dp):
            group.append(fields)
            if len(group) == self.k:
                yield group
                group = []
        if group:
            empty = tuple(f.new_full(f.shape, -1) if i == 4 else f for i, f in enumerate(group[0]))
            yield group + [empty] * (self.k - len(group))

    def _feed(self, microbatches: list, model):
        first_stage = unwrap(model).pre_process
        for fields in microbatches:
            yield self.task.prepare(fields, None, self.d.device, first_stage)

    def _step(self, data_iterator, model):
        inputs = next(data_iterator)
        output = self.task.forward(model, inputs)
        return output, lambda out: (torch.zeros((), device=self.d.device),
                                    self.task.eval_outputs(inputs, out))

    @torch.no_grad()
    def __call__(self, dataset) -> dict:
        for w in self.wrapped:
            w.eval()
        outputs = []
        for mbs in self._batches(dataset):
            mb = 1 if self.pack is not None else len(mbs[0][1])
            outputs += self.forward_backward(
                forward_step_func=self._step,
                data_iterator=[self._feed(mbs, w) for w in self.wrapped],
                model=self.wrapped, num_microbatches=self.k,
                seq_length=self.task.seq_length(self.chunks, mb), micro_batch_size=mb,
                forward_only=True)
        metrics = self.task.eval_metrics(outputs, self.chunks)
        for w in self.wrapped:
            w.train()
        return metrics


def ema_metrics(evals: dict) -> dict:
    """An evaluation of the EMA weights, named as logged beside the raw weights' metrics:
    ``eval_top1`` -> ``eval_ema_top1`` (the image count is the same, and left out)."""
    return {f"eval_ema_{k[5:]}": v for k, v in evals.items()
            if k.startswith("eval_") and k != "eval_images"}


def eval_file_name(step: int, split: str, data: dict, own: bool, ema: bool = False) -> str:
    """``eval-<step>[-ema][-train].json`` for the run's own data, else named after ``data``
    too."""
    suffix = ("-ema" if ema else "") + ("" if split == "val" else f"-{split}")
    if own:
        return f"eval-{step}{suffix}.json"
    folder = Path(str(data.get("path") or "")).name or "generated"
    folder = re.sub(r"[^A-Za-z0-9._-]+", "_", folder)
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    return f"eval-{step}-{data['kind']}-{folder}-{digest[:8]}{suffix}.json"


def data_identity(data_cfg) -> dict:
    return {k: getattr(data_cfg, k) for k in DATA_IDENTITY}


def is_runs_own_data(cfg: Config) -> bool:
    """Whether ``cfg.data`` names the images the run was trained on (its config.yaml)."""
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return True
    raw = (yaml.safe_load(saved.read_text()) or {}).get("data") or {}
    ours = data_identity(cfg.data)
    defaults = data_identity(type(cfg.data)())
    return all(raw.get(k, defaults[k]) == v for k, v in ours.items())


def evaluate_checkpoint(cfg: Config, checkpoint: str | None = None, split: str = "val",
                        ema: bool = False) -> dict:
    """``vitgraph eval``: the metrics of one checkpoint of ``cfg``'s run on ``split``, written
    to the run directory (see the module's docstring); returns them with the file's path.
    ``ema``: the checkpoint's EMA of the weights (ConvertError when it holds none)."""
    path = checkpoint_dir(cfg.run_dir, checkpoint)
    plan = resolve(cfg, launched_world_size())
    d = init_distributed(plan)
    try:
        train_set, val_set = build_datasets(plan.data, plan.train.seed, plan.native)
        task = make_task(plan, d)
        task.attach(train_set, val_set)
        chunks = task.build_model(with_init_from=False)  # the checkpoint's weights
        wrapped = for_inference(chunks)
        step = ckpt.load_model(path, chunks, ema=ema)
        dataset = train_set if split == "train" else val_set
        evaluator = Evaluator(task, wrapped, chunks, d, plan.train.eval_batch_size, plan.fp8,
                              plan.pack)
        data = {**data_identity(cfg.data), "split": split, "images": len(dataset.labels)}
        evals = evaluator(dataset)
        result = {"step": step, "checkpoint": str(path), "split": split,
                  "data": {k: data[k] for k in ("kind", "path", "split", "images")},
                  **({"weights": "ema", **ema_metrics(evals)} if ema else evals)}
        if d.rank == 0:
            out = cfg.run_dir / eval_file_name(step, split, data, is_runs_own_data(cfg), ema)
            write_text(out, json.dumps(result, indent=2) + "\n")
            result["path"] = str(out)
            scored = " ".join(str(s) for s in (cfg.data.kind, cfg.data.path, split) if s)
            print(f"eval of {path} ({scored}, {data['images']} images): {eval_line(result)} "
                  f"-> {out}", flush=True)
        return result
    finally:
        shutdown()
