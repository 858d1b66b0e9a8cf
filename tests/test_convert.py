"""Weights in and out: timm and Hugging Face ViTs <-> vitgraph, on CPU, no downloads.

Random-init reference models; vitgraph built with the torch spec in fp32 must give the same
logits (<= 1e-4 relative), and the exported weights must load back into the reference model
with the same logits again.
"""
import json
import logging

import pytest
import torch

from vitgraph.config import load_config
from vitgraph.convert import (ConvertError, detect_format, export_state_dict, from_vitgraph,
                              init_from, load_file, load_into_model, save_safetensors,
                              to_vitgraph)
from vitgraph.convert.names import qkv_from_megatron, qkv_to_megatron

from conftest import ROOT, world_of_one

dist1 = world_of_one("torch")


def build(d, *over, num_classes=10):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch", *over])
    model = build_model(resolve(cfg, d.world), cfg.model, d, num_classes, cfg.train.seed)[0]
    model.eval()
    return model


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def randomise(module, seed=0):
    """Every parameter random (timm and HF init some to zeros/ones: a swapped norm weight and
    bias, or a transposed zero bias, would go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if p.ndim == 1 else 0.0)
                    * torch.rand(p.shape, generator=g))
    return module


def test_qkv_layout_round_trip_and_megatron_split():
    heads, hd, d = 3, 4, 12
    w = torch.arange(3 * d * d, dtype=torch.float32).view(3 * d, d)
    m = qkv_to_megatron(w, heads)
    assert torch.equal(qkv_from_megatron(m, heads), w)
    # megatron reads rows as [heads, (q, k, v), head_dim]: head 1's key is timm's k rows of head 1
    assert torch.equal(m.view(heads, 3, hd, d)[1, 1], w.view(3, heads, hd, d)[1, 1])
    b = torch.arange(3 * d, dtype=torch.float32)
    assert torch.equal(qkv_from_megatron(qkv_to_megatron(b, heads), heads), b)


@pytest.fixture(scope="module")
def timm_base():
    import timm
    torch.manual_seed(0)
    model = randomise(timm.create_model("vit_base_patch16_224", pretrained=False,
                                        num_classes=7)).eval()
    return model


def test_timm_vit_base_in_and_out(dist1, timm_base, tmp_path):
    """timm vit_base_patch16_224 -> vitgraph (same logits) -> export -> timm (same logits)."""
    import timm
    src = tmp_path / "timm.safetensors"
    save_safetensors(timm_base.state_dict(), src)
    assert detect_format(load_file(src)) == "timm"
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = timm_base(x)
        ours = build(dist1, "model.name=vit_base_patch16_224", "model.layernorm_epsilon=1e-6",
                     num_classes=7)
        init_from(ours, str(src), "auto")
        got = ours(x)
    assert rel_err(got, ref) <= 1e-4

    out = from_vitgraph(export_state_dict(ours), "timm", num_heads=12)
    back = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=7).eval()
    back.load_state_dict(out, strict=True)  # every timm key present, none extra
    with torch.no_grad():
        assert rel_err(back(x), ref) <= 1e-4


def test_timm_small_other_heads_registers_and_image_size(dist1, tmp_path, caplog):
    """Head of another class count re-initialised (logged), registers mapped, position
    embeddings resized to another image size."""
    import timm
    ref = randomise(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5,
                                      reg_tokens=2, img_size=32)).eval()
    src = tmp_path / "w.pth"
    torch.save({"state_dict": ref.state_dict()}, src)
    over = ["model.name=vit_tiny_patch16_224", "model.image_size=32", "model.num_registers=2"]
    ours = build(dist1, *over, num_classes=5)
    init_from(ours, str(src))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(ours(x), ref(x)) <= 1e-4
    with caplog.at_level(logging.INFO, logger="vitgraph"):
        other = build(dist1, "model.name=vit_tiny_patch16_224", "model.image_size=48",
                      "model.num_registers=2", num_classes=3)
        report = init_from(other, str(src))
    assert report["head_reinitialised"] and report["pos_embed_resized"]
    assert "head re-initialised" in caplog.text and "5 classes" in caplog.text
    assert other.pos_embed.shape[1] == 3 + 9 and torch.equal(other.head.weight, torch.zeros(3, 192))
    # the class and register positions are kept as they were
    assert torch.equal(other.pos_embed[0, :3], ref.pos_embed[0, :3])


def test_missing_unexpected_and_misshaped_keys_are_named(dist1, tmp_path):
    import timm
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32)
    sd = ref.state_dict()
    over = ["model.name=vit_tiny_patch16_224", "model.image_size=32"]
    bad = dict(sd)
    del bad["blocks.3.norm2.bias"]
    save_safetensors(bad, tmp_path / "a.safetensors")
    with pytest.raises(ConvertError, match=r"blocks\.3\.norm2\.bias"):
        init_from(build(dist1, *over), str(tmp_path / "a.safetensors"))
    extra = dict(sd)
    extra["blocks.0.ls1.gamma"] = torch.ones(192)  # layer scale: vitgraph has none
    save_safetensors(extra, tmp_path / "b.safetensors")
    with pytest.raises(ConvertError, match=r"blocks\.0\.ls1\.gamma"):
        init_from(build(dist1, *over), str(tmp_path / "b.safetensors"))
    vg = to_vitgraph(sd, "timm", 3)
    with pytest.raises(ConvertError, match="registers"):  # the model has registers, weights not
        load_into_model(build(dist1, *over, "model.num_registers=1"), vg)
    with pytest.raises(ConvertError, match=r"decoder\.layers\.0\.mlp\.linear_fc1\.weight"):
        load_into_model(build(dist1, *over, "model.ffn_hidden_size=384"), vg)
    vg["decoder.layers.12.mlp.linear_fc2.bias"] = torch.zeros(192)
    with pytest.raises(ConvertError, match=r"decoder\.layers\.12"):
        load_into_model(build(dist1, *over), vg)
    with pytest.raises(ConvertError, match="format"):
        to_vitgraph({"foo.weight": torch.zeros(1)}, "auto", 3)
    with pytest.raises(ConvertError, match=r"visual\.conv1\.weight"):  # detected as open_clip
        to_vitgraph({"visual.transformer.resblocks.0.attn.in_proj_weight": torch.zeros(1)}, "auto", 3)


def _hf(classification: bool, layers=12, **kw):
    from transformers import ViTConfig, ViTForImageClassification, ViTModel
    cfg = ViTConfig(num_hidden_layers=layers, num_labels=4, **kw)
    torch.manual_seed(1)
    if classification:
        return randomise(ViTForImageClassification(cfg)).eval(), cfg
    return randomise(ViTModel(cfg, add_pooling_layer=True)).eval(), cfg


def test_hf_vit_for_image_classification_in_and_out(dist1, tmp_path):
    """HF ViTForImageClassification (ViT-B/16 shape) -> vitgraph -> export -> from_pretrained."""
    from transformers import ViTForImageClassification
    ref, hf_cfg = _hf(True)
    save_safetensors(ref.state_dict(), tmp_path / "hf.safetensors")  # transformers-5 names
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = ref(pixel_values=x).logits
        ours = build(dist1, "model.name=vit_base_patch16_224", "model.layernorm_epsilon=1e-12",
                     num_classes=4)
        init_from(ours, str(tmp_path / "hf.safetensors"), "hf")
        assert rel_err(ours(x), want) <= 1e-4

    out_dir = tmp_path / "export"
    out = from_vitgraph(export_state_dict(ours), "hf", num_heads=12)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in out  # the hub's names
    save_safetensors(out, out_dir / "model.safetensors", {"format": "pt"})
    hf_cfg.save_pretrained(out_dir)
    back = ViTForImageClassification.from_pretrained(out_dir).eval()
    with torch.no_grad():
        assert rel_err(back(pixel_values=x).logits, want) <= 1e-4
    # and the hub names go back in too
    again = build(dist1, "model.name=vit_base_patch16_224", "model.layernorm_epsilon=1e-12",
                  num_classes=4)
    load_into_model(again, to_vitgraph(out, "auto", 12))
    with torch.no_grad():
        assert rel_err(again(x), want) <= 1e-4


def test_hf_vit_model_features(dist1, tmp_path):
    """ViTModel (no head; its pooler is dropped): the class token's final features match."""
    ref, _ = _hf(False, layers=2, hidden_size=96, num_attention_heads=4, intermediate_size=200,
                 image_size=32, patch_size=8)
    ours = build(dist1, "model.name=vit_tiny_patch16_224", "model.hidden_size=96",
                 "model.num_heads=4", "model.ffn_hidden_size=200", "model.num_layers=2",
                 "model.image_size=32", "model.patch_size=8", "model.layernorm_epsilon=1e-12")
    report = load_into_model(ours, to_vitgraph(ref.state_dict(), "auto", 4))
    assert report["head_reinitialised"]
    feats = {}
    ours.final_norm.register_forward_hook(lambda m, i, o: feats.update(out=o))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ours(x)
        want = ref(pixel_values=x).last_hidden_state
    assert rel_err(feats["out"].transpose(0, 1), want) <= 1e-4


def test_export_state_dict_has_full_names_and_loads_with_weights_only(dist1, tmp_path):
    model = build(dist1)
    sd = export_state_dict([model])
    assert "decoder.layers.3.mlp.linear_fc2.weight" in sd
    assert not any(k.endswith("_extra_state") for k in sd)
    path = save_safetensors(sd, tmp_path / "m.safetensors", {"step": 5})
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["step"]) == 5
    back = load_file(path)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_our_names_as_the_file_calls_them():
    from vitgraph.convert.names import name_in_file
    assert name_in_file("timm", "registers") == "reg_token"
    assert name_in_file("timm", "decoder.layers.3.mlp.linear_fc1.bias") == "blocks.3.mlp.fc1.bias"
    assert name_in_file("hf", "decoder.layers.0.self_attention.linear_qkv.weight") == (
        "vit.encoder.layer.0.attention.attention.query.weight / "
        "vit.encoder.layer.0.attention.attention.key.weight / "
        "vit.encoder.layer.0.attention.attention.value.weight")
    assert name_in_file("open_clip", "decoder.layers.1.self_attention.linear_proj.weight") == (
        "visual.transformer.resblocks.1.attn.out_proj.weight")
    assert name_in_file("vitgraph", "pos_embed") == "pos_embed"


@pytest.mark.parametrize("over", [[], ["model.class_token=false", "model.pool=mean",
                                       "model.num_registers=2"]])
def test_timm_config_rebuilds_the_model(dist1, tmp_path, over):
    """timm's config.json written by the export: its architecture and model_args build a timm
    model that takes the weights and gives vitgraph's logits (class token or mean pooling)."""
    import timm

    from vitgraph.convert import export_files
    from vitgraph.models.registry import resolve_arch
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch", *over])
    ours = randomise(build(dist1, *over, num_classes=3), seed=2)
    side = export_files.timm_config(cfg.model.name, resolve_arch(cfg.model), cfg.model, 3,
                                    ["a", "b", "c"])
    ref = timm.create_model(side["architecture"], pretrained=False,
                            num_classes=side["num_classes"], **side["model_args"]).eval()
    ref.load_state_dict(from_vitgraph(export_state_dict(ours), "timm", num_heads=4), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_err(ref(x), ours(x)) <= 1e-4
    assert side["label_names"] == ["a", "b", "c"]


def test_class_names_of_a_run(tmp_path):
    from vitgraph.convert import export_files
    assert export_files.read_classes(tmp_path) is None  # a run from before they were stored
    export_files.write_classes(tmp_path, ["cat", "dog"])
    assert export_files.read_classes(tmp_path, 2) == ["cat", "dog"]
    assert export_files.read_classes(tmp_path, 3) is None  # model.num_classes set otherwise
    from vitgraph.config import ModelConfig
    from vitgraph.models.registry import get_arch
    hf = export_files.hf_config(get_arch("vit_pico_patch4_32"), ModelConfig(), 3, None)
    assert hf["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
