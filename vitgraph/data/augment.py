"""Training augmentation, batched on the device: the DeiT / timm recipe on whole microbatches.

``BatchAugment`` turns a uint8 [b, H, W, 3] microbatch (on any device) into normalized model
inputs and (soft) targets:

1. RandomResizedCrop + horizontal flip, and the geometric RandAugment / TrivialAugment ops
   (rotate, shear, translate), composed into one affine map per image: a single
   ``grid_sample`` over the batch crops, flips, warps and resizes to ``image_size``;
2. the colour ops (brightness, colour, contrast, sharpness, posterize, solarize,
   autocontrast, equalize), each applied to the images that drew it;
3. normalization, then random erasing (per-pixel normal noise, as timm's ``mode="pixel"``);
4. mixup or cutmix over the batch (one lambda per batch, partner = the batch reversed, as
   timm's ``mode="batch"``), with label smoothing folded into the soft targets.

Every random choice except the erasing noise is drawn on the CPU from a numpy generator
seeded by (seed, step, data-parallel rank, microbatch): the same on CPU and GPU, the same
after a resume, and the mixing parameters can be redrawn from the labels alone on a last
pipeline stage that never sees the images. The erasing noise is drawn on the device from a
generator seeded the same way. Colour ops commute with the warps except at the fill, so
applying all geometric ops first (inside the crop) and the colour ops after is a close stand-in
for timm's random op order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitgraph.config_keys import check_section, key
from vitgraph.data.loader import MEAN, STD, to_device_uint8

GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
COLOUR = ("identity", "autocontrast", "equalize", "brightness", "color", "contrast",
          "sharpness", "posterize", "solarize")
OPS = GEOMETRIC + COLOUR


@dataclass
class AugmentConfig:
    """``data.augment``: training-time augmentation (never applied to held-out data).

    Defaults are DeiT's ImageNet recipe: random-resized crop (8-100% of the area, aspect
    3/4-4/3), flip, RandAugment m9 (2 ops, magnitude std 0.5), mixup 0.8 / cutmix 1.0 (one of
    the two per batch), random erasing 0.25; label smoothing stays ``train.label_smoothing``.
    """
    enabled: bool = False
    # RandomResizedCrop: area fraction of the image
    crop_scale_min: float = key(0.08, above=0, max=1)
    crop_scale_max: float = key(1.0, above=0, max=1, check=lambda v, a: v >= a.crop_scale_min,
                                why="must be >= data.augment.crop_scale_min")
    crop_ratio_min: float = key(0.75, above=0)  # aspect ratio w/h
    crop_ratio_max: float = key(1.3333333, above=0, check=lambda v, a: v >= a.crop_ratio_min,
                                why="must be >= data.augment.crop_ratio_min")
    flip: float = key(0.5, min=0, max=1)  # probability of a horizontal flip
    auto: str = key("randaugment", choices=("randaugment", "trivialaugment", "none"))
    num_ops: int = key(2, min=0)  # RandAugment: ops per image (TrivialAugment: always 1)
    # RandAugment magnitude (TrivialAugment: uniform 0..10)
    magnitude: float = key(9.0, min=0, max=10)
    magnitude_std: float = key(0.5, min=0)
    # RandAugment: each chosen op is applied with this probability
    op_prob: float = key(0.5, min=0, max=1)
    mixup_alpha: float = key(0.8, min=0)  # 0 disables mixup
    cutmix_alpha: float = key(1.0, min=0)  # 0 disables cutmix
    mix_prob: float = key(1.0, min=0, max=1)  # probability that a batch is mixed at all
    # with both on: probability of cutmix rather than mixup
    switch_prob: float = key(0.5, min=0, max=1)
    erase_prob: float = key(0.25, min=0, max=1)  # random erasing, per image

    def validate(self) -> None:
        """ConfigError (a ValueError) naming the first key whose value is not allowed."""
        check_section(self, "data.augment.")

    @property
    def mixes(self) -> bool:
        return self.enabled and self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)


def _rng(seed: int, key: tuple, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, stream, *(int(k) for k in key)])


class BatchAugment:
    def __init__(self, cfg: AugmentConfig, image_size: int, num_classes: int,
                 label_smoothing: float = 0.0, seed: int = 0, rank: int = 0):
        cfg.validate()
        self.cfg, self.image_size, self.num_classes = cfg, image_size, num_classes
        self.label_smoothing, self.seed, self.rank = label_smoothing, seed, rank

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
        """[b, slots] op indices (-1: skipped) and magnitudes in [0, 1]."""
        c = self.cfg
        if c.auto == "none" or (c.auto == "randaugment" and c.num_ops == 0):
            return np.full((b, 0), -1), np.zeros((b, 0))
        slots = 1 if c.auto == "trivialaugment" else c.num_ops
        ops = rng.integers(0, len(OPS), (b, slots))
        if c.auto == "trivialaugment":
            mag = rng.uniform(0, 10, (b, slots))
        else:
            mag = c.magnitude + rng.normal(0, 1, (b, slots)) * c.magnitude_std \
                if c.magnitude_std > 0 else np.full((b, slots), c.magnitude)
            skip = rng.uniform(0, 1, (b, slots)) >= c.op_prob
            ops = np.where(skip, -1, ops)
        sign = np.where(rng.uniform(0, 1, (b, slots)) < 0.5, -1.0, 1.0)
        return ops, np.clip(mag, 0, 10) / 10 * sign

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

    def images(self, images_uint8: torch.Tensor, key: tuple, device,
               dtype=torch.float32) -> torch.Tensor:
        """uint8 [b, H, W, 3] -> augmented, normalized [b, 3, S, S] of ``dtype`` on ``device``."""
        c, s = self.cfg, self.image_size
        x = to_device_uint8(images_uint8, device).permute(0, 3, 1, 2).float().div_(255)
        b = x.shape[0]
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
        grid = F.affine_grid(torch.as_tensor(theta[:, :2], dtype=torch.float32).to(x.device),
                             [b, 3, s, s], align_corners=False)
        # sample x - 0.5 with zero padding: what a warp pulls in from outside is mid-grey
        x = F.grid_sample(x - 0.5, grid, mode="bilinear", padding_mode="zeros",
                          align_corners=False).add_(0.5).clamp_(0, 1)

        for slot in range(ops.shape[1]):
            for k, name in enumerate(OPS):
                if name in GEOMETRIC or name == "identity":
                    continue
                idx = np.nonzero(ops[:, slot] == k)[0]
                if len(idx):
                    i = torch.as_tensor(idx, device=x.device)
                    m = torch.as_tensor(np.abs(mag[idx, slot]), dtype=x.dtype).to(x.device)
                    sg = torch.as_tensor(np.sign(mag[idx, slot]), dtype=x.dtype).to(x.device)
                    x[i] = _colour(name, x[i], m.view(-1, 1, 1, 1), sg.view(-1, 1, 1, 1))

        mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        if c.erase_prob > 0:
            x = self._erase(x, rng, key)
        lam, box = self.mix_params(b, key)
        if lam < 1.0:
            if box is None:
                x = x * lam + x.flip(0) * (1 - lam)
            else:
                y0, y1, x0, x1 = (round(v * s) for v in box)
                x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
        return x.to(dtype).contiguous()

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

    def _erase(self, x: torch.Tensor, rng, key) -> torch.Tensor:
        """timm's RandomErasing (area 2-33%, log-aspect 0.3-3.3, per-pixel normal noise)."""
        b, _, hgt, wid = x.shape
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
        if not do.any():
            return x
        dev = x.device
        t = lambda v: torch.as_tensor(v).to(dev).view(-1, 1, 1, 1)  # noqa: E731
        yy = torch.arange(hgt, device=dev).view(1, 1, -1, 1)
        xx = torch.arange(wid, device=dev).view(1, 1, 1, -1)
        mask = (t(do) & (yy >= t(top)) & (yy < t(top + eh)) & (xx >= t(left))
                & (xx < t(left + ew)))
        gen = torch.Generator(device=dev).manual_seed(
            int(_rng(self.seed, (self.rank, *key), 3).integers(2**62)))
        noise = torch.randn(x.shape, generator=gen, device=dev, dtype=x.dtype)
        return torch.where(mask, noise, x)


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
        k = torch.tensor([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=x.dtype, device=x.device) / 13
        smooth = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"),
                          k.expand(3, 1, 3, 3).contiguous(), groups=3)
        return _blend(x, smooth, factor)
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


def prepare_batch(augment: BatchAugment | None, images, labels: torch.Tensor, key,
                  image_size: int, device, dtype=torch.float32, first_stage: bool = True):
    """(model input or None, targets on ``device``) for one microbatch; ``key`` None (eval) or
    no ``augment`` gives the plain eval transform and the labels."""
    from vitgraph.data.loader import to_model_input
    if augment is None or key is None:
        x = to_model_input(images, image_size, device, dtype) if first_stage else None
        return x, labels.to(device, non_blocking=True)
    x = augment.images(images, key, device, dtype) if first_stage else None
    return x, augment.targets(labels, key).to(device, non_blocking=True)
