"""CLIP towers on megatron-core with the torch spec, on CPU (single-process gloo world)."""
import math

import pytest
import torch

from vitgraph.config import load_config
from vitgraph.models.registry import CLIP_MODELS, get_clip_arch
from vitgraph.text.tokenizer import ByteTokenizer

from conftest import ROOT, world_of_one

dist1 = world_of_one("torch")


def base_config(d, *over):
    from vitgraph.models.build import transformer_config
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch", *over])
    return transformer_config(resolve(cfg, d.world), cfg.model, d)


def tiny(d, seed=0, **kw):
    from vitgraph.models.clip import build_clip
    return build_clip("clip_tiny_patch4_32", base_config(d), "torch", seed=seed, **kw)


def tokens(texts, context=128):
    return ByteTokenizer(context)(texts)


def test_forward_backward_shapes_and_normalised(dist1):
    model = tiny(dist1)
    imgs = torch.randn(3, 3, 32, 32)
    toks = tokens(["a red star", "a small blue circle on a white background", "x"])
    img, txt, scale = model(imgs, toks)
    assert img.shape == txt.shape == (3, 64)
    assert torch.allclose(img.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.allclose(txt.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert scale.item() == pytest.approx(1 / 0.07, rel=1e-5)
    (scale * img @ txt.T).logsumexp(dim=-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert model.text.token_embed.weight.grad.abs().sum() > 0
    assert model.logit_scale.grad is not None and model.logit_scale.grad != 0


def test_image_tower_is_the_vit_with_ln_pre_and_projection(dist1):
    from vitgraph.models.vit import ViT
    model = tiny(dist1)
    v = model.visual
    assert type(v) is ViT
    names = {n for n, _ in model.named_parameters()}
    for n in ("visual.ln_pre.weight", "visual.proj.weight", "visual.final_norm.weight",
              "visual.cls_token", "text.token_embed.weight", "text.pos_embed",
              "text.decoder.layers.0.self_attention.linear_qkv.weight", "text.final_norm.bias",
              "text.proj.weight", "logit_scale"):
        assert n in names, n
    assert "visual.head.weight" not in names and "visual.patch_embed.bias" not in names
    assert "logit_bias" not in names
    # QuickGELU reaches the layers' MLPs through the TransformerConfig
    import dataclasses
    from vitgraph.models.clip import build_clip, quick_gelu
    assert v.decoder.layers[0].mlp.activation_func is not quick_gelu
    arch = dataclasses.replace(get_clip_arch("clip_tiny_patch4_32"), activation="quick_gelu")
    quick = build_clip(arch, base_config(dist1), "torch")
    for tower in (quick.visual, quick.text):
        assert all(layer.mlp.activation_func is quick_gelu for layer in tower.decoder.layers)
    x = torch.linspace(-3, 3, 7)
    assert torch.allclose(quick_gelu(x), x * torch.sigmoid(1.702 * x))


def test_ln_pre_normalises_the_embedded_tokens(dist1):
    model = tiny(dist1)
    with torch.no_grad():
        tok = model.visual.embed(torch.randn(2, 3, 32, 32))[1:]  # [s, b, d]: patch tokens
    assert torch.allclose(tok.mean(-1), torch.zeros(tok.shape[:2]), atol=1e-5)
    assert torch.allclose(tok.var(-1, unbiased=False), torch.ones(tok.shape[:2]), atol=1e-3)


def test_classifier_defaults_unchanged(dist1):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    model = build_model(resolve(cfg, dist1.world), cfg.model, dist1, 10, cfg.train.seed)[0]
    names = {n for n, _ in model.named_parameters()}
    assert "head.weight" in names and "patch_embed.bias" in names
    assert not any(n.startswith(("ln_pre", "proj")) for n in names)


def test_text_tower_is_causal_and_pools_at_end_of_text(dist1):
    model = tiny(dist1).eval()
    toks = tokens(["a red star on a green background"])
    eot = int(toks.argmax())
    with torch.no_grad():
        ref = model.encode_text(toks)
        later = toks.clone()
        later[0, eot + 1:] = 100  # tokens after the end of text: invisible under a causal mask
        assert torch.allclose(model.encode_text(later), ref, atol=1e-6)
        earlier = toks.clone()
        earlier[0, 3] = 120  # a token before the end of text changes the features
        assert not torch.allclose(model.encode_text(earlier), ref, atol=1e-4)


def test_causal_torch_attention_matches_explicit_mask():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from vitgraph.models.specs import SDPAttention
    cfg = TransformerConfig(num_layers=1, hidden_size=12, num_attention_heads=3,
                            attention_dropout=0.0, cuda_graph_scope=[],
                            use_cpu_initialization=True)
    q, k, v = (torch.randn(5, 2, 3, 4) for _ in range(3))  # [s, b, heads, d]
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, None)
    assert not SDPAttention(cfg, 1, AttnMaskType.padding, None).causal
    got = attn(q, k, v)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / 2.0
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(5, 2, 12)
    assert torch.allclose(got, want, atol=1e-5)
    # with a key-padding mask as well, both apply
    pad = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    pad[..., 1] = True
    got2 = SDPAttention(cfg, 1, AttnMaskType.padding_causal, None)(q, k, v, attention_mask=pad)
    scores2 = scores.masked_fill(pad, float("-inf"))
    scores2[..., 0, :] = scores[..., 0, :]  # query 0 sees only key 0: keep it unmasked
    want2 = torch.einsum("bhst,tbhd->sbhd", scores2.softmax(-1), v).reshape(5, 2, 12)
    assert torch.allclose(got2[1:], want2[1:], atol=1e-5)


def test_layer_spec_mask_types():
    from megatron.core.transformer.enums import AttnMaskType
    from vitgraph.models.specs import get_layer_spec
    def mask(**kw):
        return get_layer_spec("torch", **kw).submodules.self_attention.params["attn_mask_type"]
    assert mask() == AttnMaskType.no_mask
    assert mask(causal=True) == AttnMaskType.causal
    assert mask(padding_mask=True) == AttnMaskType.padding
    assert mask(padding_mask=True, causal=True) == AttnMaskType.padding_causal


def test_weights_depend_only_on_the_seed(dist1):
    a, b, c = tiny(dist1, seed=3), tiny(dist1, seed=3), tiny(dist1, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    assert not torch.equal(sa["text.proj.weight"], sc["text.proj.weight"])
    # towers are seeded under their own names: same-shaped parameters differ between them
    assert not torch.equal(sa["visual.decoder.layers.0.self_attention.linear_qkv.weight"],
                           sa["text.decoder.layers.0.self_attention.linear_qkv.weight"])
    assert a.text.proj.weight.std().item() == pytest.approx(64 ** -0.5, rel=0.1)
    assert torch.equal(sa["visual.ln_pre.weight"], torch.ones(64))


def test_logit_scale_clamp_and_sigmoid_bias(dist1):
    from vitgraph.models.clip import MAX_LOGIT_SCALE
    model = tiny(dist1, init_logit_bias=-10.0)
    out = model(torch.randn(2, 3, 32, 32), tokens(["a", "b"]))
    assert len(out) == 4 and out[3].item() == -10.0
    with torch.no_grad():
        model.logit_scale.fill_(7.0)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == pytest.approx(MAX_LOGIT_SCALE)
    assert model(torch.randn(1, 3, 32, 32), tokens(["a"]))[2].item() == pytest.approx(100.0, rel=1e-5)


def test_context_length_from_the_caller(dist1):
    model = tiny(dist1, context_length=16)
    assert model.text.pos_embed.shape == (16, 64)
    with pytest.raises(ValueError, match="context length"):
        model.encode_text(tokens(["a"], context=17))


def test_registry_pairs():
    assert set(CLIP_MODELS) >= {"clip_vit_b16", "clip_vit_l14", "clip_vit_l14_336",
                                "siglip_vit_b16", "clip_tiny_patch4_32"}
    b16, l14, l336 = (get_clip_arch(n) for n in ("clip_vit_b16", "clip_vit_l14", "clip_vit_l14_336"))
    assert (b16.embed_dim, b16.vision.hidden_size, b16.text.hidden_size) == (512, 768, 512)
    assert (l14.embed_dim, l14.vision.patch_size, l14.vision.image_size) == (768, 14, 224)
    assert l336.vision.image_size == 336 and l336.vision.num_patches() == 576
    assert b16.text.context_length == 77 and b16.text.vocab_size == 49408
    s = get_clip_arch("siglip_vit_b16")
    assert not s.class_token and s.init_logit_bias == -10.0 and not s.text.causal
    assert s.vision_pool == "map" and s.embed_dim == s.vision.hidden_size == 768
    assert s.init_logit_scale == pytest.approx(math.log(10))
    with pytest.raises(KeyError, match="clip_vit_b16"):
        get_clip_arch("clip_nope")


def test_siglip_tiny_pair(dist1):
    """Attention-pooling image tower (no class token, no projection), bidirectional text
    tower pooled at the last position, tanh GELU, logit bias."""
    from vitgraph.models.clip import build_clip, gelu_tanh
    model = build_clip("siglip_tiny_patch4_32", base_config(dist1), "torch", seed=2)
    names = {n for n, _ in model.named_parameters()}
    for n in ("visual.attn_pool.latent", "visual.attn_pool.kv.weight", "visual.attn_pool.fc2.bias",
              "visual.patch_embed.bias", "text.proj.bias", "logit_bias"):
        assert n in names, n
    assert not any(n.startswith(("visual.proj", "visual.cls_token", "visual.ln_pre")) for n in names)
    assert model.visual.decoder.layers[0].mlp.activation_func is gelu_tanh
    assert model.text.final_norm.eps == 1e-6
    out = model(torch.randn(2, 3, 32, 32), tokens(["a", "b"]))
    assert len(out) == 4 and out[0].shape == out[1].shape == (2, 64)
    assert out[2].item() == pytest.approx(10.0) and out[3].item() == -10.0
    sum(o.sum() for o in out).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    model.eval()
    with torch.no_grad():  # bidirectional: the last position sees a change at the start
        toks = tokens(["a red star"])
        ref = model.encode_text(toks)
        toks[0, 1] += 1
        assert not torch.allclose(model.encode_text(toks), ref, atol=1e-5)


def test_attention_pool_matches_a_direct_computation():
    from types import SimpleNamespace
    from vitgraph.models.vit import AttentionPool
    cfg = SimpleNamespace(activation_func=torch.nn.functional.gelu, layernorm_epsilon=1e-6)
    pool = AttentionPool(8, 2, 16, cfg, device="cpu", dtype=torch.float32)
    x = torch.randn(3, 5, 8)
    q = pool.q(pool.latent)[0, 0]  # [8]
    k, v = pool.kv(x).split(8, dim=-1)
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        w = ((k[..., sl] @ q[sl]) / 2.0).softmax(dim=-1)  # [3, 5]
        heads.append(torch.einsum("bn,bnd->bd", w, v[..., sl]))
    y = pool.proj(torch.cat(heads, dim=-1))
    want = y + pool.fc2(torch.nn.functional.gelu(pool.fc1(pool.norm(y))))
    torch.testing.assert_close(pool(x), want, rtol=1e-5, atol=1e-6)
    # pooling is over the tokens: their order does not matter
    torch.testing.assert_close(pool(x.flip(1)), want, rtol=1e-5, atol=1e-6)


def test_tiny_pair_fits_shape_captions(dist1):
    """End to end on CPU: the tiny pair learns to match 16 shapes images with their captions
    (the loss falls from ~ln 16 and image->text retrieval on them becomes right)."""
    from vitgraph.data.shapes import generate
    from vitgraph.tasks.contrastive_loss import clip_loss
    images, _, captions = generate(16, 123, 10, 32)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    toks = tokens(captions)
    model = tiny(dist1, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    first = None
    for _ in range(40):
        img, txt, scale = model(x, toks)
        loss = clip_loss(img, txt, scale)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.clamp_logit_scale_()
    assert first == pytest.approx(math.log(16), abs=0.7)
    assert loss.item() < 0.3 * first, (first, loss.item())
    with torch.no_grad():
        img, txt, _ = model(x, toks)
    assert ((img @ txt.T).argmax(dim=1) == torch.arange(16)).float().mean() >= 0.9


@pytest.mark.parametrize("name", sorted(CLIP_MODELS))
def test_every_registered_pair_builds_and_runs(dist1, name):
    """Every registered geometry (cut to one layer per tower, to stay quick on CPU)."""
    import dataclasses
    from vitgraph.models.clip import build_clip
    arch = get_clip_arch(name)
    arch = dataclasses.replace(arch, vision=dataclasses.replace(arch.vision, num_layers=1),
                               text=dataclasses.replace(arch.text, num_layers=1))
    model = build_clip(arch, base_config(dist1), "torch")
    size = arch.vision.image_size
    toks = torch.randint(1, arch.text.vocab_size - 1, (1, arch.text.context_length))
    toks[0, -1] = arch.text.vocab_size - 1  # the end of text: the largest id
    with torch.no_grad():
        out = model(torch.randn(1, 3, size, size), toks)
    assert out[0].shape == out[1].shape == (1, arch.embed_dim)
    assert len(out) == (4 if arch.init_logit_bias is not None else 3)
    assert model.visual.pos_embed.shape[1] == int(arch.class_token) + arch.vision.num_patches()


def test_tiny_context_holds_the_longest_shapes_caption():
    """The longest caption the shapes data can write (longest colour names, a one-fold
    symmetric shape turned 180 degrees, a corner position) is not cut by the tokenizer."""
    from vitgraph.data import shapes
    colours = sorted((c for c, _ in shapes._PALETTE), key=len)[-2:]
    name = max((n for n in shapes.CLASSES if shapes._SYMMETRY[n] == 1), key=len)
    worst = (f"a medium {colours[1]} {name} on a {colours[0]} background, in the bottom right, "
             "rotated 180 degrees counter-clockwise")
    for arch_name in ("clip_tiny_patch4_32", "siglip_tiny_patch4_32"):
        context = get_clip_arch(arch_name).text.context_length
        ids = ByteTokenizer(context).encode(worst)
        assert len(ids) == len(worst) + 2 <= context, (arch_name, len(worst))


@pytest.mark.parametrize("name", ["clip_tiny_patch4_32", "siglip_tiny_patch4_32"])
def test_both_towers_run_under_the_graph_manager(dist1, name):
    """The graph manager (CPU rerun backend) finds the layers of both towers, including the
    causal text layers, and its steps give eager's loss and gradients."""
    from vitgraph.graphs import GraphManager, RerunBackend
    from vitgraph.models.clip import build_clip
    from vitgraph.tasks.contrastive_loss import clip_loss, siglip_loss
    eager = build_clip(name, base_config(dist1), "torch", seed=7)
    graphed = build_clip(name, base_config(dist1), "torch", seed=7)
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 1},
                                 backend=RerunBackend())
    assert len(mgr.layers) == 8  # 4 image + 4 text layers
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        images = torch.randn(4, 3, 32, 32, generator=g)
        toks = tokens([f"a shape number {step} {i}" for i in range(4)])
        mgr.step_begin(step)
        losses = []
        for model in (eager, graphed):
            out = model(images, toks)
            loss = clip_loss(*out) if len(out) == 3 else siglip_loss(*out)
            model.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6), step
        for (n, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters()):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-5, atol=1e-7, msg=n)
    stats = mgr.stats()
    assert stats["captures"] > 0 and stats["replays"] > 0, stats


@pytest.mark.parametrize("name", ["clip_tiny_patch4_32", "siglip_tiny_patch4_32"])
def test_fused_norm_towers_compute_what_megatrons_layers_do(dist1, name):
    """Both towers with ResidualNormLayer (the causal text tower included) against megatron's
    layer, same weights: the same embeddings and gradients."""
    from vitgraph.models.clip import build_clip
    from vitgraph.models.specs import ResidualNormLayer
    fused = build_clip(name, base_config(dist1), "torch", seed=3, fused_norm=True)
    plain = build_clip(name, base_config(dist1), "torch", seed=3, fused_norm=False)
    assert isinstance(fused.text.decoder.layers[0], ResidualNormLayer)
    assert isinstance(fused.visual.decoder.layers[0], ResidualNormLayer)
    plain.load_state_dict(fused.state_dict())
    imgs = torch.randn(3, 3, 32, 32)
    toks = tokens(["a red star", "a small blue circle on a white background", "x"],
                  fused.text.context_length)
    grads = []
    for model in (fused, plain):
        img, txt, scale, *_ = model(imgs, toks)  # SigLIP also returns its logit bias
        (scale * img @ txt.T).logsumexp(dim=-1).sum().backward()
        grads.append(((img, txt), {n: p.grad for n, p in model.named_parameters()}))
    (outs_f, grads_f), (outs_p, grads_p) = grads
    for a, b in zip(outs_f, outs_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for n in grads_p:
        if grads_p[n] is None:
            assert grads_f[n] is None, n
        else:
            torch.testing.assert_close(grads_f[n], grads_p[n], rtol=1e-4, atol=1e-6, msg=n)
