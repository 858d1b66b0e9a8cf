"""What an export says beside its weights: the input preprocessing and the class names.

vitgraph's held-out images are decoded to RGB, their shorter side resized to the model's image
size (bicubic) and center-cropped square (``vitgraph.data.decode.resize_crop``; shards
the same), scaled to [0, 1] and normalised with mean = std = 0.5 per channel
(``vitgraph.data.loader.to_model_input``). A run whose ``data.render_size`` differs from the
image size resizes once more (bilinear); an export states the final size.

Every format carries it in the safetensors metadata (``preprocessing``, ``classes``, JSON);
beside the file, ``hf`` writes ``config.json`` (``ViTConfig``, ``id2label`` / ``label2id``)
and ``preprocessor_config.json``, ``timm`` writes ``config.json`` (timm's hub layout:
``architecture``, ``model_args``, ``pretrained_cfg``, ``label_names``; with the weights named
``model.safetensors``, ``timm.create_model("local-dir:DIR", pretrained=True)`` builds it).
A ``task.kind: caption`` run's ``hf`` export is its tower alone, as transformers'
``SiglipVisionModel`` or ``Siglip2VisionModel`` (``hf_vision_export``): ``config.json`` and
``preprocessor_config.json`` beside it.
The class names are the run's data's (``classes.json`` in the run directory, written at the
start of training); without them (or with another count than the head has) they are
``LABEL_<i>`` for Hugging Face and left out for timm.
"""
from __future__ import annotations

import json
from pathlib import Path

from vitgraph.convert.clip_hf import HF_VISION_CLASSES, hf_vision_config, vitgraph_to_hf_vision
from vitgraph.convert.naflex import naflex_model_args
from vitgraph.convert.tables import ConvertError
from vitgraph.data.loader import MEAN, STD
from vitgraph.models.registry import (CLIP_MODELS, resolve_arch, resolve_clip_arch,
                                      resolve_pos_interp, tower_of)
from vitgraph.output import write_text

CLASSES_FILE = "classes.json"

# vitgraph registry names that timm registers too; other sizes are built from timm's ViT-B/16
# entry point with every size in model_args
TIMM_NAMES = frozenset({"vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
                        "vit_large_patch16_224", "vit_large_patch14_224", "vit_huge_patch14_224"})


def write_classes(run_dir: Path, classes: list[str]) -> None:
    write_text(Path(run_dir) / CLASSES_FILE, json.dumps(list(classes)) + "\n")


def read_classes(run_dir: Path, num_classes: int | None = None) -> list[str] | None:
    """The run's class names, if it stored them (and, given ``num_classes``, as many as the
    head has)."""
    path = Path(run_dir) / CLASSES_FILE
    if not path.is_file():
        return None
    names = [str(n) for n in json.loads(path.read_text())]
    return names if num_classes is None or len(names) == num_classes else None


def preprocessing(image_size: int) -> dict:
    return {"image_size": image_size, "resize": "shorter side, then center crop",
            "interpolation": "bicubic", "scale": 1 / 255, "mean": list(MEAN), "std": list(STD)}


def hf_config(arch, model_cfg, num_classes: int, classes: list[str] | None) -> dict:
    """A transformers ``ViTConfig`` for the exported weights (ViTForImageClassification)."""
    names = classes or [f"LABEL_{i}" for i in range(num_classes)]
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit",
            "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_heads, "intermediate_size": arch.ffn_hidden_size,
            "hidden_act": "gelu", "layer_norm_eps": model_cfg.layernorm_epsilon,
            "image_size": arch.image_size, "patch_size": arch.patch_size, "num_channels": 3,
            "qkv_bias": True, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


def hf_preprocessor_config(image_size: int) -> dict:
    """``preprocessor_config.json``: ``BitImageProcessor`` (as DINOv2's ViTs use) resizes the
    shorter side and center-crops, as vitgraph does; ``ViTImageProcessor`` would stretch a
    non-square image to the square instead."""
    return {"image_processor_type": "BitImageProcessor", "do_convert_rgb": True,
            "do_resize": True, "size": {"shortest_edge": image_size},
            "resample": 3,  # PIL.Image.BICUBIC
            "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(MEAN), "image_std": list(STD)}


def timm_config(name: str, arch, model_cfg, num_classes: int,
                classes: list[str] | None) -> dict:
    """timm's ``config.json`` for a ``VisionTransformer`` with these sizes (with
    model.distill_token: DeiT's ``VisionTransformerDistilled``)."""
    distilled = model_cfg.distill_token
    if distilled and model_cfg.num_registers:
        raise ConvertError("timm's distilled ViT (VisionTransformerDistilled) has no register "
                           "tokens: this run has a distillation token and registers")
    pool = "token" if model_cfg.pool == "cls" and model_cfg.class_token else "avg"
    model_args = {"img_size": arch.image_size, "patch_size": arch.patch_size,
                  "embed_dim": arch.hidden_size, "depth": arch.num_layers,
                  "num_heads": arch.num_heads, "mlp_ratio": arch.ffn_hidden_size / arch.hidden_size,
                  "class_token": model_cfg.class_token, "reg_tokens": model_cfg.num_registers,
                  # vitgraph norms every token before pooling: timm's fc_norm would norm after
                  "global_pool": pool, "fc_norm": False}
    s = arch.image_size
    pretrained_cfg = {"input_size": [3, s, s], "fixed_input_size": True,
                      "interpolation": "bicubic", "crop_pct": 1.0, "crop_mode": "center",
                      "mean": list(MEAN), "std": list(STD), "num_classes": num_classes,
                      "first_conv": "patch_embed.proj",
                      "classifier": ["head", "head_dist"] if distilled else "head"}
    # timm's DeiT-B distilled entry builds VisionTransformerDistilled; model_args set the sizes
    base = "deit_base_distilled_patch16_224" if distilled else \
        name if name in TIMM_NAMES else "vit_base_patch16_224"
    out = {"architecture": base,
           "num_classes": num_classes, "num_features": arch.hidden_size, "global_pool": pool,
           "model_args": model_args, "pretrained_cfg": pretrained_cfg}
    if classes:
        out["label_names"] = list(classes)
    return out


def timm_naflex_config(arch, *, class_token: bool, num_registers: int, pool: str,
                       activation: str, pos_interp: str, num_classes: int,
                       classes: list[str] | None, ln_pre: bool = False) -> dict:
    """timm's ``config.json`` for a ``NaFlexVit`` (``timm_naflex`` exports of a native run):
    the SigLIP 2 NaFlex ViT-B/16 entry point (no LayerScale) with every size and choice in
    ``model_args`` (vitgraph.convert.naflex.naflex_model_args)."""
    args = naflex_model_args(arch, class_token=class_token, num_registers=num_registers,
                             pool=pool, activation=activation, pos_interp=pos_interp,
                             num_classes=num_classes, ln_pre=ln_pre)
    args.pop("num_classes")
    base = "naflexvit_base_patch16_siglip"
    pretrained_cfg = {"input_size": [3, arch.image_size, arch.image_size],
                      "fixed_input_size": False, "interpolation": "bicubic", "crop_pct": 1.0,
                      "mean": list(MEAN), "std": list(STD), "num_classes": num_classes,
                      "first_conv": "embeds.proj", "classifier": "head"}
    out = {"architecture": base, "num_classes": num_classes,
           "num_features": arch.hidden_size, "global_pool": args["global_pool"],
           "model_args": args, "pretrained_cfg": pretrained_cfg}
    if classes:
        out["label_names"] = list(classes)
    return out


def timm_naflex_config_for(model_cfg, num_classes: int, classes: list[str] | None) -> dict:
    """``timm_naflex_config`` of a run's ``model:`` section: a classifier, or an image-text
    pair's image tower (what vitgraph.convert.naflex exports of a pair)."""
    interp = resolve_pos_interp(model_cfg)
    if model_cfg.name in CLIP_MODELS:
        pair = resolve_clip_arch(model_cfg)
        return timm_naflex_config(pair.vision, class_token=pair.class_token, num_registers=0,
                                  pool=pair.vision_pool, activation=pair.activation,
                                  pos_interp=interp, num_classes=0, classes=None,
                                  ln_pre=pair.ln_pre)
    pool = model_cfg.pool if model_cfg.pool != "cls" or model_cfg.class_token else "mean"
    return timm_naflex_config(resolve_arch(model_cfg), class_token=model_cfg.class_token,
                              num_registers=model_cfg.num_registers, pool=pool,
                              activation="gelu", pos_interp=interp, num_classes=num_classes,
                              classes=classes)


def hf_vision_export(sd: dict, model_cfg, native: bool) -> tuple[dict, dict, str]:
    """A ``task.kind: caption`` run's tower as transformers' vision model: (its weights under
    hub names, {side file: content}, the class). ``SiglipVisionModel`` (fixed resolution; at
    other sizes its bicubic position resize is vitgraph's fixed path's), or
    ``Siglip2VisionModel`` for a NaFlex-like tower (``native``: data.resolution=native, or
    model.pos_interp=bilinear: SigLIP 2 resamples the grid per image, bilinear). SigLIP has no
    class token and no registers: a tower with either is refused (ConvertError, saying so)."""
    tower = tower_of(model_cfg)
    kind = "siglip2" if native or tower.pos_interp == "bilinear" else "siglip"
    try:
        config = hf_vision_config(tower, kind)
    except ConvertError as e:
        raise ConvertError(f"{e}: this run's tower cannot be written as a "
                           f"{HF_VISION_CLASSES[kind]}; export --format vitgraph and load it "
                           f"with vitgraph.VisionTower.from_run") from None
    out = vitgraph_to_hf_vision(sd, tower.vision.num_heads, kind)
    a = tower.vision
    if kind == "siglip":
        pre = hf_preprocessor_config(a.image_size)
    else:  # each image at its own size, at most the trained grid's patch count
        pre = {"image_processor_type": "Siglip2ImageProcessor", "do_convert_rgb": True,
               "do_resize": True, "resample": 2,  # PIL.Image.BILINEAR
               "patch_size": a.patch_size, "max_num_patches": a.num_patches(),
               "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
               "image_mean": list(MEAN), "image_std": list(STD)}
    return out, {"config.json": config, "preprocessor_config.json": pre}, HF_VISION_CLASSES[kind]
