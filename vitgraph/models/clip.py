"""CLIP / SigLIP: an image tower (the classifier's ``ViT`` with ``ln_pre`` and a projection
head), a text tower (vitgraph.models.text), a learnable logit scale and, for the sigmoid loss,
a learnable logit bias.

``forward(images, tokens)`` returns the L2-normalised image and text features, the logit
scale ``exp(logit_scale)`` and, when the model has one, the bias. As in open_clip the scale
is clamped to at most 100 by clamping the parameter to [0, ln 100] after each optimizer step
(``clamp_logit_scale_``), so its gradient is never cut off in the forward pass.

SigLIP's image tower is the same ViT with ``head="map"`` (attention pooling; its output is
the embedding, no projection). Not yet: pipeline parallelism for the pair of towers.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.models.fused_act import ACTIVATIONS, gelu_tanh, quick_gelu  # noqa: F401
from vitgraph.models.init import init_clip_weights
from vitgraph.models.registry import CLIPArch, get_clip_arch
from vitgraph.models.specs import get_layer_spec
from vitgraph.models.text import TextTransformer
from vitgraph.models.vit import ViT

# task.lock_image (LiT): the parameter names of the pair's image tower, frozen by
# vitgraph.models.freeze; the logit scale and bias and the text tower train
IMAGE_TOWER = "visual.*"

MAX_LOGIT_SCALE = math.log(100.0)


class CLIP(MegatronModule):
    def __init__(self, visual: ViT, text: TextTransformer, init_logit_scale: float,
                 init_logit_bias: float | None = None):
        super().__init__(config=visual.config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = self.post_process = True  # one pipeline stage: takes the images
        self.share_embeddings_and_output_weights = False
        self.visual, self.text = visual, text
        self.init_logit_scale, self.init_logit_bias = init_logit_scale, init_logit_bias
        device = next(visual.parameters()).device
        self.logit_scale = torch.nn.Parameter(torch.tensor(float(init_logit_scale), device=device))
        self.logit_bias = None
        if init_logit_bias is not None:
            self.logit_bias = torch.nn.Parameter(torch.tensor(float(init_logit_bias), device=device))

    def set_input_tensor(self, input_tensor) -> None:
        """megatron's schedules call it on every stage; the pair runs on one stage, so there is
        never an activation from a previous stage to take."""
        if input_tensor is not None and any(t is not None for t in input_tensor):
            raise RuntimeError("CLIP / SigLIP run on one pipeline stage (parallel.pp=1)")

    @property
    def has_bias(self) -> bool:
        return self.logit_bias is not None

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.visual(images)
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        x = self.text(tokens)
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, images: torch.Tensor, tokens: torch.Tensor):
        out = (self.encode_image(images), self.encode_text(tokens), self.logit_scale.exp())
        if self.has_bias:
            out = (*out, self.logit_bias)
        return out

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Call after each optimizer step (open_clip does; the contrastive task does): the
        scale stays in [1, 100]. A mixed-precision optimizer's fp32 main copy is clamped too,
        or the next step would copy the unclamped value back."""
        p = self.logit_scale
        for t in (p, getattr(p, "main_param", None)):
            if t is not None:
                t.clamp_(0.0, MAX_LOGIT_SCALE)


def tower_config(base: TransformerConfig, *, hidden_size: int, num_layers: int, num_heads: int,
                 ffn_hidden_size: int, activation: str, eps: float) -> TransformerConfig:
    """``base`` (precision, parallel layout, dropout ...) resized for one tower. The fields that
    TransformerConfig derives from the sizes are cleared so that they are derived again; a
    count of layers to recompute is capped at the tower's depth."""
    recompute = base.recompute_num_layers and min(base.recompute_num_layers, num_layers)
    return dataclasses.replace(
        base, recompute_num_layers=recompute or None, hidden_size=hidden_size,
        num_layers=num_layers, num_attention_heads=num_heads,
        ffn_hidden_size=ffn_hidden_size, kv_channels=None, num_query_groups=None,
        moe_ffn_hidden_size=None, init_method=None, output_layer_init_method=None,
        activation_func=ACTIVATIONS[activation], layernorm_epsilon=eps)


def build_clip(arch: CLIPArch | str, base: TransformerConfig, spec: str, *, seed: int = 0,
               tp_rank: int = 0, tp_size: int = 1, context_length: int | None = None,
               pad_to=None, init_logit_bias: float | None = None,
               fused_norm: bool = False, drop_path_rate: float = 0.0, pack=None,
               pos_interp: str = "bicubic") -> CLIP:
    """One CLIP model (both towers on one pipeline stage), weights drawn layout-independently.

    ``spec``: ``te`` | ``torch`` (resolved); ``context_length``: the text positions (the
    registry's by default); ``pad_to``: the image tower's token padding (vitgraph.models.vit);
    ``fused_norm``: both towers' layers are ResidualNormLayer (vitgraph.models.specs);
    ``init_logit_bias``: give a model without one a logit bias (to train it with the SigLIP
    loss); ``drop_path_rate``: the image tower's stochastic depth (model.drop_path_rate; the
    text tower has none); ``pack`` (a vitgraph.data.packing.PackSpec): the image tower takes
    packs of it (native resolution; its padded slots with a key mask), its positions
    resampled by ``pos_interp``."""
    name = arch if isinstance(arch, str) else None
    if isinstance(arch, str):
        arch = get_clip_arch(arch)
    if arch.vision_pool == "map" and arch.embed_dim != arch.vision.hidden_size:
        raise ValueError(f"{name or 'this model'}: an attention-pooling image tower has no "
                         f"projection: embed_dim {arch.embed_dim} must equal the width "
                         f"{arch.vision.hidden_size}")
    if arch.activation not in ACTIVATIONS:
        raise ValueError(f"activation={arch.activation!r}; known: {', '.join(ACTIVATIONS)}")
    if base.pipeline_model_parallel_size > 1:
        raise NotImplementedError("CLIP / SigLIP towers run on one pipeline stage: parallel.pp "
                                  "must be 1")
    text_arch = arch.text
    if context_length is not None:
        text_arch = dataclasses.replace(text_arch, context_length=context_length)
    v, t = arch.vision, text_arch
    vcfg = tower_config(base, hidden_size=v.hidden_size, num_layers=v.num_layers,
                        num_heads=v.num_heads, ffn_hidden_size=v.ffn_hidden_size,
                        activation=arch.activation, eps=arch.layernorm_epsilon)
    tcfg = tower_config(base, hidden_size=t.hidden_size, num_layers=t.num_layers,
                        num_heads=t.num_heads, ffn_hidden_size=t.ffn_hidden_size,
                        activation=arch.activation, eps=arch.layernorm_epsilon)
    mapped = arch.vision_pool == "map"
    masked = pad_to is not None or (pack is not None and pack.padded)
    visual = ViT(vcfg, get_layer_spec(spec, padding_mask=masked,
                                      fused_norm=fused_norm, drop_path_rate=drop_path_rate),
                 v, 0,
                 class_token=arch.class_token, pool="mean" if mapped else arch.vision_pool,
                 pad_to=pad_to, ln_pre=arch.ln_pre, head="map" if mapped else "proj",
                 embed_dim=arch.embed_dim,
                 patch_bias=arch.patch_bias, pack=pack, pos_interp=pos_interp)
    text = TextTransformer(tcfg, get_layer_spec(spec, causal=t.causal, fused_norm=fused_norm), t,
                           arch.embed_dim)
    bias = arch.init_logit_bias if init_logit_bias is None else init_logit_bias
    model = CLIP(visual, text, arch.init_logit_scale, bias)
    init_clip_weights(model, seed, tp_rank=tp_rank, tp_size=tp_size)
    return model
