"""GPU: the te and torch layer specs compute the same function for the same weights (bf16)."""
import pytest
import torch

from vitgraph.config import load_config

from conftest import ROOT, world_of_one

pytestmark = pytest.mark.gpu


dist1 = world_of_one("te")


def _build(d, spec, *over):
    from vitgraph.models.build import build_model
    from vitgraph.plan import resolve
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                      ["data.kind=shapes", f"model.spec={spec}", "model.num_layers=4",
                       "model.gradient_accumulation_fusion=false", *over])
    return build_model(resolve(cfg, d.world), cfg.model, d, 10, cfg.train.seed)[0]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _assert_same_function(model, other) -> torch.Tensor:
    """``other`` given ``model``'s weights (TE's ``_extra_state`` aside) computes the same
    logits and parameter gradients in bf16; returns the input used."""
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    assert all(k.endswith("_extra_state") for k in unexpected), unexpected
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    out, out_other = model(x), other(x)
    assert _rel(out, out_other) < 2e-2
    out.float().square().sum().backward()
    out_other.float().square().sum().backward()
    grads = dict(other.named_parameters())
    for name, p in model.named_parameters():
        assert _rel(p.grad, grads[name].grad) < 5e-2, name
    return x


def test_te_and_torch_specs_agree(dist1):
    te_model = _build(dist1, "te", "model.num_registers=4")
    torch_model = _build(dist1, "torch", "model.num_registers=4")
    with torch.no_grad():
        torch.nn.init.normal_(te_model.head.weight, std=0.02)
    assert {n: p.shape for n, p in te_model.named_parameters()} == \
        {n: p.shape for n, p in torch_model.named_parameters()}
    _assert_same_function(te_model, torch_model)


def test_te_layers_copy_no_qkv_gradient_and_add_no_bias_outside_a_gemm(dist1):
    """The TE spec's kernels (as a step profile shows them): attention's backward hands dq, dk, dv to the
    fused QKV GEMM as one packed gradient (no concatenation), and the projection and MLP
    biases are added by their GEMMs (no broadcast add over the activations per layer)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.autograd import DeviceType
    layers = 4
    model = _build(dist1, "te", f"model.num_layers={layers}")
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    model(x).float().square().sum().backward()  # warm-up: autotuning, workspaces
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(x).float().square().sum().backward()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    assert events, "the profiler saw no kernels"

    def calls(*words):
        return sum(e.count for e in events if all(w in e.key for w in words))
    # one each in the embedding: the class token's cat, the position embedding's add
    assert calls("CatArrayBatchedCopy") < layers, [e.key for e in events]
    assert calls("CUDAFunctor_add", "gpu_kernel_impl_nocast") < layers, [e.key for e in events]


@pytest.mark.parametrize("act_name", ["gelu", "quick_gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_bias_activation_equals_torch(act_name, dtype):
    """The Triton bias + activation (forward, input and bias gradients) against act(x + b)
    in torch, on shapes that fill no block evenly."""
    import torch.nn.functional as F
    from vitgraph.models import fused_act
    assert fused_act.available()
    act = {"gelu": F.gelu, "quick_gelu": fused_act.quick_gelu,
           "gelu_tanh": fused_act.gelu_tanh}[act_name]
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in [(197, 3, 1000), (50, 8, 4096), (7, 130)]:
        x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
        b = torch.randn(shape[-1], device="cuda", generator=g).to(dtype).requires_grad_()
        dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
        y = fused_act.bias_act(x, b, act)
        assert y.grad_fn is not None and "BiasAct" in type(y.grad_fn).__name__
        y.backward(dy)
        # reference in fp32 from the same inputs
        xr = x.detach().float().requires_grad_()
        br = b.detach().float().requires_grad_()
        yr = act(xr + br)
        yr.backward(dy.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _rel(y, yr) < tol
        assert _rel(x.grad, xr.grad) < tol
        assert _rel(b.grad, br.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_layer_norm_equals_torch(dtype):
    """The Triton residual add + LayerNorm (outputs; gradients of both inputs, the norm's
    parameters and the added bias) against torch in fp32 from the same inputs, on shapes that
    fill no block evenly, with and without a bias, a gradient reaching the sum and a
    stochastic-depth factor per sample; and the plain add with the factor."""
    import torch.nn.functional as F
    from vitgraph.models import fused_norm
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)
    for shape, with_bias, with_dsum, with_keep in [
            ((197, 3, 1000), True, True, False), ((50, 8, 768), False, True, False),
            ((7, 130), True, False, False), ((197, 3, 1000), True, True, True),
            ((50, 8, 768), False, True, True)]:
        n = shape[-1]
        # a sample's factor: dropped (0) or kept and scaled (1 / (1 - p)), as specs._DropPath
        keep = (torch.arange(shape[1], device="cuda") % 3 != 0).to(dtype).mul_(1.25).view(
            1, shape[1], 1) if with_keep else None
        x, r = rand(*shape, scale=3.0).requires_grad_(), rand(*shape).requires_grad_()
        bias = rand(n).requires_grad_() if with_bias else None
        w, b = (rand(n, scale=0.1) + 1).requires_grad_(), rand(n, scale=0.1).requires_grad_()
        s, y = fused_norm.add_layer_norm(x, r, bias, w, b, 1e-6, keep=keep)
        assert "AddLayerNorm" in type(y.grad_fn).__name__
        dy, ds = rand(*shape), rand(*shape) if with_dsum else None
        torch.autograd.backward([y, s] if with_dsum else [y], [dy, ds] if with_dsum else [dy])
        leaves = [x, r, w, b] + ([bias] if with_bias else [])
        ref = [t.detach().float().requires_grad_() for t in leaves]
        xr, rr, wr, br = ref[:4]
        sr = ((xr + ref[4]) if with_bias else xr) * (1 if keep is None else keep.float()) + rr
        sr_rounded = sr.to(dtype).float()  # the kernel normalises the sum as stored
        yr = F.layer_norm(sr + (sr_rounded - sr).detach(), (n,), wr, br, 1e-6)
        torch.autograd.backward([yr, sr] if with_dsum else [yr],
                                [dy.float(), ds.float()] if with_dsum else [dy.float()])
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _rel(s, sr) < tol and _rel(y, yr) < tol
        for t, tr in zip(leaves, ref):
            assert _rel(t.grad, tr.grad) < tol, tuple(t.shape)
        if keep is not None:  # the last layer's add, without a norm
            xs, rs = (t.detach().clone().requires_grad_() for t in (x, r))
            bs = None if bias is None else bias.detach().clone().requires_grad_()
            out = fused_norm.add(xs, rs, bs, keep=keep)
            assert "Add" in type(out.grad_fn).__name__
            out.backward(dy)
            leaves = [xs, rs] + ([bs] if bs is not None else [])
            ref = [t.detach().float().requires_grad_() for t in leaves]
            outr = ((ref[0] + ref[2]) if bs is not None else ref[0]) * keep.float() + ref[1]
            outr.backward(dy.float())
            assert _rel(out, outr) < tol
            for t, tr in zip(leaves, ref):
                assert _rel(t.grad, tr.grad) < tol, tuple(t.shape)


def test_fused_norm_layer_agrees_with_megatrons_te_layer(dist1):
    """ResidualNormLayer on TE's linears against megatron's TransformerLayer with TE's
    LayerNormLinear, same weights, bf16; and its kernels: the Triton add + norm where the adds
    and TE's norms were, no broadcast add."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from vitgraph.models.specs import ResidualNormLayer
    layers = 4
    fused = _build(dist1, "te", f"model.num_layers={layers}", "model.fused_norm=always")
    plain = _build(dist1, "te", f"model.num_layers={layers}", "model.fused_norm=never")
    assert all(isinstance(l, ResidualNormLayer) for l in fused.decoder.layers)
    with torch.no_grad():
        torch.nn.init.normal_(fused.head.weight, std=0.02)
        for n, p in fused.named_parameters():
            if "layer_norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    x = _assert_same_function(fused, plain)

    def kernels(model):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x).float().square().sum().backward()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        return lambda *words: sum(e.count for e in events if all(w in e.key for w in words)), \
            [e.key for e in events]
    calls, keys = kernels(fused)
    plain_calls, plain_keys = kernels(plain)
    # forward: 2 per layer, the first layer's norm without an add, the last layer's add
    # without a norm, the final norm; backward: the same less the plain add (a column sum)
    assert calls("_add_ln_forward") == 2 * layers + 2, keys
    assert calls("_add_ln_backward") == 2 * layers + 1, keys
    # TE's LayerNorm kernels (which megatron's layer runs) are gone
    assert plain_calls("ln_fwd") >= 2 * layers and plain_calls("ln_bwd") >= 2 * layers, plain_keys
    assert calls("ln_fwd") + calls("ln_bwd") == 0, keys
    assert calls("CUDAFunctor_add", "gpu_kernel_impl_nocast") < layers, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_plain_layer_norm_and_add_equal_torch(dtype):
    """The same kernels as a plain LayerNorm and as a residual + bias add, against torch."""
    import torch.nn.functional as F
    from vitgraph.models import fused_norm
    g = torch.Generator(device="cuda").manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for shape in [(197, 3, 1000), (7, 130)]:
        n = shape[-1]
        x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
        r = torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_()
        w = (torch.randn(n, device="cuda", generator=g) * 0.1 + 1).to(dtype).requires_grad_()
        b = (torch.randn(n, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
        dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
        y = fused_norm.layer_norm(x, w, b, 1e-6)
        s = fused_norm.add(x, r, b)
        assert "LayerNorm" in type(y.grad_fn).__name__ and "Add" in type(s.grad_fn).__name__
        torch.autograd.backward([y, s], [dy, dy])
        ref = [t.detach().float().requires_grad_() for t in (x, r, w, b)]
        xr, rr, wr, br = ref
        torch.autograd.backward([F.layer_norm(xr, (n,), wr, br, 1e-6), (xr + br) + rr],
                                [dy.float(), dy.float()])
        assert _rel(y, F.layer_norm(xr, (n,), wr, br, 1e-6)) < tol
        assert _rel(s, (xr + br) + rr) < tol
        for t, tr in zip((x, r, w, b), ref):
            assert _rel(t.grad, tr.grad) < tol, tuple(t.shape)
