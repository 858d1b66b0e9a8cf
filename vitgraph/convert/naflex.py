"""timm ``NaFlexVit`` state dicts (``naflexvit_*``) <-> vitgraph's ViT, a classifier or a SigLIP
image tower.

Full models only (tensor-parallel size 1). Names on both sides::

    embeds.proj.weight [d, p*p*3] ((row, col, channel))   patch_embed.weight [d, 3, p, p]
    embeds.proj.bias                                       patch_embed.bias
    embeds.cls_token [1, 1, d]                             cls_token
    embeds.reg_token [1, R, d]                             registers
    embeds.pos_embed [1, G, G, d] (patches only)           pos_embed [1, prefix + G*G, d]
    norm_pre.*  (pre_norm=True)                            ln_pre.*
    norm.*                                                 final_norm.*
    attn_pool.{latent,q,kv,proj,norm}.*                    attn_pool.{latent,q,kv,proj,norm}.*
    attn_pool.mlp.fc1.* / attn_pool.mlp.fc2.*              attn_pool.fc1.* / attn_pool.fc2.*
    head.*                                                 head.*
    blocks.{i}.<layer>                                     decoder.layers.{i}.<layer>

A layer is timm's ``Block`` (the classic ViT's names: vitgraph.convert.tables.TIMM). timm's
prefix tokens have no position entry; ours do (the fixed path adds ``pos_embed[:, :prefix]``
to them, the packed path too), so on the way in our prefix entries are zero, and on the way
out they are added into ``cls_token`` / ``reg_token``: the same function both ways, and
timm -> vitgraph -> timm gives back the same tensors. A grid of another size than the model's
is resampled when loaded (vitgraph.convert.weights.load_into_model, the model's
``pos_interp``). A checkpoint without a head and with attention pooling is a SigLIP image
tower (``naflexvit_*_siglip``: timm's SigLIP 2 NaFlex towers have ``num_classes=0``): its
names come out under ``visual.`` for an image-text pair; a classifier's at the top level.

The matching vitgraph model: timm's LayerNorm eps 1e-6 (model.layernorm_epsilon), the
activation (``gelu``; SigLIP towers ``gelu_tanh``), the grid resampled per image as timm's
``pos_embed_use_grid_sample=True`` path with ``pos_embed_interp_mode`` (SigLIP: bilinear;
vitgraph's model.pos_interp).

No counterpart in vitgraph (refused with an error that says why): LayerScale (timm
``init_values``: ``ls1`` / ``ls2``, e.g. naflexvit_base_patch16_gap / _map and the so150m2
variants), a norm after the pooling (``fc_norm``), factorized or no learned position
embeddings, q/k norms, an input or embedding norm, and a position grid that is not square.
A checkpoint without a qkv bias (``qkv_bias=False``) gets zero biases.
"""
from __future__ import annotations

import math
import re

import torch

from vitgraph.convert import tables
from vitgraph.convert.tables import TIMM, ConvertError, Reshape, Tower, check_empty, take


def _patch_to_ours(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 4:  # embed_proj_type='conv': already a convolution's weight
        return t
    d, k = t.shape
    p = math.isqrt(k // 3)
    if 3 * p * p != k:
        raise ConvertError(f"embeds.proj.weight {tuple(t.shape)}: not 3 x p x p inputs")
    return t.reshape(d, p, p, 3).permute(0, 3, 1, 2).contiguous()


def _patch_to_theirs(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1).reshape(t.shape[0], -1).contiguous()


# the linear patch embedding of pre-patchified (row, col, channel) patches <-> a convolution
LINEAR_PATCH = Reshape(_patch_to_ours, _patch_to_theirs)

_POOL = tuple((f"attn_pool.{ours}.{k}", f"attn_pool.{theirs}.{k}")
              for ours, theirs in (("q", "q"), ("kv", "kv"), ("proj", "proj"), ("norm", "norm"),
                                   ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"))
              for k in ("weight", "bias"))
_OPTIONAL = frozenset({"patch_embed.bias", "cls_token", "registers", "ln_pre.weight",
                       "ln_pre.bias", "head.weight", "head.bias", "attn_pool.latent",
                       *(o for o, _ in _POOL)})

NAFLEX = Tower(
    globals=(
        ("patch_embed.weight", "embeds.proj.weight", LINEAR_PATCH),
        ("patch_embed.bias", "embeds.proj.bias"),
        ("cls_token", "embeds.cls_token"),
        ("registers", "embeds.reg_token"),
        ("ln_pre.weight", "norm_pre.weight"),
        ("ln_pre.bias", "norm_pre.bias"),
        ("final_norm.weight", "norm.weight"),
        ("final_norm.bias", "norm.bias"),
        ("attn_pool.latent", "attn_pool.latent"),
        *_POOL,
        ("head.weight", "head.weight"),
        ("head.bias", "head.bias"),
    ),
    layer=TIMM.layer, qkv=TIMM.qkv, theirs_layers="blocks.{i}.", optional=_OPTIONAL)

# what timm can hold that vitgraph cannot: (pattern, why)
_REFUSED = (
    (r"^blocks\.\d+\.ls[12]\.", "LayerScale (timm init_values, e.g. the naflexvit_*_gap, "
                                "_map and so150m2 variants) scales each residual branch by a "
                                "learned vector; vitgraph's megatron layers have no LayerScale"),
    (r"^fc_norm\.", "a LayerNorm after the pooling (timm fc_norm=True); vitgraph normalises "
                    "every token before pooling (final_norm)"),
    (r"^embeds\.pos_embed_[xy]$", "factorized position embeddings; vitgraph's are one learned "
                                  "grid"),
    (r"\.[qk]_norm\.", "q/k normalisation in attention (timm qk_norm=True); vitgraph's "
                       "attention has none"),
    (r"^embeds\.(norm_input|norm)\.", "a norm on the patch embedding's input or output (timm "
                                      "input_norm_layer / embed_norm_layer); vitgraph has none"),
    (r"^attn_pool\.pos_embed$", "position embeddings in the attention pool; vitgraph's has "
                                "none"),
)


def _refuse(sd: dict) -> None:
    found = []
    for pattern, why in _REFUSED:
        hit = sorted(k for k in sd if re.search(pattern, k))
        if hit:
            found.append(f"{hit[0]!r}: {why}")
    if found:
        raise ConvertError("timm NaFlexVit key " + "; and key ".join(found))
    if "embeds.pos_embed" not in sd:
        raise ConvertError("timm NaFlexVit weights without 'embeds.pos_embed': vitgraph needs a "
                           "learned position grid (RoPE or no position embedding cannot be "
                           "converted)")
    latent = sd.get("attn_pool.latent")
    if latent is not None and latent.shape[1] != 1:
        raise ConvertError(f"attn_pool.latent {tuple(latent.shape)}: vitgraph's attention pool "
                           "has one query")


def _num_prefix(sd: dict, cls: str, reg: str) -> int:
    return int(cls in sd) + (sd[reg].shape[1] if reg in sd else 0)


def is_tower(sd: dict) -> bool:
    """A SigLIP image tower: attention pooling and no classifier head (timm num_classes=0)."""
    head = sd.get("head.weight")
    return "attn_pool.latent" in sd and (head is None or head.numel() == 0)


def naflex_to_vitgraph(sd: dict, num_heads: int, tower: bool | None = None) -> dict:
    """A ``NaFlexVit`` state dict -> vitgraph names: a classifier's, or ``visual.*`` for a
    SigLIP image tower (``tower`` None: decided by ``is_tower``). Every key used, or an error."""
    rest = {k: v for k, v in sd.items() if not k.endswith("rope.freqs")}
    _refuse(rest)
    if tower is None:
        tower = is_tower(rest)
    head = rest.get("head.weight")
    if head is not None and head.numel() == 0:  # num_classes=0 saved as empty tensors
        rest.pop("head.weight")
        rest.pop("head.bias", None)
    for k in [k for k in rest if re.match(r"^blocks\.\d+\.attn\.qkv\.weight$", k)]:
        b = k[:-len("weight")] + "bias"
        if b not in rest:  # qkv_bias=False: the same function with zero biases
            rest[b] = torch.zeros(rest[k].shape[0], dtype=rest[k].dtype)
    grid = take(rest, "embeds.pos_embed")
    if grid.ndim != 4 or grid.shape[1] != grid.shape[2]:
        raise ConvertError(f"embeds.pos_embed {tuple(grid.shape)}: vitgraph's position grid is "
                           "square ([1, G, G, d])")
    prefix = _num_prefix(rest, "embeds.cls_token", "embeds.reg_token")
    out = tables.to_vitgraph(rest, NAFLEX, num_heads)
    check_empty(rest, "in the timm NaFlexVit weights; vitgraph's ViT has no place for it")
    g, d = grid.shape[1], grid.shape[3]
    out["pos_embed"] = torch.cat([grid.new_zeros(1, prefix, d), grid.reshape(1, g * g, d)], 1)
    return {f"visual.{k}": v for k, v in out.items()} if tower else out


def vitgraph_to_naflex(sd: dict, num_heads: int) -> dict:
    """vitgraph names (a classifier, an image tower alone, or an image-text pair, whose image
    tower is taken) -> a ``NaFlexVit`` state dict, prefix positions added into the tokens."""
    if any(k.startswith("visual.") for k in sd):
        sd = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    if "proj.weight" in sd:
        raise ConvertError("a CLIP image tower with a projection ('proj.weight') has no place in "
                           "timm's NaFlexVit (SigLIP towers pool by attention, no projection); "
                           "export it with --format open_clip")
    rest = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    pos = take(rest, "pos_embed")
    prefix = _num_prefix(rest, "cls_token", "registers")
    n, d = pos.shape[1] - prefix, pos.shape[2]
    g = math.isqrt(n)
    if g * g != n:
        raise ConvertError(f"pos_embed: {n} patch positions are not a square grid "
                           f"(with {prefix} class/register tokens)")
    at = 0
    for name in ("cls_token", "registers"):
        if name in rest:
            k = rest[name].shape[1]
            rest[name] = rest[name] + pos[:, at:at + k].to(rest[name].dtype)
            at += k
    out = tables.from_vitgraph(rest, NAFLEX, num_heads)
    check_empty(rest, "has no place in timm's NaFlexVit")
    out["embeds.pos_embed"] = pos[:, prefix:].reshape(1, g, g, d).contiguous()
    return out


def export_format(fmt: str, native: bool) -> str:
    """The format ``vitgraph export --format fmt`` writes: a native-resolution run's ``timm``
    export is timm's NaFlexVit (``timm_naflex``), the model that runs it at native sizes."""
    return "timm_naflex" if fmt == "timm" and native else fmt


def naflex_model_args(arch, *, class_token: bool, num_registers: int, pool: str,
                      activation: str, pos_interp: str, num_classes: int,
                      ln_pre: bool = False) -> dict:
    """timm ``NaFlexVit`` keyword arguments (NaFlexVitCfg fields) for weights of this shape:
    ``timm.create_model("naflexvit_base_patch16_siglip", **args)`` builds the same function
    (an entry without LayerScale: timm.create_model drops None-valued arguments, so
    ``init_values=None`` cannot switch an entry's LayerScale off)."""
    d, ffn = arch.hidden_size, arch.ffn_hidden_size
    ratio = ffn / d
    if int(d * ratio) != ffn:  # timm's MLP width is int(dim * mlp_ratio)
        ratio = (ffn + 0.5) / d
    g = arch.image_size // arch.patch_size
    return {"patch_size": arch.patch_size, "embed_dim": d, "depth": arch.num_layers,
            "num_heads": arch.num_heads, "mlp_ratio": ratio, "class_token": class_token,
            "reg_tokens": num_registers,
            "global_pool": {"cls": "token", "mean": "avg", "map": "map"}[pool],
            "fc_norm": False, "pre_norm": ln_pre,
            "act_layer": {"gelu": "gelu", "gelu_tanh": "gelu_tanh",
                          "quick_gelu": "quick_gelu"}[activation],
            "pos_embed_grid_size": (g, g), "pos_embed_interp_mode": pos_interp,
            "pos_embed_use_grid_sample": True, "num_classes": num_classes}
