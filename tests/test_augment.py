"""Batched augmentation (data.augment): shapes, determinism under a seed, and each piece."""
import dataclasses

import numpy as np
import pytest
import torch

from vitgraph.config import ConfigError, load_config
from vitgraph.data import to_model_input
from vitgraph.data.augment import COLOUR, AugmentConfig, BatchAugment, _colour, prepare_batch

from conftest import ROOT


def batch(b=8, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (b, size, size, 3), generator=g, dtype=torch.uint8),
            torch.arange(b) % 5)


def aug(**kw):
    return AugmentConfig(enabled=True, **kw)


def test_shapes_and_determinism_under_a_seed():
    images, labels = batch()
    a = BatchAugment(aug(), image_size=24, num_classes=5, label_smoothing=0.1, seed=7)
    x1, x2 = a.images(images, (3, 0), "cpu"), a.images(images, (3, 0), "cpu")
    assert x1.shape == (8, 3, 24, 24) and x1.dtype == torch.float32
    assert torch.equal(x1, x2)  # same seed, step and microbatch: the same batch
    assert torch.isfinite(x1).all()
    assert not torch.equal(x1, a.images(images, (4, 0), "cpu"))  # another step
    assert not torch.equal(x1, a.images(images, (3, 1), "cpu"))  # another microbatch
    other_seed = BatchAugment(aug(), 24, 5, 0.1, seed=8)
    assert not torch.equal(x1, other_seed.images(images, (3, 0), "cpu"))
    other_rank = BatchAugment(aug(), 24, 5, 0.1, seed=7, rank=1)
    assert not torch.equal(x1, other_rank.images(images, (3, 0), "cpu"))
    t = a.targets(labels, (3, 0))
    assert t.shape == (8, 5) and torch.allclose(t.sum(1), torch.ones(8))
    assert torch.equal(t, a.targets(labels, (3, 0)))


def test_eval_and_disabled_paths_are_the_plain_transform():
    images, labels = batch()
    plain = to_model_input(images, 24, "cpu", torch.float32)
    a = BatchAugment(aug(), 24, 5, 0.0, seed=0)
    x, y = prepare_batch(a, images, labels, None, 24, "cpu")  # eval: key None
    assert torch.equal(x, plain) and torch.equal(y, labels)
    x, y = prepare_batch(None, images, labels, (0, 0), 24, "cpu")
    assert torch.equal(x, plain) and torch.equal(y, labels)
    x, y = prepare_batch(a, images, labels, (0, 0), 24, "cpu", first_stage=False)
    assert x is None and y.shape == (8, 5)  # a last pipeline stage: targets without images


def test_crop_and_flip():
    images, _ = batch(b=64, size=16)
    base = to_model_input(images, 16, "cpu", torch.float32)
    ident = BatchAugment(aug(crop_scale_min=1.0, crop_ratio_min=1.0, crop_ratio_max=1.0,
                             flip=0.0, auto="none", mixup_alpha=0, cutmix_alpha=0,
                             erase_prob=0), 16, 5)
    assert torch.allclose(ident.images(images, (0, 0), "cpu"), base, atol=1e-5)
    flip = BatchAugment(dataclasses.replace(ident.cfg, flip=1.0), 16, 5)
    assert torch.allclose(flip.images(images, (0, 0), "cpu"), base.flip(-1), atol=1e-5)
    half = BatchAugment(dataclasses.replace(ident.cfg, flip=0.5), 16, 5)
    out = half.images(images, (0, 0), "cpu")
    flipped = [torch.allclose(o, b.flip(-1), atol=1e-5) for o, b in zip(out, base)]
    assert 16 < sum(flipped) < 48
    # a crop of a quarter of the area shows a smaller part of the image, upscaled: a linear
    # ramp image keeps its direction but spans a smaller range
    ramp = torch.linspace(0, 255, 32).round().to(torch.uint8).view(1, 1, 32, 1).expand(4, 32, 32, 3)
    crop = BatchAugment(dataclasses.replace(ident.cfg, crop_scale_min=0.25, crop_scale_max=0.25),
                        32, 5).images(ramp.contiguous(), (0, 0), "cpu")
    span = crop[:, 0, 0, -1] - crop[:, 0, 0, 0]
    assert ((span > 0.7) & (span < 1.3)).all()  # [-1, 1] -> full span 2; half the width ~1


def test_mixup_and_cutmix_targets_match_the_images():
    images, _ = batch(b=6)
    labels, n = torch.arange(6), 6  # distinct: sample i's partner (5 - i) has another class
    mix = BatchAugment(aug(crop_scale_min=1.0, crop_ratio_min=1.0, crop_ratio_max=1.0,
                           flip=0.0, auto="none", cutmix_alpha=0, erase_prob=0), 32, n, 0.1)
    lam, box = mix.mix_params(6, (0, 0))
    assert box is None and 0 < lam < 1
    base = to_model_input(images, 32, "cpu", torch.float32)
    x = mix.images(images, (0, 0), "cpu")
    assert torch.allclose(x, lam * base + (1 - lam) * base.flip(0), atol=1e-5)
    t = mix.targets(labels, (0, 0))
    one = torch.nn.functional.one_hot(labels, n).float() * 0.9 + 0.1 / n
    assert torch.allclose(t, lam * one + (1 - lam) * one.flip(0))

    cut = BatchAugment(dataclasses.replace(mix.cfg, mixup_alpha=0, cutmix_alpha=1.0), 32, n)
    x = cut.images(images, (1, 0), "cpu")
    from_partner = (x - base.flip(0)).abs().amax(1) < 1e-5
    from_self = (x - base).abs().amax(1) < 1e-5
    assert (from_partner | from_self).all()
    area = from_partner[0].float().mean().item()
    assert 0 < area < 1
    t = cut.targets(labels, (1, 0))
    assert t[0, 5].item() == pytest.approx(area, abs=1e-6) and t[0, 0] == pytest.approx(1 - area)


def test_every_colour_op_keeps_range_and_changes_something():
    x = torch.rand(4, 3, 16, 16) * 0.6 + 0.2
    for name in COLOUR:
        if name == "identity":
            continue
        y = _colour(name, x.clone(), torch.full((4, 1, 1, 1), 0.9), torch.ones(4, 1, 1, 1))
        assert y.shape == x.shape and y.min() >= 0 and y.max() <= 1, name
        assert not torch.allclose(y, x, atol=1e-3), name


@pytest.mark.parametrize("auto", ["randaugment", "trivialaugment"])
def test_auto_augment_and_erasing_change_images(auto):
    images, _ = batch(b=32)
    cfg = aug(crop_scale_min=1.0, crop_ratio_min=1.0, crop_ratio_max=1.0, flip=0.0, auto=auto,
              mixup_alpha=0, cutmix_alpha=0, erase_prob=0.0, op_prob=1.0)
    base = to_model_input(images, 32, "cpu", torch.float32)
    x = BatchAugment(cfg, 32, 5).images(images, (0, 0), "cpu")
    changed = (x - base).abs().flatten(1).amax(1) > 1e-3
    assert changed.sum() >= 16  # identity and weak draws leave some alone
    erased = BatchAugment(dataclasses.replace(cfg, auto="none", erase_prob=1.0), 32, 5)
    x = erased.images(images, (0, 0), "cpu")
    frac = ((x - base).abs() > 1e-6).float().mean((1, 2, 3))
    assert ((frac > 0.01) & (frac < 0.4)).all()


def test_config_section_and_validation():
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                      ["data.augment.enabled=true", "data.augment.auto=trivialaugment"])
    assert cfg.data.augment.enabled and cfg.data.augment.auto == "trivialaugment"
    assert cfg.data.augment.mixup_alpha == 0.8
    with pytest.raises(ConfigError, match="data.augment.auto"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.auto=autoaug"])
    with pytest.raises(ConfigError, match="erase_prob"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.erase_prob=2"])
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.mixup=0.2"])
