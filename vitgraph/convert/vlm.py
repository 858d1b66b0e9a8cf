"""A caption run's whole model (vitgraph.models.caption: the tower under ``visual.``, the
projector under ``projector.``, the language model under ``language_model.``) out as one
safetensors file and back in.

Out: ``vitgraph export RUN --format vitgraph`` of a ``task.kind: caption`` run writes every
tensor under vitgraph's (megatron-core's) names, with ``config.json`` beside it and the same
JSON in the file's metadata (``caption``): the tower's geometry (``model``), the projector,
the language model's sizes, vocabulary and positions, the tokenizer (``lm.tokenizer`` as the
run set it) and the text budget (``vlm_config``).

In: ``model.init_from`` of a caption run given such a file (any file holding
``language_model.*`` tensors) loads the whole model, every name and shape as the run builds
them (``init_caption``); any other file is a tower's weights and goes to ``visual`` as before
(``init_from``). A file whose metadata names another tokenizer than the run's is refused: the
same vocabulary size would hide it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from vitgraph.convert.tables import ConvertError
from vitgraph.convert.weights import init_from, load_file
from vitgraph.models.registry import tower_of

log = logging.getLogger("vitgraph")

ARCHITECTURE = "vitgraph_caption"
META_KEY = "caption"  # the safetensors metadata entry holding vlm_config
PARTS = ("visual.", "projector.", "language_model.")


def is_whole(sd: dict) -> bool:
    """A caption model's whole state (it has a language model), not a tower's."""
    return any(k.startswith("language_model.") for k in sd)


def vlm_config(sd: dict, model_cfg, lm: dict) -> dict:
    """What a whole-VLM export says of itself: ``sd`` the caption model's full state dict,
    ``model_cfg`` the run's ``model:`` section, ``lm`` its ``lm:`` section (as config.yaml
    holds it)."""
    tower = tower_of(model_cfg)
    a = tower.vision
    words = sd["language_model.embedding.word_embeddings.weight"]
    positions = sd["language_model.embedding.position_embeddings.weight"].shape[0]
    layers = {int(k.split(".")[3]) for k in sd if k.startswith("language_model.decoder.layers.")}
    return {
        "architecture": ARCHITECTURE,
        "model": {"name": model_cfg.name, "image_size": a.image_size,
                  "patch_size": a.patch_size, "hidden_size": a.hidden_size,
                  "num_layers": a.num_layers, "num_heads": a.num_heads,
                  "ffn_hidden_size": a.ffn_hidden_size, "class_token": tower.class_token,
                  "num_registers": tower.num_registers,
                  "layernorm_epsilon": model_cfg.layernorm_epsilon},
        "projector": lm.get("projector"),
        "language_model": {"num_layers": len(layers), "hidden_size": int(words.shape[1]),
                           "num_heads": lm.get("num_heads"),
                           "ffn_hidden_size": int(sd["language_model.decoder.layers.0.mlp."
                                                     "linear_fc1.weight"].shape[0]),
                           # rows: the tokenizer's ids, padded to a multiple of 8
                           "vocab_size": int(words.shape[0]), "positions": int(positions)},
        "tokenizer": lm.get("tokenizer"),
        "text_length": lm.get("text_length"),
        "image_tokens": int(positions) - int(lm.get("text_length") or 0),
    }


def file_config(path) -> dict | None:
    """The ``vlm_config`` in a safetensors file's metadata (None: not there)."""
    if Path(path).suffix != ".safetensors":
        return None
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta[META_KEY]) if META_KEY in meta else None


@torch.no_grad()
def load_whole(model, sd: dict, source: str) -> None:
    """Every tensor of a caption model from ``sd`` (its full state dict), names and shapes as
    ``model`` has them (one stage, tp=1); a ConvertError names the first that differs."""
    own = {k: v for k, v in model.state_dict(keep_vars=True).items()
           if not k.endswith("_extra_state")}
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    hint = ("the file's geometry is in its config.json (and metadata): set model.* / lm.* "
            "to it")
    for what, names in (("missing", sorted(set(own) - set(sd))),
                        ("unexpected", sorted(set(sd) - set(own)))):
        if names:
            raise ConvertError(f"{source}: {what} key {names[0]!r}" + (
                f" (and {len(names) - 1} more)" if len(names) > 1 else "")
                + f" for this caption model; {hint}")
    for name, t in own.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise ConvertError(f"{source}: {name} is {tuple(sd[name].shape)} in the file, "
                               f"{tuple(t.shape)} in this caption model; {hint}")
        t.copy_(sd[name])


def init_caption(model, source: str, fmt: str, tokenizer: str) -> None:
    """``model.init_from`` of a caption run: a whole-VLM file (``is_whole``) into the whole
    ``model``, else a tower's weights into ``model.visual`` (vitgraph.convert.init_from, with
    ``fmt``). ``tokenizer``: the run's lm.tokenizer, checked against the file's."""
    raw = load_file(source)
    if not is_whole(raw):
        if model.visual is not None:  # pipeline stages after the first hold no tower
            init_from(model.visual, raw, fmt, name=source)
        return
    if fmt not in ("auto", "vitgraph"):
        raise ConvertError(f"{source}: holds a whole caption model (vitgraph names); "
                           f"model.init_format={fmt} is for a tower's weights: set auto")
    cfg = file_config(source) or {}
    if cfg.get("tokenizer") not in (None, tokenizer):
        raise ConvertError(f"{source}: its language model reads lm.tokenizer="
                           f"{cfg['tokenizer']} ids; this run tokenizes with {tokenizer}: set "
                           f"lm.tokenizer={cfg['tokenizer']}")
    load_whole(model, raw, source)
    log.info("init: the whole caption model (tower, projector, language model) from %s",
             source)
