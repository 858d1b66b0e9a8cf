"""CPU tests: CUDA graphs over packed (native-resolution) inputs, through the rerun backend.

Layer scope: megatron's PackedSeqParams is a supported layer argument -- its cu_seqlens are
static inputs copied in before each replay, its qkv_format / max_seqlen part of the key --
so one capture per layer serves every pack of a PackSpec. Step scope: a pack is a tuple of
fixed-shape tensors, so one step graph serves every pack. The rerun backend reruns the
captured function on the static inputs: a stale cu_seqlens (not copied in) would give the
previous pack's attention pattern and fail the comparisons with eager below.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from vitgraph.data.packing import PackSpec, layout
from vitgraph.graphs import GraphManager, GraphsConfig, RerunBackend, StepGraphs, tree

from conftest import ROOT, normalise_patches, world_of_one

dist1 = world_of_one("torch")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one intra-op thread (two threads on a shared 2-core machine spin)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

SPEC = PackSpec(tokens=96, max_images=6, max_patches=24, num_prefix=1, patch_size=4)


def random_pack(rng: random.Random, spec: PackSpec = SPEC):
    """(coords, seg, cu_seqlens) of a pack of random grids (1 .. max_images images); its image
    count is seg's largest slot + 1."""
    grids, used = [], 0
    for _ in range(rng.randint(1, spec.max_images)):
        gh = rng.randint(1, 6)
        gw = rng.randint(1, max(1, spec.max_patches // gh))
        n = spec.image_tokens((gh, gw))
        if used + n > spec.tokens:
            break
        grids.append((gh, gw))
        used += n
    return layout(grids, spec)[:3]


def distinct_packs(n: int, seed: int) -> list:
    """``n`` random packs, no two with the same layout."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        p = random_pack(rng)
        if tuple(p[2].tolist()) not in seen:
            seen.add(tuple(p[2].tolist()))
            out.append(p)
    return out


def packed(cu: torch.Tensor, max_len: int = SPEC.max_len) -> PackedSeqParams:
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


class PackedLayer(nn.Module):
    """A TransformerLayer stand-in: attention kept inside each cu_seqlens segment (fixed
    shapes: the mask is built on the device from the offsets), megatron's signature and
    (hidden, context) output; [T, 1, d] in and out."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None):
        p = packed_seq_params
        assert p.qkv_format == "thd" and isinstance(p.max_seqlen_q, int)
        x = hidden_states.squeeze(1)
        t = x.shape[0]
        pos = torch.arange(t, device=x.device)
        seg_q = torch.searchsorted(p.cu_seqlens_q[1:].long(), pos, right=True)
        seg_k = torch.searchsorted(p.cu_seqlens_kv[1:].long(), pos, right=True)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.t()) / p.max_seqlen_q ** 0.5
        scores = scores.masked_fill(seg_q[:, None] != seg_k[None, :], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return (x + self.proj(y)).unsqueeze(1), None


class Stack(nn.Module):
    def __init__(self, n: int = 2, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(PackedLayer(d) for _ in range(n))

    def forward(self, x, params):
        h = x.unsqueeze(1)
        for layer in self.layers:
            h, _ = layer(h, attention_mask=None, packed_seq_params=params)
        return h.squeeze(1)


def manager(layers, **cfg):
    cfg = {"enabled": True, "warmup_steps": 1, "capture_warmup_iters": 1, **cfg}
    return GraphManager(GraphsConfig(**cfg), layers, backend=RerunBackend()).apply()


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


# ----------------------------------------------------------------------------------------------
# the argument itself


def test_packed_seq_params_flatten_to_their_tensors_and_a_hashable_spec():
    cu = torch.tensor([0, 5, 9, 9], dtype=torch.int32)
    p = packed(cu, 7)
    leaves, spec = tree.flatten(((torch.ones(3),), {"packed_seq_params": p}))
    assert len(leaves) == 2 and leaves[1] is cu  # cu_seqlens_kv is the same tensor: one leaf
    hash(spec)
    new = torch.tensor([0, 2, 9, 9], dtype=torch.int32)
    (_, ), kw = tree.unflatten([torch.zeros(3), new], spec)
    back = kw["packed_seq_params"]
    assert type(back) is PackedSeqParams and back.qkv_format == "thd"
    assert back.cu_seqlens_q is new and back.cu_seqlens_kv is new
    assert (back.max_seqlen_q, back.max_seqlen_kv, back.cu_seqlens_q_padded) == (7, 7, None)
    # the constants are the key: another max_seqlen is another graph, another pack is not
    assert tree.flatten(packed(new, 7))[1] == tree.flatten(p)[1]
    assert tree.flatten(packed(cu, 8))[1] != tree.flatten(p)[1]
    apart = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(),
                            max_seqlen_q=7, max_seqlen_kv=7)
    assert len(tree.flatten(apart)[0]) == 2
    with pytest.raises(tree.Unsupported, match="max_seqlen_q"):
        tree.flatten(PackedSeqParams(qkv_format="thd", max_seqlen_q=[7]))


# ----------------------------------------------------------------------------------------------
# layer scope


def inputs_for(n, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.tokens, d, generator=g) for _ in range(n)]


def _run_packs(model, mgr, packs, xs):
    """One step per pack: forward, backward; each step's output and gradients."""
    outs = []
    for step, ((_, _, cu), x0) in enumerate(zip(packs, xs)):
        if mgr is not None:
            mgr.step_begin(step)
        x = x0.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        y = model(x, packed(cu))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach().clone(), x.grad.clone(),
                     [p.grad.clone() for p in model.parameters()]))
    return outs


@pytest.mark.parametrize("pool", ["slot", "shared"])
def test_layer_graphs_over_packs_equal_eager(pool):
    torch.manual_seed(0)
    eager = Stack()
    graphed = copy.deepcopy(eager)
    mgr = manager(list(graphed.layers), pool=pool)
    packs = distinct_packs(8, seed=1)
    xs = inputs_for(len(packs))
    for (y, gx, gp), (ye, gxe, gpe) in zip(_run_packs(graphed, mgr, packs, xs),
                                            _run_packs(eager, None, packs, xs)):
        torch.testing.assert_close(y, ye, rtol=0, atol=0)
        torch.testing.assert_close(gx, gxe)
        for a, b in zip(gp, gpe):
            torch.testing.assert_close(a, b)
    s = mgr.stats()
    assert s["captures"] == 2 and s["eager_fallbacks"] == {"warmup": 2}, s


@pytest.mark.parametrize("impl", ["local", "te"])
def test_one_capture_per_layer_serves_a_hundred_packs(impl):
    torch.manual_seed(1)
    model = Stack(n=3)
    ref = copy.deepcopy(model)
    kw = {}
    if impl == "te":
        from test_graphs import _fake_te
        kw["te_make_graphed_callables"] = _fake_te()
    mgr = GraphManager(GraphsConfig(enabled=True, impl=impl, warmup_steps=2,
                                    capture_warmup_iters=1), list(model.layers),
                       backend=RerunBackend(), **kw).apply()
    packs = distinct_packs(102, seed=2)
    xs = inputs_for(len(packs))
    last = _run_packs(model, mgr, packs, xs)[-1]
    s = mgr.stats()
    assert s["captures"] == 3 and s["slots"] == 3, s  # one per layer
    assert s["replays"] == 3 * 100 and s["recaptures"] == {} and s["unseen_shapes"] == 0, s
    assert s["eager_fallbacks"] == {"warmup": 6}, s  # the two warm-up steps only
    # the last pack, replayed by graphs captured 100 packs earlier, equals eager on the same
    # weights (each step only zeroes the gradients: no update)
    y, gx, gp = _run_packs(ref, None, packs[-1:], xs[-1:])[0]
    torch.testing.assert_close(last[0], y, rtol=0, atol=0)
    torch.testing.assert_close(last[1], gx)
    for a, b in zip(last[2], gp):
        torch.testing.assert_close(a, b)


def test_another_max_seqlen_is_another_capture_and_other_objects_stay_eager():
    torch.manual_seed(2)
    layer = PackedLayer()
    mgr = manager([layer], warmup_steps=0)
    mgr.step_begin(0)
    x = torch.randn(SPEC.tokens, 1, 8)
    cu = random_pack(random.Random(3))[2]
    for max_len in (SPEC.max_len, SPEC.max_len, SPEC.max_len + 1):
        y, _ = layer(x, packed_seq_params=packed(cu, max_len))
        y.sum().backward()
    s = mgr.stats()
    assert s["captures"] == 2 and s["graph_sets"] == 2 and s["slots"] == 2, s

    class Holder:  # an object that may hold tensors: a graph would bake in a stale one
        qkv_format, max_seqlen_q = "thd", SPEC.max_len

    bad = packed(cu)
    bad.local_cp_size = Holder()
    layer(x, packed_seq_params=bad)
    assert mgr.stats()["eager_fallbacks"] == {"unsupported_arg": 1}


# ----------------------------------------------------------------------------------------------
# step scope


class PackedClassifier(nn.Module):
    """Patch rows -> embedding + per-token position lookup by coords -> packed layers ->
    mean per image slot by seg (index_add: fixed shapes) -> logits [max_images, classes]."""

    def __init__(self, d=8, classes=3, patch_dim=5):
        super().__init__()
        self.embed = nn.Linear(patch_dim, d)
        self.pos = nn.Parameter(torch.randn(SPEC.max_patches, SPEC.max_patches, d) * 0.1)
        self.stack = Stack(n=2, d=d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, coords, seg, cu):
        r, c = coords[:, 0].clamp(min=0), coords[:, 1]
        h = self.embed(x) + self.pos[r, c] * (coords[:, 0] >= 0).unsqueeze(1)
        h = self.stack(h, packed(cu))
        m = SPEC.max_images
        sums = torch.zeros(m + 1, h.shape[1]).index_add(0, seg, h)
        count = torch.zeros(m + 1).index_add(0, seg, torch.ones(seg.shape[0]))
        return self.head(sums[:m] / count[:m].clamp(min=1).unsqueeze(1))


def _step_body(model, opt):
    def body(inputs):
        x, coords, seg, cu, labels = inputs[0]
        opt.zero_grad(set_to_none=False)
        logits = model(x, coords, seg, cu)
        loss = nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        keep = (labels >= 0).float()
        loss = (loss * keep).sum() / keep.sum().clamp(min=1)
        loss.backward()
        opt.step()
        return [loss.detach()]
    return body


def _pack_inputs(pack, g):
    coords, seg, cu = pack
    n = int(seg[seg < SPEC.max_images].max()) + 1
    labels = torch.full((SPEC.max_images,), -1, dtype=torch.int64)
    labels[:n] = torch.randint(0, 3, (n,), generator=g)
    return (torch.randn(SPEC.tokens, 5, generator=g), coords, seg, cu, labels)


def test_step_graphs_serve_a_hundred_packs_and_equal_eager():
    torch.manual_seed(3)
    graphed = PackedClassifier()
    eager = copy.deepcopy(graphed)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (graphed, eager)]
    sg = StepGraphs(GraphsConfig(enabled=True, scope="step", warmup_steps=2),
                    backend=RerunBackend())
    body, body_e = _step_body(graphed, opts[0]), _step_body(eager, opts[1])
    g = torch.Generator().manual_seed(5)
    for step, pack in enumerate(distinct_packs(102, seed=4)):
        inputs = [_pack_inputs(pack, g)]
        sg.step_begin(step)
        loss = sg.run(inputs, body)[0].clone()
        loss_e = body_e(inputs)[0]
        torch.testing.assert_close(loss, loss_e, rtol=0, atol=0)
    for p, q in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    s = sg.stats()
    assert (s["captures"], s["graphs"], s["unseen_shapes"]) == (1, 1, 0), s
    assert s["replays"] == 100 and s["eager_fallbacks"] == {"eager_steps": 2}, s


# ----------------------------------------------------------------------------------------------
# the packed ViT (vitgraph.models.vit, torch spec, fp32): megatron's TransformerLayers


def packed_vit(d, seed=0, layers=2):
    """A tiny classifier ViT taking packs of VIT_SPEC (class token + 2 registers)."""
    from vitgraph.config import load_config
    from vitgraph.models.build import transformer_config
    from vitgraph.models.clip import tower_config
    from vitgraph.models.registry import ViTArch
    from vitgraph.models.specs import get_layer_spec
    from vitgraph.models.vit import ViT
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    config = tower_config(transformer_config(resolve(cfg, d.world), cfg.model, d), hidden_size=16,
                          num_layers=layers, num_heads=2, ffn_hidden_size=32, activation="gelu",
                          eps=1e-6)
    arch = ViTArch(16, layers, 2, 32, VIT_SPEC.patch_size, 4 * VIT_SPEC.patch_size)
    torch.manual_seed(seed)
    model = ViT(config, get_layer_spec("torch"), arch, 5, num_registers=2, class_token=True,
                pool="mean", pack=VIT_SPEC, pos_interp="bicubic")
    with torch.no_grad():  # away from the init's zeros (head) and ones (norms)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


VIT_SPEC = PackSpec(tokens=96, max_images=5, max_patches=20, num_prefix=3, patch_size=2)


def vit_packs(n, seed):
    """``n`` packs of distinct layouts as the task hands them to the model: (x normalised,
    coords, seg, cu_seqlens, labels)."""
    from vitgraph.data.packing import assemble
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    out, seen = [], set()
    while len(out) < n:
        grids, used = [], 0
        for _ in range(rng.randint(1, VIT_SPEC.max_images)):
            gh = rng.randint(1, 5)
            grid = (gh, rng.randint(1, VIT_SPEC.max_patches // gh))
            if used + VIT_SPEC.image_tokens(grid) > VIT_SPEC.tokens:
                break
            grids.append(grid)
            used += VIT_SPEC.image_tokens(grid)
        rows = [torch.randint(0, 256, (gh * gw, VIT_SPEC.patch_dim), generator=g,
                              dtype=torch.uint8) for gh, gw in grids]
        labels = torch.randint(0, 5, (len(grids),), generator=g).tolist()
        patches, coords, seg, cu, lab = assemble(rows, grids, labels, VIT_SPEC)
        if tuple(cu.tolist()) in seen:
            continue
        seen.add(tuple(cu.tolist()))
        out.append((normalise_patches(patches, "cpu"), coords, seg, cu, lab))
    return out


def vit_loss(model, pack):
    x, coords, seg, cu, labels = pack
    logits = model(x, coords, seg, cu)
    keep = labels >= 0
    return F.cross_entropy(logits[keep], labels[keep])


def same_vit(d, seed=0):
    """Two models with the same weights (megatron modules hold process groups: no deepcopy)."""
    a, b = packed_vit(d, seed), packed_vit(d, seed + 1)
    b.load_state_dict(a.state_dict())
    return a, b


def test_packed_vit_layer_graphs_equal_eager_and_one_capture_serves_a_hundred_packs(dist1):
    eager, graphed = same_vit(dist1)
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 2,
                                             "capture_warmup_iters": 1}, backend=RerunBackend())
    assert len(mgr.layers) == 2
    for step, pack in enumerate(vit_packs(102, seed=6)):
        mgr.step_begin(step)
        loss, loss_e = vit_loss(graphed, pack), vit_loss(eager, pack)
        torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=1e-6)
        if step % 25 == 0 or step == 101:  # the backward and its gradients, now and then
            loss.backward()
            loss_e.backward()
            for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
            graphed.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    s = mgr.stats()
    assert s["captures"] == 2 and s["slots"] == 2, s  # one per layer, for every pack
    assert s["recaptures"] == {} and s["unseen_shapes"] == 0, s
    assert s["eager_fallbacks"] == {"warmup": 4}, s
    # steps without a backward leave their slots busy: freed at the next step_begin
    assert s["replays"] == 2 * 100 and s["leaked_slots"] > 0, s


def test_packed_vit_step_graphs_equal_eager_over_a_hundred_packs(dist1):
    eager, graphed = same_vit(dist1, seed=3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (graphed, eager)]

    def body_of(model, opt):
        def body(inputs):
            opt.zero_grad(set_to_none=False)
            loss = vit_loss(model, inputs[0])
            loss.backward()
            opt.step()
            return [loss.detach()]
        return body

    sg = StepGraphs(GraphsConfig(enabled=True, scope="step", warmup_steps=2),
                    backend=RerunBackend())
    body, body_e = body_of(graphed, opts[0]), body_of(eager, opts[1])
    for step, pack in enumerate(vit_packs(102, seed=7)):
        sg.step_begin(step)
        loss = sg.run([pack], body)[0].clone()
        torch.testing.assert_close(loss, body_e([pack])[0], rtol=0, atol=0)
    for p, q in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    s = sg.stats()
    assert (s["captures"], s["replays"], s["unseen_shapes"]) == (1, 100, 0), s


# ----------------------------------------------------------------------------------------------
# scripts/bench.py --native on CPU (tiny model): the rows' code path cannot break silently


def load_bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_native_stream_and_its_packing():
    bench = load_bench()
    grids = bench.native_stream(300, 0, 16, 576)
    assert grids == bench.native_stream(300, 0, 16, 576)  # seeded: the same stream every run
    assert all(gh * gw <= 576 for gh, gw in grids)
    assert min(min(g) for g in grids) >= 4 and max(max(g) for g in grids) > 2 * min(max(g) for g in grids)
    spec = PackSpec(tokens=4096, max_images=16, max_patches=576, num_prefix=1, patch_size=16)
    steps = bench.packed_steps(grids, spec, 2)
    seen = [i for s in steps for p in s for i in p]
    assert len(seen) == len(set(seen)) and len(steps) > 5
    for s in steps:
        assert len(s) == 2 and all(sum(spec.image_tokens(grids[i]) for i in p) <= spec.tokens
                                   and len(p) <= spec.max_images for p in s)
    assert bench.batched_steps(grids, 64)[-1] == list(range(192, 256))
    # the timm peer is vitgraph's function: class token, token pooling, no LayerScale
    net, _ = bench.timm_naflex_model("vit_pico_patch4_32", 3)
    keys = net.state_dict()
    assert "embeds.cls_token" in keys and not any(".ls1." in k or "fc_norm" in k for k in keys)
    assert net.global_pool == "token" and net.embeds.pos_embed_use_grid_sample


def test_bench_native_rows_on_cpu(tmp_path, monkeypatch):
    """bench.py --native's rows on CPU; the timm peer's step, as if one microbatch of its
    images ran out of GPU memory, runs again in two with their gradients accumulated."""
    import json
    import types
    bench = load_bench()
    timm_step = bench.bench_timm_naflex

    def short_of_memory(*a, microbatches=1, **k):
        if microbatches == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return timm_step(*a, microbatches=microbatches, **k)
    monkeypatch.setattr(bench, "bench_timm_naflex", short_of_memory)
    args = types.SimpleNamespace(
        models=["vit_pico_patch4_32"], max_patches=[12], images=64, seed=0, pack_tokens=64,
        max_images=6, packs_per_step=2, timm_batch=4, timm_arch=None, warmup=3, iters=2,
        num_classes=3, out=tmp_path / "native.json", native=True,
        systems=["vitgraph+packed+step-graphs", "vitgraph+padded", "timm-naflex"],
        override=["model.spec=torch", "model.num_layers=1", "train.precision=fp32",
                  "data.workers=1"])
    assert bench.run_native(args) == 0
    out = json.loads(args.out.read_text())
    rows = {r["system"]: r for r in out["rows"]}
    assert out["provenance"]["native"]["pack_tokens"] == 64
    for name, r in rows.items():
        assert r["error"] is None and r["images_per_s"] > 0 and r["real_tokens_per_s"] > 0, r
        assert r["max_patches"] == 12 and r["resolution"] == "native"
    packed = rows["vitgraph+packed+step-graphs"]
    assert packed["graph_stats"]["captures"] == 1 and packed["graph_stats"]["unseen_shapes"] == 0
    # the same stream and batches: timm and the padded slots pad every image to max_patches
    assert rows["timm-naflex"]["real_share"] == pytest.approx(rows["vitgraph+padded"]["real_share"])
    assert rows["timm-naflex"]["images_in_stream"] == rows["vitgraph+padded"]["images_in_stream"]
    assert rows["timm-naflex"]["microbatches"] == 2 and rows["timm-naflex"]["batch"] == 4
    assert rows["timm-naflex"]["fitted_after"].startswith("4 images in 1 microbatch(es) ran out")
