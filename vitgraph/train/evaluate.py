"""``vitgraph eval``: evaluate a run's checkpoint on its own, without touching the run.

The model is built from the config as training builds it (any tp / pp layout), the
checkpoint's model weights are loaded through megatron-core's dist_checkpointing (no optimizer
state) and the held-out (or training) split is evaluated without augmentation. The result goes to ``<run_dir>/eval-<step>.json``
(``eval-<step>-train.json`` for the training split): a new file, and nothing else in the run
directory is written.
"""
from __future__ import annotations

import json
import logging

from vitgraph.config import Config

log = logging.getLogger("vitgraph")


def evaluate_checkpoint(cfg: Config, checkpoint: str | None = None, split: str = "val") -> dict:
    from vitgraph.convert.run_weights import checkpoint_dir
    from vitgraph.parallel.setup import shutdown
    from vitgraph.train import checkpoint as ckpt
    from vitgraph.train.loop import Trainer, _eval_line

    path = checkpoint_dir(cfg.run_dir, checkpoint)
    trainer = Trainer(cfg, readonly=True)
    try:
        step = ckpt.load_model(path, trainer.chunks)
        if trainer.graphs is not None:
            trainer.graphs.reset()
        dataset = trainer.train_set if split == "train" else trainer.val_set
        result = {"step": step, "checkpoint": str(path), "split": split,
                  **trainer.evaluate(dataset)}
        if trainer.d.rank == 0:
            name = f"eval-{step}.json" if split == "val" else f"eval-{step}-{split}.json"
            out = cfg.run_dir / name
            tmp = out.with_name(out.name + ".partial")
            tmp.write_text(json.dumps(result, indent=2) + "\n")
            tmp.replace(out)
            result["path"] = str(out)
            log.info("eval of %s (%s): %s -> %s", path, split, _eval_line(result), out)
        return result
    finally:
        trainer.close(shutdown_dist=False)
        shutdown()
