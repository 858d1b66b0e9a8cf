"""The packed (native-resolution) ViT on CPU, fp32, torch spec, tiny widths: a pack of images
of different grids equals each image run alone, forward and backward; position resampling;
empty slots; the padded layout; packed SDPAttention."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitgraph.data.packing import PackSpec, assemble
from vitgraph.models import packed as pk
from vitgraph.models.registry import ViTArch

from conftest import ROOT, normalise_patches, world_of_one

dist1 = world_of_one("torch")

ARCH = ViTArch(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, patch_size=4,
               image_size=16)  # a 4 x 4 learned position grid
GRIDS = [(3, 5), (4, 4), (2, 7), (6, 3)]
POOLS = {  # name -> (class token, registers, head, position interpolation, pool)
    "cls": (True, 2, "classifier", "bicubic", "cls"),
    "mean": (True, 1, "classifier", "bilinear", "mean"),
    "map": (False, 2, "map", "bicubic", "mean"),  # SigLIP's tower: the pooled width
    "map-classifier": (True, 1, "classifier", "bilinear", "map"),
}


def tower_config(d):
    from vitgraph.models.build import transformer_config
    from vitgraph.models.clip import tower_config as resize
    from vitgraph.plan import resolve
    from vitgraph.config import load_config
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    base = transformer_config(resolve(cfg, d.world), cfg.model, d)
    # fp32 on the CPU on any machine: the comparisons below are at 1e-5
    base = dataclasses.replace(base, bf16=False, params_dtype=torch.float32,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    return resize(base, hidden_size=ARCH.hidden_size, num_layers=ARCH.num_layers,
                  num_heads=ARCH.num_heads, ffn_hidden_size=ARCH.ffn_hidden_size,
                  activation="gelu", eps=1e-6)


def spec_for(class_token, registers, max_images=5, tokens=96, max_patches=24, padded=False):
    prefix = int(class_token) + registers
    if padded:  # each image in a slot of its own
        tokens = max_images * (prefix + max_patches)
    return PackSpec(tokens=tokens, max_images=max_images, max_patches=max_patches,
                    num_prefix=prefix, patch_size=ARCH.patch_size, padded=padded)


def make_vit(d, pool, attention="thd", seed=0, **kw):
    from vitgraph.models.specs import get_layer_spec
    from vitgraph.models.vit import ViT
    cls, regs, head, interp, pooling = POOLS[pool]
    padded = attention == "padded"
    spec = spec_for(cls, regs, padded=padded, **kw)
    torch.manual_seed(seed)
    model = ViT(tower_config(d), get_layer_spec("torch", padding_mask=padded),
                ARCH, 7, num_registers=regs, class_token=cls, pool=pooling, head=head, pack=spec,
                pos_interp=interp)
    assert model.packed_attention == attention
    with torch.no_grad():  # away from the init's zeros (head) and ones (norms)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model, spec


def images(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (gh * gw, 3 * ARCH.patch_size ** 2), generator=g,
                          dtype=torch.uint8) for gh, gw in grids]


def pack_of(grids, spec, seed=1):
    rows = images(grids, seed)
    patches, coords, seg, cu, labels = assemble(rows, grids, list(range(len(grids))), spec)
    return rows, (normalise_patches(patches, "cpu"), coords, seg, cu), labels


def position_grid(model):
    g = ARCH.image_size // ARCH.patch_size
    return model.pos_embed[0, model.num_prefix:].view(g, g, -1)


def alone(model, rows, grid):
    """One image through the same parameters as a dense sequence of its own: the reference."""
    gh, gw = grid
    P, d = model.num_prefix, ARCH.hidden_size
    conv = model.patch_embed
    x = F.linear(normalise_patches(rows, "cpu"), conv.weight.reshape(d, -1), conv.bias)
    src = position_grid(model).permute(2, 0, 1)[None]
    where = F.affine_grid(torch.eye(2, 3, dtype=src.dtype)[None], (1, d, gh, gw),
                          align_corners=False)
    pos = F.grid_sample(src, where, mode=model.pos_interp, padding_mode="border",
                        align_corners=False)[0].flatten(1).t()
    tokens = x + pos
    if P:
        prefix = torch.cat([p[0] for p in model._prefix_params()]) + model.pos_embed[0, :P]
        tokens = torch.cat([prefix, tokens])
    h = model.final_norm(model.decoder(hidden_states=tokens[:, None], attention_mask=None)[:, 0])
    if model.attn_pool is not None:
        feats = model.attn_pool(h[None, P:])[0]
    else:
        feats = h[0] if model.global_pool == "cls" else h[P:].mean(0)
    return model.head(feats) if model.head is not None else feats


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_pack_equals_each_image_alone_forward_and_backward(dist1, pool):
    model, spec = make_vit(dist1, pool)
    rows, inputs, labels = pack_of(GRIDS, spec)
    n = len(GRIDS)
    out = model(*inputs)
    assert out.shape[0] == spec.max_images and torch.isfinite(out).all()
    weights = torch.randn(n, out.shape[1], generator=torch.Generator().manual_seed(3))
    (out[:n] * weights).sum().backward()
    packed_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    refs = torch.stack([alone(model, r, g) for r, g in zip(rows, GRIDS)])
    torch.testing.assert_close(out[:n], refs, atol=1e-5, rtol=1e-5)
    (refs * weights).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[k], p.grad, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{k}: {m}")
    assert packed_grads["pos_embed"].abs().sum() > 0


def test_position_resampling_is_grid_sample_and_the_grid_at_its_size(dist1):
    g = torch.randn(4, 4, 8)
    spec = PackSpec(tokens=64, max_images=3, max_patches=30, num_prefix=1, patch_size=4)
    grids = [(4, 4), (2, 6), (5, 3)]
    _, coords, seg, _, _ = assemble(images(grids), grids, [0, 1, 2], spec)
    for mode in pk.POS_INTERP:
        got = pk.resample_positions(g, coords, mode)
        for i, (gh, gw) in enumerate(grids):
            own = (seg == i) & (coords[:, 0] >= 0)
            where = F.affine_grid(torch.eye(2, 3)[None], (1, 8, gh, gw), align_corners=False)
            ref = F.grid_sample(g.permute(2, 0, 1)[None], where, mode=mode,
                                padding_mode="border", align_corners=False)
            torch.testing.assert_close(got[own], ref[0].flatten(1).t(), atol=1e-5, rtol=1e-5)
        # the trained grid itself, exactly where the image has the trained grid's size
        torch.testing.assert_close(got[(seg == 0) & (coords[:, 0] >= 0)], g.reshape(16, 8),
                                   atol=1e-6, rtol=1e-6)
        # a bf16 grid (bf16 training's parameters) in bf16, its cells padded to 8: the fp32
        # numbers within the weights' rounding, its own cells exactly, and its gradient
        gb = g.bfloat16().requires_grad_()
        half = pk.resample_positions(gb, coords, mode)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), got, atol=2e-2, rtol=1e-2)
        assert torch.equal(half[(seg == 0) & (coords[:, 0] >= 0)], gb.detach().reshape(16, 8))
        half.float().sum().backward()
        torch.testing.assert_close(gb.grad.float(), torch.autograd.grad(
            pk.resample_positions(g.requires_grad_(), coords, mode).sum(), g)[0],
            atol=2e-2, rtol=1e-2)
        g = g.detach()
        g3 = torch.randn(3, 3, 8)  # 9 cells, padded to 16
        torch.testing.assert_close(pk.resample_positions(g3.bfloat16(), coords, mode).float(),
                                   pk.resample_positions(g3, coords, mode), atol=2e-2, rtol=1e-2)


def test_square_images_match_the_fixed_path(dist1):
    """A square image in a pack gives what the fixed-resolution forward gives: at the trained
    size, and (bicubic) at another size, whose fixed path resizes the grid by F.interpolate."""
    model, spec = make_vit(dist1, "cls")
    for side in (4, 3):
        rows = images([(side, side)])[0]
        _, inputs, _ = pack_of([(side, side)], spec)
        p = ARCH.patch_size
        img = normalise_patches(rows, "cpu").view(side, side, 3, p, p).permute(2, 0, 3, 1, 4)
        model.pack, pack = None, model.pack
        try:
            ref = model(img.reshape(1, 3, side * p, side * p))
        finally:
            model.pack = pack
        torch.testing.assert_close(model(*inputs)[:1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_empty_slots_and_an_empty_pack_are_finite(dist1, pool):
    model, spec = make_vit(dist1, pool)
    for grids in ([], [(2, 2)]):
        _, inputs, labels = pack_of(grids, spec)
        out = model(*inputs)
        assert torch.isfinite(out).all(), grids
        out[labels >= 0].sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()
    valid = pk.slot_valid(inputs[2], spec.max_images)
    assert valid.tolist() == [True] + [False] * (spec.max_images - 1)


@pytest.mark.parametrize("pool", ["cls", "map"])
def test_padded_layout_equals_the_pack(dist1, pool):
    model, spec = make_vit(dist1, pool)
    padded, slots = make_vit(dist1, pool, attention="padded")
    padded.load_state_dict(model.state_dict())
    rows, inputs, _ = pack_of(GRIDS, spec)
    fields = assemble(rows, GRIDS, list(range(len(GRIDS))), slots)
    assert fields[0].shape[0] == spec.max_images * spec.max_len == padded.padded_len(1)
    # image i at the start of slot i, the slots' bounds (an empty one's too) as cu_seqlens
    L = spec.max_len
    assert fields[3].tolist() == [i * L for i in range(spec.max_images + 1)]
    assert fields[2][::L].tolist() == [0, 1, 2, 3, spec.max_images]
    x = normalise_patches(fields[0], "cpu")
    got = padded(x, *fields[1:4])
    torch.testing.assert_close(got[:len(GRIDS)], model(*inputs)[:len(GRIDS)],
                               atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_packed_sdpa_is_per_segment_sdpa(dist1):
    from megatron.core.packed_seq_params import PackedSeqParams
    from vitgraph.models.specs import MASKS, SDPAttention
    attn = SDPAttention(tower_config(dist1), 1, MASKS[(False, False)], "self")
    cu = torch.tensor([0, 5, 5, 12, 13, 20, 20], dtype=torch.int32)  # empty segments too
    q, k, v = torch.randn(3, 20, 4, 8).unbind(0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=7, max_seqlen_kv=7)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (20, 32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        ref = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)))
        torch.testing.assert_close(out[a:b], ref.transpose(0, 1).reshape(b - a, 32),
                                   atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ plan, build, tasks

# packs, as written: auto would choose padded slots for images this close to max_patches
NATIVE = ["model.spec=torch", "data.resolution=native", "data.packing.max_patches=24",
          "data.packing.tokens_per_microbatch=96", "data.packing.max_images=5",
          "data.packing.layout=packed", "train.micro_batch_size=1", "train.global_batch_size=2",
          "model.num_layers=1", "train.precision=fp32"]


def load_config_of(path, *over):
    from vitgraph.config import load_config
    return load_config(ROOT / "configs" / path, list(over))


def native_config(path, *over):
    return load_config_of(path, *NATIVE, *over)


def test_plan_carries_the_pack_and_never_pads_it(dist1):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = native_config("vit-tiny-shapes.yaml", "model.num_registers=2")
    plan = resolve(cfg, dist1.world)
    assert plan.pack == PackSpec(tokens=96, max_images=5, max_patches=24, num_prefix=3,
                                 patch_size=4) and not plan.pads
    assert plan.pos_interp == "bicubic"
    model = build_model(plan, cfg.model, dist1, 10, 0)[0]
    assert model.pack == plan.pack and model.padded_len(1) == 96
    assert model.decoder.layers[0].self_attention.attn_mask_type.name == "no_mask"
    assert (plan.pack_layout.name, plan.pack_layout.reason) == (
        "packed", "data.packing.layout=packed in the config")
    # padded: as many slots of max_len as the budget holds, the layers masked
    cfg = native_config("vit-tiny-shapes.yaml", "model.num_registers=2",
                        "data.packing.layout=padded")
    plan = resolve(cfg, dist1.world)
    assert plan.pack == PackSpec(tokens=3 * 27, max_images=3, max_patches=24, num_prefix=3,
                                 patch_size=4, padded=True)
    padded = build_model(plan, cfg.model, dist1, 10, 0)[0]
    assert padded.packed_attention == "padded" and padded.padded_len(1) == 3 * (3 + 24)
    assert padded.decoder.layers[0].self_attention.attn_mask_type.name == "padding"
    fixed = resolve(native_config("vit-tiny-shapes.yaml", "data.resolution=fixed"), dist1.world)
    assert fixed.pack is None
    pair = resolve(native_config("clip-tiny-shapes.yaml", "model.name=siglip_tiny_patch4_32",
                                 "task.context_length=32"), dist1.world)
    assert pair.pack.num_prefix == 0 and pair.pos_interp == "bilinear"


def test_auto_layout_rule_on_the_measured_cases():
    """data.packing.layout=auto on the bench's stream (benchmarks/BENCHMARKS.md): images of
    ~231 tokens (256 patches at most) and ~431 (576) in 16,384-token packs or 64 slots. With
    max_images=0's count (images_per_pack) packs won at both, and auto packs; at most 64 images
    held packs to 90% full at 256, where padded won, and auto pads."""
    from vitgraph.data.native import images_per_pack, pack_fill
    from vitgraph.plan import choose_layout, packed_path

    def choose(max_patches, mean, path, max_images=0):
        # images of two sizes, ``mean`` tokens on average
        tokens = np.array([round(mean) - 40, round(mean) + 40] * 256)
        packed = PackSpec(16384, max_images or 1, max_patches, 1, 16)
        if not max_images:
            packed = dataclasses.replace(packed, max_images=images_per_pack(tokens, packed, 4))
        padded = PackSpec(64 * (1 + max_patches), 64, max_patches, 1, 16, padded=True)
        fill = pack_fill(tokens, packed, 4)
        spec, why = choose_layout(packed, padded, mean, fill, path, 512)
        assert spec is (padded if why.name == "padded" else packed)
        return why, packed.max_images

    assert (packed_path("te", 72), packed_path("te", 64), packed_path("te", 128),
            packed_path("torch", 64)) == ("slots", "thd", "thd", "torch")
    so400m, m = choose(256, 231.0, "slots")
    assert 72 <= m <= 96 and so400m.name == "packed", so400m.reason
    assert choose(256, 231.0, "thd")[0].name == "packed"
    held, _ = choose(256, 231.0, "slots", max_images=64)  # 256 tokens an image
    assert held.name == "padded" and held.reason == (
        "data.packing.layout=auto: padded: an image costs 257 tokens in a padded slot, ~263.7 "
        "in a pack (mean 231.0 tokens over 512 sampled images / fill 0.902 x 1.03 for slots "
        "attention)")
    assert choose(256, 231.0, "thd", max_images=64)[0].name == "padded"
    assert choose(576, 431.0, "slots")[0].name == "packed"
    assert choose(576, 431.0, "thd", max_images=64)[0].name == "packed"
    # images that nearly fill a slot: padded whatever a pack holds
    assert choose(256, 250.0, "thd")[0].name == "padded"


def test_max_images_zero_lets_tokens_end_a_pack(dist1):
    """data.packing.max_images=0 (the default) resolves to the count at which packs of the
    sampled sizes fill as they would with no limit (a multiple of 8, logged with the layout);
    a count written in the config is kept; with no sample, images of half max_patches."""
    from vitgraph.data import PackingConfig
    from vitgraph.data.native import images_per_pack, pack_fill
    from vitgraph.plan import resolve, resolve_max_images
    auto = resolve(native_config("vit-tiny-shapes.yaml", "data.packing.max_images=0",
                                 "data.packing.tokens_per_microbatch=960"), dist1.world)
    m = auto.pack.max_images
    assert m % 8 == 0 and "data.packing.max_images=0: " in auto.pack_layout.reason
    kept = resolve(native_config("vit-tiny-shapes.yaml", f"data.packing.max_images={m - 3}",
                                 "data.packing.tokens_per_microbatch=960"), dist1.world)
    assert kept.pack.max_images == m - 3 and "max_images" not in kept.pack_layout.reason
    k = PackingConfig(max_patches=256, tokens_per_microbatch=16384)
    assert resolve_max_images(k, None, 16, 1, 4)[0].max_images == 128  # 2 * 16384 / 257
    # the count leaves packs as full as no limit does, a lower one does not
    tokens = np.random.default_rng(0).integers(60, 258, 512)
    spec = PackSpec(16384, 1, 256, 1, 16)
    m = images_per_pack(tokens, spec, 4)

    def fill(n):
        return pack_fill(tokens, dataclasses.replace(spec, max_images=n), 4)
    assert fill(m) >= fill(4 * m) - 0.002 > fill(m - 16)


def test_auto_layout_of_a_config_and_an_explicit_one_wins(dist1):
    """auto resolves from the shapes data's sizes; packed or padded as written wins; padded
    slots that cannot run are an error as written and packs under auto; a bad value is one
    error naming the key."""
    from vitgraph.config import ConfigError
    from vitgraph.plan import resolve

    def plan(*over, world=dist1.world):
        return resolve(native_config("vit-tiny-shapes.yaml", *over), world)

    # the shipped demo: its images (mean ~54 tokens) fill a 65-token slot too little
    demo = resolve(load_config_of("vit-tiny-shapes-native.yaml", "model.spec=torch"),
                   dist1.world)
    assert demo.pack_layout.name == "packed" and not demo.pack.padded
    assert demo.pack_layout.reason.startswith("data.packing.layout=auto: packed: an image costs "
                                              "65 tokens in a padded slot, ~6")
    # at 24 patches the images nearly fill a slot (and 5 of them fill half a pack)
    auto = plan("data.packing.layout=auto")
    assert auto.pack_layout.name == "padded" and auto.pack.padded
    assert plan().pack_layout.name == "packed" and not plan().pack.padded  # NATIVE: packed
    padded = plan("data.packing.layout=padded", "data.packing.max_patches=64",
                  "data.packing.tokens_per_microbatch=2048")
    assert padded.pack_layout.reason == "data.packing.layout=padded in the config"
    assert padded.pack == PackSpec(5 * 65, 5, 64, 1, 4, padded=True)  # max_images binds
    # sequence parallel splits a slot of 25 tokens over tp=2: not as written, packs under auto
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"data.packing.layout='padded': slots of 25 tokens"):
        native_config("vit-tiny-shapes.yaml", *sp, "data.packing.layout=padded")
    split = plan(*sp, "data.packing.layout=auto", world=2)
    assert split.pack_layout.name == "packed" and "no padded slots" in split.pack_layout.reason
    with pytest.raises(ConfigError, match="data.packing.layout='diagonal': must be one of"):
        native_config("vit-tiny-shapes.yaml", "data.packing.layout=diagonal")


def raw_pack(spec, grids, labels, seed=1):
    return assemble(images(grids, seed), grids, labels, spec)


def test_classification_task_on_a_pack(dist1):
    """prepare -> forward -> loss: the mean label-smoothed cross-entropy over the pack's
    images (empty slots out), the stats vector over images, the FLOPs of a pack."""
    from vitgraph.plan import resolve
    from vitgraph.tasks.classification import ClassificationTask
    cfg = native_config("vit-tiny-shapes.yaml")
    task = ClassificationTask(resolve(cfg, dist1.world), dist1)
    task.num_classes = 10
    model = task.build_model()[0]
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight)
    grids = [(3, 5), (4, 4), (2, 7)]
    raw = raw_pack(task.pack, grids, [3, 1, 4])
    inputs = task.prepare(raw, None, dist1.device, True)
    assert [t.shape for t in inputs] == [(96, 48), (96, 4), (96,), (task.pack.num_segments + 1,),
                                         (5,)]
    out = task.forward(model, inputs)
    loss, stats = task.loss(inputs, out)
    labels = torch.tensor([3, 1, 4], device=out.device)
    ref = F.cross_entropy(out[:3], labels, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)
    correct = (out[:3].argmax(-1) == labels).sum()
    torch.testing.assert_close(stats.cpu(), torch.stack([ref * 3, correct.float(),
                                                         torch.tensor(3.0)]).cpu())
    # an image of n tokens costs the fixed formula's FLOPs at n tokens (a 16 x 16 image: 17)
    from vitgraph.models.vit import vit_flops_per_image
    per_token, pair, per_image = task.pack_flops
    assert per_image == 0.0
    assert 17 * per_token + 17 ** 2 * pair == pytest.approx(
        vit_flops_per_image(task.arch, 1, 10, image_size=16))
    assert "packs of 96 tokens" in task.describe([model], 1)
    empty = task.prepare(raw_pack(task.pack, [], []), None, dist1.device, True)
    loss, stats = task.loss(empty, task.forward(model, empty))
    assert loss.item() == 0.0 and stats.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_contrastive_losses_with_empty_slots_equal_the_valid_pairs_alone(loss):
    from vitgraph.tasks.contrastive_loss import clip_loss, siglip_loss
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(6, 8, generator=g), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(6, 8, generator=g), dim=-1).requires_grad_()
    valid = torch.tensor([True, False, True, True, False, True])
    scale, bias = torch.tensor(10.0), torch.tensor(-2.0)
    fn = (lambda i, t, **kw: clip_loss(i, t, scale, **kw)) if loss == "clip" else \
        (lambda i, t, **kw: siglip_loss(i, t, scale, bias, **kw))
    masked = fn(image, text, valid=valid)
    masked.backward()
    grads = image.grad.clone(), text.grad.clone()
    image.grad = text.grad = None
    alone = fn(image[valid], text[valid])
    alone.backward()
    torch.testing.assert_close(masked, alone)
    torch.testing.assert_close(grads[0], image.grad)
    torch.testing.assert_close(grads[1], text.grad)
    none = fn(image, text, valid=torch.zeros(6, dtype=torch.bool))
    assert none.item() == 0.0


def test_contrastive_task_on_a_pack(dist1):
    """A SigLIP pair's packed image tower: each slot's features equal the image alone in a
    pack of its own, empty slots are fill_label and out of the loss."""
    from vitgraph.plan import resolve
    from vitgraph.tasks.contrastive import ContrastiveTask
    from vitgraph.tasks.contrastive_loss import siglip_loss
    cfg = native_config("clip-tiny-shapes.yaml", "model.name=siglip_tiny_patch4_32",
                        "task.context_length=32", "task.loss=siglip", "data.caption_dropout=0")
    task = ContrastiveTask(resolve(cfg, dist1.world), dist1)
    model = task.build_model()[0]
    grids = [(3, 5), (4, 4), (2, 7)]
    tokens = torch.randint(1, 200, (5, 32), generator=torch.Generator().manual_seed(2))
    raw = (*raw_pack(task.pack, grids, [3, -1, 4]), tokens)
    inputs = task.prepare(raw, None, dist1.device, True)
    assert inputs[-1].tolist() == [3, -1, 4, -2, -2]  # -1: unlabelled, kept; -2: no image
    out = task.forward(model, inputs)
    loss, stats = task.loss(inputs, out)
    image, text, scale, bias = out
    torch.testing.assert_close(loss, siglip_loss(image[:3], text[:3], scale, bias))
    assert stats[2].item() == 3
    for i, grid in enumerate(grids):
        one = task.prepare((*raw_pack(task.pack, [grid], [0]), tokens), None, dist1.device,
                           True)
        one[0][:grid[0] * grid[1]] = normalise_patches(images(grids)[i], dist1.device)
        torch.testing.assert_close(task.forward(model, one)[0][0], image[i], atol=1e-5,
                                   rtol=1e-5)
    # an image of n tokens: the image tower's fixed formula at n tokens, and its caption's
    from vitgraph.tasks.contrastive import _tower_flops
    per_token, pair, per_image = task.pack_flops
    v = task.arch.vision
    n_image = sum(p.numel() for p in model.visual.parameters())
    assert per_image == task.text_flops > 0
    assert 17 * per_token + 17 ** 2 * pair == pytest.approx(
        _tower_flops(n_image, 17, v.num_layers, v.hidden_size))
    # padded slots (data.packing.layout=padded): the same weights, the same features
    slots = ContrastiveTask(resolve(native_config(
        "clip-tiny-shapes.yaml", "model.name=siglip_tiny_patch4_32", "task.context_length=32",
        "task.loss=siglip", "data.caption_dropout=0", "data.packing.layout=padded"),
        dist1.world), dist1)
    padded = slots.build_model()[0]
    assert slots.pack.padded and padded.visual.packed_attention == "padded"
    m = slots.pack.max_images
    got = slots.forward(padded, slots.prepare((*raw_pack(slots.pack, grids, [3, -1, 4]),
                                               tokens[:m]), None, dist1.device, True))
    torch.testing.assert_close(got[0][:3], image[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1][:3], text[:3])


@pytest.mark.gpu
def test_te_thd_pack_matches_the_torch_spec_and_each_image_alone(dist1):
    """TE's thd attention (bf16, GPU): a pack gives what the torch spec's block-diagonal
    SDPA gives with the same weights, and what each image gives in a pack of its own."""
    from vitgraph.models.specs import get_layer_spec, te_available
    from vitgraph.models.vit import ViT
    if not te_available():
        pytest.skip("needs Transformer Engine")
    config = dataclasses.replace(tower_config(dist1), bf16=True, params_dtype=torch.bfloat16,
                                 pipeline_dtype=torch.bfloat16, use_cpu_initialization=False)
    spec = spec_for(True, 1)
    models = {}
    for name in ("te", "torch"):
        torch.manual_seed(0)
        models[name] = ViT(config, get_layer_spec(name), ARCH, 7, num_registers=1, pack=spec,
                           pos_interp="bicubic")
    with torch.no_grad():
        for p in models["te"].parameters():
            p.add_(0.1 * torch.randn_like(p))
    missing, _ = models["torch"].load_state_dict(models["te"].state_dict(), strict=False)
    assert not missing

    def on_gpu(inputs):
        x, *rest = (t.cuda() for t in inputs)
        return (x.bfloat16(), *rest)

    rows, inputs, _ = pack_of(GRIDS, spec)
    inputs = on_gpu(inputs)
    te = models["te"](*inputs).float()
    torch.testing.assert_close(te, models["torch"](*inputs).float(), atol=3e-2, rtol=3e-2)
    for i, grid in enumerate(GRIDS):
        _, one, _ = pack_of([grid], spec)
        one[0][spec.num_prefix:spec.num_prefix + grid[0] * grid[1]] = normalise_patches(rows[i], "cpu")
        alone_out = models["te"](*on_gpu(one))[0].float()
        torch.testing.assert_close(te[i], alone_out, atol=3e-2, rtol=3e-2)
    te[:len(GRIDS)].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in models["te"].parameters()
               if p.grad is not None)
