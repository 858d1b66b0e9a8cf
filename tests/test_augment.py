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
    assert cfg.data.augment.mixup_alpha == 0.0  # the tiny config's preset is light
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.preset=deit"])
    assert cfg.data.augment.mixup_alpha == 0.8
    with pytest.raises(ConfigError, match="data.augment.auto"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.auto=autoaug"])
    with pytest.raises(ConfigError, match="erase_prob"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.erase_prob=2"])
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.mixup=0.2"])


# ---------------------------------------------------------------- presets

def test_presets_resolve_and_an_explicit_key_wins():
    from vitgraph.data.augment import PRESETS
    keys = [f.name for f in dataclasses.fields(AugmentConfig) if f.name not in
            ("enabled", "preset")]
    for name, values in PRESETS.items():
        assert sorted(values) == sorted(keys), name  # every preset sets every key
        c = AugmentConfig(preset=name)
        assert {k: getattr(c, k) for k in keys} == values
    # the default is deit, and deit is the recipe the keys defaulted to before presets
    assert AugmentConfig().preset == "deit"
    assert (AugmentConfig().crop_scale_min, AugmentConfig().auto, AugmentConfig().mixup_alpha,
            AugmentConfig().erase_prob) == (0.08, "randaugment", 0.8, 0.25)
    light = AugmentConfig(enabled=True, preset="light", crop_scale_min=0.5, flip=None)
    assert light.crop_scale_min == 0.5 and light.flip == 0.0 and not light.mixes
    assert AugmentConfig(preset="light", flip=0.5).flip == 0.5
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                      ["data.augment.enabled=true", "data.augment.preset=deit3",
                       "data.augment.color_jitter=0.1", "data.augment.mixup_alpha=0.8"])
    a = cfg.data.augment
    assert (a.preset, a.auto, a.color_jitter, a.mixup_alpha, a.cutmix_alpha, a.erase_prob) == \
        ("deit3", "3augment", 0.1, 0.8, 1.0, 0.0)


def test_small_configs_name_light_and_stay_off():
    from vitgraph.data.augment import PRESETS
    for name in ("vit-tiny-shapes.yaml", "clip-tiny-shapes.yaml", "vit-tiny-shapes-native.yaml"):
        a = load_config(ROOT / "configs" / name).data.augment
        assert not a.enabled and a.preset == "light", name
        on = load_config(ROOT / "configs" / name, ["data.augment.enabled=true"]).data.augment
        assert on.enabled and not on.mixes and on.auto == "none" and on.erase_prob == 0
        assert on.crop_scale_min == PRESETS["light"]["crop_scale_min"] > 0.08


def test_a_bad_preset_names_the_key():
    with pytest.raises(ConfigError, match=r"data\.augment\.preset='deit4'.*did you mean"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.preset=deit4"])
    with pytest.raises(ConfigError, match=r"data\.augment\.preset"):
        AugmentConfig(preset="strong")
    with pytest.raises(ConfigError, match="data.augment.color_jitter"):
        load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.color_jitter=1.5"])
    # native packs cannot blur (an image's neighbouring patches): 3-Augment is refused there
    with pytest.raises(ConfigError, match="data.augment.auto='3augment'"):
        load_config(ROOT / "configs" / "vit-tiny-shapes-native.yaml",
                    ["data.augment.enabled=true", "data.augment.preset=deit3",
                     "data.augment.cutmix_alpha=0"])


def test_resolved_config_saves_and_resumes(tmp_path):
    import yaml

    from vitgraph.train.runcheck import save_config
    from vitgraph.train.runcheck import config_changes
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["data.augment.enabled=true"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["data"]["augment"]["erase_prob"] == 0.0  # the resolved values are saved
    again = load_config(tmp_path / "config.yaml")
    assert config_changes(saved, again.to_dict()) == []
    assert again.data.augment == cfg.data.augment
    # a run saved before presets existed (no preset key, the deit values) resumes unchanged
    old = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                      ["data.augment.preset=deit"]).to_dict()
    del old["data"]["augment"]["preset"], old["data"]["augment"]["color_jitter"]
    assert config_changes(old, load_config(ROOT / "configs" / "vit-tiny-shapes.yaml",
                                           ["data.augment.preset=deit"]).to_dict()) == []
    changed = config_changes(saved, load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", [
        "data.augment.enabled=true", "data.augment.preset=deit"]).to_dict())
    assert ("data.augment.erase_prob", 0.0, 0.25) in changed


@pytest.mark.parametrize("preset", ["light", "deit", "deit3"])
def test_each_presets_draws_are_in_range(preset):
    from vitgraph.data.augment import JITTER, TABLE, THREE_AUGMENT, _rng
    c = AugmentConfig(enabled=True, preset=preset)
    a = BatchAugment(c, 32, 10)
    rng = _rng(0, (0, 0, 0), 1)
    n = 4000
    w, h, cx, cy, flip = a._crop_params(rng, n)
    area = w * h
    whole = (w == 1) & (h == 1)
    assert ((area >= c.crop_scale_min - 1e-9) & (area <= c.crop_scale_max + 1e-9) | whole).all()
    assert ((cx - w / 2 >= -1e-9) & (cx + w / 2 <= 1 + 1e-9)).all()
    assert abs(flip.mean() - c.flip) < 0.05
    ops, mag = a._op_params(rng, n)
    assert ((ops >= -1) & (ops < len(TABLE))).all() and (np.abs(mag) <= 1 + 1e-12).all()
    if preset == "light":
        assert ops.shape == (n, 0) and not c.mixes and c.erase_prob == 0
    elif preset == "deit":
        assert ops.shape == (n, 2) and ops.max() < len(TABLE) - 2  # RandAugment's own ops
        assert 0.4 < (ops >= 0).mean() < 0.6  # op_prob 0.5
    else:
        assert ops.shape == (n, 4) and (ops >= 0).all()
        names = np.array(TABLE)[ops]
        # exactly one of 3-Augment's ops per image, each a third of the time
        assert np.isin(names[:, 0], THREE_AUGMENT).all()
        for op in THREE_AUGMENT:
            assert 0.3 < (names[:, 0] == op).mean() < 0.37, op
        blur = names[:, 0] == "blur"
        assert ((mag[blur, 0] >= 0.05) & (mag[blur, 0] <= 1)).all()  # sigma 0.1-2 px
        assert (mag[names[:, 0] == "solarize", 0] == 0.5).all()  # PIL's threshold 128
        # then colour jitter: brightness, contrast and saturation once each, in random order
        assert all(sorted(row) == sorted(JITTER) for row in names[:200, 1:])
        assert len({tuple(row) for row in names[:, 1:]}) == 6
        factor = 1 + 0.9 * mag[:, 1:]
        assert ((factor >= 0.7 - 1e-9) & (factor <= 1.3 + 1e-9)).all()
        assert factor.min() < 0.72 and factor.max() > 1.28
        lam, box = a.mix_params(32, (0, 0))
        assert box is not None  # cutmix alone (mixup off)


def test_deit3_applies_exactly_one_of_its_ops_per_image():
    from vitgraph.data.augment import TABLE, _blur, _rng
    images, _ = batch(b=60)
    cfg = AugmentConfig(enabled=True, preset="deit3", crop_scale_min=1.0, crop_ratio_min=1.0,
                        crop_ratio_max=1.0, flip=0.0, color_jitter=0.0, cutmix_alpha=0.0)
    a = BatchAugment(cfg, 32, 5)
    x = a.images(images, (2, 0), "cpu")
    rng = _rng(0, (0, 2, 0), 1)
    a._crop_params(rng, 60)
    ops, mag = a._op_params(rng, 60)
    names = np.array(TABLE)[ops[:, 0]]
    base = images.permute(0, 3, 1, 2).float() / 255
    from vitgraph.data.loader import MEAN, STD
    y = x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)  # [0, 1]
    for i, name in enumerate(names):
        gray = torch.allclose(y[i, 0], y[i, 1], atol=1e-5) and torch.allclose(y[i, 1], y[i, 2],
                                                                             atol=1e-5)
        solar = torch.allclose(y[i], torch.where(base[i] >= 0.5, 1 - base[i], base[i]), atol=1e-5)
        blurred = _blur(base[i:i + 1], torch.tensor([2.0 * mag[i, 0]], dtype=torch.float32))
        blur = torch.allclose(y[i], blurred[0], atol=1e-5)
        assert (gray, solar, blur) == (name == "grayscale", name == "solarize",
                                       name == "blur"), (i, name)
    assert len(set(names)) == 3


def test_grayscale_and_blur_numerics():
    from vitgraph.data.augment import _blur
    x = torch.rand(3, 3, 20, 20)
    g = _colour("grayscale", x, torch.zeros(3, 1, 1, 1), torch.ones(3, 1, 1, 1))
    assert torch.equal(g[:, 0], g[:, 1]) and torch.equal(g[:, 1], g[:, 2])
    want = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    assert torch.allclose(g[:, 0], want, atol=1e-6)
    flat = torch.full((2, 3, 16, 16), 0.3)
    assert torch.allclose(_colour("blur", flat, torch.full((2, 1, 1, 1), 1.0),
                                  torch.ones(2, 1, 1, 1)), flat, atol=1e-6)
    # a point spreads into a normalised gaussian of each image's own sigma
    delta = torch.zeros(2, 3, 33, 33)
    delta[:, :, 16, 16] = 1.0
    y = _blur(delta, torch.tensor([1.0, 1.5]))
    assert torch.allclose(y.sum((2, 3)), torch.ones(2, 3), atol=1e-5)
    t = torch.arange(33.0) - 16
    var = (y[:, 0].sum(1) * t ** 2).sum(1)  # the spread along x
    assert var[0] == pytest.approx(1.0, rel=0.02) and var[1] == pytest.approx(2.25, rel=0.02)
    assert torch.allclose(y[:, 0], y[:, 0].transpose(-1, -2), atol=1e-7)  # separable, square
    tiny = _blur(x, torch.full((3,), 0.1))  # sigma 0.1: nearly the image
    assert torch.allclose(tiny, x, atol=1e-4)


def test_presets_run_end_to_end_and_deterministically():
    images, labels = batch(b=16)
    for preset in ("light", "deit", "deit3"):
        a = BatchAugment(AugmentConfig(enabled=True, preset=preset), 24, 5, 0.1, seed=1)
        x = a.images(images, (1, 0), "cpu")
        assert x.shape == (16, 3, 24, 24) and torch.isfinite(x).all()
        assert torch.equal(x, a.images(images, (1, 0), "cpu")), preset
        t = a.targets(labels, (1, 0))
        assert t.shape == ((16,) if preset == "light" else (16, 5))


def test_native_packs_draw_colour_jitter_with_their_own_ops():
    from vitgraph.data.native import OPS as PACK_OPS
    from vitgraph.data.native import PackAugment
    cfg = AugmentConfig(enabled=True, preset="light", color_jitter=0.3)
    flip, ops, mag = (t.numpy() for t in PackAugment(cfg).draw(50, (0, 0))[:3])
    assert ops.shape == (50, 3) and flip.shape == (50,)
    names = np.array(PACK_OPS)[ops]
    assert all(sorted(r) == ["brightness", "color", "contrast"] for r in names)
    assert ((1 + 0.9 * mag >= 0.7 - 1e-9) & (1 + 0.9 * mag <= 1.3 + 1e-9)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["light", "deit", "deit3"])
def test_presets_on_the_gpu_match_the_cpu(preset):
    """The draws are the host's, the ops (blur and grayscale included) batched on the device:
    the same batch as on the CPU up to float rounding (equalize and posterize round to 8 bits,
    so a pixel there may differ by a level). The erasing noise is a hash of integers, then
    log / cos: equal up to their rounding on each device."""
    images, labels = batch(b=32, size=40)
    a = BatchAugment(AugmentConfig(enabled=True, preset=preset, erase_prob=0.5), 32, 5, 0.1,
                     seed=3)
    for key in ((0, 0), (7, 1)):
        cpu = a.images(images, key, "cpu")
        gpu = a.images(images.cuda(), key, "cuda").cpu()
        close = ((gpu - cpu).abs() < 1e-4).float().mean()
        assert close > 0.999, (preset, key, close)
        assert torch.equal(a.targets(labels, key), a.targets(labels.cuda(), key).cpu())


# ---------------------------------------------------------------- the device function

def old_images(a, images_uint8, key, noise=None):
    """The eager implementation before the draws and the device function were split (per-op
    Python loops, indexing by the draws), kept as the reference. ``noise(x)``: the erasing
    noise; None draws it as it did, from a torch generator."""
    from vitgraph.data.augment import GEOMETRIC, TABLE, _rng
    from vitgraph.data.loader import MEAN, STD
    c, s = a.cfg, a.image_size
    x = images_uint8.permute(0, 3, 1, 2).float().div_(255)
    b = x.shape[0]
    rng = _rng(a.seed, (a.rank, *key), 1)
    w, h, cx, cy, flip = a._crop_params(rng, b)
    ops, mag = a._op_params(rng, b)
    theta = np.zeros((b, 3, 3))
    theta[:, 0, 0] = w * np.where(flip, -1.0, 1.0)
    theta[:, 1, 1] = h
    theta[:, 0, 2], theta[:, 1, 2] = 2 * cx - 1, 2 * cy - 1
    theta[:, 2, 2] = 1
    for slot in range(ops.shape[1]):
        theta = theta @ a._geometric(ops[:, slot], mag[:, slot])
    grid = torch.nn.functional.affine_grid(torch.as_tensor(theta[:, :2], dtype=torch.float32),
                                           [b, 3, s, s], align_corners=False)
    x = torch.nn.functional.grid_sample(x - 0.5, grid, mode="bilinear", padding_mode="zeros",
                                        align_corners=False).add_(0.5).clamp_(0, 1)
    for slot in range(ops.shape[1]):
        for k, name in enumerate(TABLE):
            if name in GEOMETRIC or name == "identity":
                continue
            idx = np.nonzero(ops[:, slot] == k)[0]
            if len(idx):
                m = torch.as_tensor(np.abs(mag[idx, slot]), dtype=x.dtype)
                sg = torch.as_tensor(np.sign(mag[idx, slot]), dtype=x.dtype)
                x[idx] = _colour(name, x[idx], m.view(-1, 1, 1, 1), sg.view(-1, 1, 1, 1))
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    if c.erase_prob > 0:
        x = old_erase(a, x, rng, key, noise)
    lam, box = a.mix_params(b, key)
    if lam < 1.0:
        if box is None:
            x = x * lam + x.flip(0) * (1 - lam)
        else:
            y0, y1, x0, x1 = (round(v * s) for v in box)
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
    return x.contiguous()


def old_erase(a, x, rng, key, noise):
    import math

    from vitgraph.data.augment import _rng
    b, _, hgt, wid = x.shape
    area = rng.uniform(0.02, 1 / 3, (b, 10)) * hgt * wid
    logr = rng.uniform(math.log(0.3), math.log(1 / 0.3), (b, 10))
    eh = np.round(np.sqrt(area * np.exp(logr))).astype(int)
    ew = np.round(np.sqrt(area / np.exp(logr))).astype(int)
    ok = (eh < hgt) & (ew < wid) & (eh > 0) & (ew > 0)
    rows, first = np.arange(b), ok.argmax(1)
    do = (rng.uniform(0, 1, b) < a.cfg.erase_prob) & ok.any(1)
    eh, ew = eh[rows, first], ew[rows, first]
    top = (rng.uniform(0, 1, b) * (hgt - eh + 1)).astype(int)
    left = (rng.uniform(0, 1, b) * (wid - ew + 1)).astype(int)
    if not do.any():
        return x
    t = lambda v: torch.as_tensor(v).view(-1, 1, 1, 1)  # noqa: E731
    yy = torch.arange(hgt).view(1, 1, -1, 1)
    xx = torch.arange(wid).view(1, 1, 1, -1)
    mask = (t(do) & (yy >= t(top)) & (yy < t(top + eh)) & (xx >= t(left))
            & (xx < t(left + ew)))
    if noise is None:
        gen = torch.Generator().manual_seed(int(_rng(a.seed, (a.rank, *key), 3).integers(2**62)))
        return torch.where(mask, torch.randn(x.shape, generator=gen), x)
    return torch.where(mask, noise(x), x)


def new_noise(a, key):
    """The device function's erasing noise for microbatch ``key``, as a reference noise."""
    from vitgraph.data.augment import _noise
    return lambda x: _noise(a.draw(x.shape[0], key).noise, x)


CASES = {  # each preset, and each op / mix / erase alone
    "light": dict(preset="light"),
    "deit": dict(preset="deit"),
    "deit3": dict(preset="deit3"),
    "deit3+mixup": dict(preset="deit3", mixup_alpha=0.8),
    "randaugment-all-ops": dict(preset="deit", op_prob=1.0, num_ops=3, mixup_alpha=0,
                                cutmix_alpha=0, erase_prob=0),
    "trivialaugment+jitter": dict(preset="deit", auto="trivialaugment", color_jitter=0.4,
                                  mixup_alpha=0, cutmix_alpha=0, erase_prob=0),
    "mixup": dict(preset="light", mixup_alpha=0.8),
    "cutmix": dict(preset="light", cutmix_alpha=1.0),
    "erase": dict(preset="light", erase_prob=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_device_function_gives_the_old_images_and_targets(case):
    """Bit-equal (torch.equal) to the old eager code for the same seed and key, every op
    included; the erasing noise is the one thing drawn differently (a counter-based hash of
    a per-image seed instead of a torch generator), so it is compared with that noise put into
    the old code, and the erased pixels (old noise) are checked apart."""
    images, labels = batch(b=24, size=40)
    a = BatchAugment(AugmentConfig(enabled=True, **CASES[case]), 32, 5, 0.1, seed=3, rank=1)
    for key in ((0, 0), (5, 1), (11, 2)):
        new = a.images(images, key, "cpu")
        assert torch.equal(new, old_images(a, images, key, new_noise(a, key))), (case, key)
        assert torch.equal(a.targets(labels, key), a.targets(labels.clone(), key))
        if a.cfg.erase_prob == 0:
            assert torch.equal(new, old_images(a, images, key)), (case, key)
        elif not a.cfg.mixes:  # the old generator's noise: the same pixels erased, others
            old = old_images(a, images, key)
            erased = a.draw(24, key).erase
            assert (erased[:, 1] > erased[:, 0]).any()
            differs = (new != old).any(1)
            for i, (y0, y1, x0, x1) in enumerate(erased.tolist()):
                inside = torch.zeros(32, 32, dtype=torch.bool)
                inside[y0:y1, x0:x1] = True
                assert torch.equal(differs[i], inside), (case, key, i)


def test_the_erasing_noise_is_standard_normal_and_keyed():
    from vitgraph.data.augment import _noise
    like = torch.zeros(64, 3, 32, 32)
    z = _noise(torch.arange(64) * 7919, like)
    assert z.shape == like.shape and torch.isfinite(z).all()
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert abs(z.flatten(1).std(1).mean().item() - 1) < 0.02
    assert abs(((z.abs() < 1).float().mean()).item() - 0.6827) < 0.005
    # one image's noise depends on its seed alone, not on its neighbours
    assert torch.equal(z[5:6], _noise(torch.tensor([5 * 7919]), like[:1]))
    assert not torch.equal(z[0], z[1])
    assert torch.corrcoef(z[:2].flatten(1))[0, 1].abs() < 0.05


@pytest.mark.parametrize("preset", ["deit", "deit3"])
def test_the_device_functions_shapes_do_not_depend_on_the_draws(preset):
    """The parameters' shapes follow the config and the micro-batch only, and so do the
    kernels: an op nobody drew, a mix that did not happen, no erasing, all run the same
    shapes (a step graph replays one recording for any draw)."""
    images, _ = batch(b=16, size=40)
    a = BatchAugment(AugmentConfig(enabled=True, preset=preset), 32, 5, seed=0)
    shapes = {tuple((tuple(t.shape), t.dtype) for t in a.draw(16, (k, 0))) for k in range(20)}
    assert len(shapes) == 1
    p = a.draw(16, (0, 0))
    none = p._replace(ops=torch.full_like(p.ops, -1), mag=torch.zeros_like(p.mag),
                      erase=torch.zeros_like(p.erase),
                      mix=torch.tensor([1.0, 0.0, 0, 0, 0, 0]))
    kernels = []
    for params in (p, none):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = a.apply(images, params)
        assert out.shape == (16, 3, 32, 32) and torch.isfinite(out).all()
        kernels.append([(e.name, str(e.input_shapes)) for e in prof.events()
                        if e.name.startswith("aten::")])
    assert kernels[0] == kernels[1]
    # no draw at all: the crop and nothing else, as the eval transform without a resize
    plain = a.apply(images[:, 4:36, 4:36].contiguous(), none._replace(
        theta=torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]).expand(16, 2, 3)))
    assert torch.allclose(plain, to_model_input(images[:, 4:36, 4:36], 32, "cpu",
                                                torch.float32), atol=1e-5)


# ---------------------------------------------------------------- in the trainer

def _train(run_dir, *over):
    """Six steps of the tiny config with the deit preset (RandAugment, mixup / cutmix,
    erasing), two microbatches a step; the loss of each step."""
    import json

    from conftest import tiny_overrides
    from vitgraph.train.loop import train
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", tiny_overrides(run_dir, 6, **{
        "train.log_every": 1, "data.num_train": 128, "data.num_val": 32,
        "train.global_batch_size": 16, "train.micro_batch_size": 8, "checkpoint.every": 3,
        "checkpoint.keep": 5, "data.augment.enabled": "true", "data.augment.preset": "deit",
        "data.augment.erase_prob": 0.5}) + list(over))
    train(cfg)
    recs = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, recs


def test_step_graphs_train_the_eager_curve_with_augmentation_and_resume_onto_it(tmp_path):
    """The augmentation runs in the task's forward, inside the step: graphs.scope=step (the
    CPU rerun backend: the captured step replayed with each step's images and parameters
    copied into its inputs) trains the eager curve exactly, and a run resumed from its
    step-3 checkpoint continues it exactly (the draws are keyed by step and microbatch)."""
    import shutil
    eager, _ = _train(tmp_path / "eager")
    assert sorted(eager) == list(range(1, 7))
    assert "mixup 0.8 / cutmix 1 (p 1, cutmix share 0.5), erasing 0.5" in (
        tmp_path / "eager" / "train.log").read_text()
    graphed, recs = _train(tmp_path / "step", "graphs.enabled=true", "graphs.scope=step",
                           "graphs.warmup_steps=2")
    assert [r for r in recs if "loss" in r][-1]["graphs_replays"] > 0
    assert graphed == eager
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "step", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000006")
    (resumed / "checkpoints" / "latest").write_text("step_000003\n")
    for name in ("log.jsonl", "metrics.json"):  # a finished run is not trained again
        (resumed / name).unlink()
    got, _ = _train(resumed, "graphs.enabled=true", "graphs.scope=step",
                    "graphs.warmup_steps=1")
    assert got == {s: eager[s] for s in (4, 5, 6)}


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["deit", "deit3"])
def test_the_device_function_replays_in_a_cuda_graph(preset):
    """Captured once (a host sync or a draw-dependent shape would fail the capture), then
    replayed with other images and parameters copied into its inputs: the eager batch of
    each key, bit for bit (the same kernels on the same inputs)."""
    a = BatchAugment(AugmentConfig(enabled=True, preset=preset, erase_prob=0.5), 32, 5,
                     seed=3)
    dev = torch.device("cuda")
    images = batch(b=32, size=40)[0].to(dev)
    params = a.draw(32, (0, 0)).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (library workspaces)
        a.apply(images, params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = a.apply(images, params)
    for key in ((1, 0), (7, 1), (8, 0)):
        new = batch(b=32, size=40, seed=key[0])[0].to(dev)
        images.copy_(new)
        for static, t in zip(params, a.draw(32, key)):
            static.copy_(t)
        graph.replay()
        assert torch.equal(out, a.images(new, key, dev)), key
