"""The ViT on megatron-core with the torch spec, on CPU (single-process gloo world)."""
import pytest
import torch

from vitgraph.config import load_config
from vitgraph.models.registry import MODELS, get_arch, resolve_arch
from vitgraph.models.vit import vit_param_count

from conftest import ROOT, world_of_one


dist1 = world_of_one("torch")


def build(d, *over):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch", *over])
    return build_model(resolve(cfg, d.world), cfg.model, d, 10, cfg.train.seed)[0], cfg


def test_registry_names_and_aliases():
    assert get_arch("vit_l16_224") == MODELS["vit_large_patch16_224"]
    assert get_arch("vit_b16_224").hidden_size == 768
    with pytest.raises(KeyError):
        get_arch("vit_nope")
    for name, a in MODELS.items():
        assert f"patch{a.patch_size}" in name and name.endswith(str(a.image_size))


def test_param_count_formula_matches_the_module(dist1):
    model, cfg = build(dist1, "model.num_registers=2")
    real = sum(p.numel() for p in model.parameters())
    assert real == vit_param_count(resolve_arch(cfg.model), model.num_prefix, 10)


def test_forward_shapes_and_te_compatible_names(dist1):
    model, _ = build(dist1, "model.num_registers=4")
    x = torch.randn(3, 3, 32, 32)
    assert model(x).shape == (3, 10)
    names = {n for n, _ in model.named_parameters()}
    # TE's layer norms live inside the linears: the torch spec must use TE's names
    for n in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
              "decoder.layers.0.self_attention.linear_qkv.weight",
              "decoder.layers.0.self_attention.linear_proj.bias",
              "decoder.layers.0.mlp.linear_fc1.layer_norm_bias",
              "decoder.layers.0.mlp.linear_fc2.weight", "registers", "cls_token", "pos_embed",
              "final_norm.weight", "head.weight"):
        assert n in names, n
    assert model.pos_embed.shape[1] == 1 + 4 + 64


def test_attention_is_bidirectional(dist1):
    """A causal mask (megatron-core's local ViT spec) would hide later tokens from the class
    token; here changing the last patch must change the class token's output."""
    model, _ = build(dist1, "model.num_layers=1")
    model.eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight)
        x = torch.randn(1, 3, 32, 32)
        y1 = model(x)
        x[..., -4:, -4:] += 5.0  # only the last patch
        y2 = model(x)
    assert not torch.allclose(y1, y2)


def test_other_image_size_interpolates_position_embeddings(dist1):
    model, _ = build(dist1)
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 10)


def test_mean_pool_without_class_token(dist1):
    model, _ = build(dist1, "model.class_token=false", "model.pool=mean")
    assert model.num_prefix == 0
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_interleaved_chunks_tell_float16module_their_virtual_stage(dist1):
    """megatron's Float16Module casts the input of the first virtual stage to bf16 and the output
    of the last one to fp32, finding them from the chunk's ``vp_stage``. Without it, the first
    chunk's fp32 images met bf16 conv weights: interleaved pipelines failed in their first step
    on GPU (the CPU path runs fp32, without Float16Module)."""
    import dataclasses
    from megatron.core.transformer.module import Float16Module
    from vitgraph.models.specs import get_layer_spec
    from vitgraph.models.vit import ViT
    from vitgraph.models.build import transformer_config
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", ["model.spec=torch"])
    plan = resolve(cfg, dist1.world)
    tc = dataclasses.replace(transformer_config(plan, cfg.model, dist1), bf16=True,
                             params_dtype=torch.bfloat16, virtual_pipeline_model_parallel_size=2)
    arch = resolve_arch(cfg.model)
    first, last = (Float16Module(tc, ViT(tc, get_layer_spec("torch"), arch, 10, vp_stage=i,
                                         pre_process=i == 0, post_process=i == 1))
                   for i in range(2))
    hidden = first(torch.randn(2, 3, 32, 32))  # fp32 images in: cast for the first stage
    assert hidden.dtype == torch.bfloat16
    last.set_input_tensor(hidden)
    assert last(None).dtype == torch.float32  # logits back in fp32 from the last stage


def test_building_the_model_logs_no_unknown_mlp_warning(dist1, caplog):
    """megatron warns once per layer about an MLP spec it does not know; BiasActMLP is an MLP."""
    import logging
    with caplog.at_level(logging.WARNING):
        build(dist1)
    assert not [r for r in caplog.records if "Unknown MLP" in r.getMessage()]


def test_mlp_adds_fc1_bias_with_the_activation(dist1):
    """fc1 hands its bias to the activation (one fused kernel on CUDA, torch here): the MLP is
    still LN -> fc1 -> GELU -> fc2, fc2's bias returned for the layer's bias-dropout-add."""
    import torch.nn.functional as F
    from vitgraph.models.specs import BiasActMLP
    model, _ = build(dist1, "model.fused_norm=never")
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp, BiasActMLP)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    with torch.no_grad():
        fc1.bias.normal_()
        fc2.bias.normal_()
        x = torch.randn(5, 2, fc1.weight.shape[1])
        out, bias = mlp(x)
        h = F.layer_norm(x, x.shape[-1:], fc1.layer_norm_weight, fc1.layer_norm_bias, fc1.eps)
        ref = F.gelu(h @ fc1.weight.T + fc1.bias) @ fc2.weight.T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias, fc2.bias)


def _forward_backward(model, x, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_norm_layer_computes_what_megatrons_layer_does(dist1, dropout):
    """ResidualNormLayer (the residual adds inside the norms, the stream unsummed between
    layers) against megatron's TransformerLayer with the same weights: the same logits and
    gradients, hidden dropout included (the same masks, drawn in the same order)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from vitgraph.models.specs import ResidualNormLayer
    over = [f"model.hidden_dropout={dropout}", "model.num_layers=3"]
    fused, _ = build(dist1, *over, "model.fused_norm=always")
    plain, _ = build(dist1, *over, "model.fused_norm=never")
    assert all(type(l) is ResidualNormLayer for l in fused.decoder.layers)
    assert all(type(l) is TransformerLayer for l in plain.decoder.layers)
    assert [l.closes_stream for l in fused.decoder.layers] == [False, False, True]
    plain.load_state_dict(fused.state_dict())
    with torch.no_grad():  # biases and norms away from their zero / one init
        for (n, p), q in zip(fused.named_parameters(), plain.parameters()):
            if "norm" in n or n.endswith("bias") or n.startswith("head"):
                p.add_(torch.randn_like(p) * 0.1)
                q.copy_(p)
    fused.train(), plain.train()
    x = torch.randn(4, 3, 32, 32)
    out_f, grads_f = _forward_backward(fused, x)
    out_p, grads_p = _forward_backward(plain, x)
    torch.testing.assert_close(out_f, out_p, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_p.keys()
    for n in grads_f:
        torch.testing.assert_close(grads_f[n], grads_p[n], rtol=1e-4, atol=1e-6, msg=n)


def test_fused_norm_layer_hands_the_stream_on_unsummed(dist1):
    """Between layers the stream travels as (sum so far, (last MLP output, its bias, its
    stochastic-depth factor or None)) in megatron's (hidden, context) pair; the last layer of
    the block returns the sum and None."""
    fused, _ = build(dist1, "model.num_layers=2", "model.fused_norm=always")
    first, last = fused.decoder.layers
    x = torch.randn(65, 2, first.config.hidden_size)
    with torch.no_grad():
        residual, pending = first(hidden_states=x)
        mlp_out, fc2_bias, keep = pending
        assert keep is None
        assert mlp_out.shape == x.shape
        torch.testing.assert_close(fc2_bias, first.mlp.linear_fc2.bias)
        out, context = last(hidden_states=residual, context=pending)
        assert context is None
        last.closes_stream = False
        s, (o, b, _) = last(hidden_states=residual, context=pending)
        torch.testing.assert_close(out, (o + b) + s)


def test_fused_norm_auto_decides_by_the_micro_batch_tokens(dist1):
    """model.fused_norm=auto: the fused layer from FUSED_NORM_MIN_TOKENS tokens in a training
    micro-batch (faster there on an H200, slower for small ones); never under FP8."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from vitgraph.models.specs import ResidualNormLayer
    from vitgraph.models.build import FUSED_NORM_MIN_TOKENS, use_fused_norm
    small, cfg = build(dist1, "train.micro_batch_size=8", "train.global_batch_size=8")
    assert type(small.decoder.layers[0]) is TransformerLayer  # 8 x 65 tokens
    mb = -(-FUSED_NORM_MIN_TOKENS // small.seq_len)
    large, _ = build(dist1, f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}")
    assert type(large.decoder.layers[0]) is ResidualNormLayer
    assert use_fused_norm("auto", False, 1) is False
    assert use_fused_norm("auto", False, FUSED_NORM_MIN_TOKENS) is True
    assert use_fused_norm("always", False, 1) is True
    assert use_fused_norm("never", False, 10 ** 9) is False
    assert use_fused_norm("always", True, 10 ** 9) is False  # FP8: TE's layers normalise
