"""GPU: the te and torch layer specs compute the same function for the same weights (bf16)."""
import pytest
import torch

from vitgraph.config import load_config

from conftest import ROOT, world_of_one

pytestmark = pytest.mark.gpu


dist1 = world_of_one("te")


def _build(d, spec, *over):
    from vitgraph.parallel.setup import build_model
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                      ["data.kind=shapes", f"model.spec={spec}", "model.num_layers=4",
                       "model.gradient_accumulation_fusion=false", *over])
    return build_model(cfg, d, 10)[0]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_te_and_torch_specs_agree(dist1):
    te_model = _build(dist1, "te", "model.num_registers=4")
    torch_model = _build(dist1, "torch", "model.num_registers=4")
    with torch.no_grad():
        torch.nn.init.normal_(te_model.head.weight, std=0.02)
    state = te_model.state_dict()
    missing, unexpected = torch_model.load_state_dict(state, strict=False)
    assert not missing, missing
    assert all(k.endswith("_extra_state") for k in unexpected), unexpected
    assert {n: p.shape for n, p in te_model.named_parameters()} == \
        {n: p.shape for n, p in torch_model.named_parameters()}

    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    out_te, out_torch = te_model(x), torch_model(x)
    assert _rel(out_te, out_torch) < 2e-2
    out_te.float().square().sum().backward()
    out_torch.float().square().sum().backward()
    grads_te = dict(te_model.named_parameters())
    for name, p in torch_model.named_parameters():
        assert _rel(grads_te[name].grad, p.grad) < 5e-2, name


def test_te_layers_copy_no_qkv_gradient_and_add_no_bias_outside_a_gemm(dist1):
    """The TE spec's kernels (issue 6's profile): attention's backward hands dq, dk, dv to the
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
