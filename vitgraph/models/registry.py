"""Named ViT sizes. Names follow timm: ``vit_<size>_patch<P>_<image>``; short aliases too."""
from __future__ import annotations

import dataclasses
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
}

ALIASES = {
    "vit_b16_224": "vit_base_patch16_224",
    "vit_l16_224": "vit_large_patch16_224",
    "vit_l14_224": "vit_large_patch14_224",
    "vit_h14_224": "vit_huge_patch14_224",
    "vit_s16_224": "vit_small_patch16_224",
}


def get_arch(name: str) -> ViTArch:
    key = ALIASES.get(name, name)
    if key not in MODELS:
        raise KeyError(f"unknown model; known: {', '.join(sorted([*MODELS, *ALIASES]))}")
    return MODELS[key]


def resolve_arch(model_cfg) -> ViTArch:
    """The registry entry with the config's explicit overrides applied."""
    arch = get_arch(model_cfg.name)
    over = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(ViTArch)
            if getattr(model_cfg, f.name, None) is not None}
    if "hidden_size" in over and "ffn_hidden_size" not in over:
        over["ffn_hidden_size"] = 4 * over["hidden_size"]
    return dataclasses.replace(arch, **over)
