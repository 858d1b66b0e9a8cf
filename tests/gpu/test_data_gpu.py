"""GPU: the prefetcher puts the next step on the device from a side stream (pinned copies);
the main stream then sees exactly the loader's microbatches."""
import pytest
import torch

from conftest import write_photos
from vitgraph.data import ImageDataset, MicrobatchLoader
from vitgraph.data.prefetch import Prefetcher

pytestmark = pytest.mark.gpu


def test_prefetcher_puts_the_loaders_microbatches_on_the_device():
    n = 96
    g = torch.Generator().manual_seed(0)
    ds = ImageDataset(torch.randint(0, 256, (n, 224, 224, 3), dtype=torch.uint8, generator=g),
                      torch.arange(n), ["x"], None)
    plain = MicrobatchLoader(ds, 8, 2, 0, 1, seed=3)
    pre = Prefetcher(MicrobatchLoader(ds, 8, 2, 0, 1, seed=3), "cuda")
    try:
        for _ in range(8):  # across an epoch (6 steps)
            got, want = pre.next_step(), plain.next_step()
            pre.stage_next()  # as the trainer does once a step's kernels are queued
            for (gi, gl), (wi, wl) in zip(got, want):
                assert gi.is_cuda and gl.is_cuda
                # consumed on the main stream while the side stream fills the next step
                assert torch.equal(gi.cpu(), wi)
                assert torch.equal(gl.cpu(), wl)
        assert pre.state_dict() == plain.state_dict()
    finally:
        pre.close()


def test_an_imagefolder_decoded_by_nvjpeg_gives_the_cpu_decoders_pixels(tmp_path):
    """data.decode=cuda on an ImageFolder: JPEGs (photo-sized, two sizes) by nvJPEG, a PNG
    and a CMYK JPEG by the loader's threads, resized on the device, through the prefetcher;
    the pixels are PIL's up to resampling and JPEG decoder rounding."""
    from vitgraph.data.imagefolder import list_classes, read_split
    write_photos(tmp_path, 12, [(375, 500), (500, 375), (500, 375)])
    classes = list_classes(str(tmp_path / "train"))
    cpu = read_split(str(tmp_path), "train", classes, 224, workers=4, preload=True)
    gpu = read_split(str(tmp_path), "train", classes, 224, workers=4, preload=False,
                     decode="cuda")
    pre = Prefetcher(MicrobatchLoader(gpu, 4, 3, 0, 1, seed=1), "cuda")
    plain = MicrobatchLoader(cpu, 4, 3, 0, 1, seed=1)
    try:
        for _ in range(2):
            got, want = pre.next_step(), plain.next_step()
            pre.stage_next()
            for (gi, gl), (wi, wl) in zip(got, want):
                assert gi.is_cuda and gi.shape == wi.shape and torch.equal(gl.cpu(), wl)
                # nvJPEG's IDCT and chroma upsampling differ from libjpeg's at sharp edges (the
                # sawtooth's wraps): some pixels differ by tens, each image's mean by about one
                # level; a wrong, shifted or grey image is off by tens on average
                diff = (gi.cpu().float() - wi.float()).abs().flatten(1).mean(1)
                assert (diff < 4).all(), diff
    finally:
        pre.close()
