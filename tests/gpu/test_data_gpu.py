"""GPU: the prefetcher puts the next step on the device from a side stream (pinned copies);
the main stream then sees exactly the loader's microbatches."""
import pytest
import torch

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
