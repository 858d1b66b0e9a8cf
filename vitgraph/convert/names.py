"""Parameter names: vitgraph's (megatron-core's) <-> timm's and Hugging Face's ViT, and the
dispatch over every format (open_clip: vitgraph.convert.openclip; Hugging Face CLIP / SigLIP
pairs and, ``hf_vision``, their vision models alone: vitgraph.convert.clip_hf; timm's
NaFlexVit, ``timm_naflex``: vitgraph.convert.naflex).

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

The tables below are walked by vitgraph.convert.tables (QKV layouts are explained there).
"""
from __future__ import annotations

import re

from vitgraph.convert import tables
from vitgraph.convert.clip_hf import VISION_ALONE, hf_vision_to_vitgraph, vitgraph_to_hf_vision
from vitgraph.convert.naflex import NAFLEX, naflex_to_vitgraph, vitgraph_to_naflex
from vitgraph.convert.openclip import TEXT, VISION, open_clip_to_vitgraph, vitgraph_to_open_clip
from vitgraph.convert.tables import (CLASSIFIER_OPTIONAL, TIMM, ConvertError, Tower,  # noqa: F401
                                     check_empty, num_layers_of, qkv_from_megatron,
                                     qkv_to_megatron)

FORMATS = ("vitgraph", "timm", "hf", "open_clip", "timm_naflex", "hf_vision")

# Hugging Face ViT, the names its hub checkpoints use (transformers 4; transformers 5 renames
# them on load). ViTForImageClassification prefixes the encoder with "vit.".
HF = Tower(
    globals=(
        ("patch_embed.weight", "vit.embeddings.patch_embeddings.projection.weight"),
        ("patch_embed.bias", "vit.embeddings.patch_embeddings.projection.bias"),
        ("cls_token", "vit.embeddings.cls_token"),
        ("pos_embed", "vit.embeddings.position_embeddings"),
        ("final_norm.weight", "vit.layernorm.weight"),
        ("final_norm.bias", "vit.layernorm.bias"),
        ("head.weight", "classifier.weight"),
        ("head.bias", "classifier.bias"),
    ),
    layer=(
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
    ),
    qkv=("attention.attention.query.{kind}", "attention.attention.key.{kind}",
         "attention.attention.value.{kind}"),
    theirs_layers="vit.encoder.layer.{i}.",
    optional=CLASSIFIER_OPTIONAL - {"cls_token"},
)
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


def detect_format(sd: dict) -> str:
    keys = list(sd)

    def has(pattern):
        return any(re.search(pattern, k) for k in keys)

    if has(r"(^|\.)decoder\.layers\.\d+\.self_attention\.linear_qkv\."):
        return "vitgraph"
    if has(r"^embeds\.(proj\.weight|pos_embed)") and has(r"^blocks\.\d+\."):
        return "timm_naflex"  # before timm: the same block names
    if has(r"^blocks\.\d+\.attn\.qkv\."):
        return "timm"
    if has(r"(^|\.)encoder\.layers\.\d+\.self_attn\.q_proj\.") and \
            has(r"^(vision_model\.)?embeddings\.patch_embedding\."):
        return "hf_vision"  # a CLIP / SigLIP (2) vision model, or a pair's vision half
    if has(r"(^|\.)encoder\.layer\.\d+\.attention\.attention\.query\.") or \
            has(r"^(vit\.)?layers\.\d+\.attention\.q_proj\."):
        return "hf"
    if has(r"(^|\.)transformer\.resblocks\.\d+\.attn\.in_proj_weight"):
        return "open_clip"
    raise ConvertError("cannot tell the weights' format from their names (first keys: "
                       f"{', '.join(keys[:5])}); set model.init_format")


def _no_place(fmt: str) -> str:
    return f"in the {fmt} weights; vitgraph's ViT has no place for it"


def _refuse_tower_weights(sd: dict, fmt: str) -> None:
    """A CLIP model's weights (``visual.*`` ...) exported to a classifier format."""
    if any(k.startswith(("visual.", "text.")) for k in sd):
        raise ConvertError(f"these are a CLIP / SigLIP model's weights (visual.*, text.*): "
                           f"{fmt} names a classifier ViT; export them with --format open_clip "
                           f"(or vitgraph)")


# ---------------------------------------------------------------- timm


def timm_to_vitgraph(sd: dict, num_heads: int) -> dict:
    rest = dict(sd)
    out = tables.to_vitgraph(rest, TIMM, num_heads)
    if "head.weight" in out and out["head.weight"].numel() == 0:  # num_classes=0 models
        del out["head.weight"], out["head.bias"]
    check_empty(rest, _no_place("timm"))
    return out


def vitgraph_to_timm(sd: dict, num_heads: int) -> dict:
    _refuse_tower_weights(sd, "timm")
    rest = dict(sd)
    out = tables.from_vitgraph(rest, TIMM, num_heads)
    check_empty(rest, "has no place in timm's VisionTransformer")
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
    rest.pop("vit.embeddings.mask_token", None)  # only for masked-image modelling
    out = tables.to_vitgraph(rest, HF, num_heads)
    check_empty(rest, _no_place("Hugging Face"))
    return out


def vitgraph_to_hf(sd: dict, num_heads: int) -> dict:
    _refuse_tower_weights(sd, "hf")
    if "registers" in sd:
        raise ConvertError("Hugging Face's ViT has no register tokens ('registers')")
    if "cls_token" not in sd:
        raise ConvertError("Hugging Face's ViT needs a class token (model.class_token=true)")
    rest = dict(sd)
    out = tables.from_vitgraph(rest, HF, num_heads)
    check_empty(rest, "has no place in Hugging Face's ViTForImageClassification")
    return out


# ---------------------------------------------------------------- dispatch


def to_vitgraph(sd: dict, fmt: str, num_heads: int, text_heads: int | None = None) -> dict:
    """Any supported format -> vitgraph's full (tp=1) names; ``fmt`` "auto" detects it.
    ``num_heads``: the (image) encoder's attention heads; ``text_heads``: the text tower's, for
    image-text pairs (open_clip)."""
    if fmt == "auto":
        fmt = detect_format(sd)
    if fmt == "vitgraph":
        return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    if fmt == "timm":
        return timm_to_vitgraph(sd, num_heads)
    if fmt == "hf":
        return hf_to_vitgraph(sd, num_heads)
    if fmt == "open_clip":
        return open_clip_to_vitgraph(sd, num_heads, text_heads)
    if fmt == "timm_naflex":
        return naflex_to_vitgraph(sd, num_heads)
    if fmt == "hf_vision":
        return hf_vision_to_vitgraph(sd, num_heads)
    raise ConvertError(f"unknown weights format {fmt!r}; known: auto, {', '.join(FORMATS)}")


def name_in_file(fmt: str, ours: str) -> str:
    """One of our names as a ``fmt`` file calls it, for messages (ours where unknown)."""
    if fmt in ("timm", "hf"):
        return tables.their_name(TIMM if fmt == "timm" else HF, ours) or ours
    if fmt == "timm_naflex":
        if ours in ("pos_embed", "visual.pos_embed"):
            return "embeds.pos_embed"
        return (tables.their_name(NAFLEX, ours)
                or tables.their_name(NAFLEX, ours.removeprefix("visual.")) or ours)
    if fmt == "hf_vision":
        bare = ours.removeprefix("visual.")
        return (tables.their_name(VISION_ALONE["siglip"], bare)
                or tables.their_name(VISION_ALONE["clip"], bare) or ours)
    if fmt == "open_clip":
        return (tables.their_name(VISION, ours) or tables.their_name(VISION, "visual." + ours)
                or tables.their_name(TEXT, ours) or ours)
    return ours


def from_vitgraph(sd: dict, fmt: str, num_heads: int, text_heads: int | None = None) -> dict:
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    if fmt == "vitgraph":
        return sd
    if fmt == "timm":
        return vitgraph_to_timm(sd, num_heads)
    if fmt == "hf":
        return vitgraph_to_hf(sd, num_heads)
    if fmt == "open_clip":
        return vitgraph_to_open_clip(sd, num_heads, text_heads)
    if fmt == "timm_naflex":
        return vitgraph_to_naflex(sd, num_heads)
    if fmt == "hf_vision":  # SigLIP's names (SigLIP 2's: vitgraph_to_hf_vision)
        return vitgraph_to_hf_vision(sd, num_heads, "siglip")
    raise ConvertError(f"unknown weights format {fmt!r}; known: {', '.join(FORMATS)}")
