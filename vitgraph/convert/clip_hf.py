"""Hugging Face ``CLIPModel`` and ``SiglipModel`` state dicts <-> vitgraph's ``CLIP``
(vitgraph.models.clip).

Full models only (tensor-parallel size 1). Names on both sides::

    vision_model.embeddings.class_embedding [d]          visual.cls_token [1, 1, d]
    vision_model.embeddings.patch_embedding.weight       visual.patch_embed.weight (no bias)
    vision_model.embeddings.position_embedding.weight    visual.pos_embed [1, n, d]
    vision_model.pre_layrnorm.*                          visual.ln_pre.*
    vision_model.post_layernorm.*                        visual.final_norm.*
    visual_projection.weight                             visual.proj.weight
    text_model.embeddings.token_embedding.weight         text.token_embed.weight
    text_model.embeddings.position_embedding.weight      text.pos_embed [ctx, d]
    text_model.final_layer_norm.*                        text.final_norm.*
    text_projection.weight                               text.proj.weight
    logit_scale                                          logit_scale
    <tower>.encoder.layers.{i}.<layer>                   <tower>.decoder.layers.{i}.<layer>

A layer: ``layer_norm1`` / ``layer_norm2`` are the norms fused into ``linear_qkv`` /
``linear_fc1``; q, k and v are concatenated into megatron's per-head QKV rows
(vitgraph.convert.tables.qkv_to_megatron). The matching vitgraph architecture: QuickGELU
(HF's default ``hidden_act``), LayerNorm eps 1e-5, ``ln_pre``, a patch embedding without bias,
class-token pooling, causal text tower pooled at the end of text (HF takes the first
``eos_token_id``, or the largest id for configs with ``eos_token_id == 2``; the byte tokenizer's
end of text is both).

``SiglipModel``: no class token, no ``ln_pre``, a patch bias; the vision ``head`` (probe,
``nn.MultiheadAttention`` with packed q/k/v, layernorm, mlp) is vitgraph's ``attn_pool``
(``latent``, ``q``, ``kv``, ``proj``, ``norm``, ``fc1``, ``fc2``); the text ``head`` (with a
bias) is ``text.proj``; ``logit_scale`` / ``logit_bias`` are [1] there, scalars here. The
matching architecture: tanh GELU, eps 1e-6, bidirectional text pooled at the last position.
open_clip names: vitgraph.convert.openclip. Both walk their tables with vitgraph.convert.tables.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from vitgraph.convert import tables
from vitgraph.convert.naflex import LINEAR_PATCH
from vitgraph.convert.tables import (FLAT_TOKEN, NO_BATCH_DIM, ONE_ELEMENT, ConvertError,  # noqa: F401
                                     Tower, check_empty, take)
from vitgraph.models.registry import TowerArch, ViTArch

_LAYER = (
    ("self_attention.linear_qkv.layer_norm_weight", "layer_norm1.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "layer_norm1.bias"),
    ("self_attention.linear_proj.weight", "self_attn.out_proj.weight"),
    ("self_attention.linear_proj.bias", "self_attn.out_proj.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "layer_norm2.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "layer_norm2.bias"),
    ("mlp.linear_fc1.weight", "mlp.fc1.weight"),
    ("mlp.linear_fc1.bias", "mlp.fc1.bias"),
    ("mlp.linear_fc2.weight", "mlp.fc2.weight"),
    ("mlp.linear_fc2.bias", "mlp.fc2.bias"),
)
_QKV = ("self_attn.q_proj.{kind}", "self_attn.k_proj.{kind}", "self_attn.v_proj.{kind}")


def _tower(ours: str, theirs: str, globals_: tuple) -> Tower:
    return Tower(globals=globals_, layer=_LAYER, qkv=_QKV,
                 theirs_layers=f"{theirs}.encoder.layers.{{i}}.",
                 ours_layers=f"{ours}.decoder.layers.{{i}}.")


CLIP_VISION = _tower("visual", "vision_model", (
    ("visual.patch_embed.weight", "vision_model.embeddings.patch_embedding.weight"),
    ("visual.cls_token", "vision_model.embeddings.class_embedding", FLAT_TOKEN),
    ("visual.pos_embed", "vision_model.embeddings.position_embedding.weight", NO_BATCH_DIM),
    ("visual.ln_pre.weight", "vision_model.pre_layrnorm.weight"),
    ("visual.ln_pre.bias", "vision_model.pre_layrnorm.bias"),
    ("visual.final_norm.weight", "vision_model.post_layernorm.weight"),
    ("visual.final_norm.bias", "vision_model.post_layernorm.bias"),
    ("visual.proj.weight", "visual_projection.weight"),
))
CLIP_TEXT = _tower("text", "text_model", (
    ("text.token_embed.weight", "text_model.embeddings.token_embedding.weight"),
    ("text.pos_embed", "text_model.embeddings.position_embedding.weight"),
    ("text.final_norm.weight", "text_model.final_layer_norm.weight"),
    ("text.final_norm.bias", "text_model.final_layer_norm.bias"),
    ("text.proj.weight", "text_projection.weight"),
    ("logit_scale", "logit_scale"),
))
# the attention-pooling head's packed in_proj (q; k; v) is split into q and kv apart, below
SIGLIP_VISION = _tower("visual", "vision_model", (
    ("visual.patch_embed.weight", "vision_model.embeddings.patch_embedding.weight"),
    ("visual.patch_embed.bias", "vision_model.embeddings.patch_embedding.bias"),
    ("visual.pos_embed", "vision_model.embeddings.position_embedding.weight", NO_BATCH_DIM),
    ("visual.final_norm.weight", "vision_model.post_layernorm.weight"),
    ("visual.final_norm.bias", "vision_model.post_layernorm.bias"),
    ("visual.attn_pool.latent", "vision_model.head.probe"),
    ("visual.attn_pool.proj.weight", "vision_model.head.attention.out_proj.weight"),
    ("visual.attn_pool.proj.bias", "vision_model.head.attention.out_proj.bias"),
    ("visual.attn_pool.norm.weight", "vision_model.head.layernorm.weight"),
    ("visual.attn_pool.norm.bias", "vision_model.head.layernorm.bias"),
    ("visual.attn_pool.fc1.weight", "vision_model.head.mlp.fc1.weight"),
    ("visual.attn_pool.fc1.bias", "vision_model.head.mlp.fc1.bias"),
    ("visual.attn_pool.fc2.weight", "vision_model.head.mlp.fc2.weight"),
    ("visual.attn_pool.fc2.bias", "vision_model.head.mlp.fc2.bias"),
))
SIGLIP_TEXT = _tower("text", "text_model", (
    ("text.token_embed.weight", "text_model.embeddings.token_embedding.weight"),
    ("text.pos_embed", "text_model.embeddings.position_embedding.weight"),
    ("text.final_norm.weight", "text_model.final_layer_norm.weight"),
    ("text.final_norm.bias", "text_model.final_layer_norm.bias"),
    ("text.proj.weight", "text_model.head.weight"),
    ("text.proj.bias", "text_model.head.bias"),
    ("logit_scale", "logit_scale", ONE_ELEMENT),
    ("logit_bias", "logit_bias", ONE_ELEMENT),
))


def _to_vitgraph(sd: dict, towers, vision_heads: int, text_heads: int):
    rest = {k: v for k, v in sd.items() if not k.endswith("position_ids")}  # buffers
    out = {}
    for tower, heads in zip(towers, (vision_heads, text_heads)):
        out.update(tables.to_vitgraph(rest, tower, heads))
    return out, rest


def _from_vitgraph(sd: dict, towers, vision_heads: int, text_heads: int):
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = {}
    for tower, heads in zip(towers, (vision_heads, text_heads)):
        out.update(tables.from_vitgraph(rest, tower, heads))
    return out, rest


def hf_clip_to_vitgraph(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """A ``CLIPModel`` state dict -> vitgraph ``CLIP`` names (every key used, or an error)."""
    out, rest = _to_vitgraph(sd, (CLIP_VISION, CLIP_TEXT), vision_heads, text_heads)
    check_empty(rest, "in the CLIPModel weights has no place in vitgraph's CLIP")
    return out


def vitgraph_to_hf_clip(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """vitgraph ``CLIP`` names -> a ``CLIPModel`` state dict (without HF's position_ids)."""
    out, rest = _from_vitgraph(sd, (CLIP_VISION, CLIP_TEXT), vision_heads, text_heads)
    check_empty(rest, "has no place in a CLIPModel")
    return out


def hf_siglip_to_vitgraph(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """A ``SiglipModel`` state dict -> vitgraph ``CLIP`` names (every key used, or an error)."""
    out, rest = _to_vitgraph(sd, (SIGLIP_VISION, SIGLIP_TEXT), vision_heads, text_heads)
    w = take(rest, "vision_model.head.attention.in_proj_weight")
    b = take(rest, "vision_model.head.attention.in_proj_bias")
    d = w.shape[1]
    out["visual.attn_pool.q.weight"], out["visual.attn_pool.kv.weight"] = w[:d], w[d:]
    out["visual.attn_pool.q.bias"], out["visual.attn_pool.kv.bias"] = b[:d], b[d:]
    check_empty(rest, "in the SiglipModel weights has no place in vitgraph's CLIP")
    return out


def vitgraph_to_hf_siglip(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """vitgraph ``CLIP`` names (a SigLIP pair) -> a ``SiglipModel`` state dict."""
    out, rest = _from_vitgraph(sd, (SIGLIP_VISION, SIGLIP_TEXT), vision_heads, text_heads)
    out["vision_model.head.attention.in_proj_weight"] = torch.cat(
        [take(rest, "visual.attn_pool.q.weight"), take(rest, "visual.attn_pool.kv.weight")])
    out["vision_model.head.attention.in_proj_bias"] = torch.cat(
        [take(rest, "visual.attn_pool.q.bias"), take(rest, "visual.attn_pool.kv.bias")])
    check_empty(rest, "has no place in a SiglipModel")
    return out


# ---------------------------------------------------------------- vision models on their own
#
# ``CLIPVisionModel`` (``CLIPVisionModelWithProjection``: ``visual_projection``),
# ``SiglipVisionModel`` and ``Siglip2VisionModel``, or the vision half of a ``CLIPModel`` /
# ``SiglipModel``, <-> an image tower's own names (vitgraph.tower.VisionTower, a caption
# model's ``visual``): the pair's tables above without ``visual.``. SigLIP 2's patch
# embedding is a linear over pre-patchified (row, column, channel) pixels, timm NaFlexVit's
# (vitgraph.convert.naflex.LINEAR_PATCH). Hub files name the tensors ``vision_model.*``;
# transformers 5's ``SiglipVisionModel.state_dict()`` leaves that prefix out: both are read.

HF_VISION_KINDS = ("clip", "siglip", "siglip2")
HF_VISION_CLASSES = {"clip": "CLIPVisionModel", "siglip": "SiglipVisionModel",
                     "siglip2": "Siglip2VisionModel"}
# transformers' hidden_act -> vitgraph's activation (and back: the first of each)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                  "quick_gelu": "quick_gelu"}
_HF_ACTIVATION_OF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}
# transformers' defaults of each vision config (a config.json may leave them out)
_HF_DEFAULTS = {
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, image_size=224, patch_size=32, hidden_act="quick_gelu",
                 layer_norm_eps=1e-5),
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, image_size=224, patch_size=16,
                   hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True),
    "siglip2": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, num_patches=256, patch_size=16,
                    hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=True),
}
_MODEL_TYPES = {"clip": "clip", "clip_vision_model": "clip", "siglip": "siglip",
                "siglip_vision_model": "siglip", "siglip2": "siglip2",
                "siglip2_vision_model": "siglip2"}
_VISION_PARTS = ("embeddings.", "encoder.", "pre_layrnorm.", "post_layernorm.", "head.")


def _alone(tower: Tower, optional=()) -> Tower:
    """``tower`` (a pair's image tower) under a tower's own names."""
    entries = tuple((e[0].removeprefix("visual."), *e[1:]) for e in tower.globals)
    return dataclasses.replace(tower, globals=entries, ours_layers="decoder.layers.{i}.",
                               optional=frozenset(optional))


_POOL_NAMES = [e[0].removeprefix("visual.") for e in SIGLIP_VISION.globals
               if e[0].startswith("visual.attn_pool.")]
VISION_ALONE = {
    "clip": _alone(CLIP_VISION, ["proj.weight"]),
    "siglip": _alone(SIGLIP_VISION, _POOL_NAMES),
    "siglip2": _alone(dataclasses.replace(SIGLIP_VISION, globals=tuple(
        (*e[:2], LINEAR_PATCH) if e[0] == "visual.patch_embed.weight" else e
        for e in SIGLIP_VISION.globals)), _POOL_NAMES),
}
_IN_PROJ = "vision_model.head.attention.in_proj_{}"


def vision_part(sd: dict) -> tuple[dict, list[str]]:
    """(the vision model's tensors under hub names, ``vision_model.*``, the names of the
    rest: a pair's text tower, logit scale ...)."""
    vision, rest = {}, []
    for k, v in sd.items():
        if k.endswith("position_ids"):  # a buffer
            continue
        if k.startswith(_VISION_PARTS):  # transformers 5, a vision model's own state_dict()
            k = "vision_model." + k
        if k.startswith("vision_model.") or k == "visual_projection.weight":
            vision[k] = v
        else:
            rest.append(k)
    return vision, rest


def hf_vision_kind(sd: dict) -> str:
    """clip | siglip | siglip2: which vision model ``sd`` (``vision_part``'s names) is."""
    if "vision_model.embeddings.class_embedding" in sd:
        return "clip"
    patch = sd.get("vision_model.embeddings.patch_embedding.weight")
    return "siglip2" if patch is not None and patch.ndim == 2 else "siglip"


def hf_vision_to_vitgraph(sd: dict, num_heads: int, tower: bool = False) -> dict:
    """A Hugging Face CLIP / SigLIP / SigLIP 2 vision model's tensors (a pair's text half is
    left out: ``vision_part``) -> an image tower's names (``visual.*`` with ``tower``: for an
    image-text pair); every vision key used, or an error."""
    rest, _ = vision_part(sd)
    out = tables.to_vitgraph(rest, VISION_ALONE[hf_vision_kind(rest)], num_heads)
    w = take(rest, _IN_PROJ.format("weight"), required=False)
    if w is not None:  # the attention pool's packed (q; k; v), split into q and kv
        b, d = take(rest, _IN_PROJ.format("bias")), w.shape[1]
        out["attn_pool.q.weight"], out["attn_pool.kv.weight"] = w[:d], w[d:]
        out["attn_pool.q.bias"], out["attn_pool.kv.bias"] = b[:d], b[d:]
    check_empty(rest, "in the Hugging Face vision model has no place in vitgraph's tower")
    return {f"visual.{k}": v for k, v in out.items()} if tower else out


def vitgraph_to_hf_vision(sd: dict, num_heads: int, kind: str) -> dict:
    """An image tower's names (or ``visual.*``) -> a ``kind`` vision model's hub names."""
    if any(k.startswith("visual.") for k in sd):
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = tables.from_vitgraph(rest, VISION_ALONE[kind], num_heads)
    if "attn_pool.q.weight" in rest:
        for part in ("weight", "bias"):
            out[_IN_PROJ.format(part)] = torch.cat(
                [take(rest, f"attn_pool.q.{part}"), take(rest, f"attn_pool.kv.{part}")])
    check_empty(rest, f"has no place in a {HF_VISION_CLASSES[kind]}")
    return out


def hf_vision_arch(config: dict) -> tuple[TowerArch, str]:
    """(the TowerArch, the kind) of a Hugging Face vision config (``config.json`` or
    ``model.config.to_dict()``; a pair's: its ``vision_config``)."""
    kind = _MODEL_TYPES.get(config.get("model_type", ""))
    if kind is None:
        raise ConvertError(f"model_type {config.get('model_type')!r}: not a Hugging Face CLIP / "
                           f"SigLIP / SigLIP 2 (vision) config")
    if "vision_config" in config:
        config = config["vision_config"] or {}
    c = {**_HF_DEFAULTS[kind], **config}
    act = HF_ACTIVATIONS.get(c["hidden_act"])
    if act is None:
        raise ConvertError(f"hidden_act {c['hidden_act']!r}: vitgraph's towers run "
                           f"{', '.join(HF_ACTIVATIONS)}")
    p = c["patch_size"]
    image = c["image_size"] if kind != "siglip2" else math.isqrt(c["num_patches"]) * p
    vit = ViTArch(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                  c["intermediate_size"], p, image)
    if kind == "clip":
        return TowerArch(vit, act, c["layer_norm_eps"], class_token=True, ln_pre=True,
                         patch_bias=False), kind
    return TowerArch(vit, act, c["layer_norm_eps"], class_token=False,
                     pool="map" if c["vision_use_head"] else "none",
                     pos_interp="bilinear" if kind == "siglip2" else "bicubic"), kind


def siglip_refusal(tower: TowerArch) -> str | None:
    """Why a SigLIP (2) vision model cannot hold ``tower``'s weights, or None."""
    why = [what for what, has in (
        ("a class token (model.class_token=false trains without one)", tower.class_token),
        ("register tokens (model.num_registers)", tower.num_registers),
        ("a LayerNorm before the encoder (ln_pre)", tower.ln_pre),
        ("a patch embedding without bias", not tower.patch_bias)) if has]
    return f"SigLIP's vision model has no place for {' or '.join(why)}" if why else None


def hf_vision_config(tower: TowerArch, kind: str) -> dict:
    """transformers' ``config.json`` of a ``SiglipVisionModel`` / ``Siglip2VisionModel`` with
    ``tower``'s sizes (SigLIP's layout: ConvertError naming what does not fit)."""
    why = siglip_refusal(tower)
    if why or kind not in ("siglip", "siglip2"):
        raise ConvertError(why or f"{kind}: a vision model export writes siglip or siglip2")
    a = tower.vision
    out = {"architectures": [HF_VISION_CLASSES[kind]], "model_type": f"{kind}_vision_model",
           "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size,
           "num_hidden_layers": a.num_layers, "num_attention_heads": a.num_heads,
           "num_channels": 3, "patch_size": a.patch_size,
           "hidden_act": _HF_ACTIVATION_OF[tower.activation],
           "layer_norm_eps": tower.layernorm_epsilon, "attention_dropout": 0.0,
           "vision_use_head": tower.pool == "map"}
    if kind == "siglip2":
        out["num_patches"] = (a.image_size // a.patch_size) ** 2
    else:
        out["image_size"] = a.image_size
    return out
