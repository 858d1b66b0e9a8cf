"""open_clip CLIP weights <-> vitgraph CLIP, on CPU, no downloads.

- a hand-built random open_clip-format state dict (no open_clip needed) goes in through
  ``model.init_from`` (format detected), gives the image features of a small reference forward
  written from open_clip's VisionTransformer, and comes back out exactly;
- a real ``open_clip.create_model('ViT-B-16', pretrained=None)`` (random weights; skipped
  where open_clip_torch is not installed): same image and text features (fp32, <= 1e-4
  relative), and the export loads back into open_clip with every tensor equal;
- ``vitgraph export RUN_DIR --format open_clip`` on a CLIP checkpoint written as training
  writes it; what cannot be expressed is an error that says why.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vitgraph.convert import (ConvertError, detect_format, export_state_dict, from_vitgraph,
                              init_from, save_safetensors, to_vitgraph)
from vitgraph.models.registry import CLIPArch, TextArch, ViTArch

from conftest import ROOT, import_open_clip, world_of_one

dist1 = world_of_one("torch")

# vision: width 48, 2 layers, 3 heads, patch 4 on 16x16; text: width 32, 2 layers, 4 heads
TINY = CLIPArch(24, ViTArch(48, 2, 3, 96, 4, 16), TextArch(259, 24, 32, 2, 4, 128),
                activation="quick_gelu", layernorm_epsilon=1e-5)


def build(d, arch, seed=0):
    from vitgraph.config import load_config
    from vitgraph.models.clip import build_clip
    from vitgraph.models.build import transformer_config
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    plan = resolve(cfg, d.world)
    return build_clip(arch, transformer_config(plan, cfg.model, d), "torch", seed=seed).eval()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_open_clip(arch: CLIPArch, seed=0, text=True) -> dict:
    """An open_clip ``CLIP`` state dict with these sizes, every tensor random."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return torch.randn(*shape, generator=g) * 0.05 + base

    v, t, e = arch.vision, arch.text, arch.embed_dim
    n = (v.image_size // v.patch_size) ** 2 + 1
    sd = {"visual.conv1.weight": r(v.hidden_size, 3, v.patch_size, v.patch_size),
          "visual.class_embedding": r(v.hidden_size), "visual.positional_embedding": r(n, v.hidden_size),
          "visual.ln_pre.weight": r(v.hidden_size, base=1), "visual.ln_pre.bias": r(v.hidden_size),
          "visual.ln_post.weight": r(v.hidden_size, base=1), "visual.ln_post.bias": r(v.hidden_size),
          "visual.proj": r(v.hidden_size, e)}
    towers = [("visual.transformer.resblocks", v)]
    if text:
        sd.update({"token_embedding.weight": r(t.vocab_size, t.hidden_size),
                   "positional_embedding": r(t.context_length, t.hidden_size),
                   "ln_final.weight": r(t.hidden_size, base=1), "ln_final.bias": r(t.hidden_size),
                   "text_projection": r(t.hidden_size, e), "logit_scale": torch.tensor(2.5)})
        towers.append(("transformer.resblocks", t))
    for prefix, a in towers:
        d, f = a.hidden_size, a.ffn_hidden_size
        for i in range(a.num_layers):
            p = f"{prefix}.{i}."
            sd.update({p + "ln_1.weight": r(d, base=1), p + "ln_1.bias": r(d),
                       p + "attn.in_proj_weight": r(3 * d, d), p + "attn.in_proj_bias": r(3 * d),
                       p + "attn.out_proj.weight": r(d, d), p + "attn.out_proj.bias": r(d),
                       p + "ln_2.weight": r(d, base=1), p + "ln_2.bias": r(d),
                       p + "mlp.c_fc.weight": r(f, d), p + "mlp.c_fc.bias": r(f),
                       p + "mlp.c_proj.weight": r(d, f), p + "mlp.c_proj.bias": r(d)})
    return sd


def reference_image_features(sd: dict, images: torch.Tensor, heads: int, eps=1e-5):
    """open_clip's VisionTransformer.forward (class-token pooling, QuickGELU), written out."""
    x = F.conv2d(images, sd["visual.conv1.weight"], stride=sd["visual.conv1.weight"].shape[-1])
    x = x.flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], 1) + sd["visual.positional_embedding"]

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)

    x = ln(x, "visual.ln_pre")
    b, n, d = x.shape
    i = 0
    while f"visual.transformer.resblocks.{i}.ln_1.weight" in sd:
        p = f"visual.transformer.resblocks.{i}."
        q, k, v = F.linear(ln(x, p + "ln_1"), sd[p + "attn.in_proj_weight"],
                           sd[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + F.linear(a, sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"])
        h = F.linear(ln(x, p + "ln_2"), sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        h = h * torch.sigmoid(1.702 * h)
        x = x + F.linear(h, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
        i += 1
    return ln(x, "visual.ln_post")[:, 0] @ sd["visual.proj"]


def test_hand_built_open_clip_weights_in_and_out(dist1, tmp_path):
    ref = random_open_clip(TINY)
    path = save_safetensors(ref, tmp_path / "open_clip.safetensors")
    assert detect_format(ref) == "open_clip"
    ours = build(dist1, TINY)
    report = init_from(ours, str(path))  # format detected
    assert not report["kept"] and not report["pos_embed_resized"]
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        got = ours.encode_image(images, normalize=False)
    want = reference_image_features(ref, images, heads=3)
    assert rel_err(got, want) <= 1e-4
    assert ours.logit_scale.item() == 2.5
    # and out again: open_clip's names, every tensor as it came in
    back = from_vitgraph(export_state_dict(ours), "open_clip", 3, 4)
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_image_tower_alone_loads_into_a_pair_or_a_tower(dist1, tmp_path, caplog):
    """visual.* only (a VLM's vision tower, say): the pair keeps its text tower; the bare
    VisionTransformer's names (no visual. prefix) are recognised too."""
    import logging
    ref = random_open_clip(TINY, seed=1, text=False)
    bare = {k[len("visual."):]: v for k, v in ref.items()}
    save_safetensors(bare, tmp_path / "tower.safetensors")
    ours = build(dist1, TINY)
    text_before = ours.text.proj.weight.clone()
    with caplog.at_level(logging.INFO, logger="vitgraph"):
        report = init_from(ours, str(tmp_path / "tower.safetensors"), "open_clip")
    assert "text tower" in caplog.text and "logit_scale" in report["kept"]
    assert torch.equal(ours.text.proj.weight, text_before)
    images = torch.randn(2, 3, 16, 16)
    want = reference_image_features(ref, images, heads=3)
    tower = build(dist1, TINY, seed=1).visual
    init_from(tower, str(tmp_path / "tower.safetensors"))  # into the image tower alone
    with torch.no_grad():
        assert rel_err(ours.encode_image(images, normalize=False), want) <= 1e-4
        assert rel_err(tower(images), want) <= 1e-4
    full = random_open_clip(TINY, seed=2)  # a whole pair's file into the image tower alone
    save_safetensors(full, tmp_path / "pair.safetensors")
    init_from(tower, str(tmp_path / "pair.safetensors"))
    with torch.no_grad():
        assert rel_err(tower(images), reference_image_features(full, images, heads=3)) <= 1e-4
    init_from(tower, str(tmp_path / "tower.safetensors"))
    for sd in (export_state_dict(tower),  # the bare tower's names, or the pair's visual.*
               {k: v for k, v in export_state_dict(ours).items() if k.startswith("visual.")}):
        out = from_vitgraph(sd, "open_clip", 3)
        assert set(out) == set(ref) and all(torch.equal(out[k], ref[k]) for k in ref)


def test_what_open_clip_cannot_hold_is_an_error_that_says_why(dist1, tmp_path):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    from vitgraph.config import load_config
    ref = random_open_clip(TINY, text=False)
    # open_clip weights into the classifier ViT
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    classifier = build_model(resolve(cfg, dist1.world), cfg.model, dist1, 10, cfg.train.seed)[0]
    save_safetensors(ref, tmp_path / "oc.safetensors")
    with pytest.raises(ConvertError, match="ln_pre.*classifier|classifier.*ln_pre"):
        init_from(classifier, str(tmp_path / "oc.safetensors"))
    # the classifier out to open_clip
    with pytest.raises(ConvertError, match="classifier ViT cannot be written as open_clip"):
        from_vitgraph(export_state_dict(classifier), "open_clip", 4)
    # a SigLIP tower out to open_clip
    from vitgraph.models.registry import get_clip_arch
    siglip = build(dist1, get_clip_arch("siglip_tiny_patch4_32"))
    with pytest.raises(ConvertError, match="SigLIP image tower"):
        from_vitgraph(export_state_dict(siglip), "open_clip", 4, 4)
    # open_clip features vitgraph has no place for
    for key, shape, why in [("visual.attn_pool.query", (4, 24), "attentional pooler"),
                            ("visual.transformer.resblocks.0.ls_1.gamma", (48,), "layer scale"),
                            ("visual.extra.weight", (2,), r"visual\.extra\.weight")]:
        with pytest.raises(ConvertError, match=why):
            to_vitgraph({**ref, key: torch.zeros(shape)}, "open_clip", 3)
    bad = dict(ref)
    del bad["visual.transformer.resblocks.1.mlp.c_fc.bias"]
    with pytest.raises(ConvertError, match=r"visual\.transformer\.resblocks\.1\.mlp\.c_fc\.bias"):
        to_vitgraph(bad, "open_clip", 3)
    # a tower without ln_pre (open_clip's no_ln_pre) into a model that has one: named
    no_ln_pre = {k: v for k, v in ref.items() if "ln_pre" not in k}
    save_safetensors(no_ln_pre, tmp_path / "noln.safetensors")
    with pytest.raises(ConvertError, match=r"visual\.ln_pre\.weight"):
        init_from(build(dist1, TINY), str(tmp_path / "noln.safetensors"))


def test_cli_export_of_a_clip_checkpoint(dist1, tmp_path):
    """A CLIP pair's checkpoint, written by the trainer's checkpoint writer (dist_checkpointing,
    layers stacked under visual.decoder.layers / text.decoder.layers), exported with
    ``vitgraph export --format open_clip`` and loaded back through model.init_from."""
    import yaml
    from safetensors.torch import load_file

    from vitgraph.cli import main
    from vitgraph.models.registry import get_clip_arch
    from vitgraph.train import checkpoint
    arch = get_clip_arch("clip_tiny_patch4_32")
    ours = build(dist1, arch)
    with torch.no_grad():
        ours.logit_scale.fill_(3.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "clip_tiny_patch4_32"}}))
    checkpoint.save(run_dir / "checkpoints", 7, dist1, {"model0": ours.sharded_state_dict()}, keep=1)
    out = tmp_path / "open_clip.safetensors"
    assert main(["export", str(run_dir), "--format", "open_clip", "--out", str(out)]) == 0
    sd = load_file(out)
    want = from_vitgraph(export_state_dict(ours), "open_clip", 4, 4)
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)
    assert "visual.transformer.resblocks.3.attn.in_proj_weight" in sd and sd["visual.proj"].shape == (64, 64)
    again = build(dist1, arch, seed=1)
    assert not torch.equal(again.visual.proj.weight, ours.visual.proj.weight)
    init_from(again, str(out))
    got = again.state_dict()
    for k, v in ours.state_dict().items():
        if isinstance(v, torch.Tensor):  # megatron's _extra_state entries are None here
            assert torch.equal(got[k], v), k


@pytest.fixture(scope="module")
def open_clip_b16():
    open_clip = import_open_clip()
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-16", pretrained=None).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms at 1 / 0 and zero biases would hide a swapped or dropped one
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return open_clip, model


def test_open_clip_vit_b16_in_and_out(dist1, open_clip_b16, tmp_path):
    """open_clip ViT-B-16 (GELU, random init) -> vitgraph clip_vit_b16 with activation gelu:
    the same image and text features; exported back, open_clip loads it strictly and every
    tensor is equal."""
    from vitgraph.models.registry import get_clip_arch
    open_clip, ref = open_clip_b16
    src = tmp_path / "b16.pth"
    torch.save({"state_dict": ref.state_dict()}, src)
    arch = dataclasses.replace(get_clip_arch("clip_vit_b16"), activation="gelu")
    ours = build(dist1, arch)
    init_from(ours, str(src))
    images = torch.randn(2, 3, 224, 224)
    tokens = torch.randint(1, 49000, (3, 77))
    for row, eot in enumerate((5, 20, 76)):  # open_clip and vitgraph pool at the largest id
        tokens[row, eot] = 49407
        tokens[row, eot + 1:] = 0
    with torch.no_grad():
        want_img, want_txt = ref.encode_image(images), ref.encode_text(tokens)
        got_img = ours.encode_image(images, normalize=False)
        got_txt = ours.encode_text(tokens, normalize=False)
    assert rel_err(got_img, want_img) <= 1e-4
    assert rel_err(got_txt, want_txt) <= 1e-4
    assert ours.logit_scale.item() == pytest.approx(ref.logit_scale.item())

    out = from_vitgraph(export_state_dict(ours), "open_clip", 12, 8)
    save_safetensors(out, tmp_path / "back.safetensors")
    back = open_clip.create_model("ViT-B-16", pretrained=None).eval()
    from safetensors.torch import load_file
    back.load_state_dict(load_file(tmp_path / "back.safetensors"), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
