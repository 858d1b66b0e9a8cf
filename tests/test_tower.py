"""vitgraph.VisionTower on CPU: docs/vlm.md's examples (layer graphs through the rerun backend
give eager's tokens, loss, gradients and weights exactly), the packed path against each image
alone, weights from Hugging Face (CLIP, SigLIP, SigLIP 2), timm and open_clip, and a caption
run's tower exported as transformers' SiglipVisionModel / Siglip2VisionModel."""
import json
import re

import pytest
import torch

from conftest import ROOT, tiny_overrides
from vitgraph import PackedTokens, VisionTower
from vitgraph.cli import main
from vitgraph.config import ModelConfig
from vitgraph.convert import ConvertError, init_from, save_safetensors
from vitgraph.convert.export_files import hf_vision_export

transformers = pytest.importorskip("transformers")

VLM = ROOT / "configs" / "vlm-tiny-shapes.yaml"
SMALL = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
             patch_size=4)


def doc_examples() -> list[str]:
    """The python blocks of docs/vlm.md's VisionTower section, in order."""
    text = (ROOT / "docs" / "vlm.md").read_text()
    section = text.split("## The tower in someone else's training step")[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_example(code: str) -> dict:
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(code, "docs/vlm.md", "exec"), scope)
    return scope


def test_the_docs_training_loop_graphed_equals_eager():
    code = doc_examples()[0]
    assert "graphs=True" in code
    graphed = run_example(code)
    eager = run_example(code.replace("graphs=True", "graphs=False"))
    tower = graphed["tower"]
    stats = tower.graphs.stats()
    assert stats["replays"] > 0 and stats["eager_fallbacks"] == {"warmup": 3 * 4}, stats
    assert eager["tower"].graphs is None
    assert graphed["tokens"].shape == (8, 65, 64)
    assert torch.equal(graphed["tokens"], eager["tokens"])
    assert torch.equal(graphed["loss"], eager["loss"])
    named = dict(eager["tower"].named_parameters())
    for name, p in tower.named_parameters():
        assert torch.equal(p.grad, named[name].grad), name
        assert torch.equal(p, named[name]), name
    assert any(p.grad.abs().sum() > 0 for p in tower.visual.decoder.parameters())


def test_the_docs_packed_example_and_each_image_alone():
    first, packed = doc_examples()[:2]
    imports = "".join(line + "\n" for line in first.splitlines()
                      if line.startswith(("import ", "from ")))
    scope = run_example(imports + packed)  # the block goes on from the first one
    tower, out, images = scope["tower"], scope["out"], scope["images"]
    assert isinstance(out, PackedTokens) and out.rows.shape == (512, 64)
    assert out.lengths.tolist() == [65, 41, 37]
    assert [t.shape[0] for t in scope["per_image"]] == [65, 41, 37]
    tower.eval()
    with torch.no_grad():
        alone = tower(images[0][None])[0]  # 32 x 32: the fixed path's positions, exactly
        torch.testing.assert_close(scope["first"], alone, rtol=1e-5, atol=1e-5)
        without = tower(images, prefix_tokens=False)
        assert without.lengths.tolist() == [64, 40, 36]
        assert torch.equal(without.per_image()[1], out.per_image()[1][1:])


def test_packed_graphed_equals_eager():
    images = [torch.randn(3, 32, 32), torch.randn(3, 16, 40), torch.randn(3, 8, 28)]
    weights = torch.randn(3, 64)
    results = []
    for graphs in (False, {"warmup_steps": 1}):
        tower = VisionTower.from_name("vit_pico_patch4_32", graphs=graphs,
                                      packing=dict(tokens=256, max_patches=64, max_images=4))
        pack = tower.pack(images)
        for _ in range(3):
            tower.zero_grad()
            out = tower(pack)
            loss = sum((t * w).sum() for t, w in zip(out.per_image(), weights))
            loss.backward()
        results.append((out.per_image(), {n: p.grad for n, p in tower.named_parameters()}))
        if graphs:
            assert tower.graphs.stats()["replays"] > 0
    (eager, eg), (graphed, gg) = results
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    for name in eg:
        torch.testing.assert_close(gg[name], eg[name], rtol=0, atol=0, msg=name)


def _randomised(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the init's zeros and ones
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("kind", ["siglip", "siglip_nohead", "clip"])
def test_hf_vision_models_give_the_same_tokens(kind):
    from transformers import (CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig,
                              SiglipVisionModel)
    if kind == "clip":
        hf = CLIPVisionModel(CLIPVisionConfig(image_size=16, **SMALL))
    else:
        hf = SiglipVisionModel(SiglipVisionConfig(image_size=16, **SMALL,
                                                  vision_use_head=kind == "siglip"))
    hf = _randomised(hf)
    tower = VisionTower.from_hf(hf).eval()
    assert tower.num_prefix == (1 if kind == "clip" else 0)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want, tokens = hf(pixel_values=x), tower(x)
        hidden = want.last_hidden_state
        if kind == "clip":  # CLIP's last_hidden_state comes before its post_layernorm
            hidden = getattr(hf, "vision_model", hf).post_layernorm(hidden)
            torch.testing.assert_close(tokens[:, 0], want.pooler_output, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tokens, hidden, rtol=1e-5, atol=1e-5)
        if kind == "siglip":
            torch.testing.assert_close(tower.pool(tokens), want.pooler_output, rtol=1e-5,
                                       atol=1e-5)
        # SigLIP's bicubic position resize at another size is the fixed path's
        if kind != "clip":
            x = torch.randn(2, 3, 24, 24)
            torch.testing.assert_close(
                tower(x), hf(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state,
                rtol=1e-5, atol=1e-5)


def siglip2_inputs(images, patch, max_patches):
    """Siglip2VisionModel's inputs for [3, h, w] images: (row, column, channel) patch rows."""
    n = len(images)
    pv = torch.zeros(n, max_patches, 3 * patch * patch)
    mask = torch.zeros(n, max_patches, dtype=torch.long)
    shapes = []
    for i, img in enumerate(images):
        gh, gw = img.shape[1] // patch, img.shape[2] // patch
        rows = img.reshape(3, gh, patch, gw, patch).permute(1, 3, 2, 4, 0).reshape(gh * gw, -1)
        pv[i, :gh * gw], mask[i, :gh * gw] = rows, 1
        shapes.append((gh, gw))
    return dict(pixel_values=pv, pixel_attention_mask=mask, spatial_shapes=torch.tensor(shapes))


def test_hf_siglip2_at_native_sizes():
    """SigLIP 2 from a folder: the packed path at grids at least the learned 4 x 4 (its
    antialiased resize is plain bilinear there) and the fixed path at the learned size."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel
    hf = _randomised(Siglip2VisionModel(Siglip2VisionConfig(num_patches=16, **SMALL)))
    tower = VisionTower.from_hf(hf, packing=dict(tokens=256, max_patches=64)).eval()
    assert tower.arch.pos_interp == "bilinear"
    images = [torch.randn(3, 16, 16), torch.randn(3, 20, 28), torch.randn(3, 16, 36)]
    with torch.no_grad():
        want = hf(**siglip2_inputs(images, 4, 64)).last_hidden_state
        got = tower(images).per_image()
        for i, t in enumerate(got):
            torch.testing.assert_close(t, want[i, :t.shape[0]], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tower(images[0][None])[0], want[0, :16], rtol=1e-5,
                                   atol=1e-5)


def test_timm_and_open_clip_towers_load():
    timm = pytest.importorskip("timm")
    open_clip = pytest.importorskip("open_clip")
    ref = _randomised(timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32,
                                        patch_size=4, embed_dim=64, depth=2, num_heads=4,
                                        num_classes=5))
    tower = _pico_of_depth(2)
    report = tower.load(ref)  # the classifier head has no place in the tower: left out
    assert report["pos_embed_resized"] is None
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(tower.eval()(x), ref.forward_features(x), rtol=1e-5,
                                   atol=1e-5)
    visual = _randomised(open_clip.model.VisionTransformer(
        image_size=32, patch_size=4, width=64, layers=2, heads=4, mlp_ratio=4.0, output_dim=32,
        output_tokens=True))
    tower = _pico_of_depth(2, activation="gelu", ln_pre=True, patch_bias=False,
                           layernorm_epsilon=1e-5)
    tower.load(visual.state_dict(), "open_clip")
    with torch.no_grad():
        _, tokens = visual(x)  # the patch tokens after ln_post
        torch.testing.assert_close(tower.eval()(x, prefix_tokens=False), tokens, rtol=1e-5,
                                   atol=1e-5)


def _pico_of_depth(depth, **kw):
    import dataclasses

    from vitgraph.models.registry import TowerArch, get_arch
    vit = dataclasses.replace(get_arch("vit_pico_patch4_32"), num_layers=depth)
    return VisionTower.from_arch(TowerArch(vit, **kw))


def _siglip_for_caption():
    """A SiglipVisionModel of the caption tower's geometry (pico, exact GELU, eps 1e-6)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel
    return _randomised(SiglipVisionModel(SiglipVisionConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        patch_size=4, image_size=32, hidden_act="gelu", layer_norm_eps=1e-6)))


def test_caption_tower_init_from_a_siglip_vision_model(tmp_path):
    """model.init_from (auto: hf_vision) into the caption model's tower: SigLIP's pooling
    head is left out, the tokens are the vision model's."""
    from vitgraph.config import load_config
    from vitgraph.models.build import transformer_config
    from vitgraph.models.caption import build_caption
    from vitgraph.plan import resolve
    hf = _siglip_for_caption()
    path = save_safetensors(hf.state_dict(), tmp_path / "siglip.safetensors")
    VisionTower.from_name("vit_pico_patch4_32")  # megatron's state (a world of one)
    plan = resolve(load_config(VLM, ["model.spec=torch", "model.class_token=false"]), 1)

    class D:  # this process alone, on CPU
        tp = pp = vpp = 1
        cuda = False
    model = build_caption(plan.arch, transformer_config(plan, plan.model, D), "torch",
                          plan.caption, plan.caption.vocab_size, class_token=False)
    init_from(model.visual, str(path), plan.model.init_format)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = model.eval().visual.forward_features(x).transpose(0, 1)
        torch.testing.assert_close(got, hf(pixel_values=x).last_hidden_state, rtol=1e-5,
                                   atol=1e-5)


def test_export_refuses_a_tower_with_a_class_token():
    with pytest.raises(ConvertError, match="class token.*VisionTower.from_run"):
        hf_vision_export({}, ModelConfig(), native=False)
    with pytest.raises(ConvertError, match="register tokens"):
        hf_vision_export({}, ModelConfig(class_token=False, num_registers=2), native=False)


# the CLI runs below tear down this process's process groups: they come last
@pytest.fixture(scope="module", params=["bicubic", "bilinear"])
def caption_run(request, tmp_path_factory):
    run = tmp_path_factory.mktemp(f"caption-{request.param}") / "run"
    code = main(["train", str(VLM), *tiny_overrides(run, steps=2), "data.num_val=50",
                 "train.eval_batch_size=50", "model.class_token=false",
                 f"model.pos_interp={request.param}"])
    assert code == 0, (run / "train.log").read_text()[-3000:]
    return run, request.param


def test_caption_run_exports_its_tower_as_a_transformers_vision_model(caption_run, tmp_path,
                                                                      capsys):
    run, interp = caption_run
    out = tmp_path / "hf" / "model.safetensors"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    cls = "Siglip2VisionModel" if interp == "bilinear" else "SiglipVisionModel"
    printed = capsys.readouterr().out
    assert f"transformers' {cls}" in printed and "config.json" in printed
    config = json.loads((out.parent / "config.json").read_text())
    assert config["architectures"] == [cls] and not config["vision_use_head"]
    hf, info = getattr(transformers, cls).from_pretrained(out.parent, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    transformers.AutoImageProcessor.from_pretrained(out.parent)
    kw = {"packing": dict(tokens=256, max_patches=128)} if interp == "bilinear" else {}
    tower = VisionTower.from_run(run, **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = tower(x)
        if interp == "bilinear":
            images = [x[0], torch.randn(3, 36, 40)]  # grids at least the learned 8 x 8
            want = hf.eval()(**siglip2_inputs(images, 4, 128)).last_hidden_state
            for i, t in enumerate(tower(images).per_image()):
                torch.testing.assert_close(t, want[i, :t.shape[0]], rtol=1e-5, atol=1e-5)
        else:
            want = hf.eval()(pixel_values=x).last_hidden_state
            torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert tokens.shape == (2, 64, 64)
