"""GPU: native-resolution packs decoded by nvJPEG and resized and patchified on the device
(through the prefetcher's side stream) give the CPU path's patches up to resampling and JPEG
decoder rounding; the per-image augmentation on the device is the CPU's, repeats exactly and
replays in a CUDA graph."""
import pytest
import torch

from conftest import write_photos
from vitgraph.data import pack_inputs
from vitgraph.data.augment import AugmentConfig
from vitgraph.data.imagefolder import list_classes, read_split_native
from vitgraph.data.native import PackAugment, PackedLoader, PackParams, pack_to_device
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


def test_pack_augmentation_replays_in_a_cuda_graph(tmp_path):
    """PackAugment.apply captured once (a host sync or a draw-dependent shape would fail the
    capture), then replayed with other packs and draws copied into its inputs: the eager
    pack of each key, bit for bit (the same kernels on the same inputs; equalize's
    histogram adds whole numbers)."""
    _photos(tmp_path, n=16)
    classes = list_classes(str(tmp_path / "train"))
    ds = read_split_native(str(tmp_path), "train", classes, workers=4, decode="cpu")
    loader = PackedLoader(ds, SPEC, 1, 0, 1, seed=0)
    a = PackAugment(AugmentConfig(enabled=True, flip=0.5, op_prob=0.7, num_ops=2,
                                  color_jitter=0.3, erase_prob=0.5, mixup_alpha=0,
                                  cutmix_alpha=0), seed=3)
    dev = torch.device("cuda")
    static = [*pack_to_device(loader.next_step()[0], dev),
              *a.draw(SPEC.max_images, (0, 0)).to(dev)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        a.apply(*static[:4], PackParams(*static[5:]))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = a.apply(*static[:4], PackParams(*static[5:]))
    for step in (1, 2, 3):
        fields = pack_to_device(loader.next_step()[0], dev)
        params = a.draw(SPEC.max_images, (step, 0)).to(dev)
        for buf, t in zip(static, [*fields, *params]):
            buf.copy_(t)
        graph.replay()
        assert torch.equal(out, a.apply(*fields[:4], params)), step
