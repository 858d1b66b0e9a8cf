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

import torch

from vitgraph.convert import tables
from vitgraph.convert.tables import (FLAT_TOKEN, NO_BATCH_DIM, ONE_ELEMENT, ConvertError,  # noqa: F401
                                     Tower, check_empty, take)

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
