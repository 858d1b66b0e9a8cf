"""Training augmentation, batched on the device: the DeiT / timm recipes on whole microbatches.

``BatchAugment`` turns a uint8 [b, H, W, 3] microbatch (on any device) into normalized model
inputs and (soft) targets:

1. RandomResizedCrop + horizontal flip, and the geometric RandAugment / TrivialAugment ops
   (rotate, shear, translate), composed into one affine map per image: a single
   ``grid_sample`` over the batch crops, flips, warps and resizes to ``image_size``;
2. the colour ops (brightness, colour, contrast, sharpness, posterize, solarize,
   autocontrast, equalize; 3-Augment's grayscale, solarize and gaussian blur; colour jitter
   as brightness, contrast and colour factors in a random order), each applied to the images
   that drew it;
3. normalization, then random erasing (per-pixel normal noise, as timm's ``mode="pixel"``);
4. mixup or cutmix over the batch (one lambda per batch, partner = the batch reversed, as
   timm's ``mode="batch"``), with label smoothing folded into the soft targets.

``data.augment.preset`` (light | deit | deit3) gives every other key its default; a key set in
the config wins over its preset (``AugmentConfig.resolve``).

Every random choice is drawn on the CPU from a numpy generator seeded by (seed, step,
data-parallel rank, microbatch) (``BatchAugment.draw``): the same on CPU and GPU, the same after
a resume, and the mixing parameters can be redrawn from the labels alone on a last pipeline
stage that never sees the images. The draws are packed into tensors of fixed shapes
(``AugmentParams``) and the device function (``BatchAugment.apply``) reads them: no shape, host
sync or Python branch there depends on a draw, so it can run inside a captured step graph (the
classification task calls it in its forward; the tensors are graph inputs refilled before each
replay). The erasing noise is a counter-based hash of a per-image seed and the pixel index, for
the same reason. Colour ops commute with the warps except at the fill, so applying all
geometric ops first (inside the crop) and the colour ops after is a close stand-in for timm's
random op order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from vitgraph.config_keys import ConfigError, check_section, declared, key
from vitgraph.data.loader import MEAN, STD, to_device_uint8, to_model_input

GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
COLOUR = ("identity", "autocontrast", "equalize", "brightness", "color", "contrast",
          "sharpness", "posterize", "solarize")
OPS = GEOMETRIC + COLOUR  # what RandAugment / TrivialAugment draw from
# 3-Augment's own ops (outside OPS, so that RandAugment's draws are unchanged)
EXTRA = ("grayscale", "blur")
TABLE = OPS + EXTRA  # what an op index of ``draw_ops`` names here
THREE_AUGMENT = ("grayscale", "solarize", "blur")
JITTER = ("brightness", "contrast", "color")  # torchvision ColorJitter's b / c / saturation
BLUR_SIGMA = (0.1, 2.0)  # 3-Augment's gaussian blur: sigma in pixels of the output (DeiT III)

# Each preset gives every other key of data.augment (a key the config sets wins):
# - deit: DeiT's ImageNet-1k recipe (timm's defaults): random-resized crop 8-100% of the area,
#   flip, RandAugment m9 (2 ops, std 0.5, p 0.5), mixup 0.8 / cutmix 1.0 on every batch,
#   random erasing 0.25. For ViT-S/B and up on ImageNet-sized data and hundreds of epochs; far
#   too strong for a small model or a few thousand images (the 4-layer tiny config on 1,437
#   digit scans: 36% held-out with it, 98% without; docs/data.md).
# - deit3: DeiT III's 3-Augment: random-resized crop 8-100%, flip, one of grayscale /
#   solarize / gaussian blur (sigma 0.1-2 px) per image, colour jitter 0.3, cutmix 1.0 without
#   mixup (DeiT III's ImageNet-21k runs; its ImageNet-1k runs add mixup_alpha=0.8), no
#   RandAugment, no erasing. For ViT-B and up on ImageNet-1k / 21k with long schedules.
# - light: a mild random-resized crop (80-100% of the area: a small shift and zoom) and nothing
#   else, no flip: small models, small data and short runs (the tiny CPU configs), where the
#   recipes above cost more than they add. Tuned on the tiny config (docs/data.md): crop 35% +
#   flip and crop 80% + flip both trained worse than no augmentation on digit scans (a mirror
#   makes a digit another glyph); add data.augment.flip=0.5 for natural images.
PRESETS = {"deit": dict(
    crop_scale_min=0.08, crop_scale_max=1.0, crop_ratio_min=0.75, crop_ratio_max=1.3333333,
    flip=0.5, auto="randaugment", num_ops=2, magnitude=9.0, magnitude_std=0.5, op_prob=0.5,
    color_jitter=0.0, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=1.0, switch_prob=0.5,
    erase_prob=0.25)}
PRESETS["deit3"] = {**PRESETS["deit"], "auto": "3augment", "color_jitter": 0.3,
                    "mixup_alpha": 0.0, "erase_prob": 0.0}
PRESETS["light"] = {**PRESETS["deit"], "crop_scale_min": 0.8, "flip": 0.0, "auto": "none",
                    "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "erase_prob": 0.0}


def _at_least(name: str):
    return lambda v, a: getattr(a, name) is None or v >= getattr(a, name)


@dataclass
class AugmentConfig:
    """``data.augment``: training-time augmentation (never applied to held-out data).

    ``preset`` gives the other keys their defaults (``PRESETS`` above says what each preset
    holds and the scale it suits); a key given in the config (not null) wins. The keys are
    resolved when the section is made (``resolve``): what is saved with a run, compared on
    resume and read by ``BatchAugment`` are the resolved values. Label smoothing stays
    ``train.label_smoothing``.
    """
    enabled: bool = False
    # deit is the default so that a config without a preset trains as it did before presets
    # existed (and resumes: a run's saved config holds these values); the tiny configs and
    # small-data configs name light
    preset: str = key("deit", choices=tuple(PRESETS))
    # RandomResizedCrop: area fraction of the image
    crop_scale_min: Optional[float] = key(None, above=0, max=1)
    crop_scale_max: Optional[float] = key(None, above=0, max=1, check=_at_least("crop_scale_min"),
                                          why="must be >= data.augment.crop_scale_min")
    crop_ratio_min: Optional[float] = key(None, above=0)  # aspect ratio w/h
    crop_ratio_max: Optional[float] = key(None, above=0, check=_at_least("crop_ratio_min"),
                                          why="must be >= data.augment.crop_ratio_min")
    flip: Optional[float] = key(None, min=0, max=1)  # probability of a horizontal flip
    # per-image ops: randaugment (num_ops of OPS), trivialaugment (one), 3augment (DeiT III:
    # one of grayscale / solarize / gaussian blur, always applied), none
    auto: Optional[str] = key(None, choices=("randaugment", "trivialaugment", "3augment",
                                             "none"))
    num_ops: Optional[int] = key(None, min=0)  # RandAugment: ops per image (TrivialAugment: 1)
    # RandAugment magnitude (TrivialAugment: uniform 0..10)
    magnitude: Optional[float] = key(None, min=0, max=10)
    magnitude_std: Optional[float] = key(None, min=0)
    # RandAugment: each chosen op is applied with this probability
    op_prob: Optional[float] = key(None, min=0, max=1)
    # colour jitter after the ops: brightness, contrast and saturation factors each uniform in
    # [1 - j, 1 + j], in a random order per image (torchvision's ColorJitter(j, j, j)); 0: off
    color_jitter: Optional[float] = key(None, min=0, max=0.9)
    mixup_alpha: Optional[float] = key(None, min=0)  # 0 disables mixup
    cutmix_alpha: Optional[float] = key(None, min=0)  # 0 disables cutmix
    # probability that a batch is mixed at all
    mix_prob: Optional[float] = key(None, min=0, max=1)
    # with both on: probability of cutmix rather than mixup
    switch_prob: Optional[float] = key(None, min=0, max=1)
    erase_prob: Optional[float] = key(None, min=0, max=1)  # random erasing, per image

    def __post_init__(self):
        self.resolve()

    def resolve(self) -> "AugmentConfig":
        """Fill every key left null with ``preset``'s value (the one place presets apply)."""
        if self.preset not in PRESETS:
            f = next(f for f in fields(self) if f.name == "preset")
            why = declared(f).problem(self.preset) or f"must be one of {', '.join(PRESETS)}"
            raise ConfigError(f"data.augment.preset={self.preset!r}: {why}")
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        return self

    def validate(self) -> None:
        """ConfigError (a ValueError) naming the first key whose value is not allowed."""
        check_section(self.resolve(), "data.augment.")

    @property
    def mixes(self) -> bool:
        return self.enabled and self.mix_prob > 0 and (self.mixup_alpha > 0
                                                       or self.cutmix_alpha > 0)


def draw_ops(cfg: AugmentConfig, rng: np.random.Generator, n: int, pool: tuple,
             table: tuple | None = None):
    """Per image: [n, slots] op indices into ``table`` (-1: skipped) and signed magnitudes in
    [-1, 1], for ``cfg.auto`` (RandAugment / TrivialAugment pick from ``pool``, the first
    entries of ``table``) and then ``cfg.color_jitter``. Shared by ``BatchAugment`` and the
    native-resolution packs (vitgraph.data.native.PackAugment), each with its own ops."""
    table = pool if table is None else table
    ops, mag = np.full((n, 0), -1), np.zeros((n, 0))
    if cfg.auto in ("randaugment", "trivialaugment") and not (
            cfg.auto == "randaugment" and cfg.num_ops == 0):
        slots = 1 if cfg.auto == "trivialaugment" else cfg.num_ops
        ops = rng.integers(0, len(pool), (n, slots))
        if cfg.auto == "trivialaugment":
            m = rng.uniform(0, 10, (n, slots))
        else:
            m = cfg.magnitude + rng.normal(0, 1, (n, slots)) * cfg.magnitude_std \
                if cfg.magnitude_std > 0 else np.full((n, slots), cfg.magnitude)
            ops = np.where(rng.uniform(0, 1, (n, slots)) >= cfg.op_prob, -1, ops)
        sign = np.where(rng.uniform(0, 1, (n, slots)) < 0.5, -1.0, 1.0)
        mag = np.clip(m, 0, 10) / 10 * sign
    elif cfg.auto == "3augment":
        pick = rng.integers(0, len(THREE_AUGMENT), n)
        ops = np.array([table.index(name) for name in THREE_AUGMENT])[pick][:, None]
        sigma = rng.uniform(*BLUR_SIGMA, n)
        # solarize at 128 of 255 (PIL's default threshold: 1 - m); blur's sigma / its maximum
        mag = np.where(np.array(THREE_AUGMENT)[pick] == "blur", sigma / BLUR_SIGMA[1],
                       np.where(np.array(THREE_AUGMENT)[pick] == "solarize", 0.5, 0.0))[:, None]
    if cfg.color_jitter > 0:
        j = cfg.color_jitter
        factor = rng.uniform(1 - j, 1 + j, (n, len(JITTER)))
        order = np.argsort(rng.uniform(0, 1, (n, len(JITTER))), axis=1)  # a random order each
        idx = np.array([table.index(name) for name in JITTER])
        # the colour ops' factor is 1 + 0.9 x the signed magnitude
        ops = np.concatenate([ops, idx[order]], 1)
        mag = np.concatenate([mag, np.take_along_axis((factor - 1) / 0.9, order, 1)], 1)
    return ops, mag


def _rng(seed: int, key: tuple, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, stream, *(int(k) for k in key)])


def fused(fn):
    """``fn`` (a device function of fixed shapes) compiled by torch.compile on its first call
    with CUDA tensors, eager elsewhere. Eagerly each colour op, the erasing noise and the mix
    is a pass over the whole microbatch in fp32; compiled they fuse into a few kernels
    (benchmarks/BENCHMARKS.md, "The DeiT augmentation inside the step"). A step graph
    captures the compiled kernels; a first call made inside a capture runs eagerly (compiling
    there would not be capturable). Not fullgraph: each other augmentation config is another
    compile of the same code, and past dynamo's recompile limit (8) a fullgraph function fails
    where this one runs eagerly (a process that trains many configs: the GPU tests)."""
    compiled = None

    def run(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            if torch.cuda.is_current_stream_capturing():
                return fn(*args)
            compiled = torch.compile(fn, dynamic=False)
        return compiled(*args)
    return run


class AugmentParams(NamedTuple):
    """One microbatch's augmentation as drawn on the host (``BatchAugment.draw``): tensors of
    fixed shapes for a config and micro-batch size, whatever was drawn, so that a step graph
    takes them as inputs refilled before each replay (``BatchAugment.apply`` reads them)."""
    mix: torch.Tensor  # [6] float32: mixup lam, 1 - lam (1, 0: none); cutmix rows y0..y1,
    #                    columns x0..x1 in pixels (empty: none)
    theta: torch.Tensor  # [b, 2, 3] float32: output -> input coords (crop, flip, warps)
    ops: torch.Tensor  # [b, slots] int64: each slot's op, a TABLE index (-1: none)
    mag: torch.Tensor  # [b, slots] float32: its signed magnitude in [-1, 1]
    erase: torch.Tensor  # [b, 4] int64: erased rows top..bottom, columns left..right (empty: none)
    # [b] int64: each image's erasing-noise seed (32 bits); last, as it leads with b: the
    # trainer reads the micro-batch size off a prepared microbatch's last field
    noise: torch.Tensor

    def to(self, device) -> "AugmentParams":
        return AugmentParams(*(t.to(device, non_blocking=True) for t in self))


def slot_ops(cfg: AugmentConfig, pool: tuple = COLOUR) -> tuple:
    """The colour ops each op slot of ``draw_ops`` can hold under ``cfg`` (geometric ops are
    folded into the warp; ``pool``: the colour ops drawn from, a native pack's fewer): what
    the device computes for every image of a slot."""
    colour = tuple(n for n in pool if n != "identity")
    slots = {"randaugment": (colour,) * cfg.num_ops, "trivialaugment": (colour,),
             "3augment": (THREE_AUGMENT,)}.get(cfg.auto, ())
    return slots + ((JITTER,) * len(JITTER) if cfg.color_jitter > 0 else ())


class BatchAugment:
    """Host-side draws (``draw``: numpy, keyed) and the device function (``apply``: fixed
    shapes, no host sync, no branch on a drawn value), so that a step graph can hold it."""

    def __init__(self, cfg: AugmentConfig, image_size: int, num_classes: int,
                 label_smoothing: float = 0.0, seed: int = 0, rank: int = 0):
        cfg.validate()
        self.cfg, self.image_size, self.num_classes = cfg, image_size, num_classes
        self.label_smoothing, self.seed, self.rank = label_smoothing, seed, rank
        self.slot_ops = slot_ops(cfg)
        self._fused = fused(self._apply)

    # ------------------------------------------------------------ parameters (CPU, numpy)

    def _crop_params(self, rng, b: int):
        """Per image: crop width and height as fractions of the side, centre in [0, 1]."""
        c = self.cfg
        area = rng.uniform(c.crop_scale_min, c.crop_scale_max, (b, 10))
        logr = rng.uniform(math.log(c.crop_ratio_min), math.log(c.crop_ratio_max), (b, 10))
        w, h = np.sqrt(area * np.exp(logr)), np.sqrt(area / np.exp(logr))
        ok = (w <= 1) & (h <= 1)
        first = ok.argmax(1)
        rows = np.arange(b)
        w = np.where(ok.any(1), w[rows, first], 1.0)  # 10 misses: the whole image, as timm
        h = np.where(ok.any(1), h[rows, first], 1.0)
        cx = w / 2 + rng.uniform(0, 1, b) * (1 - w)
        cy = h / 2 + rng.uniform(0, 1, b) * (1 - h)
        flip = rng.uniform(0, 1, b) < c.flip
        return w, h, cx, cy, flip

    def _op_params(self, rng, b: int):
        """[b, slots] op indices into ``TABLE`` (-1: skipped) and signed magnitudes."""
        return draw_ops(self.cfg, rng, b, OPS, TABLE)

    def mix_params(self, b: int, key: tuple):
        """(lam, cutmix box (y0, y1, x0, x1) as fractions or None); lam 1 = no mixing."""
        c = self.cfg
        if not c.mixes:
            return 1.0, None
        rng = _rng(self.seed, (self.rank, *key), 2)
        if rng.uniform() >= c.mix_prob:
            return 1.0, None
        cutmix = c.cutmix_alpha > 0 and (c.mixup_alpha == 0 or rng.uniform() < c.switch_prob)
        lam = float(rng.beta(c.cutmix_alpha, c.cutmix_alpha) if cutmix
                    else rng.beta(c.mixup_alpha, c.mixup_alpha))
        if not cutmix:
            return lam, None
        r = math.sqrt(1 - lam)
        cy, cx = rng.uniform(0, 1, 2)
        y0, y1 = max(cy - r / 2, 0.0), min(cy + r / 2, 1.0)
        x0, x1 = max(cx - r / 2, 0.0), min(cx + r / 2, 1.0)
        return lam, (y0, y1, x0, x1)

    def draw(self, b: int, key: tuple) -> AugmentParams:
        """Microbatch ``key``'s parameters for ``b`` images, on the CPU: the same numpy calls in
        the same order for every config, so a seed gives the same draws on any device."""
        rng = _rng(self.seed, (self.rank, *key), 1)
        w, h, cx, cy, flip = self._crop_params(rng, b)
        ops, mag = self._op_params(rng, b)
        # one affine per image: output coords -> (geometric ops) -> crop -> input coords
        theta = np.zeros((b, 3, 3))
        theta[:, 0, 0] = w * np.where(flip, -1.0, 1.0)
        theta[:, 1, 1] = h
        theta[:, 0, 2], theta[:, 1, 2] = 2 * cx - 1, 2 * cy - 1
        theta[:, 2, 2] = 1
        for slot in range(ops.shape[1]):
            theta = theta @ self._geometric(ops[:, slot], mag[:, slot])
        erase, noise = np.zeros((b, 4), np.int64), np.zeros(b, np.int64)
        if self.cfg.erase_prob > 0:
            erase = self._erase_rects(rng, b)
            noise = _rng(self.seed, (self.rank, *key), 3).integers(0, 2**32, b)
        lam, box = self.mix_params(b, key)
        s = self.image_size
        y0, y1, x0, x1 = (round(v * s) for v in box) if box is not None else (0, 0, 0, 0)
        blend = lam if box is None else 1.0
        mix = torch.tensor([blend, 1 - blend, y0, y1, x0, x1], dtype=torch.float32)
        return AugmentParams(mix, torch.as_tensor(theta[:, :2], dtype=torch.float32),
                             torch.as_tensor(ops, dtype=torch.int64),
                             torch.as_tensor(mag, dtype=torch.float32),
                             torch.as_tensor(erase), torch.as_tensor(noise, dtype=torch.int64))

    def _geometric(self, ops, mag) -> np.ndarray:
        """[b, 3, 3] affine (output -> input, normalized coords) of each image's geometric op."""
        b = len(ops)
        a = np.tile(np.eye(3), (b, 1, 1))
        for k, name in enumerate(GEOMETRIC):
            sel = ops == k
            if not sel.any():
                continue
            m = mag[sel]
            if name == "rotate":
                t = np.deg2rad(30.0 * m)
                a[sel, 0, 0], a[sel, 0, 1] = np.cos(t), -np.sin(t)
                a[sel, 1, 0], a[sel, 1, 1] = np.sin(t), np.cos(t)
            elif name == "shear_x":
                a[sel, 0, 1] = 0.3 * m
            elif name == "shear_y":
                a[sel, 1, 0] = 0.3 * m
            elif name == "translate_x":
                a[sel, 0, 2] = 2 * 0.45 * m  # up to 45% of the side
            else:
                a[sel, 1, 2] = 2 * 0.45 * m
        return a

    def _erase_rects(self, rng, b: int) -> np.ndarray:
        """timm's RandomErasing (area 2-33%, log-aspect 0.3-3.3): [b, 4] rows top..bottom and
        columns left..right of each image's rectangle, empty where it erases nothing."""
        hgt = wid = self.image_size
        area = rng.uniform(0.02, 1 / 3, (b, 10)) * hgt * wid
        logr = rng.uniform(math.log(0.3), math.log(1 / 0.3), (b, 10))
        eh = np.round(np.sqrt(area * np.exp(logr))).astype(int)
        ew = np.round(np.sqrt(area / np.exp(logr))).astype(int)
        ok = (eh < hgt) & (ew < wid) & (eh > 0) & (ew > 0)
        rows, first = np.arange(b), ok.argmax(1)
        do = (rng.uniform(0, 1, b) < self.cfg.erase_prob) & ok.any(1)
        eh, ew = eh[rows, first], ew[rows, first]
        top = (rng.uniform(0, 1, b) * (hgt - eh + 1)).astype(int)
        left = (rng.uniform(0, 1, b) * (wid - ew + 1)).astype(int)
        rect = np.stack([top, top + eh, left, left + ew], 1).astype(np.int64)
        return np.where(do[:, None], rect, 0)

    # ------------------------------------------------------------ the batch

    def targets(self, labels: torch.Tensor, key: tuple) -> torch.Tensor:
        """Soft targets [b, classes] (smoothed, mixed) when mixing is on, else the labels."""
        if not self.cfg.mixes:
            return labels
        lam, box = self.mix_params(len(labels), key)
        if box is not None:
            lam = self._box_lam(box)
        n, eps = self.num_classes, self.label_smoothing
        one = F.one_hot(labels, n).float() * (1 - eps) + eps / n
        return lam * one + (1 - lam) * one.flip(0)

    def _box_lam(self, box) -> float:
        s = self.image_size
        y0, y1, x0, x1 = (round(v * s) for v in box)
        return 1 - (y1 - y0) * (x1 - x0) / (s * s)

    def images(self, images_uint8, key: tuple, device, dtype=torch.float32) -> torch.Tensor:
        """uint8 [b, H, W, 3] -> augmented, normalized [b, 3, S, S] of ``dtype`` on ``device``:
        ``draw`` then ``apply``, eagerly."""
        x = to_device_uint8(images_uint8, device)
        return self.apply(x, self.draw(x.shape[0], key).to(x.device), dtype)

    def apply(self, images: torch.Tensor, p: AugmentParams,
              dtype=torch.float32) -> torch.Tensor:
        """The device function: uint8 [b, H, W, 3] and ``p`` (on the images' device) ->
        [b, 3, S, S]. Every op runs on the whole batch and ``torch.where`` keeps it for the
        images that drew it: shapes and kernels depend on the config, never on the draws.
        On a GPU it runs compiled (``fused``)."""
        return self._fused(images, p, dtype)

    def _apply(self, images: torch.Tensor, p: AugmentParams, dtype) -> torch.Tensor:
        s, b = self.image_size, images.shape[0]
        x = images.permute(0, 3, 1, 2).float().div_(255)
        grid = F.affine_grid(p.theta, [b, 3, s, s], align_corners=False)
        # sample x - 0.5 with zero padding: what a warp pulls in from outside is mid-grey
        x = F.grid_sample(x - 0.5, grid, mode="bilinear", padding_mode="zeros",
                          align_corners=False).add_(0.5).clamp_(0, 1)
        x = self._colours(x, p.ops, p.mag)
        x = (x - _constant(MEAN, x)) / _constant(STD, x)
        if self.cfg.erase_prob > 0:
            x = torch.where(_box_mask(p.erase.view(b, 1, 1, 1, 4), s), _noise(p.noise, x), x)
        if self.cfg.mixes:
            partner = x.flip(0)
            x = x * p.mix[0] + partner * p.mix[1]  # lam 1: x * 1 + partner * 0 = x
            x = torch.where(_box_mask(p.mix[2:].view(1, 1, 1, 1, 4), s), partner, x)
        return x.to(dtype).contiguous()

    def _colours(self, x: torch.Tensor, ops: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
        """Each slot's colour ops in turn, each op on every image, kept where it was drawn."""
        for slot, names in enumerate(self.slot_ops):
            for name in names:
                sel = (ops[:, slot] == TABLE.index(name)).view(-1, 1, 1, 1)
                # images that did not draw the op get magnitude 1, sign 1: finite, discarded
                m = torch.where(sel, mag[:, slot].view(-1, 1, 1, 1).abs(), 1.0)
                sign = torch.where(sel, mag[:, slot].view(-1, 1, 1, 1).sign(), 1.0)
                x = torch.where(sel, _colour(name, x, m, sign), x)
        return x


def _constant(values: tuple, like: torch.Tensor) -> torch.Tensor:
    """[1, c, 1, 1] of ``values`` made by fills on ``like``'s device: a host copy would not be
    capturable."""
    return torch.stack([torch.full((), v, dtype=like.dtype, device=like.device)
                        for v in values]).view(1, -1, 1, 1)


def _box_mask(box: torch.Tensor, size: int) -> torch.Tensor:
    """Pixels inside rows box[..., 0]..box[..., 1] and columns box[..., 2]..box[..., 3] of a
    ``size`` square (box broadcast as [..., 1, 1, 4])."""
    yy = torch.arange(size, device=box.device).view(size, 1)
    xx = torch.arange(size, device=box.device).view(1, size)
    return ((yy >= box[..., 0]) & (yy < box[..., 1]) & (xx >= box[..., 2])
            & (xx < box[..., 3]))


MASK32 = 0xFFFFFFFF


def _hash32(v: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (values kept below 2**32 in int64: the products stay below 2**63)."""
    v = ((v >> 16) ^ v) * 0x45D9F3B & MASK32
    v = ((v >> 16) ^ v) * 0x45D9F3B & MASK32
    return (v >> 16) ^ v


def _noise(seeds: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise shaped as ``like`` [b, ...], a function of each image's seed and
    the pixel alone (counter-based: no generator state, the same in a graph and on resume).
    Box-Muller on two 16-bit uniforms a hash gives two values (|z| <= 4.7)."""
    n = like[0].numel()
    half = (n + 1) // 2
    counter = _hash32(torch.arange(half, device=like.device))
    h = _hash32(counter.view(1, -1) ^ seeds.view(-1, 1))
    r, angle = _normal_polar(h, like.dtype)
    z = torch.cat([r * torch.cos(angle), r * torch.sin(angle)], 1)
    return z[:, :n].reshape(like.shape)


def _normal_polar(h: torch.Tensor, dtype) -> tuple:
    """Box-Muller's radius and angle from 32-bit hashes ``h`` (two 16-bit uniforms each): r cos
    and r sin are two standard normal values (|z| <= 4.7)."""
    u1 = ((h >> 16) + 1).to(dtype) / 65536
    angle = (h & 0xFFFF).to(dtype) * (2 * math.pi / 65536)
    return torch.sqrt(-2 * torch.log(u1)), angle


def _gray(x):
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def _blend(a, b, f):
    return (b + (a - b) * f).clamp_(0, 1)


def _colour(name: str, x: torch.Tensor, m: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """One colour op on float images in [0, 1]; ``m`` magnitude in [0, 1], ``sign`` +-1."""
    factor = 1 + 0.9 * m * sign  # the enhance ops: timm's "increasing" variant
    if name == "brightness":
        return _blend(x, torch.zeros_like(x), factor)
    if name == "color":
        return _blend(x, _gray(x).expand_as(x), factor)
    if name == "contrast":
        return _blend(x, _gray(x).mean((2, 3), keepdim=True).expand_as(x), factor)
    if name == "sharpness":
        # PIL's smoothing kernel (1 around, 5 at the centre, / 13) as a sum of shifted views of
        # the edge-padded images: pointwise, so the compiled augmentation fuses it (as a
        # depthwise conv it stayed a kernel of its own, 0.38 ms a microbatch of 128 at 224)
        h, w = x.shape[-2:]
        p = F.pad(x, (1, 1, 1, 1), mode="replicate")
        around = sum(p[..., i:i + h, j:j + w] for i in range(3) for j in range(3))
        return _blend(x, (around + 4 * x) / 13, factor)
    if name == "posterize":
        bits = 8 - (4 * m).floor()  # keep 8 .. 4 bits
        step = 2 ** (8 - bits)
        return torch.floor(x * 255 / step) * step / 255
    if name == "solarize":
        threshold = 1 - m  # invert everything above it
        return torch.where(x >= threshold, 1 - x, x)
    if name == "autocontrast":
        lo = x.amin((2, 3), keepdim=True)
        hi = x.amax((2, 3), keepdim=True)
        return torch.where(hi > lo, (x - lo) / (hi - lo).clamp_min(1e-6), x)
    if name == "grayscale":
        return _gray(x).expand_as(x).contiguous()
    if name == "blur":  # gaussian, sigma = m x BLUR_SIGMA[1] pixels, edges replicated
        return _blur(x, m.view(-1) * BLUR_SIGMA[1])
    if name == "equalize":
        b = x.shape[0]
        q = (x * 255).round().long().clamp_(0, 255).view(b * 3, -1)
        hist = torch.zeros(b * 3, 256, device=x.device).scatter_add_(
            1, q, torch.ones_like(q, dtype=torch.float32))
        cdf = hist.cumsum(1)
        cdf_min = torch.where(hist > 0, cdf, torch.full_like(cdf, float("inf"))).amin(1, True)
        lut = ((cdf - cdf_min) / (cdf[:, -1:] - cdf_min).clamp_min(1)).clamp_(0, 1)
        return lut.gather(1, q).view_as(x).to(x.dtype)
    raise ValueError(name)


def _blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A separable gaussian blur per image (sigma [b] in pixels), one grouped conv a pass."""
    b, c, h, w = x.shape
    r = math.ceil(3 * BLUR_SIGMA[1])
    t = torch.arange(-r, r + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-t.view(1, -1) ** 2 / (2 * sigma.view(-1, 1).to(x.dtype) ** 2))
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [b c, 2r + 1]
    y = F.pad(x.reshape(1, b * c, h, w), (r, r, r, r), mode="replicate")
    y = F.conv2d(y, k.view(b * c, 1, 1, -1), groups=b * c)
    y = F.conv2d(y, k.view(b * c, 1, -1, 1), groups=b * c)
    return y.view(b, c, h, w).clamp_(0, 1)


def augment_line(a, mixes_labels: bool = True) -> str:
    """The augmentation in force (``data.augment``, its preset's values resolved), as the
    start of a run logs it. ``mixes_labels``: whether the task mixes labels (a contrastive
    task never does)."""
    if not a.enabled:
        return "off"
    a = a.resolve()
    parts = [f"crop {a.crop_scale_min:g}-{a.crop_scale_max:g} of the area"]
    if a.flip:
        parts.append(f"flip {a.flip:g}")
    if a.auto == "randaugment" and a.num_ops:
        parts.append(f"randaugment {a.num_ops} ops m{a.magnitude:g} (std {a.magnitude_std:g}, "
                     f"p {a.op_prob:g})")
    elif a.auto == "trivialaugment":
        parts.append("trivialaugment")
    elif a.auto == "3augment":
        parts.append("3-augment (grayscale / solarize / blur)")
    if a.color_jitter:
        parts.append(f"colour jitter {a.color_jitter:g}")
    if mixes_labels and a.mixes:
        mix = [f"{name} {alpha:g}" for name, alpha in (("mixup", a.mixup_alpha),
                                                        ("cutmix", a.cutmix_alpha)) if alpha]
        parts.append(" / ".join(mix) + f" (p {a.mix_prob:g}"
                     + (f", cutmix share {a.switch_prob:g})" if len(mix) == 2 else ")"))
    if a.erase_prob:
        parts.append(f"erasing {a.erase_prob:g}")
    return ", ".join(parts)


def prepare_batch(augment: BatchAugment | None, images, labels: torch.Tensor, key,
                  image_size: int, device, dtype=torch.float32, first_stage: bool = True):
    """(model input or None, targets on ``device``) for one microbatch; ``key`` None (eval) or
    no ``augment`` gives the plain eval transform and the labels."""
    if augment is None or key is None:
        x = to_model_input(images, image_size, device, dtype) if first_stage else None
        return x, labels.to(device, non_blocking=True)
    x = augment.images(images, key, device, dtype) if first_stage else None
    return x, augment.targets(labels, key).to(device, non_blocking=True)
