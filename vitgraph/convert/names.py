"""Parameter names: vitgraph's (megatron-core's) <-> timm's and Hugging Face's ViT.

Everything here works on the *full* model (tensor-parallel size 1, all pipeline stages) with
global layer numbers: ``decoder.layers.{i}`` counts from 0 over the whole encoder.

vitgraph's layer (megatron-core ``TransformerLayer`` with the layer norms fused into the
linears, as TE does)::

    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_{weight,bias}   pre-attention norm
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}               [3d, d], [3d]
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_{weight,bias}               pre-MLP norm
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}

QKV rows: megatron splits the fused projection per query group, ``[heads, (q, k, v),
head_dim]`` (``SelfAttention.get_query_key_value_tensors``: the output is viewed as
``[groups, (q_per_group + 2) * head_dim]``); timm's fused ``qkv`` is ``[(q, k, v), heads,
head_dim]``; Hugging Face keeps q, k and v apart.
"""
from __future__ import annotations

import re

import torch

FORMATS = ("vitgraph", "timm", "hf", "open_clip")


class ConvertError(ValueError):
    """Weights that cannot be converted or loaded; the message names the key."""


# (vitgraph name, timm name); "{i}" is the layer number. QKV is handled apart.
_TIMM_GLOBAL = [
    ("patch_embed.weight", "patch_embed.proj.weight"),
    ("patch_embed.bias", "patch_embed.proj.bias"),
    ("cls_token", "cls_token"),
    ("registers", "reg_token"),
    ("pos_embed", "pos_embed"),
    ("final_norm.weight", "norm.weight"),
    ("final_norm.bias", "norm.bias"),
    ("head.weight", "head.weight"),
    ("head.bias", "head.bias"),
]
_TIMM_LAYER = [
    ("self_attention.linear_qkv.layer_norm_weight", "norm1.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "norm1.bias"),
    ("self_attention.linear_proj.weight", "attn.proj.weight"),
    ("self_attention.linear_proj.bias", "attn.proj.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "norm2.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "norm2.bias"),
    ("mlp.linear_fc1.weight", "mlp.fc1.weight"),
    ("mlp.linear_fc1.bias", "mlp.fc1.bias"),
    ("mlp.linear_fc2.weight", "mlp.fc2.weight"),
    ("mlp.linear_fc2.bias", "mlp.fc2.bias"),
]

# Hugging Face ViT, the names its hub checkpoints use (transformers 4; transformers 5 renames
# them on load). ViTForImageClassification prefixes the encoder with "vit.".
_HF_GLOBAL = [
    ("patch_embed.weight", "vit.embeddings.patch_embeddings.projection.weight"),
    ("patch_embed.bias", "vit.embeddings.patch_embeddings.projection.bias"),
    ("cls_token", "vit.embeddings.cls_token"),
    ("pos_embed", "vit.embeddings.position_embeddings"),
    ("final_norm.weight", "vit.layernorm.weight"),
    ("final_norm.bias", "vit.layernorm.bias"),
    ("head.weight", "classifier.weight"),
    ("head.bias", "classifier.bias"),
]
_HF_LAYER = [
    ("self_attention.linear_qkv.layer_norm_weight", "layernorm_before.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "layernorm_before.bias"),
    ("self_attention.linear_proj.weight", "attention.output.dense.weight"),
    ("self_attention.linear_proj.bias", "attention.output.dense.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "layernorm_after.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "layernorm_after.bias"),
    ("mlp.linear_fc1.weight", "intermediate.dense.weight"),
    ("mlp.linear_fc1.bias", "intermediate.dense.bias"),
    ("mlp.linear_fc2.weight", "output.dense.weight"),
    ("mlp.linear_fc2.bias", "output.dense.bias"),
]
_HF_QKV = ("attention.attention.query", "attention.attention.key", "attention.attention.value")
# transformers 5 module names -> the hub names above (applied in this order)
_HF5_RENAMES = [
    (r"\.layers\.(\d+)\.", r".encoder.layer.\1."),
    (r"\.attention\.q_proj\.", ".attention.attention.query."),
    (r"\.attention\.k_proj\.", ".attention.attention.key."),
    (r"\.attention\.v_proj\.", ".attention.attention.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
]
# a ViTModel's pooler (dense + tanh on the class token) has no counterpart in vitgraph and no
# use in classification (ViTForImageClassification does not use it either): dropped on import
_HF_IGNORED = re.compile(r"^(vit\.)?pooler\.")

_VG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def num_layers_of(sd: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(pattern, k))}
    if found and found != set(range(max(found) + 1)):
        raise ConvertError(f"layers {sorted(set(range(max(found) + 1)) - found)} are missing")
    return len(found)


def detect_format(sd: dict) -> str:
    keys = list(sd)

    def has(pattern):
        return any(re.search(pattern, k) for k in keys)

    if has(r"^decoder\.layers\.\d+\.self_attention\.linear_qkv\."):
        return "vitgraph"
    if has(r"^blocks\.\d+\.attn\.qkv\."):
        return "timm"
    if has(r"(^|\.)encoder\.layer\.\d+\.attention\.attention\.query\.") or \
            has(r"^(vit\.)?layers\.\d+\.attention\.q_proj\."):
        return "hf"
    if has(r"(^|\.)transformer\.resblocks\.\d+\.attn\.in_proj_weight"):
        return "open_clip"
    raise ConvertError("cannot tell the weights' format from their names (first keys: "
                       f"{', '.join(keys[:5])}); set model.init_format")


# ---------------------------------------------------------------- QKV layouts


def qkv_to_megatron(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[(q, k, v), heads, head_dim, ...] rows -> megatron's [heads, (q, k, v), head_dim, ...]."""
    rest = w.shape[1:]
    return w.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def qkv_from_megatron(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


# ---------------------------------------------------------------- timm


def _pop(rest: dict, key: str, required: bool = True):
    if key not in rest:
        if required:
            raise ConvertError(f"missing key {key!r}")
        return None
    return rest.pop(key)


def _check_empty(rest: dict, fmt: str) -> None:
    if rest:
        extra = sorted(rest)
        raise ConvertError(f"unexpected key {extra[0]!r} in the {fmt} weights"
                           + (f" (and {len(extra) - 1} more: {', '.join(extra[1:6])})"
                              if len(extra) > 1 else "")
                           + "; vitgraph's ViT has no place for it")


def _from_table(rest: dict, table_global, table_layer, layer_prefix: str, num_layers: int,
                optional=("cls_token", "registers", "head.weight", "head.bias")) -> dict:
    out = {}
    for ours, theirs in table_global:
        v = _pop(rest, theirs, required=ours not in optional)
        if v is not None:
            out[ours] = v
    for i in range(num_layers):
        for ours, theirs in table_layer:
            out[f"decoder.layers.{i}.{ours}"] = _pop(rest, f"{layer_prefix}{i}.{theirs}")
    return out


def timm_to_vitgraph(sd: dict, num_heads: int) -> dict:
    rest = dict(sd)
    n = num_layers_of(rest, r"^blocks\.(\d+)\.")
    qkv = {}
    for i in range(n):
        for kind in ("weight", "bias"):
            qkv[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = qkv_to_megatron(
                _pop(rest, f"blocks.{i}.attn.qkv.{kind}"), num_heads)
    out = _from_table(rest, _TIMM_GLOBAL, _TIMM_LAYER, "blocks.", n)
    if "head.weight" in out and out["head.weight"].numel() == 0:  # num_classes=0 models
        del out["head.weight"], out["head.bias"]
    _check_empty(rest, "timm")
    return {**out, **qkv}


def vitgraph_to_timm(sd: dict, num_heads: int) -> dict:
    out = {}
    for ours, theirs in _TIMM_GLOBAL:
        if ours in sd:
            out[theirs] = sd[ours]
    for i in range(num_layers_of(sd, _VG_LAYER.pattern)):
        p = f"decoder.layers.{i}."
        for ours, theirs in _TIMM_LAYER:
            out[f"blocks.{i}.{theirs}"] = sd[p + ours]
        for kind in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{kind}"] = qkv_from_megatron(
                sd[p + f"self_attention.linear_qkv.{kind}"], num_heads)
    return out


# ---------------------------------------------------------------- Hugging Face


def _hf_normalise(sd: dict) -> dict:
    """Hub names with the "vit." prefix, whatever transformers version or class wrote them."""
    out = {}
    for k, v in sd.items():
        if _HF_IGNORED.match(k):
            continue
        if not k.startswith(("vit.", "classifier.")):
            k = "vit." + k  # ViTModel: no prefix
        for pat, rep in _HF5_RENAMES:
            k = re.sub(pat, rep, k)
        out[k] = v
    return out


def hf_to_vitgraph(sd: dict, num_heads: int) -> dict:
    rest = _hf_normalise(sd)
    n = num_layers_of(rest, r"^vit\.encoder\.layer\.(\d+)\.")
    qkv = {}
    for i in range(n):
        p = f"vit.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            stacked = torch.cat([_pop(rest, f"{p}{name}.{kind}") for name in _HF_QKV])
            qkv[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = qkv_to_megatron(
                stacked, num_heads)
    out = _from_table(rest, _HF_GLOBAL, _HF_LAYER, "vit.encoder.layer.", n)
    rest.pop("vit.embeddings.mask_token", None)  # only for masked-image modelling
    _check_empty(rest, "Hugging Face")
    return {**out, **qkv}


def vitgraph_to_hf(sd: dict, num_heads: int) -> dict:
    if "registers" in sd:
        raise ConvertError("Hugging Face's ViT has no register tokens ('registers')")
    if "cls_token" not in sd:
        raise ConvertError("Hugging Face's ViT needs a class token (model.class_token=true)")
    out = {}
    for ours, theirs in _HF_GLOBAL:
        if ours in sd:
            out[theirs] = sd[ours]
    for i in range(num_layers_of(sd, _VG_LAYER.pattern)):
        p, q = f"decoder.layers.{i}.", f"vit.encoder.layer.{i}."
        for ours, theirs in _HF_LAYER:
            out[q + theirs] = sd[p + ours]
        for kind in ("weight", "bias"):
            w = qkv_from_megatron(sd[p + f"self_attention.linear_qkv.{kind}"], num_heads)
            for name, part in zip(_HF_QKV, w.chunk(3)):
                out[f"{q}{name}.{kind}"] = part.contiguous()
    return out


# ---------------------------------------------------------------- dispatch


def to_vitgraph(sd: dict, fmt: str, num_heads: int) -> dict:
    """Any supported format -> vitgraph's full (tp=1) names; ``fmt`` "auto" detects it."""
    if fmt == "auto":
        fmt = detect_format(sd)
    if fmt == "vitgraph":
        return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    if fmt == "timm":
        return timm_to_vitgraph(sd, num_heads)
    if fmt == "hf":
        return hf_to_vitgraph(sd, num_heads)
    if fmt == "open_clip":
        raise ConvertError(_OPEN_CLIP)
    raise ConvertError(f"unknown weights format {fmt!r}; known: auto, {', '.join(FORMATS)}")


def from_vitgraph(sd: dict, fmt: str, num_heads: int) -> dict:
    if fmt == "vitgraph":
        return dict(sd)
    if fmt == "timm":
        return vitgraph_to_timm(sd, num_heads)
    if fmt == "hf":
        return vitgraph_to_hf(sd, num_heads)
    if fmt == "open_clip":
        raise ConvertError(_OPEN_CLIP)
    raise ConvertError(f"unknown weights format {fmt!r}; known: {', '.join(FORMATS)}")


_OPEN_CLIP = ("open_clip weights are CLIP image towers: a pre-norm (ln_pre), a patch "
              "embedding without bias, QuickGELU and a projection instead of a class head. "
              "vitgraph's classifier ViT has none of these; the open_clip converter comes with "
              "the CLIP tower")
