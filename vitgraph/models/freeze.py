"""Frozen parameters (model.freeze, task.lock_image): parameter names as the whole model has
them, and ``freeze``, which vitgraph.parallel.setup.parallelize applies before DDP."""
from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from vitgraph.config_keys import ConfigError


def global_names(chunk: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the whole model: an encoder layer's index is its global
    one (megatron's ``layer_number`` - 1), so "decoder.layers.0.*" means the first layer at any
    pp / vpp layout (a later stage's chunk numbers its own layers from 0)."""
    out = {id(p): n for n, p in chunk.named_parameters()}
    for name, m in chunk.named_modules():
        if isinstance(m, BaseTransformerLayer) and "." in name:
            prefix = f"{name.rsplit('.', 1)[0]}.{m.layer_number - 1}"
            for n, p in m.named_parameters():
                out[id(p)] = f"{prefix}.{n}"
    return out


def freeze(chunks: list, rules: list[tuple[str, str]], pp_rank: int = 0, pp: int = 1) -> int:
    """Set requires_grad=False on every parameter of this rank's (unwrapped) ``chunks`` whose
    name (``global_names``) matches one of ``rules`` (vitgraph.plan.Plan.freeze); before DDP wraps
    them, so megatron's DDP and optimizer (and CpuOptimizer) give them no gradient buffer and
    no state. Collective (``pp_rank`` / ``pp``: this rank's pipeline stage and their number):
    a pattern that matches no parameter on any rank, or leaves nothing to train, is a
    ConfigError; so is, under a pipeline, a first stage with nothing to train (megatron's
    backward there would start from an output that needs no gradient). Returns the
    parameters frozen here."""
    if not rules:
        return 0
    hits, frozen, trainable = [0] * len(rules), 0, [0] * len(chunks)
    for c, chunk in enumerate(chunks):
        names = global_names(chunk)
        for p in chunk.parameters():
            name = names[id(p)]
            matched = [i for i, (_, pat) in enumerate(rules) if fnmatch.fnmatchcase(name, pat)]
            for i in matched:
                hits[i] += 1
            if matched:
                p.requires_grad_(False)
                frozen += 1
            elif p.requires_grad:
                trainable[c] += 1
    # (matches per rule, trainable here, trainable in the model's first (virtual) stage)
    mine = (hits, sum(trainable), trainable[0] if pp_rank == 0 else 0, pp_rank == 0)
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    patterns = [pat for _, pat in rules]
    for i, (key, pat) in enumerate(rules):
        if not sum(e[0][i] for e in every):
            what = ("no image-tower parameter" if key == "task.lock_image" else
                    "no parameter name (`vitgraph params CONFIG` lists them)")
            raise ConfigError(f"{key}: pattern {pat!r} matches {what}")
    if not sum(e[1] for e in every):
        raise ConfigError(f"model.freeze: {patterns} freeze every parameter: nothing is left "
                          "to train")
    if pp > 1 and not sum(e[2] for e in every if e[3]):
        raise ConfigError(f"model.freeze: {patterns} freeze the whole first pipeline stage, "
                          "whose backward needs a parameter to train: freeze less, or use "
                          "parallel.pp=1")
    return frozen
