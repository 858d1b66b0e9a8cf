"""Stochastic depth (model.drop_path_rate) on CPU, torch spec: the DeiT depth ramp by global
layer index, per-sample masks, survivors scaled, eval untouched, both layer classes, packed
images, pipeline stages, and graphed (layer and step scope, rerun backend) == eager."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from vitgraph.config import load_config

from conftest import ROOT, tiny_overrides, world_of_one

dist1 = world_of_one("torch")
CONFIG = ROOT / "configs" / "vit-tiny-shapes.yaml"


def build(d, *over):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(CONFIG, ["model.spec=torch", *over])
    return build_model(resolve(cfg, d.world), cfg.model, d, 10, cfg.train.seed)[0]


def test_rates_follow_the_deit_ramp():
    from vitgraph.models.specs import drop_path_rates
    assert drop_path_rates(0.1, 12) == pytest.approx(torch.linspace(0, 0.1, 12).tolist())
    assert drop_path_rates(0.3, 1) == [0.0]
    assert drop_path_rates(0.0, 4) == [0.0] * 4


def test_rate_zero_builds_the_layers_as_before(dist1):
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from vitgraph.models.specs import get_layer_spec
    for fused in (False, True):
        assert get_layer_spec("torch", fused_norm=fused) == get_layer_spec(
            "torch", fused_norm=fused, drop_path_rate=0.0)
    model = build(dist1, "model.fused_norm=never", "model.drop_path_rate=0")
    assert all(type(layer) is TransformerLayer for layer in model.decoder.layers)


@pytest.mark.parametrize("fused", ["never", "always"])
def test_dropped_fraction_per_layer_matches_the_ramp(dist1, fused):
    """Over many samples each layer drops each branch with its rate (first layer: never),
    one draw per sample and branch, survivors scaled by 1 / (1 - p): the mean factor is 1."""
    rate, n = 0.4, 20000
    model = build(dist1, "model.num_layers=5", f"model.drop_path_rate={rate}",
                  f"model.fused_norm={fused}")
    model.train()
    layers = model.decoder.layers
    want = [rate * i / 4 for i in range(5)]
    assert [layer.drop_path for layer in layers] == pytest.approx(want)
    hidden = torch.zeros(3, n, 8)
    torch.manual_seed(0)
    for layer, p in zip(layers, want):
        keep = layer._draw_keep(hidden)
        if p == 0:
            assert keep is None
            continue
        assert keep.shape == (2, 1, n, 1)
        dropped = (keep == 0).double().mean(dim=(1, 2, 3))
        sigma = math.sqrt(p * (1 - p) / n)
        assert torch.all((dropped - p).abs() < 5 * sigma), (p, dropped)
        survivors = keep[keep != 0]
        torch.testing.assert_close(survivors, torch.full_like(survivors, 1 / (1 - p)))
        mean = keep.double().mean(dim=(1, 2, 3))
        assert torch.all((mean - 1).abs() < 5 * sigma / (1 - p)), mean
        # the two branches draw independently
        assert not torch.equal(keep[0], keep[1])


def _branches(layer, x):
    """The layer's attention and MLP branch outputs (bias included), as functions."""
    def attn(h):
        out, bias = layer.self_attention(h, attention_mask=None)
        return out if bias is None else out + bias

    def mlp(h):
        out, bias = layer.mlp(h)
        return out if bias is None else out + bias
    return attn, mlp


def test_forward_applies_the_drawn_masks_per_sample(dist1):
    """Training forward of a DropPathLayer = x + k0 attn(x), then + k1 mlp(.), with the masks
    the layer draws first in its forward (same seed): dropped samples skip the branch."""
    from vitgraph.models.specs import DropPathLayer
    model = build(dist1, "model.num_layers=2", "model.drop_path_rate=0.5",
                  "model.fused_norm=never")
    layer = model.decoder.layers[1]
    assert type(layer) is DropPathLayer and layer.drop_path == 0.5
    layer.train()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        x = torch.randn(5, 16, layer.config.hidden_size)
        torch.manual_seed(3)
        keep = layer._draw_keep(x)
        torch.manual_seed(3)
        out, _ = layer(hidden_states=x)
        attn, mlp = _branches(layer, x)
        h = x + keep[0] * attn(x)
        ref = h + keep[1] * mlp(h)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    both = (keep[0, 0, :, 0] == 0) & (keep[1, 0, :, 0] == 0)
    assert both.any() and (keep != 0).any()
    torch.testing.assert_close(out[:, both], x[:, both])  # both branches dropped: identity


def test_eval_does_not_drop_and_training_does(dist1):
    drop = build(dist1, "model.drop_path_rate=0.5")
    plain = build(dist1, "model.drop_path_rate=0")
    plain.load_state_dict(drop.state_dict())
    with torch.no_grad():
        torch.nn.init.normal_(drop.head.weight)
        plain.head.weight.copy_(drop.head.weight)
    x = torch.randn(8, 3, 32, 32)
    drop.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(drop(x), plain(x))
        drop.train(), plain.train()
        torch.manual_seed(0)
        a = drop(x)
        torch.manual_seed(0)
        b = plain(x)
    assert not torch.allclose(a, b)


def test_fused_norm_layer_drops_what_megatrons_layer_drops(dist1):
    """ResidualNormLayer with drop path (and hidden dropout) against DropPathLayer with the
    same weights and seed: the same logits and gradients (masks drawn in the same order)."""
    from vitgraph.models.specs import DropPathLayer, ResidualNormLayer
    over = ["model.num_layers=3", "model.drop_path_rate=0.5", "model.hidden_dropout=0.1"]
    fused = build(dist1, *over, "model.fused_norm=always")
    plain = build(dist1, *over, "model.fused_norm=never")
    assert all(type(layer) is ResidualNormLayer for layer in fused.decoder.layers)
    assert all(type(layer) is DropPathLayer for layer in plain.decoder.layers)
    plain.load_state_dict(fused.state_dict())
    with torch.no_grad():
        for (n, p), q in zip(fused.named_parameters(), plain.parameters()):
            if "norm" in n or n.endswith("bias") or n.startswith("head"):
                p.add_(torch.randn_like(p) * 0.1)
                q.copy_(p)
    fused.train(), plain.train()
    x = torch.randn(16, 3, 32, 32)
    results = []
    for model in (fused, plain):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (out_f, g_f), (out_p, g_p) = results
    torch.testing.assert_close(out_f, out_p, rtol=1e-5, atol=1e-6)
    for n in g_f:
        torch.testing.assert_close(g_f[n], g_p[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_images_draw_one_mask_per_image(dist1):
    """A packed sequence ([t, 1, h], thd): every token of a segment of cu_seqlens shares its
    image's draw; under sequence parallelism a rank's tokens start at rank x t."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from vitgraph.models.specs import _DropPath
    cu = torch.tensor([0, 3, 7, 7, 12, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=5, max_seqlen_kv=5)
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 3, 3, 4, 4, 4, 4])

    def layer(sp, rank):
        return SimpleNamespace(training=True, drop_path=0.5, tp_group=SimpleNamespace(
            rank=lambda: rank), config=SimpleNamespace(sequence_parallel=sp))

    torch.manual_seed(0)
    whole = _DropPath._draw_keep(layer(False, 0), torch.zeros(16, 1, 4), params)
    assert whole.shape == (2, 16, 1, 1)
    torch.manual_seed(0)
    draws = torch.empty(2, 5).bernoulli_(0.5).div_(0.5)
    torch.testing.assert_close(whole[:, :, 0, 0], draws[:, seg])
    for rank in (0, 1):  # sequence parallel over 2 ranks, the same draws on each
        torch.manual_seed(0)
        half = _DropPath._draw_keep(layer(True, rank), torch.zeros(8, 1, 4), params)
        torch.testing.assert_close(half, whole[:, 8 * rank: 8 * rank + 8])


def test_native_model_trains_with_drop_path(dist1):
    """data.resolution=native: the packed ViT's layers get per-image masks (thd), and a
    training forward / backward runs; eval equals the model without drop path."""
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    from test_native_model import NATIVE, raw_pack
    from vitgraph.tasks.classification import ClassificationTask
    cfg = load_config(CONFIG, [*NATIVE, "model.drop_path_rate=0.3", "model.num_layers=3"])
    task = ClassificationTask(resolve(cfg, dist1.world), dist1)
    task.num_classes = 10
    model = task.build_model()[0]
    assert model.decoder.layers[-1].drop_path == pytest.approx(0.3)
    inputs = task.prepare(raw_pack(task.pack, [(3, 5), (4, 4), (2, 7)], [3, 1, 4]), None,
                          dist1.device, True)
    model.train()
    loss, _ = task.loss(inputs, task.forward(model, inputs))
    loss.backward()
    assert torch.isfinite(loss)
    plain = build_model(resolve(cfg, dist1.world), dataclasses.replace(cfg.model,
                                                                      drop_path_rate=0.0),
                        dist1, 10, 0)[0]
    plain.load_state_dict(model.state_dict())
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(task.forward(model, inputs), task.forward(plain, inputs))


def test_clip_image_tower_drops_and_text_tower_does_not(dist1):
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from vitgraph.models.build import transformer_config
    from vitgraph.models.clip import build_clip
    from vitgraph.plan import resolve
    cfg = load_config(CONFIG, ["model.spec=torch", "model.drop_path_rate=0"])
    base = transformer_config(resolve(cfg, dist1.world), cfg.model, dist1)
    model = build_clip("clip_tiny_patch4_32", base, "torch", drop_path_rate=0.2)
    rates = [layer.drop_path for layer in model.visual.decoder.layers]
    assert rates == pytest.approx([0.2 * i / (len(rates) - 1) for i in range(len(rates))])
    assert all(type(layer) is TransformerLayer for layer in model.text.decoder.layers)
    model.train()
    images = torch.randn(4, 3, 32, 32)
    tokens = torch.randint(0, 100, (4, model.text.context_length))
    torch.manual_seed(0)
    a = model.encode_image(images)
    torch.manual_seed(1)
    b = model.encode_image(images)
    assert not torch.allclose(a, b)  # other masks
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_image(images), model.encode_image(images))
        assert model.encode_text(tokens).shape == (4, 64)


class _StubGroup:
    """A pipeline group as this rank would see it at rank ``r`` of ``n``."""

    def __init__(self, r, n):
        self.r, self.n = r, n

    def rank(self):
        return self.r

    def size(self):
        return self.n


@pytest.mark.parametrize("vpp, vp_stage, first", [(1, None, 5), (2, 0, 3), (2, 1, 7)])
def test_later_pipeline_stage_takes_rates_by_global_index(dist1, vpp, vp_stage, first):
    """The second of 2 pipeline stages (and its virtual stages) of an 8-layer model: its
    layers' rates are those of global layers 5-8 (vpp 2: 3-4 and 7-8), not 1-4."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlock
    from vitgraph.models.build import transformer_config
    from vitgraph.models.specs import drop_path_rates, get_layer_spec
    from vitgraph.plan import resolve
    cfg = load_config(CONFIG, ["model.spec=torch", "model.num_layers=8"])
    config = dataclasses.replace(
        transformer_config(resolve(cfg, dist1.world), cfg.model, dist1),
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.pp = _StubGroup(1, 2)
    rates = drop_path_rates(0.35, 8)
    for fused in (False, True):
        spec = get_layer_spec("torch", fused_norm=fused, drop_path_rate=0.35)
        block = TransformerBlock(config, spec, post_layer_norm=False, pre_process=False,
                                 post_process=vp_stage in (None, 1), pg_collection=pgs,
                                 vp_stage=vp_stage)
        n = 4 // vpp
        assert [layer.layer_number for layer in block.layers] == list(range(first, first + n))
        assert [layer.drop_path for layer in block.layers] == pytest.approx(
            rates[first - 1: first - 1 + n])


# ---------------------------------------------------------------- graphs (rerun backend)

def _train_steps(model, steps, mgr=None, microbatches=2):
    """SGD-free steps: forward / backward per microbatch, one seed at the start; the
    outputs and gradients of every step."""
    outs, grads = [], []
    torch.manual_seed(123)
    for step in range(steps):
        if mgr is not None:
            mgr.step_begin(step)
        model.zero_grad(set_to_none=True)
        ys = []
        for i in range(microbatches):
            x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(10 * step + i))
            ys.append(model(x))
        for y in reversed(ys):
            y.square().sum().backward()
        outs.append(torch.stack([y.detach() for y in ys]))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return outs, grads


@pytest.mark.parametrize("fused", ["never", "always"])
def test_layer_graphs_replay_new_masks_equal_to_eager(dist1, fused):
    """Layer graphs (rerun backend): warm-up and capture consume no random numbers, every
    replay draws the step's fresh masks: outputs and gradients equal eager for the same
    seed, step after step (and they differ between steps: the masks are not baked in)."""
    from vitgraph.graphs import GraphManager, RerunBackend
    over = ["model.num_layers=3", "model.drop_path_rate=0.5", f"model.fused_norm={fused}"]
    eager, graphed = build(dist1, *over), build(dist1, *over)
    graphed.load_state_dict(eager.state_dict())
    with torch.no_grad():
        torch.nn.init.normal_(eager.head.weight)
        graphed.head.weight.copy_(eager.head.weight)
    eager.train(), graphed.train()
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 1,
                                             "capture_warmup_iters": 1},
                                 backend=RerunBackend())
    out_g, grad_g = _train_steps(graphed, 3, mgr)
    stats = mgr.stats()
    mgr.restore()
    assert stats["captures"] > 0 and stats["replays"] > 0, stats
    out_e, grad_e = _train_steps(eager, 3)
    for s in range(3):
        torch.testing.assert_close(out_g[s], out_e[s], rtol=0, atol=0)
        for n in grad_e[s]:
            torch.testing.assert_close(grad_g[s][n], grad_e[s][n], rtol=0, atol=0, msg=n)
    # the same inputs with other masks give other outputs
    torch.manual_seed(999)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(20))
    with torch.no_grad():
        assert not torch.equal(eager(x), out_e[2][0])


def _run(tmp_path, name, *over):
    from vitgraph.train.loop import train
    run_dir = tmp_path / name
    cfg = load_config(CONFIG, tiny_overrides(run_dir, steps=6, **{
        "train.log_every": 1, "data.num_train": 128, "data.num_val": 32,
        "train.global_batch_size": 16, "train.micro_batch_size": 8}) + list(over))
    train(cfg)
    recs = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, recs


def test_step_and_layer_graphs_train_the_eager_curve(tmp_path):
    """The trainer with model.drop_path_rate: graphs.scope=step and scope=layer (the CPU
    rerun backend) train the eager loss curve; drop path changes it."""
    dp = "model.drop_path_rate=0.3"
    eager, _ = _run(tmp_path, "eager", dp)
    plain, _ = _run(tmp_path, "plain", "model.drop_path_rate=0")
    assert eager.keys() == plain.keys() and eager != plain
    for scope in ("step", "layer"):
        got, recs = _run(tmp_path, scope, dp, "graphs.enabled=true", f"graphs.scope={scope}",
                         "graphs.warmup_steps=2")
        assert [r for r in recs if "loss" in r][-1]["graphs_replays"] > 0
        assert got.keys() == eager.keys()
        for s in eager:
            assert got[s] == eager[s], (scope, s, got, eager)  # the same masks, exactly
