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
(vitgraph.convert.names.qkv_to_megatron). The matching vitgraph architecture: QuickGELU
(HF's default ``hidden_act``), LayerNorm eps 1e-5, ``ln_pre``, a patch embedding without bias,
class-token pooling, causal text tower pooled at the end of text (HF takes the first
``eos_token_id``, or the largest id for configs with ``eos_token_id == 2``; the byte tokenizer's
end of text is both).

``SiglipModel``: no class token, no ``ln_pre``, a patch bias; the vision ``head`` (probe,
``nn.MultiheadAttention`` with packed q/k/v, layernorm, mlp) is vitgraph's ``attn_pool``
(``latent``, ``q``, ``kv``, ``proj``, ``norm``, ``fc1``, ``fc2``); the text ``head`` (with a
bias) is ``text.proj``; ``logit_scale`` / ``logit_bias`` are [1] there, scalars here. The
matching architecture: tanh GELU, eps 1e-6, bidirectional text pooled at the last position.
open_clip names are not converted yet.
"""
from __future__ import annotations

import re

import torch

from vitgraph.convert.names import ConvertError, qkv_from_megatron, qkv_to_megatron

_TOWERS = (("vision_model", "visual"), ("text_model", "text"))

_GLOBAL = [
    ("visual.patch_embed.weight", "vision_model.embeddings.patch_embedding.weight"),
    ("visual.ln_pre.weight", "vision_model.pre_layrnorm.weight"),
    ("visual.ln_pre.bias", "vision_model.pre_layrnorm.bias"),
    ("visual.final_norm.weight", "vision_model.post_layernorm.weight"),
    ("visual.final_norm.bias", "vision_model.post_layernorm.bias"),
    ("visual.proj.weight", "visual_projection.weight"),
    ("text.token_embed.weight", "text_model.embeddings.token_embedding.weight"),
    ("text.pos_embed", "text_model.embeddings.position_embedding.weight"),
    ("text.final_norm.weight", "text_model.final_layer_norm.weight"),
    ("text.final_norm.bias", "text_model.final_layer_norm.bias"),
    ("text.proj.weight", "text_projection.weight"),
    ("logit_scale", "logit_scale"),
]
_LAYER = [
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
]


_SIGLIP_GLOBAL = [
    ("visual.patch_embed.weight", "vision_model.embeddings.patch_embedding.weight"),
    ("visual.patch_embed.bias", "vision_model.embeddings.patch_embedding.bias"),
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
    ("text.token_embed.weight", "text_model.embeddings.token_embedding.weight"),
    ("text.pos_embed", "text_model.embeddings.position_embedding.weight"),
    ("text.final_norm.weight", "text_model.final_layer_norm.weight"),
    ("text.final_norm.bias", "text_model.final_layer_norm.bias"),
    ("text.proj.weight", "text_model.head.weight"),
    ("text.proj.bias", "text_model.head.bias"),
]


def _layers(sd: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(pattern, k))}
    if found != set(range(len(found))):
        raise ConvertError(f"layers {sorted(set(range(max(found) + 1)) - found)} are missing")
    return len(found)


def _take(rest: dict, key: str) -> torch.Tensor:
    if key not in rest:
        raise ConvertError(f"missing key {key!r}")
    return rest.pop(key)


def _layers_to_vitgraph(rest: dict, out: dict, vision_heads: int, text_heads: int) -> None:
    for (theirs, ours), heads in zip(_TOWERS, (vision_heads, text_heads)):
        n = _layers(rest, rf"^{theirs}\.encoder\.layers\.(\d+)\.")
        for i in range(n):
            src, dst = f"{theirs}.encoder.layers.{i}.", f"{ours}.decoder.layers.{i}."
            for o, t in _LAYER:
                out[dst + o] = _take(rest, src + t)
            for kind in ("weight", "bias"):
                qkv = torch.cat([_take(rest, f"{src}self_attn.{p}_proj.{kind}")
                                 for p in ("q", "k", "v")])
                out[f"{dst}self_attention.linear_qkv.{kind}"] = qkv_to_megatron(qkv, heads)


def _layers_from_vitgraph(rest: dict, out: dict, vision_heads: int, text_heads: int) -> None:
    for (theirs, ours), heads in zip(_TOWERS, (vision_heads, text_heads)):
        n = _layers(rest, rf"^{ours}\.decoder\.layers\.(\d+)\.")
        for i in range(n):
            src, dst = f"{ours}.decoder.layers.{i}.", f"{theirs}.encoder.layers.{i}."
            for o, t in _LAYER:
                out[dst + t] = _take(rest, src + o)
            for kind in ("weight", "bias"):
                qkv = qkv_from_megatron(_take(rest, f"{src}self_attention.linear_qkv.{kind}"), heads)
                for p, part in zip(("q", "k", "v"), qkv.chunk(3)):
                    out[f"{dst}self_attn.{p}_proj.{kind}"] = part.clone()


def _done(rest: dict, what: str) -> None:
    if rest:
        raise ConvertError(f"{what}: {', '.join(sorted(rest)[:5])}")


def hf_clip_to_vitgraph(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """A ``CLIPModel`` state dict -> vitgraph ``CLIP`` names (every key used, or an error)."""
    rest = {k: v for k, v in sd.items() if not k.endswith("position_ids")}  # buffers
    out = {ours: _take(rest, theirs) for ours, theirs in _GLOBAL}
    out["visual.cls_token"] = _take(rest, "vision_model.embeddings.class_embedding").view(1, 1, -1)
    out["visual.pos_embed"] = _take(
        rest, "vision_model.embeddings.position_embedding.weight").unsqueeze(0)
    _layers_to_vitgraph(rest, out, vision_heads, text_heads)
    _done(rest, "unexpected keys in the CLIPModel weights")
    return out


def vitgraph_to_hf_clip(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """vitgraph ``CLIP`` names -> a ``CLIPModel`` state dict (without HF's position_ids)."""
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = {theirs: _take(rest, ours) for ours, theirs in _GLOBAL}
    out["vision_model.embeddings.class_embedding"] = _take(rest, "visual.cls_token").reshape(-1)
    out["vision_model.embeddings.position_embedding.weight"] = _take(rest, "visual.pos_embed")[0]
    _layers_from_vitgraph(rest, out, vision_heads, text_heads)
    _done(rest, "vitgraph keys with no CLIPModel place")
    return out


def hf_siglip_to_vitgraph(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """A ``SiglipModel`` state dict -> vitgraph ``CLIP`` names (every key used, or an error)."""
    rest = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    out = {ours: _take(rest, theirs) for ours, theirs in _SIGLIP_GLOBAL}
    out["visual.pos_embed"] = _take(
        rest, "vision_model.embeddings.position_embedding.weight").unsqueeze(0)
    w = _take(rest, "vision_model.head.attention.in_proj_weight")
    b = _take(rest, "vision_model.head.attention.in_proj_bias")
    d = w.shape[1]
    out["visual.attn_pool.q.weight"], out["visual.attn_pool.kv.weight"] = w[:d], w[d:]
    out["visual.attn_pool.q.bias"], out["visual.attn_pool.kv.bias"] = b[:d], b[d:]
    out["logit_scale"] = _take(rest, "logit_scale").reshape(())
    out["logit_bias"] = _take(rest, "logit_bias").reshape(())
    _layers_to_vitgraph(rest, out, vision_heads, text_heads)
    _done(rest, "unexpected keys in the SiglipModel weights")
    return out


def vitgraph_to_hf_siglip(sd: dict, vision_heads: int, text_heads: int) -> dict:
    """vitgraph ``CLIP`` names (a SigLIP pair) -> a ``SiglipModel`` state dict."""
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    out = {theirs: _take(rest, ours) for ours, theirs in _SIGLIP_GLOBAL}
    out["vision_model.embeddings.position_embedding.weight"] = _take(rest, "visual.pos_embed")[0]
    out["vision_model.head.attention.in_proj_weight"] = torch.cat(
        [_take(rest, "visual.attn_pool.q.weight"), _take(rest, "visual.attn_pool.kv.weight")])
    out["vision_model.head.attention.in_proj_bias"] = torch.cat(
        [_take(rest, "visual.attn_pool.q.bias"), _take(rest, "visual.attn_pool.kv.bias")])
    out["logit_scale"] = _take(rest, "logit_scale").reshape(1)
    out["logit_bias"] = _take(rest, "logit_bias").reshape(1)
    _layers_from_vitgraph(rest, out, vision_heads, text_heads)
    _done(rest, "vitgraph keys with no SiglipModel place")
    return out
