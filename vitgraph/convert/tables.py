"""Name tables and the one walker that applies them: a foreign format's tensors <-> vitgraph's.

Every converter (timm, Hugging Face ViT / CLIP / SigLIP, open_clip) describes each encoder it
holds as a ``Tower``: its global tensors, the tensors of one layer, and how that layer stores
the attention's QKV projection. ``to_vitgraph`` / ``from_vitgraph`` walk a tower, popping the
source tensors from a dict, so that whatever is left over at the end (``check_empty``) is a key
the other side has no place for.

QKV rows: megatron splits the fused projection per query group, ``[heads, (q, k, v),
head_dim]`` (``SelfAttention.get_query_key_value_tensors``: the output is viewed as
``[groups, (q_per_group + 2) * head_dim]``); timm's ``qkv`` and torch's
``MultiheadAttention.in_proj_*`` (open_clip) are ``[(q, k, v), heads, head_dim]``; Hugging
Face keeps q, k and v apart.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


class ConvertError(ValueError):
    """Weights that cannot be converted or loaded; the message names the key."""


class Reshape(NamedTuple):
    """A tensor stored differently on the two sides: ``to_ours(theirs)``, ``to_theirs(ours)``."""
    to_ours: Callable[[torch.Tensor], torch.Tensor]
    to_theirs: Callable[[torch.Tensor], torch.Tensor]


# a token stored flat, [d] there, [1, 1, d] here (HF CLIP's and open_clip's class embedding)
FLAT_TOKEN = Reshape(lambda t: t.reshape(1, 1, -1), lambda t: t.reshape(-1))
# position embeddings without the batch dimension there, [n, d] vs [1, n, d] here
NO_BATCH_DIM = Reshape(lambda t: t.unsqueeze(0), lambda t: t[0].contiguous())
# a projection applied as ``x @ proj`` there ([d, e]), an nn.Linear weight here ([e, d])
MATMUL_PROJ = Reshape(lambda t: t.t().contiguous(), lambda t: t.t().contiguous())
# a scalar stored as [1] there (Hugging Face SigLIP's logit scale and bias)
ONE_ELEMENT = Reshape(lambda t: t.reshape(()), lambda t: t.reshape(1))


@dataclass(frozen=True)
class Tower:
    """One encoder of a foreign format.

    ``globals``: (ours, theirs) or (ours, theirs, Reshape) full names; ``layer``: (ours,
    theirs) names inside one layer; ``qkv``: their QKV names inside a layer with ``{kind}``
    for weight / bias, one name (fused rows ``[(q, k, v), heads, head_dim]``) or three (q, k
    and v apart); ``theirs_layers`` / ``ours_layers``: the layer prefixes, ``{i}`` the layer
    number (``theirs_layers`` None: the tower has no layers, only globals); ``optional``: our
    names that may be absent on either side.
    """
    globals: tuple
    layer: tuple = ()
    qkv: tuple = ()
    theirs_layers: str | None = None
    ours_layers: str = "decoder.layers.{i}."
    optional: frozenset = frozenset()


def take(rest: dict, key: str, required: bool = True):
    if key not in rest:
        if required:
            raise ConvertError(f"missing key {key!r}")
        return None
    return rest.pop(key)


def check_empty(rest: dict, what: str) -> None:
    """Keys left over after a conversion: an error naming them. ``what`` says whose keys they
    are and where they had no place, e.g. "in the timm weights; vitgraph's ViT has no place for
    it"."""
    if rest:
        extra = sorted(rest)
        more = (f" (and {len(extra) - 1} more: {', '.join(extra[1:6])})" if len(extra) > 1
                else "")
        raise ConvertError(f"unexpected key {extra[0]!r}{more} {what}")


def layer_pattern(template: str) -> str:
    """``"blocks.{i}."`` -> a regex whose group 1 is the layer number."""
    before, after = template.split("{i}")
    return "^" + re.escape(before) + r"(\d+)" + re.escape(after)


def num_layers_of(sd: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(pattern, k))}
    if found and found != set(range(max(found) + 1)):
        raise ConvertError(f"layers {sorted(set(range(max(found) + 1)) - found)} are missing")
    return len(found)


def qkv_to_megatron(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[(q, k, v), heads, head_dim, ...] rows -> megatron's [heads, (q, k, v), head_dim, ...]."""
    rest = w.shape[1:]
    return w.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def qkv_from_megatron(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    return w.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape).contiguous()


def _entries(tower: Tower):
    for e in tower.globals:
        ours, theirs = e[0], e[1]
        yield ours, theirs, (e[2] if len(e) > 2 else None)


def their_name(tower: Tower, ours: str) -> str | None:
    """The name ``tower``'s format gives one of our tensors (q, k and v kept apart: all three),
    or None where it has none."""
    for o, theirs, _ in _entries(tower):
        if o == ours:
            return theirs
    m = re.match(layer_pattern(tower.ours_layers), ours) if tower.theirs_layers else None
    if not m:
        return None
    dst, inner = tower.theirs_layers.format(i=m.group(1)), ours[m.end():]
    for o, theirs in tower.layer:
        if o == inner:
            return dst + theirs
    if inner.startswith("self_attention.linear_qkv."):
        kind = inner.rsplit(".", 1)[1]
        return " / ".join(dst + name.format(kind=kind) for name in tower.qkv)
    return None


def to_vitgraph(rest: dict, tower: Tower, num_heads: int) -> dict:
    """Pop ``tower``'s tensors from ``rest`` (their names) -> {our name: tensor}."""
    out = {}
    for ours, theirs, reshape in _entries(tower):
        v = take(rest, theirs, required=ours not in tower.optional)
        if v is not None:
            out[ours] = reshape.to_ours(v) if reshape else v
    if tower.theirs_layers is None:
        return out
    for i in range(num_layers_of(rest, layer_pattern(tower.theirs_layers))):
        src, dst = tower.theirs_layers.format(i=i), tower.ours_layers.format(i=i)
        for ours, theirs in tower.layer:
            out[dst + ours] = take(rest, src + theirs)
        for kind in ("weight", "bias"):
            parts = [take(rest, src + name.format(kind=kind)) for name in tower.qkv]
            fused = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = qkv_to_megatron(fused, num_heads)
    return out


def from_vitgraph(rest: dict, tower: Tower, num_heads: int) -> dict:
    """Pop ``tower``'s tensors from ``rest`` (our names) -> {their name: tensor}."""
    out = {}
    for ours, theirs, reshape in _entries(tower):
        v = take(rest, ours, required=ours not in tower.optional)
        if v is not None:
            out[theirs] = reshape.to_theirs(v) if reshape else v
    if tower.theirs_layers is None:
        return out
    for i in range(num_layers_of(rest, layer_pattern(tower.ours_layers))):
        src, dst = tower.ours_layers.format(i=i), tower.theirs_layers.format(i=i)
        for ours, theirs in tower.layer:
            out[dst + theirs] = take(rest, src + ours)
        for kind in ("weight", "bias"):
            w = qkv_from_megatron(take(rest, f"{src}self_attention.linear_qkv.{kind}"), num_heads)
            parts = [w] if len(tower.qkv) == 1 else [p.clone() for p in w.chunk(3)]
            for name, part in zip(tower.qkv, parts):
                out[dst + name.format(kind=kind)] = part
    return out


# ---------------------------------------------------------------- timm's ViT

# timm's VisionTransformer names (vitgraph.convert.names); its NaFlexVit has the same layer
# (vitgraph.convert.naflex)
CLASSIFIER_OPTIONAL = frozenset({"cls_token", "registers", "head.weight", "head.bias",
                                  "dist_token", "head_dist.weight", "head_dist.bias"})

TIMM = Tower(
    globals=(
        ("patch_embed.weight", "patch_embed.proj.weight"),
        ("patch_embed.bias", "patch_embed.proj.bias"),
        ("cls_token", "cls_token"),
        ("dist_token", "dist_token"),  # DeiT's distilled models
        ("registers", "reg_token"),
        ("pos_embed", "pos_embed"),
        ("final_norm.weight", "norm.weight"),
        ("final_norm.bias", "norm.bias"),
        ("head.weight", "head.weight"),
        ("head.bias", "head.bias"),
        ("head_dist.weight", "head_dist.weight"),
        ("head_dist.bias", "head_dist.bias"),
    ),
    layer=(
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
    ),
    qkv=("attn.qkv.{kind}",),
    theirs_layers="blocks.{i}.",
    optional=CLASSIFIER_OPTIONAL,
)
