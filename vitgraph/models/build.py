"""This rank's model, built from a resolved plan (vitgraph.plan.Plan: architecture, layer
spec, precision, token padding, fused norms) and the ``model:`` section.

One ``ViT`` per virtual pipeline stage (one without interleaving); tensor-, sequence- and
pipeline-parallel layers come from megatron-core, and the weights are drawn
layout-independently (vitgraph.models.init). Precision, data parallelism and graphs are
applied afterwards, from outside (vitgraph.parallel.setup.parallelize).

``d`` below is the rank's place in the process groups (vitgraph.parallel.dist.Dist): tp,
pp, vpp, its ranks and device. Nothing here reads the raw config or the environment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.models.fused_act import ACTIVATIONS
from vitgraph.models.init import init_weights
from vitgraph.models.specs import get_layer_spec
from vitgraph.models.vit import ViT

# model.fused_norm=auto: the fused residual add + LayerNorm from this many tokens in a training
# micro-batch. ViT-L/16 step graphs on an H200: at mb 256 (50,432 tokens) 1,276.8 img/s fused
# against 1,259.7; at mb 8 (1,576) 550.7 against 572.4 (the fused kernels' fixed costs:
# partial-sum reductions, small launches). A straight line through the two puts the crossing
# near 11,000 tokens; nothing between them was measured.
FUSED_NORM_MIN_TOKENS = 16384

FP8_RECIPES = {"current": "tensorwise", "delayed": "delayed", "mxfp8": "mxfp8"}


def use_fused_norm(setting: str, fp8: bool, tokens: int) -> bool:
    """ResidualNormLayer (vitgraph.models.specs) for a run: model.fused_norm ``setting``
    (auto | always | never) and a training micro-batch's ``tokens`` (micro-batch x sequence
    length) in the encoder it is for. Never with FP8, whose TE layers normalise themselves."""
    if fp8 or setting == "never":
        return False
    return setting == "always" or tokens >= FUSED_NORM_MIN_TOKENS


def token_multiple(sequence_parallel_tp: int, fp8: bool, micro_batch_size: int) -> int:
    """Pad the token sequence to a multiple of this (1: no padding).

    Sequence parallel splits the tokens over the ``sequence_parallel_tp`` ranks; FP8 GEMMs
    need the token count (sequence x micro-batch) to be a multiple of 16. Padded tokens are
    masked out of attention and dropped before the head (vitgraph.models.vit).
    """
    multiple = sequence_parallel_tp
    if fp8:
        f = 16 // math.gcd(16, micro_batch_size)
        multiple = multiple * f // math.gcd(multiple, f)
    return multiple


@dataclass(frozen=True)
class Recompute:
    """train.recompute resolved: megatron-core's recompute_granularity (None: off),
    recompute_method and recompute_num_layers (full), recompute_modules (selective)."""
    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple | None = None

    @property
    def name(self) -> str:
        return self.granularity or "none"


def recompute_plan(t, layers_per_chunk: int) -> Recompute:
    """train.recompute* (``t``: the train: section) for model chunks of ``layers_per_chunk``
    encoder layers (one pipeline stage's, or one virtual stage's)."""
    if t.recompute == "none":
        return Recompute()
    if t.recompute == "selective":
        return Recompute("selective", modules=tuple(t.recompute_modules or ("core_attn",)))
    n = t.recompute_layers or (1 if t.recompute_method == "uniform" else layers_per_chunk)
    return Recompute("full", t.recompute_method, min(n, layers_per_chunk))


def recompute_kwargs(recompute) -> dict:
    """TransformerConfig's activation-recompute fields from the plan's (``Recompute``; None:
    off). Megatron's TransformerBlock and layers then checkpoint themselves, in the
    same way under every graph scope and pipeline layout."""
    if recompute is None or recompute.granularity is None:
        return {}
    if recompute.granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(recompute.modules))
    return dict(recompute_granularity="full", recompute_method=recompute.method,
                recompute_num_layers=recompute.num_layers)


def encoder_config(arch, *, cuda: bool, dtype: torch.dtype, activation: str = "gelu",
                   layernorm_epsilon: float = 1e-6, init_std: float = 0.02,
                   hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                   gradient_accumulation_fusion: bool = False, **layout) -> TransformerConfig:
    """megatron-core's TransformerConfig of a ViT encoder of ``arch`` (a registry ViTArch) on
    one device; ``layout``: the parallel, FP8 and recompute fields a training plan adds.
    ``gradient_accumulation_fusion``: TE's weight-gradient GEMMs accumulate into megatron
    DDP's ``main_grad`` (without DDP there is none: a plain torch optimizer needs it off)."""
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads, ffn_hidden_size=arch.ffn_hidden_size,
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
        layernorm_epsilon=layernorm_epsilon, add_bias_linear=True,
        activation_func=ACTIVATIONS[activation], gated_linear_unit=False,
        normalization="LayerNorm", init_method_std=init_std,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        # vitgraph.models.init draws the weights again, layout-independently; the layers'
        # own initialisation stays on because it also tags tensor-parallel parameters
        # (partition_dim, used by init, grad clipping and checkpoints)
        use_cpu_initialization=not cuda, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        cuda_graph_scope=[],  # the whole layer: megatron's default, "full", warns it is deprecated
        gradient_accumulation_fusion=gradient_accumulation_fusion, **layout)


def transformer_config(plan, model_cfg, d) -> TransformerConfig:
    """megatron-core's TransformerConfig of the plan's (image) encoder on this rank."""
    fp8 = plan.fp8_recipe
    return encoder_config(
        plan.arch, cuda=d.cuda, dtype=plan.dtype, layernorm_epsilon=model_cfg.layernorm_epsilon,
        init_std=model_cfg.init_std, hidden_dropout=model_cfg.hidden_dropout,
        attention_dropout=model_cfg.attention_dropout,
        # (not under FSDP: its gradients are sharded DTensors, TE's fused wgrad writes main_grad)
        gradient_accumulation_fusion=model_cfg.gradient_accumulation_fusion and d.cuda
        and plan.spec == "te" and not plan.fsdp,
        tensor_model_parallel_size=d.tp, pipeline_model_parallel_size=d.pp,
        virtual_pipeline_model_parallel_size=d.vpp if d.vpp > 1 else None,
        sequence_parallel=plan.sequence_parallel,
        fp8="hybrid" if fp8 else None, fp8_recipe=FP8_RECIPES[fp8] if fp8 else "delayed",
        fp8_amax_history_len=1024 if fp8 == "delayed" else 1,
        fp8_amax_compute_algo="max",
        **recompute_kwargs(plan.recompute),
        **plan.p2p,
    )


def build_model(plan, model_cfg, d, num_classes: int, seed: int) -> list[ViT]:
    """This rank's classifier chunks: one per virtual pipeline stage (a list of one without).
    ``num_classes``: the head's (model.num_classes, when set, wins); ``seed``: the weights'.
    With ``plan.pack`` (data.resolution=native) the chunks take packs as its layout says:
    the images of a pack as attention segments (thd), or with ``pack.padded`` each image in a
    slot of max_len tokens with a key mask (data.packing.layout)."""
    config = transformer_config(plan, model_cfg, d)
    pack = plan.pack
    # the padding mask costs a little in attention: only layers that may see padding get it
    # (eval batches of other sizes are filled up instead: vitgraph.train.evaluate). A thd
    # pack needs none (megatron asks TE for its padding mask type itself)
    padding = plan.pads if pack is None else pack.padded
    layer_spec = get_layer_spec(plan.spec, padding_mask=padding, fused_norm=plan.fused_norm,
                                drop_path_rate=model_cfg.drop_path_rate)
    chunks = []
    for vp in range(d.vpp):
        first = d.is_first_stage and vp == 0
        last = d.is_last_stage and vp == d.vpp - 1
        chunk = ViT(config, layer_spec, plan.arch, model_cfg.num_classes or num_classes,
                    num_registers=model_cfg.num_registers, class_token=model_cfg.class_token,
                    distill_token=model_cfg.distill_token, pool=model_cfg.pool, pre_process=first, post_process=last,
                    vp_stage=vp if d.vpp > 1 else None,
                    pad_to=plan.token_padding if plan.pads else None, pack=pack,
                    pos_interp=plan.pos_interp)
        init_weights(chunk, seed, tp_rank=d.tp_rank, tp_size=d.tp)
        chunks.append(chunk)
    return chunks


def build_tower(tower, *, spec: str, cuda: bool, dtype: torch.dtype = torch.float32,
                seed: int = 0, pack=None, gradient_accumulation_fusion: bool = False) -> ViT:
    """An image tower on its own (vitgraph.tower.VisionTower): the ViT of ``tower`` (a
    registry TowerArch) on one device, ending at its final norm (``head="none"``) or at
    SigLIP's attention pooling (``tower.pool`` map); ``spec``: te | torch (resolved);
    ``pack`` (a vitgraph.data.packing.PackSpec): it takes packs of it too. Its weights are
    drawn as a caption model's or an image-text pair's tower (under ``visual.``)."""
    fusion = gradient_accumulation_fusion and cuda and spec == "te"
    config = encoder_config(tower.vision, cuda=cuda, dtype=dtype, activation=tower.activation,
                            layernorm_epsilon=tower.layernorm_epsilon,
                            gradient_accumulation_fusion=fusion)
    vit = ViT(config, get_layer_spec(spec), tower.vision, 0, num_registers=tower.num_registers,
              class_token=tower.class_token, ln_pre=tower.ln_pre,
              head="map" if tower.pool == "map" else "none", patch_bias=tower.patch_bias,
              pack=pack, pos_interp=tower.pos_interp)
    init_weights(vit, seed, prefix="visual.")
    return vit
