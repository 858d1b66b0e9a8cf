"""Named ViT sizes. Names follow timm: ``vit_<size>_patch<P>_<image>``; short aliases too."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ViTArch:
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    patch_size: int
    image_size: int

    def num_patches(self, image_size: int | None = None) -> int:
        return ((image_size or self.image_size) // self.patch_size) ** 2


def _arch(width, depth, heads, patch, image, mlp_ratio=4):
    return ViTArch(width, depth, heads, width * mlp_ratio, patch, image)


MODELS: dict[str, ViTArch] = {
    # 2-CPU-core size: trains the embedded shapes data in minutes
    "vit_pico_patch4_32": _arch(64, 4, 4, 4, 32),
    "vit_tiny_patch4_32": _arch(192, 12, 3, 4, 32),
    "vit_tiny_patch16_224": _arch(192, 12, 3, 16, 224),
    "vit_small_patch16_224": _arch(384, 12, 6, 16, 224),
    "vit_base_patch16_224": _arch(768, 12, 12, 16, 224),
    "vit_base_patch14_224": _arch(768, 12, 12, 14, 224),
    "vit_large_patch16_224": _arch(1024, 24, 16, 16, 224),
    "vit_large_patch14_224": _arch(1024, 24, 16, 14, 224),
    "vit_huge_patch14_224": _arch(1280, 32, 16, 14, 224, mlp_ratio=4),
    # SigLIP's shape-optimised 400M tower (timm vit_so400m_patch14_siglip_224 /
    # vit_so400m_patch16_siglip_256; at 384 px, 27 x 27 patches: the image encoder of
    # PaliGemma, LLaVA-OneVision and Idefics)
    "vit_so400m_patch14_224": ViTArch(1152, 27, 16, 4304, 14, 224),
    # SigLIP's 384 px tower (timm vit_so400m_patch14_siglip_384) in whole patches: 27 x 14
    "vit_so400m_patch14_378": ViTArch(1152, 27, 16, 4304, 14, 378),
    "vit_so400m_patch16_256": ViTArch(1152, 27, 16, 4304, 16, 256),
    # big towers (timm vit_giant_patch14_224 / open_clip ViT-bigG-14 / InternViT-6B's geometry);
    # at these sizes train.recompute decides what fits (vitgraph plan)
    "vit_giant_patch14_224": ViTArch(1408, 40, 16, 6144, 14, 224),
    "vit_gigantic_patch14_224": ViTArch(1664, 48, 16, 8192, 14, 224),
    "vit_6b_patch14_224": ViTArch(3200, 45, 25, 12800, 14, 224),
}

ALIASES = {
    "vit_b16_224": "vit_base_patch16_224",
    "vit_l16_224": "vit_large_patch16_224",
    "vit_l14_224": "vit_large_patch14_224",
    "vit_h14_224": "vit_huge_patch14_224",
    "vit_s16_224": "vit_small_patch16_224",
    "vit_so400m14_224": "vit_so400m_patch14_224",
    "vit_so400m14_378": "vit_so400m_patch14_378",
    "vit_so400m16_256": "vit_so400m_patch16_256",
    "vit_g14_224": "vit_giant_patch14_224",
    "vit_bigG14_224": "vit_gigantic_patch14_224",
    "vit_6b14_224": "vit_6b_patch14_224",
}


def get_arch(name: str) -> ViTArch:
    key = ALIASES.get(name, name)
    if key not in MODELS:
        raise KeyError(f"unknown model; known: {', '.join(sorted([*MODELS, *ALIASES]))} "
                       f"(image-text: {', '.join(sorted(CLIP_MODELS))})")
    return MODELS[key]


def resolve_arch(model_cfg) -> ViTArch:
    """The registry entry with the config's explicit overrides applied (for an image-text
    pair: its image tower's)."""
    if model_cfg.name in CLIP_MODELS:
        return resolve_clip_arch(model_cfg).vision
    arch = get_arch(model_cfg.name)
    return _override(arch, model_cfg)


def _override(arch: ViTArch, model_cfg) -> ViTArch:
    over = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(ViTArch)
            if getattr(model_cfg, f.name, None) is not None}
    if "hidden_size" in over and "ffn_hidden_size" not in over:
        over["ffn_hidden_size"] = 4 * over["hidden_size"]
    return dataclasses.replace(arch, **over)


# --- image–text pairs (CLIP, SigLIP): vitgraph.models.clip builds them ---------------------

@dataclass(frozen=True)
class TextArch:
    vocab_size: int
    context_length: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    causal: bool = True      # CLIP: causal; SigLIP: bidirectional
    pool: str = "eot"        # eot: the end-of-text token (argmax of the ids); last: position -1
    proj_bias: bool = False  # SigLIP's text projection has a bias


@dataclass(frozen=True)
class CLIPArch:
    embed_dim: int
    vision: ViTArch
    text: TextArch
    activation: str = "gelu"       # gelu | quick_gelu (OpenAI CLIP) | gelu_tanh (SigLIP)
    layernorm_epsilon: float = 1e-5
    class_token: bool = True
    vision_pool: str = "cls"       # cls | mean | map (SigLIP's attention pooling, no projection)
    ln_pre: bool = True
    patch_bias: bool = False       # OpenAI CLIP's patch embedding has no bias
    init_logit_scale: float = math.log(1 / 0.07)
    init_logit_bias: float | None = None  # set: the model has a learnable bias (SigLIP loss)
    # data.resolution=native, model.pos_interp=auto: how the position grid is resampled
    pos_interp: str = "bicubic"


def _text(width, depth, heads, vocab=49408, context=77, **kw):
    return TextArch(vocab, context, width, depth, heads, 4 * width, **kw)


# the SigLIP layout: no class token, attention pooling, tanh GELU, sigmoid loss with a bias
_SIGLIP = dict(activation="gelu_tanh", layernorm_epsilon=1e-6, class_token=False,
               vision_pool="map", ln_pre=False, patch_bias=True,
               init_logit_scale=math.log(10), init_logit_bias=-10.0, pos_interp="bilinear")

CLIP_MODELS: dict[str, CLIPArch] = {
    # 2-CPU-core pair for the embedded shapes data: byte-level tokenizer (259 ids); its
    # longest caption is 117 bytes, + start and end of text (tests/test_clip.py checks it)
    "clip_tiny_patch4_32": CLIPArch(64, _arch(64, 4, 4, 4, 32),
                                    _text(64, 4, 4, vocab=259, context=128)),
    # the SigLIP layout at the same size (attention pooling, bidirectional text, bias)
    "siglip_tiny_patch4_32": CLIPArch(64, _arch(64, 4, 4, 4, 32),
                                      _text(64, 4, 4, vocab=259, context=128, causal=False,
                                            pool="last", proj_bias=True),
                                      **_SIGLIP),
    # OpenAI CLIP sizes (QuickGELU, as its released weights were trained)
    "clip_vit_b16": CLIPArch(512, _arch(768, 12, 12, 16, 224), _text(512, 12, 8),
                             activation="quick_gelu"),
    "clip_vit_l14": CLIPArch(768, _arch(1024, 24, 16, 14, 224), _text(768, 12, 12),
                             activation="quick_gelu"),
    "clip_vit_l14_336": CLIPArch(768, _arch(1024, 24, 16, 14, 336), _text(768, 12, 12),
                                 activation="quick_gelu"),
    # SigLIP B/16 (open_clip ViT-B-16-SigLIP, HF google/siglip-base-patch16-224): no class
    # token, attention-pooling head (its output is the embedding: no projection), tanh GELU,
    # bidirectional text tower pooled at the last position, sigmoid loss with a bias
    "siglip_vit_b16": CLIPArch(768, _arch(768, 12, 12, 16, 224),
                               _text(768, 12, 12, vocab=32000, context=64, causal=False,
                                     pool="last", proj_bias=True),
                               **_SIGLIP),
    # SigLIP so400m/14 (HF google/siglip-so400m-patch14-224 and -384; open_clip
    # ViT-SO400M-14-SigLIP(-384)): the 1152-wide towers, MLP 4304, 16 text positions at 224
    "siglip_so400m_patch14_224": CLIPArch(1152, ViTArch(1152, 27, 16, 4304, 14, 224),
                                          TextArch(32000, 16, 1152, 27, 16, 4304, causal=False,
                                                   pool="last", proj_bias=True),
                                          **_SIGLIP),
    "siglip_so400m_patch14_384": CLIPArch(1152, ViTArch(1152, 27, 16, 4304, 14, 384),
                                          TextArch(32000, 64, 1152, 27, 16, 4304, causal=False,
                                                   pool="last", proj_bias=True),
                                          **_SIGLIP),
}


def get_clip_arch(name: str) -> CLIPArch:
    if name not in CLIP_MODELS:
        raise KeyError(f"unknown image–text model {name!r}; known: {', '.join(sorted(CLIP_MODELS))}")
    return CLIP_MODELS[name]


def resolve_clip_arch(model_cfg) -> CLIPArch:
    """An image-text pair with the config's model.* size overrides applied to its image tower."""
    arch = get_clip_arch(model_cfg.name)
    return dataclasses.replace(arch, vision=_override(arch.vision, model_cfg))


def resolve_pos_interp(model_cfg) -> str:
    """model.pos_interp with auto resolved: the pair's (bilinear for SigLIP), else bicubic."""
    mode = model_cfg.pos_interp
    if mode != "auto":
        return mode
    if model_cfg.name in CLIP_MODELS:
        return CLIP_MODELS[model_cfg.name].pos_interp
    return "bicubic"


# --- an image tower on its own (vitgraph.tower.VisionTower) ---------------------------------

@dataclass(frozen=True)
class TowerArch:
    """An image tower: the ViT's sizes and what makes it a classifier's, CLIP's or SigLIP's
    tower. ``pool``: ``none`` (tokens only) | ``map`` (SigLIP's attention-pooling head kept
    beside the tokens); ``pos_interp``: how a native-resolution image resamples the position
    grid (vitgraph.models.packed)."""
    vision: ViTArch
    activation: str = "gelu"
    layernorm_epsilon: float = 1e-6
    class_token: bool = True
    num_registers: int = 0
    ln_pre: bool = False
    patch_bias: bool = True
    pool: str = "none"
    pos_interp: str = "bicubic"

    def __post_init__(self):
        for field, value, allowed in (("pool", self.pool, ("none", "map")),
                                      ("activation", self.activation,
                                       ("gelu", "quick_gelu", "gelu_tanh")),
                                      ("pos_interp", self.pos_interp, ("bicubic", "bilinear"))):
            if value not in allowed:
                raise ValueError(f"TowerArch.{field}={value!r}: {' | '.join(allowed)}")

    @property
    def num_prefix(self) -> int:
        return int(self.class_token) + self.num_registers


def tower_arch(name: str, image_size: int | None = None) -> TowerArch:
    """The tower of a registry name: a ViT (a classifier's layout, its head left out) or an
    image-text pair's image tower (its activation, norms and pooling; a projection left out);
    ``image_size``: another input size than the registry's."""
    if name in CLIP_MODELS:
        p = CLIP_MODELS[name]
        tower = TowerArch(p.vision, p.activation, p.layernorm_epsilon, p.class_token, 0,
                          p.ln_pre, p.patch_bias, "map" if p.vision_pool == "map" else "none",
                          p.pos_interp)
    else:
        tower = TowerArch(get_arch(name))
    if image_size is None:
        return tower
    return dataclasses.replace(tower, vision=dataclasses.replace(tower.vision,
                                                                 image_size=image_size))


def tower_of(model_cfg) -> TowerArch:
    """The tower a run's ``model:`` section builds without a head (task.kind=caption's
    ``visual``, a classifier's encoder): the registry's sizes with the config's overrides,
    exact GELU, its class token, registers, eps and model.pos_interp."""
    if model_cfg.name in CLIP_MODELS:
        pair = resolve_clip_arch(model_cfg)
        return dataclasses.replace(tower_arch(model_cfg.name), vision=pair.vision,
                                   pos_interp=resolve_pos_interp(model_cfg))
    return TowerArch(resolve_arch(model_cfg), "gelu", model_cfg.layernorm_epsilon,
                     model_cfg.class_token, model_cfg.num_registers,
                     pos_interp=resolve_pos_interp(model_cfg))
