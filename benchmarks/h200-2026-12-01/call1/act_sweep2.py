# session 7: bias-activation kernel tiles on this GPU, both grid orders (ViT-L MLP, M=256*197)
import itertools, torch
from vitgraph.models import fused_act as fa
def t(fn, n=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1000
m, n = 256 * 197, 4096
x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x); y = torch.empty_like(x); dx = torch.empty_like(x)
print(f"copy x->y {t(lambda: y.copy_(x)):.1f} us (826 MB moved)", flush=True)
for kind in (0, 1):
    res = []
    for bm, bn, w, cf in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8), (False, True)):
        if not 2048 <= bm * bn <= 16384: continue
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, COLS_FIRST=cf)
        res.append((t(lambda: fa.launch_forward(x, b, y, kind, cfg)), cfg))
    res.sort(key=lambda r: r[0])
    print(f"kind {kind} fwd default {t(lambda: fa.launch_forward(x, b, y, kind)):.1f} us; best:", flush=True)
    for us, cfg in res[:5]: print(f"    {us:.1f} {cfg}", flush=True)
    res = []
    for bm, bn, w, k, cf in itertools.product((8, 16, 32, 64), (64, 128, 256, 512), (4, 8), (1, 4, 8), (False, True)):
        if not 1024 <= bm * bn <= 16384: continue
        cfg = dict(ROWS=bm * k, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, COLS_FIRST=cf)
        res.append((t(lambda: fa.launch_backward(x, b, dy, dx, kind, cfg)), cfg))
    res.sort(key=lambda r: r[0])
    print(f"kind {kind} bwd default {t(lambda: fa.launch_backward(x, b, dy, dx, kind)):.1f} us; best:", flush=True)
    for us, cfg in res[:6]: print(f"    {us:.1f} {cfg}", flush=True)
# bias gradient of an [M, N] gradient: cuBLASLt's bgrad runs 71 us avg for qkv/proj/fc2
for nn in (1024, 3072):
    g = torch.randn(m, nn, device="cuda", dtype=torch.bfloat16)
    print(f"N={nn}: torch sum(0) fp32 {t(lambda: g.sum(0, dtype=torch.float32)):.1f} us, "
          f"read-only ideal at 4 TB/s {m * nn * 2 / 4e12 * 1e6:.1f} us", flush=True)
