"""GPU: native-resolution training under CUDA graphs, through the Trainer (TE spec, bf16,
megatron DDP + distributed optimizer), one pack per microbatch.

* packed + step graphs == packed eager (the same step body run eagerly) after 20 steps: loss,
  grad norm, parameters; and within bf16 of megatron's own eager step;
* packed + layer graphs (impl local and te: megatron's PackedSeqParams through both) == eager;
* one capture serves >= 100 different packs (step and layer scope): no recapture, no eager
  fallback after the warm-up;
* TE's thd attention under replayed layer graphs keeps the images apart: a pack gives what
  each image gives in a pack of its own;
* each of the above also at head dim 72 (SO400M's), where TE's core attention runs the pack
  in slots (vitgraph.models.specs.THD_HEAD_DIMS);
* the Triton row gather of the slot layout == index_select + where, NaN rows masked;
* padding rows are safe: with the device memory that graph pools and the caching allocator
  hand out filled with NaN beforehand, graphed and eager steps give the same finite loss,
  grad norm and parameters (a row that no kernel writes would carry NaN into them).

Run on the H200:   pytest -m gpu tests/gpu/test_native_gpu.py -v -rs
"""
import random

import pytest
import torch

from vitgraph.config import load_config

from conftest import ROOT, normalise_patches

pytestmark = pytest.mark.gpu

BASE = ["data.kind=shapes", "data.num_train=64", "data.num_val=64", "data.render_size=32",
        "model.num_layers=2", "model.num_classes=10", "train.steps=1000",
        "train.tensorboard=false", "train.progress=false", "train.log_every=1000",
        "data.augment.enabled=false", "train.label_smoothing=0",
        "data.augment.mixup_alpha=0", "data.augment.cutmix_alpha=0",
        "data.resolution=native", "data.packing.max_patches=64",
        "data.packing.tokens_per_microbatch=1024", "data.packing.max_images=16",
        "data.packing.layout=packed",
        "train.micro_batch_size=1", "train.global_batch_size=2",  # two packs a step
        "graphs.enabled=false"]
STEP = ["graphs.enabled=true", "graphs.scope=step"]
# head dim 64 (TE's thd attention) and 72 (SO400M's: the slot layout)
HEAD_DIMS = {"d64": [], "d72": ["model.hidden_size=576", "model.num_heads=8"]}
LAYER = ["graphs.enabled=true", "graphs.scope=layer"]


def make_trainer(tmp_path, *over):
    from vitgraph.train.loop import Trainer
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                      [*BASE, f"run.dir={tmp_path}", *over])
    return Trainer(cfg)


def random_pack(spec, rng: random.Random, g: torch.Generator, grids=None):
    """One raw pack as the loader hands it over (CPU): random grids up to the budget."""
    from vitgraph.data.packing import assemble
    if grids is None:
        grids, used = [], 0
        for _ in range(rng.randint(1, spec.max_images)):
            gh = rng.randint(1, 8)
            grid = (gh, rng.randint(1, spec.max_patches // gh))
            if used + spec.image_tokens(grid) > spec.tokens:
                break
            grids.append(grid)
            used += spec.image_tokens(grid)
    rows = [torch.randint(0, 256, (gh * gw, spec.patch_dim), generator=g, dtype=torch.uint8)
            for gh, gw in grids]
    labels = torch.randint(0, 10, (len(grids),), generator=g).tolist()
    return assemble(rows, grids, labels, spec), rows, grids


def step_data(spec, step: int, n: int = 2) -> list:
    """Step ``step``'s ``n`` packs: the same on every run, different at every step."""
    rng, g = random.Random(step), torch.Generator().manual_seed(step)
    return [random_pack(spec, rng, g)[0] for _ in range(n)]


def run_steps(t, first, last):
    """Steps first+1 .. last as the loop runs them: (loss, grad norm) per step."""
    out = []
    for s in range(first, last):
        t.step = s
        t.graphs.step_begin(s)
        r = t.train_step(step_data(t.plan.pack, s))
        assert bool(r.ok)
        out.append(((r.stats[0] / r.stats[2]).item(), float(r.grad_norm)))
    t.step = last
    return out


def flat(curve):
    return [v for pair in curve for v in pair]


def params(t):
    return [p.detach().float().clone() for c in t.chunks for p in c.parameters()]


def _runs(tmp_path, variants, steps=20):
    runs = {}
    for name, over in variants.items():
        t = make_trainer(tmp_path / name, *over)
        try:
            assert t.plan.pack is not None
            runs[name] = (run_steps(t, 0, steps), params(t), t.graphs.stats() if t.graphs else None)
        finally:
            t.close(shutdown_dist=False)
    return runs


@pytest.mark.parametrize("head", HEAD_DIMS)
def test_packed_step_graphs_equal_packed_eager_after_20_steps(tmp_path, head):
    h = HEAD_DIMS[head]
    runs = _runs(tmp_path, {"eager": h, "step-eager": [*h, *STEP, "graphs.warmup_steps=1000"],
                            "step-graphs": [*h, *STEP, "graphs.warmup_steps=3"]})
    curve, weights, stats = runs["step-graphs"]
    assert stats["captures"] == 1 and stats["replays"] == 17, stats  # 20 steps, one graph
    ref_curve, ref_weights, _ = runs["step-eager"]
    assert flat(curve) == pytest.approx(flat(ref_curve), rel=1e-5), (curve, ref_curve)
    for a, b in zip(weights, ref_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    eager_curve, eager_weights, _ = runs["eager"]  # megatron's optimizer step, host clipping
    assert [c[0] for c in curve] == pytest.approx([c[0] for c in eager_curve], rel=2e-3)
    assert [c[1] for c in curve] == pytest.approx([c[1] for c in eager_curve], rel=2e-2)
    for a, b in zip(weights, eager_weights):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("impl", ["local", "te"])
def test_packed_layer_graphs_equal_packed_eager_after_20_steps(tmp_path, impl):
    runs = _runs(tmp_path, {"eager": [],
                            "graphs": [*LAYER, f"graphs.impl={impl}", "graphs.warmup_steps=3"]})
    curve, weights, stats = runs["graphs"]
    assert stats["captures"] == stats["layers"] == 2, stats  # one slot per layer: every pack
    assert stats["recaptures"] == {} and set(stats["eager_fallbacks"]) == {"warmup"}, stats
    eager_curve, eager_weights, _ = runs["eager"]
    # TE may pick another attention backend under capture: bf16 rounding apart
    assert [c[0] for c in curve] == pytest.approx([c[0] for c in eager_curve], rel=2e-3)
    assert [c[1] for c in curve] == pytest.approx([c[1] for c in eager_curve], rel=2e-2)
    for a, b in zip(weights, eager_weights):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("scope", ["step", "layer"])
def test_one_capture_serves_a_hundred_packs(tmp_path, scope):
    t = make_trainer(tmp_path, "graphs.enabled=true", f"graphs.scope={scope}",
                     "graphs.warmup_steps=2", "graphs.on_new_shape=eager")
    try:
        layouts = set()
        for s in range(105):
            data = step_data(t.plan.pack, s)
            layouts.update(tuple(p[3].tolist()) for p in data)
            t.graphs.step_begin(s)
            r = t.train_step(data)
            assert bool(r.ok)
        assert len(layouts) >= 100
        stats = t.graphs.stats()
    finally:
        t.close(shutdown_dist=False)
    assert stats["unseen_shapes"] == 0 and not any(stats["recaptures"].values()), stats
    if scope == "step":
        assert stats["captures"] == 1 and stats["replays"] == 103, stats
        assert stats["eager_fallbacks"] == {"eager_steps": 2}, stats
    else:
        assert stats["captures"] == stats["slots"] == stats["layers"], stats
        # two warm-up steps of two packs eager; then every layer call a graph (the capture's
        # call counted with the replays)
        assert stats["eager_fallbacks"] == {"warmup": 2 * 2 * stats["layers"]}, stats
        assert stats["replays"] == 103 * 2 * stats["layers"], stats


@pytest.mark.parametrize("head", HEAD_DIMS)
def test_thd_attention_under_layer_graphs_keeps_images_apart(tmp_path, head):
    """After the capture, a graphed forward of a new pack (new cu_seqlens in the static
    buffers) gives each image what it gives alone (eagerly, in a pack of its own)."""
    from vitgraph.models.vit import unwrap
    t = make_trainer(tmp_path, *HEAD_DIMS[head], *LAYER, "graphs.warmup_steps=1")
    try:
        run_steps(t, 0, 3)  # warm-up, capture, replay
        model = unwrap(t.chunks[0])
        spec = t.plan.pack
        rng, g = random.Random(99), torch.Generator().manual_seed(99)
        (patches, coords, seg, cu, _), rows, grids = random_pack(spec, rng, g)
        assert len(grids) >= 3

        dev, dtype = t.d.device, model.patch_embed.weight.dtype

        def on_gpu(patches, coords, seg, cu):
            return (normalise_patches(patches, dev, dtype), coords.to(dev), seg.to(dev), cu.to(dev))

        t.graphs.step_begin(3)
        before = t.graphs.stats()["replays"]
        packed = model(*on_gpu(patches, coords, seg, cu))[:len(grids)].float().detach()
        assert t.graphs.stats()["replays"] > before  # the layers replayed their graphs
        with torch.no_grad():  # eager: graphs run only with grad
            for i, grid in enumerate(grids):
                (p1, c1, s1, cu1, _), _, _ = random_pack(spec, rng, g, grids=[grid])
                p1[spec.num_prefix:spec.num_prefix + grid[0] * grid[1]] = rows[i]
                alone = model(*on_gpu(p1, c1, s1, cu1))[0].float()
                torch.testing.assert_close(packed[i], alone, atol=3e-2, rtol=3e-2)
    finally:
        t.close(shutdown_dist=False)


def poison_device_memory(share: float = 0.6) -> None:
    """Fill ``share`` of the free device memory with NaN and free it: the caching allocator
    keeps the block (eager allocations reuse it) and, after empty_cache, the driver hands the
    same pages to the next graph pool (cudaMalloc does not clear memory)."""
    free, _ = torch.cuda.mem_get_info()
    x = torch.full((int(free * share) // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    del x


@pytest.mark.parametrize("head", HEAD_DIMS)
def test_padding_rows_safe_whatever_the_pool_held(tmp_path, head):
    """Packs with padding runs (most of them: random fills of 1,024 tokens) through step
    graphs and eagerly, each run started on NaN-filled memory: every step finite, and the
    graphed run equal to the same step body run eagerly (loss, grad norm, parameters)."""
    h = HEAD_DIMS[head]
    runs = {}
    for name, over in {"step-eager": [*STEP, "graphs.warmup_steps=1000"],
                       "step-graphs": [*STEP, "graphs.warmup_steps=2"]}.items():
        torch.cuda.empty_cache()
        poison_device_memory()
        if name == "step-graphs":
            torch.cuda.empty_cache()  # the pages go to the driver, then to the graph's pool
        t = make_trainer(tmp_path / name, *h, *over)
        try:
            pads = [int((p[2] == t.plan.pack.max_images).sum()) for s in range(8)
                    for p in step_data(t.plan.pack, s)]
            assert sum(n > 0 for n in pads) >= 12, pads  # padding in most packs
            runs[name] = (run_steps(t, 0, 8), params(t))
        finally:
            t.close(shutdown_dist=False)
    curve, weights = runs["step-graphs"]
    ref_curve, ref_weights = runs["step-eager"]
    assert all(torch.isfinite(torch.tensor(flat(c))).all() for c in (curve, ref_curve))
    assert flat(curve) == pytest.approx(flat(ref_curve), rel=1e-5), (curve, ref_curve)
    for a, b in zip(weights, ref_weights):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_row_gather_equals_index_select(dtype):
    """The Triton row gather of the slot layout (packed._take on the GPU) == index_select +
    where, for a contiguous 2-D input, a strided [T, h, d] view (a slice of a QKV projection)
    and a permuted one; a masked row that holds NaN gives zeros, not NaN."""
    from vitgraph.models import packed as pk
    if pk.triton is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(3000, 3 * 8 * 72, device="cuda", generator=g).to(dtype)
    qkv[::7] = float("nan")
    idx = torch.randint(0, 3000, (4100,), device="cuda", generator=g)
    mask = torch.isfinite(qkv[idx, 0]) & (torch.rand(4100, device="cuda", generator=g) > 0.2)
    strided = qkv.view(3000, 8, 3 * 72)[:, :, 72:144]
    permuted = torch.randn(8, 3000, 72, device="cuda", generator=g).to(dtype).transpose(0, 1)
    for x in (qkv, strided, permuted):
        for m in (None, mask):
            got = pk._take_fused(x, idx, m)
            want = x.reshape(3000, -1).index_select(0, idx)
            if m is not None:
                want = torch.where(m[:, None], want, 0)
            assert got.shape == (4100, *x.shape[1:])
            assert torch.equal(got.reshape(4100, -1).isnan(), want.isnan())
            torch.testing.assert_close(got.reshape(4100, -1), want, rtol=0, atol=0,
                                       equal_nan=True)
