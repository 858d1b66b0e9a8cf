"""The model weights of a run's checkpoint, as one full vitgraph state dict.

The one place that knows how training checkpoints store the model (megatron-core
dist_checkpointing under ``checkpoints/step_N/dist``: sharded tensors keyed by global names,
each encoder's layers, ``decoder.layers.*`` or a CLIP pair's ``visual.decoder.layers.*`` and
``text.decoder.layers.*``, stacked along a leading layer dimension); ``vitgraph export`` and
``vitgraph eval`` read through it. Read with torch.distributed.checkpoint in one process (no
process group), whatever the tp / pp layout of the run that wrote it.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from vitgraph.convert.checkpoints import quiet_reads
from vitgraph.convert.names import ConvertError

# a stacked layer tensor: "[visual.|text.]decoder.layers.<rest>" with no layer number
_STACKED = re.compile(r"^(.*?decoder\.layers\.)(?!\d+\.)(.+)$")


def read_checkpoint_weights(path: str | Path, ema: bool = False
                            ) -> tuple[dict[str, torch.Tensor], int]:
    """(full state dict with global layer numbers, step) of one checkpoint's step directory
    (vitgraph.convert.checkpoints.checkpoint_dir finds it in a run). ``ema``: the EMA of the
    weights (train.ema) instead of the weights; ConvertError naming the checkpoint when it
    holds none."""
    path = Path(path)
    sd, step = read_dist_weights(path / "dist", ema)
    if not sd and ema:
        raise ConvertError(f"{path}: checkpoint of step {step} holds no EMA of the weights "
                           f"(the run trained without train.ema.decay); leave out --ema")
    if not sd:
        raise ConvertError(f"{path / 'dist'}: holds no model tensors")
    return sd, step


def read_dist_weights(dist_dir: Path, ema: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """The model tensors of one dist_checkpointing folder as a full state dict, and its step.
    ``ema``: the tensors saved as ``ema.<name>`` (train.ema), named ``<name>``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not (dist_dir / ".metadata").is_file():
        raise ConvertError(f"{dist_dir}: not a megatron dist_checkpointing folder")
    reader = dcp.FileSystemReader(str(dist_dir))
    meta = reader.read_metadata().state_dict_metadata
    # the model's tensors have no prefix; the optimizer state's is "optimizer.", the EMA's "ema."
    model = [k for k, m in meta.items() if isinstance(m, TensorStorageMetadata)
             and not k.startswith(("optimizer.", "ema."))]
    if ema:  # the EMA where there is one: tensors without (frozen ones, buffers) are as trained
        model = [f"ema.{k}" if f"ema.{k}" in meta else k for k in model]
        if not any(k.startswith("ema.") for k in model):
            model = []
    stacked = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in model}
    if stacked:
        with quiet_reads():  # "assuming ... a single process": as asked (no_dist)
            dcp.load(stacked, storage_reader=reader, no_dist=True)
    out = {}
    for name, t in stacked.items():
        name = name[len("ema."):] if name.startswith("ema.") else name
        m = _STACKED.match(name)
        if m:  # [layers, ...] -> one entry per global layer
            prefix, rest = m.groups()
            for i, layer in enumerate(t.unbind(0)):
                out[f"{prefix}{i}.{rest}"] = layer.clone()
        else:
            out[name] = t
    common = torch.load(dist_dir / "common.pt", map_location="cpu", weights_only=False)
    return out, int(common.get("step", 0))
