"""The model weights of a run's checkpoint, as one full vitgraph state dict.

The one place that knows how training checkpoints store the model (today
``checkpoints/step_N/mp_rank_TT_PPP.pt``, key "model", one file per pipeline stage with
stage-local layer numbers); ``vitgraph export`` and ``vitgraph eval`` read through it, so a new
checkpoint format changes only this file.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from vitgraph.convert.names import ConvertError

_MP_FILE = re.compile(r"^mp_rank_(\d+)_(\d+)\.pt$")


def checkpoint_dir(run_dir: str | Path, checkpoint: str | int | None = None) -> Path:
    """The step directory: the newest complete one, a step number, or a path."""
    from vitgraph.train.checkpoint import latest
    ckpts = Path(run_dir) / "checkpoints"
    if checkpoint is None:
        path = latest(ckpts) if ckpts.is_dir() else None
        if path is None:
            raise ConvertError(f"{run_dir}: no complete checkpoint under {ckpts}")
        return path
    s = str(checkpoint)
    if s.isdigit():
        path = ckpts / f"step_{int(s):06d}"
    else:
        path = Path(s)
    if not path.is_dir() or path.name.endswith(".tmp"):
        raise ConvertError(f"checkpoint {s!r}: no complete checkpoint directory {path}")
    return path


def read_checkpoint_weights(run_dir: str | Path, checkpoint: str | int | None = None
                            ) -> tuple[dict[str, torch.Tensor], int, Path]:
    """(full state dict with global layer numbers, step, step directory)."""
    path = checkpoint_dir(run_dir, checkpoint)
    files = sorted((int(m.group(1)), int(m.group(2)), p) for p in path.iterdir()
                   if (m := _MP_FILE.match(p.name)))
    if not files:
        raise ConvertError(f"{path}: no mp_rank_*.pt model files")
    if any(tp != 0 for tp, _, _ in files):
        raise ConvertError(f"{path}: tensor-parallel checkpoints (tp > 1) are not merged here")
    out, offset, step = {}, 0, None
    for _, _, f in files:  # pipeline stages in order
        state = torch.load(f, map_location="cpu", weights_only=False)
        step = int(state.get("step", 0))
        layers = set()
        for name, t in state["model"].items():
            if name.endswith("_extra_state"):
                continue
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m:
                layers.add(int(m.group(1)))
                name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
            out[name] = t
        offset += len(layers)
    return out, step, path
