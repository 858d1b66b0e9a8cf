"""GPU: native-resolution packs decoded by nvJPEG and resized and patchified on the device
(through the prefetcher's side stream) give the CPU path's patches up to resampling and JPEG
decoder rounding; the per-image augmentation on the device is the CPU's and repeats exactly."""
import pytest
import torch

from conftest import write_photos
from vitgraph.data import pack_inputs
from vitgraph.data.augment import AugmentConfig
from vitgraph.data.imagefolder import list_classes, read_split_native
from vitgraph.data.native import PackedLoader
from vitgraph.data.packing import PackSpec
from vitgraph.data.prefetch import Prefetcher

pytestmark = pytest.mark.gpu


def _photos(root, n=16):
    """JPEGs of several sizes and aspect ratios (one large enough for PIL's draft scale)."""
    write_photos(root, n, [(500, 375), (375, 500), (640, 320), (1200, 900), (256, 512), (333, 333)])


SPEC = PackSpec(tokens=2048, max_images=8, max_patches=256, num_prefix=1, patch_size=16)


def test_nvjpeg_packs_through_the_prefetcher_match_the_cpu_path(tmp_path):
    _photos(tmp_path)
    classes = list_classes(str(tmp_path / "train"))
    cpu = read_split_native(str(tmp_path), "train", classes, workers=4, decode="cpu")
    gpu = read_split_native(str(tmp_path), "train", classes, workers=4, decode="cuda")
    crop = AugmentConfig(enabled=True, crop_scale_min=0.3, mixup_alpha=0, cutmix_alpha=0)
    for cfg in (None, crop):
        plain = PackedLoader(cpu, SPEC, 2, 0, 1, seed=1, augment_cfg=cfg)
        pre = Prefetcher(PackedLoader(gpu, SPEC, 2, 0, 1, seed=1, augment_cfg=cfg), "cuda")
        try:
            for _ in range(3):
                got, want = pre.next_step(), plain.next_step()
                pre.stage_next()
                for g, w in zip(got, want):
                    assert all(t.is_cuda for t in g)
                    assert all(torch.equal(a.cpu(), b) for a, b in zip(g[1:], w[1:]))
                    seg = w[2]
                    diff = (g[0].cpu().float() - w[0].float()).abs().mean(1)
                    # per image: nvJPEG's IDCT and upsampling against libjpeg's at PIL's draft
                    # scale, fp16 resize weights (6.5 on an H200 for a small crop); a wrong,
                    # shifted or grey image is off by tens
                    for k in range(int((w[4] >= 0).sum())):
                        assert diff[seg == k].mean() < 10, (k, diff[seg == k].mean())
            assert pre.state_dict() == plain.state_dict()
        finally:
            pre.close()


def test_pack_inputs_on_the_device_are_the_cpus_and_repeat_exactly(tmp_path):
    _photos(tmp_path, n=8)
    classes = list_classes(str(tmp_path / "train"))
    ds = read_split_native(str(tmp_path), "train", classes, workers=4, decode="cpu")
    fields = PackedLoader(ds, SPEC, 1, 0, 1, seed=0).next_step()[0]
    cfg = AugmentConfig(enabled=True, op_prob=1.0, num_ops=3, mixup_alpha=0, cutmix_alpha=0)
    for key in ((0, 0), (1, 0), (2, 0), (5, 0)):
        a = pack_inputs(fields, "cuda", cfg, key, seed=3)
        b = pack_inputs(fields, "cuda", cfg, key, seed=3)
        c = pack_inputs(fields, "cpu", cfg, key, seed=3)
        assert torch.equal(a[0], b[0])  # no atomics in the per-image statistics
        # equal up to float rounding; posterize / equalize may step a level where a value
        # sits on a bin edge and the two devices round it apart
        diff = (a[0].cpu() - c[0]).abs()
        assert (diff > 2e-5).float().mean() < 5e-3, key  # an H200: 1.0e-3 (equalize / posterize bins)
        assert all(torch.equal(x.cpu(), y) for x, y in zip(a[1:], c[1:]))
