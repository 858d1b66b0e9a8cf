"""open_clip ``CLIP`` state dicts <-> vitgraph's ``CLIP`` (vitgraph.models.clip).

Full models only (tensor-parallel size 1). open_clip's image tower (``VisionTransformer``) and
its text tower, which ``CLIP`` keeps at the top level, are named::

    visual.conv1.weight (no bias)                    visual.patch_embed.weight
    visual.class_embedding [d]                       visual.cls_token [1, 1, d]
    visual.positional_embedding [n, d]               visual.pos_embed [1, n, d]
    visual.ln_pre.*  (absent with no_ln_pre)         visual.ln_pre.*
    visual.ln_post.*                                 visual.final_norm.*
    visual.proj [d, e]  (pooled @ proj)              visual.proj.weight [e, d]
    token_embedding.weight                           text.token_embed.weight
    positional_embedding [ctx, d]                    text.pos_embed [ctx, d]
    ln_final.*                                       text.final_norm.*
    text_projection [d, e]  (x @ text_projection)    text.proj.weight [e, d]
    logit_scale [], logit_bias [] (if any)           logit_scale, logit_bias
    visual.transformer.resblocks.{i}.<layer>         visual.decoder.layers.{i}.<layer>
    transformer.resblocks.{i}.<layer>                text.decoder.layers.{i}.<layer>

A layer (``ResidualAttentionBlock``): ``ln_1`` / ``ln_2`` are the norms fused into
``linear_qkv`` / ``linear_fc1``; ``attn.in_proj_{weight,bias}`` (torch's MultiheadAttention,
rows ``[(q, k, v), heads, head_dim]``) become megatron's per-head QKV rows; ``attn.out_proj``
is ``linear_proj``, ``mlp.c_fc`` / ``mlp.c_proj`` are ``linear_fc1`` / ``linear_fc2``.

Only the image tower is required: a file with ``visual.*`` alone (or the bare
``VisionTransformer``'s names, ``conv1.weight`` ...) converts to ``visual.*`` alone, and the
text tower and logit scale follow when any of their keys is there.

The matching vitgraph architecture (vitgraph.models.registry ``CLIPArch``): the activation
open_clip was built with (``quick_gelu`` for OpenAI's weights and the ``-quickgelu`` configs,
``gelu`` otherwise), LayerNorm eps 1e-5, ``ln_pre`` (unless ``no_ln_pre``), no patch bias,
class-token pooling (``pool_type='tok'``; ``'avg'`` is vitgraph's ``vision_pool='mean'`` with
``final_ln_after_pool`` off), and the causal text tower pooled at the end-of-text token.

No counterpart in vitgraph (refused with an error that says why): open_clip's attentional
pooler (``visual.attn_pool*``, CoCa: learned queries, ``ln_q`` / ``ln_k``, no MLP; vitgraph's
``attn_pool`` is SigLIP's MAP head), timm or Hugging Face trunks (``visual.trunk.*``,
``text.transformer.*``), layer scale (``ls_1`` / ``ls_2``), the ``scale_attn`` / ``scale_fc``
norms. The other way, vitgraph's classifier ViT (a class head, a patch embedding with a bias,
no ``ln_pre``) and a SigLIP image tower (attention pooling, no class token) have no place in
open_clip's ``VisionTransformer``.
"""
from __future__ import annotations

from vitgraph.convert import tables
from vitgraph.convert.tables import (FLAT_TOKEN, MATMUL_PROJ, NO_BATCH_DIM, ConvertError, Tower,
                                     check_empty)

_LAYER = (
    ("self_attention.linear_qkv.layer_norm_weight", "ln_1.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "ln_1.bias"),
    ("self_attention.linear_proj.weight", "attn.out_proj.weight"),
    ("self_attention.linear_proj.bias", "attn.out_proj.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "ln_2.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "ln_2.bias"),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight"),
    ("mlp.linear_fc1.bias", "mlp.c_fc.bias"),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight"),
    ("mlp.linear_fc2.bias", "mlp.c_proj.bias"),
)
_QKV = ("attn.in_proj_{kind}",)

VISION = Tower(
    globals=(
        ("visual.patch_embed.weight", "visual.conv1.weight"),
        ("visual.cls_token", "visual.class_embedding", FLAT_TOKEN),
        ("visual.pos_embed", "visual.positional_embedding", NO_BATCH_DIM),
        ("visual.ln_pre.weight", "visual.ln_pre.weight"),
        ("visual.ln_pre.bias", "visual.ln_pre.bias"),
        ("visual.final_norm.weight", "visual.ln_post.weight"),
        ("visual.final_norm.bias", "visual.ln_post.bias"),
        ("visual.proj.weight", "visual.proj", MATMUL_PROJ),
    ),
    layer=_LAYER, qkv=_QKV,
    theirs_layers="visual.transformer.resblocks.{i}.",
    ours_layers="visual.decoder.layers.{i}.",
    optional=frozenset({"visual.ln_pre.weight", "visual.ln_pre.bias"}),
)
TEXT = Tower(
    globals=(
        ("text.token_embed.weight", "token_embedding.weight"),
        ("text.pos_embed", "positional_embedding"),
        ("text.final_norm.weight", "ln_final.weight"),
        ("text.final_norm.bias", "ln_final.bias"),
        ("text.proj.weight", "text_projection", MATMUL_PROJ),
        ("logit_scale", "logit_scale"),
        ("logit_bias", "logit_bias"),
    ),
    layer=_LAYER, qkv=_QKV,
    theirs_layers="transformer.resblocks.{i}.",
    ours_layers="text.decoder.layers.{i}.",
    optional=frozenset({"logit_scale", "logit_bias"}),
)
_LOGITS = Tower(globals=TEXT.globals[-2:], optional=TEXT.optional)
_TEXT_KEYS = ("token_embedding.", "positional_embedding", "ln_final.", "text_projection",
              "transformer.resblocks.")

# buffers and OpenAI-checkpoint scalars that carry no weights
_IGNORED = ("attn_mask", "input_resolution", "context_length", "vocab_size")

CLASSIFIER = ("vitgraph's classifier ViT cannot be written as open_clip weights: open_clip's "
              "VisionTransformer has a LayerNorm before the encoder (ln_pre), a patch embedding "
              "without bias and a projection instead of a class head, and the classifier has "
              "none of these. Train a CLIP image tower (vitgraph.models.clip, registry "
              "clip_vit_b16 ...) or export with --format timm | hf | vitgraph")
INTO_CLASSIFIER = ("open_clip weights are a CLIP image tower (a LayerNorm before the encoder, "
                   "ln_pre; a patch embedding without bias; a projection instead of a class "
                   "head): vitgraph's classifier ViT has no ln_pre and a biased patch embedding, "
                   "so it cannot hold them. Load them into a CLIP model or its image tower "
                   "(vitgraph.models.clip.build_clip, registry clip_vit_b16 ...)")


def _normalise(sd: dict) -> dict:
    out = {k: v for k, v in sd.items() if k.split(".")[-1] not in _IGNORED}
    if "conv1.weight" in out and not any(k.startswith("visual.") for k in out):
        out = {f"visual.{k}": v for k, v in out.items()}  # a bare VisionTransformer
    return out


def _refuse_unsupported(rest: dict) -> None:
    def first(prefix):
        return next((k for k in sorted(rest) if k.startswith(prefix)), None)

    if k := first("visual.attn_pool"):
        raise ConvertError(
            f"{k!r}: open_clip's attentional pooler (CoCa: learned queries with ln_q / ln_k and "
            "no MLP) has no counterpart in vitgraph, whose attention-pooling head is SigLIP's "
            "(vitgraph.models.vit.AttentionPool)")
    if k := first("visual.trunk."):
        raise ConvertError(f"{k!r}: this open_clip model's image tower is a timm model "
                           "(visual.trunk.*), not open_clip's VisionTransformer; convert the "
                           "trunk's weights with model.init_format=timm")
    if k := next((k for k in sorted(rest) if ".ls_1." in k or ".ls_2." in k), None):
        raise ConvertError(f"{k!r}: layer scale (open_clip's ls_init_value) has no counterpart "
                           "in vitgraph's layers")


def open_clip_to_vitgraph(sd: dict, vision_heads: int, text_heads: int | None = None) -> dict:
    """An open_clip ``CLIP`` state dict (or its image tower alone) -> vitgraph ``CLIP`` names."""
    rest = _normalise(sd)
    _refuse_unsupported(rest)
    out = tables.to_vitgraph(rest, VISION, vision_heads)
    if any(k.startswith(_TEXT_KEYS) for k in rest):
        if text_heads is None:
            raise ConvertError("these open_clip weights hold a text tower: its attention head "
                               "count is needed (load them into a CLIP model)")
        out.update(tables.to_vitgraph(rest, TEXT, text_heads))
    else:  # the image tower alone (the logit scale and bias, if there, are the pair's)
        out.update(tables.to_vitgraph(rest, _LOGITS, 0))
    check_empty(rest, "in the open_clip weights has no place in vitgraph's CLIP")
    return out


def vitgraph_to_open_clip(sd: dict, vision_heads: int, text_heads: int | None = None) -> dict:
    """vitgraph ``CLIP`` names (both towers, ``visual.*`` alone, or an image tower's own names)
    -> open_clip ``CLIP`` names."""
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    if not any(k.startswith("visual.") for k in rest) and \
            ("proj.weight" in rest or "attn_pool.latent" in rest):
        rest = {f"visual.{k}": v for k, v in rest.items()}  # an image tower on its own
    if not any(k.startswith("visual.") for k in rest):
        raise ConvertError(CLASSIFIER)
    if "visual.attn_pool.latent" in rest:
        raise ConvertError("a SigLIP image tower (attention pooling, no class token) has no place "
                           "in open_clip's VisionTransformer (open_clip's SigLIP models use a "
                           "timm trunk); export it with --format hf or vitgraph")
    if "visual.patch_embed.bias" in rest:
        raise ConvertError("'visual.patch_embed.bias': open_clip's patch embedding (conv1) has "
                           "no bias")
    if "visual.cls_token" not in rest:
        raise ConvertError("open_clip's VisionTransformer always has a class token "
                           "(class_embedding); this image tower has none")
    out = tables.from_vitgraph(rest, VISION, vision_heads)
    if any(k.startswith("text.") for k in rest):
        if text_heads is None:
            raise ConvertError("the text tower's attention head count is needed to export it")
        out.update(tables.from_vitgraph(rest, TEXT, text_heads))
    else:
        out.update(tables.from_vitgraph(rest, _LOGITS, 0))
    check_empty(rest, "has no place in open_clip's CLIP")
    return out
