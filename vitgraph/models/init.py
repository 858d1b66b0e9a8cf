"""Initial weights that do not depend on the parallel layout.

Every parameter is drawn whole, from a generator seeded by (run seed, the parameter's global
name), on the CPU in fp32; a tensor-parallel rank then keeps its slice along the parameter's
partition dimension. So the same seed gives the same model for any tp, pp or vpp, for both
layer specs and on CPU or GPU, and a checkpoint's weights can be compared across layouts.

Global names are the tp=1, pp=1 names: ``decoder.layers.<global layer index>.<rest>``.
megatron's fused QKV weight is laid out per head group ([groups, (heads/groups + 2) x head_dim,
width]), so contiguous slices along dim 0 are exactly what tensor parallelism hands each rank.

Distributions (as megatron-core and timm): QKV and FC1 weights N(0, init_std); the output
projections (attention proj, FC2) N(0, init_std / sqrt(2 x layers)); biases 0; norm weights 1;
patch embedding U(+-1/sqrt(fan_in)) as torch's Conv2d; class token, registers and position
embeddings truncated N(0, 0.02); the head 0. CLIP towers (vitgraph.models.clip) add: ``ln_pre``
as the other norms; the projection to the joint embedding (``proj``) N(0, 1/sqrt(width)) with
a zero bias (as open_clip); the token embedding N(0, 0.02); SigLIP's attention-pooling head:
its query truncated N(0, 1/sqrt(width)), linears N(0, init_std), biases 0, norm 1 / 0; the
logit scale and bias take the model's constants. A CLIP model's towers are drawn under the
global names ``visual.<name>`` and ``text.<name>``. A caption model (vitgraph.models.caption)
draws its parts under ``visual.``, ``projector.`` and ``language_model.``, as megatron-core
initialises them: the projector's linears (``encoder.``) N(0, init_std), its second
N(0, init_std / sqrt(2)), biases 0; the GPT's word and position embeddings and output layer
N(0, init_std), its final norm 1 / 0; a vocabulary padded for tp draws the unpadded rows and
zeros after them (``rows``). An unknown parameter is an error, so a new module cannot
silently get layout-dependent weights.
"""
from __future__ import annotations

import math
import zlib

import torch


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Local state-dict name -> global (tp=1, pp=1) name for one model chunk (TE's
    ``_extra_state`` entries left out)."""
    offsets = {}
    decoder = getattr(model, "decoder", None)
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        offsets[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
    out = {}
    for name in model.state_dict(keep_vars=True):
        if name.endswith("_extra_state"):
            continue
        glob = name
        for local, g in offsets.items():
            if name.startswith(local):
                glob = g + name[len(local):]
                break
        out[name] = glob
    return out


def _seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _draw(name: str, shape: list[int], gen: torch.Generator, std: float, layers: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    norm = name.startswith(("final_norm.", "ln_pre.", "decoder.final_layernorm."))
    if leaf == "layer_norm_weight" or norm and leaf == "weight":
        return t.fill_(1.0)
    if leaf in ("layer_norm_bias",) or norm or name.startswith(("head.", "head_dist.")) \
            or name == "proj.bias":
        return t.zero_()
    if name == "proj.weight":  # [embed_dim, width]
        return t.normal_(0.0, shape[1] ** -0.5, generator=gen)
    if name == "token_embed.weight":
        return t.normal_(0.0, 0.02, generator=gen)
    if name.startswith("encoder."):  # a caption model's projector: an MLP, or one linear
        if leaf == "bias":
            return t.zero_()
        if name == "encoder.linear_fc2.weight":
            return t.normal_(0.0, std / math.sqrt(2.0 * layers), generator=gen)
        return t.normal_(0.0, std, generator=gen)
    if name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "output_layer.weight"):  # a GPT language model's
        return t.normal_(0.0, std, generator=gen)
    if name.startswith("attn_pool."):  # SigLIP's attention-pooling head
        if name == "attn_pool.latent":
            return torch.nn.init.trunc_normal_(t, std=shape[-1] ** -0.5, generator=gen)
        if name.startswith("attn_pool.norm."):
            return t.fill_(1.0) if leaf == "weight" else t.zero_()
        if leaf == "bias":
            return t.zero_()
        return t.normal_(0.0, std, generator=gen)
    if name.startswith("decoder.layers."):
        if leaf == "bias":
            return t.zero_()
        if name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
            return t.normal_(0.0, std, generator=gen)
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            return t.normal_(0.0, std / math.sqrt(2.0 * layers), generator=gen)
    if name == "patch_embed.weight":
        bound = 1.0 / math.sqrt(shape[1] * shape[2] * shape[3])
        return t.uniform_(-bound, bound, generator=gen)
    if name in ("pos_embed", "cls_token", "dist_token", "registers"):
        return torch.nn.init.trunc_normal_(t, std=0.02, generator=gen)
    raise ValueError(f"vitgraph.models.init: no initialisation rule for parameter {name!r}")


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, tp_rank: int = 0, tp_size: int = 1,
                 prefix: str = "", rows: dict | None = None) -> None:
    """Fill every parameter of ``model`` (one chunk) from (seed, global name); see above.
    ``prefix``: the model's place in a larger one (``visual.``), part of the seeding name;
    ``rows``: global name -> the rows drawn (those after them zero: a padded vocabulary)."""
    if any(p.is_meta for p in model.parameters()):
        return  # built on the meta device to count its parameters (vitgraph.memory): no data
    names = global_names(model)
    std = model.config.init_method_std
    layers = model.config.num_layers
    for local, p in model.named_parameters():
        name = names[local]
        shape = list(p.shape)
        dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        if dim >= 0 and tp_size > 1:
            shape[dim] *= tp_size
        gen = torch.Generator().manual_seed(_seed(seed, prefix + name))
        if name == "patch_embed.bias":  # torch's Conv2d: the weight's fan-in bounds the bias
            w = model.patch_embed.weight
            bound = 1.0 / math.sqrt(w.shape[1] * w.shape[2] * w.shape[3])
            full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        elif rows and name in rows:
            full = torch.zeros(shape)
            full[:rows[name]] = _draw(name, [rows[name], *shape[1:]], gen, std, layers)
        else:
            full = _draw(name, shape, gen, std, layers)
        if dim >= 0 and tp_size > 1:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        p.copy_(full.to(p.dtype))


@torch.no_grad()
def init_clip_weights(model: torch.nn.Module, seed: int, tp_rank: int = 0,
                      tp_size: int = 1) -> None:
    """A CLIP model (vitgraph.models.clip): both towers, then the logit scale and bias."""
    init_weights(model.visual, seed, tp_rank, tp_size, prefix="visual.")
    init_weights(model.text, seed, tp_rank, tp_size, prefix="text.")
    for name, p in model.named_parameters(recurse=False):
        if p.is_meta:
            continue
        if name == "logit_scale":
            p.fill_(model.init_logit_scale)
        elif name == "logit_bias":
            p.fill_(model.init_logit_bias)
        else:
            raise ValueError(f"vitgraph.models.init: no initialisation rule for parameter {name!r}")
