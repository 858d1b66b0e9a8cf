"""GPU: vitgraph.VisionTower on its real path: the te spec (Transformer Engine layers), bf16,
CUDA graphs of its layers (impl local and te) on the stream the caller trains on, a plain torch
optimizer (no megatron DDP: TE's fused weight-gradient accumulation off, gradients in .grad).

Graphed == eager: two towers of one seed through the same steps; tokens and every parameter's
gradient within bf16 rounding (relative error 2e-2, as tests/gpu/test_graphs_gpu.py: TE may
choose another attention backend under capture), at capture and at replay. The packed path:
each image's rows against that image alone. A Hugging Face SigLIP vision model's tokens from
the tower in fp32 on the GPU.

Run on the H200:   pytest -m gpu tests/gpu/test_tower_gpu.py -v -rs
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _tower(**kw):
    from vitgraph import VisionTower
    from vitgraph.models.specs import te_available
    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    return VisionTower.from_name("vit_pico_patch4_32", dtype=torch.bfloat16, **kw)


def _steps(tower, batches):
    """Forward, a loss over the tokens, backward, for each batch: the last tokens and grads."""
    for images in batches:
        tower.zero_grad(set_to_none=True)
        tokens = tower(images)
        (tokens.float() * torch.linspace(-1, 1, tokens.shape[-1], device=tokens.device)).sum() \
            .backward()
    return tokens.detach().clone(), {n: p.grad.clone() for n, p in tower.named_parameters()}


def test_te_spec_bf16_and_plain_grads():
    tower = _tower()
    assert tower.device.type == "cuda" and tower.dtype == torch.bfloat16
    layer = tower.visual.decoder.layers[0]
    assert "transformer_engine" in type(layer.self_attention.linear_qkv).__module__ or \
        "TE" in type(layer.self_attention.linear_qkv).__name__
    assert not tower.visual.config.gradient_accumulation_fusion
    tokens, grads = _steps(tower, [torch.randn(8, 3, 32, 32, device="cuda")])
    assert tokens.shape == (8, 65, 64) and torch.isfinite(tokens).all()
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert not any(hasattr(p, "main_grad") for p in tower.parameters())


@pytest.mark.parametrize("impl", ["local", "te"])
def test_layer_graphs_equal_eager(impl):
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randn(8, 3, 32, 32, device="cuda", generator=g) for _ in range(4)]
    eager = _tower()
    graphed = _tower(graphs={"impl": impl, "warmup_steps": 1})
    for n in (2, 3, 4):  # warm-up + capture, then replays
        want, want_g = _steps(eager, batches[:n])
        got, got_g = _steps(graphed, batches[:n])
        assert rel(got, want) <= 2e-2
        for name in want_g:
            assert rel(got_g[name], want_g[name]) <= 2e-2, name
    stats = graphed.graphs.stats()
    assert stats["captures"] > 0 and stats["replays"] > 0, stats


def test_packed_rows_equal_each_image_alone_and_graphed():
    tower = _tower(packing=dict(tokens=512, max_patches=64), graphs={"warmup_steps": 1})
    images = [torch.randn(3, 32, 32, device="cuda"), torch.randn(3, 16, 40, device="cuda")]
    for _ in range(3):
        out = tower(images)
        sum(t.float().sum() for t in out.per_image()).backward()
    assert tower.graphs.stats()["replays"] > 0
    tower.eval()
    with torch.no_grad():
        alone = tower(images[0][None])[0]
        packed = tower(images).per_image()[0]
    assert rel(packed, alone) <= 2e-2


def test_hf_siglip_vision_model_on_the_gpu():
    transformers = pytest.importorskip("transformers")
    from vitgraph import VisionTower
    hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        patch_size=4, image_size=32)).eval()
    tower = VisionTower.from_hf(hf).eval()  # fp32, the te spec
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = hf(pixel_values=x).last_hidden_state
        got = tower(x.cuda()).cpu()
    assert rel(got, want) <= 1e-3  # TF32 GEMMs on the GPU
