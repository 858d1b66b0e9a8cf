"""Hugging Face CLIPModel (random weights, nothing downloaded) -> vitgraph CLIP and back: the
same image and text embeddings."""
import pytest
import torch

from vitgraph.models.registry import CLIPArch, TextArch, ViTArch
from vitgraph.text.tokenizer import ByteTokenizer

from conftest import world_of_one

dist1 = world_of_one("torch")
transformers = pytest.importorskip("transformers")


def _pair(d):
    from transformers import CLIPConfig, CLIPModel
    from vitgraph.config import load_config
    from vitgraph.models.clip import build_clip
    from vitgraph.models.build import transformer_config
    from vitgraph.plan import resolve
    from conftest import ROOT
    torch.manual_seed(0)
    hf = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=24, eos_token_id=258),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=3, image_size=16, patch_size=4),
        projection_dim=24)).eval()
    arch = CLIPArch(24, ViTArch(48, 2, 3, 96, 4, 16), TextArch(259, 24, 32, 2, 4, 64),
                    activation="quick_gelu", layernorm_epsilon=1e-5)
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    plan = resolve(cfg, d.world)
    ours = build_clip(arch, transformer_config(plan, cfg.model, d), "torch", seed=0).eval()
    return hf, ours


def _hf_features(hf, images, ids):
    with torch.no_grad():
        img = hf.visual_projection(hf.vision_model(pixel_values=images).pooler_output)
        txt = hf.text_projection(hf.text_model(input_ids=ids).pooler_output)
    return img, txt


def test_hf_clip_weights_give_the_same_embeddings(dist1):
    from vitgraph.convert.clip_hf import hf_clip_to_vitgraph, vitgraph_to_hf_clip
    hf, ours = _pair(dist1)
    sd = hf_clip_to_vitgraph(hf.state_dict(), vision_heads=3, text_heads=4)
    missing, unexpected = ours.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    images = torch.randn(3, 3, 16, 16)
    ids = ByteTokenizer(24)(["a red star", "a small blue circle on the left", "x"])
    want_img, want_txt = _hf_features(hf, images, ids)
    with torch.no_grad():
        got_img = ours.encode_image(images, normalize=False)
        got_txt = ours.encode_text(ids, normalize=False)
    torch.testing.assert_close(got_img, want_img, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_txt, want_txt, rtol=1e-4, atol=1e-5)
    assert ours.logit_scale.item() == pytest.approx(hf.logit_scale.item())
    # and back: exactly HF's tensors (position_ids buffers aside)
    back = vitgraph_to_hf_clip(ours.state_dict(), vision_heads=3, text_heads=4)
    ref = {k: v for k, v in hf.state_dict().items() if not k.endswith("position_ids")}
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_unexpected_or_missing_keys_are_named():
    from vitgraph.convert.clip_hf import hf_clip_to_vitgraph
    from vitgraph.convert.names import ConvertError
    from transformers import CLIPConfig, CLIPModel
    hf = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=4), projection_dim=8))
    sd = hf.state_dict()
    with pytest.raises(ConvertError, match="extra.weight"):
        hf_clip_to_vitgraph({**sd, "extra.weight": torch.zeros(1)}, 2, 2)
    sd.pop("text_projection.weight")
    with pytest.raises(ConvertError, match="text_projection.weight"):
        hf_clip_to_vitgraph(sd, 2, 2)


def test_hf_siglip_weights_give_the_same_embeddings(dist1):
    """SigLIP: attention-pooling image head, bidirectional text pooled at the last position,
    tanh GELU, logit bias."""
    import dataclasses
    from transformers import SiglipConfig, SiglipModel
    from vitgraph.config import load_config
    from vitgraph.convert.clip_hf import hf_siglip_to_vitgraph, vitgraph_to_hf_siglip
    from vitgraph.models.clip import build_clip
    from vitgraph.models.registry import get_clip_arch
    from vitgraph.models.build import transformer_config
    from vitgraph.plan import resolve
    from conftest import ROOT
    torch.manual_seed(0)
    hf = SiglipModel(SiglipConfig(
        text_config=dict(vocab_size=259, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=20),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=3, image_size=16, patch_size=4))).eval()
    with torch.no_grad():  # HF starts the probe / bias at values that hide mistakes: randomise
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    base = get_clip_arch("siglip_tiny_patch4_32")
    arch = dataclasses.replace(base, embed_dim=48, vision=ViTArch(48, 2, 3, 96, 4, 16),
                               text=dataclasses.replace(base.text, hidden_size=48, num_layers=2,
                                                        num_heads=4, ffn_hidden_size=96,
                                                        context_length=20))
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    plan = resolve(cfg, dist1.world)
    ours = build_clip(arch, transformer_config(plan, cfg.model, dist1), "torch", seed=0).eval()
    sd = hf_siglip_to_vitgraph(hf.state_dict(), vision_heads=3, text_heads=4)
    ours.load_state_dict(sd, strict=True)
    images = torch.randn(3, 3, 16, 16)
    ids = ByteTokenizer(20)(["a red star", "a blue circle on the left", "x"])
    with torch.no_grad():
        want_img = hf.vision_model(pixel_values=images).pooler_output
        want_txt = hf.text_model(input_ids=ids).pooler_output
        got_img = ours.encode_image(images, normalize=False)
        got_txt = ours.encode_text(ids, normalize=False)
    torch.testing.assert_close(got_img, want_img, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_txt, want_txt, rtol=1e-4, atol=1e-5)
    assert ours.logit_bias.item() == pytest.approx(hf.logit_bias.item())
    back = vitgraph_to_hf_siglip(ours.state_dict(), vision_heads=3, text_heads=4)
    ref = {k: v for k, v in hf.state_dict().items() if not k.endswith("position_ids")}
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
