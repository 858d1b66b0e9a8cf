import torch, torch.nn.functional as F
from vitgraph.models import fused_act as fa
x = torch.randn(256 * 197, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
def t(fn, n=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n
for name, act in [("gelu", F.gelu), ("quick_gelu", fa.quick_gelu), ("gelu_tanh", fa.gelu_tanh)]:
    xd = x.detach()
    tf = t(lambda: act(xd))
    tfb = t(lambda: fa.bias_act(xd, b.detach(), act))
    def torch_bwd():
        y = act(x); torch.autograd.grad(y, x, dy)
    def torch_bwd_bias():
        y = act(x + b); torch.autograd.grad(y, [x, b], dy)
    def fused_bwd():
        y = fa.bias_act(x, b, act); torch.autograd.grad(y, [x, b], dy)
    print(f"{name}: fwd torch {tf:.3f} ms fused(bias) {tfb:.3f} ms | fwd+bwd torch {t(torch_bwd):.3f} "
          f"torch+bias {t(torch_bwd_bias):.3f} fused {t(fused_bwd):.3f} ms", flush=True)
