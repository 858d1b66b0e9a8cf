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
