# session 7: bias-activation kernels after the approximate reciprocal / 32-bit offsets / 2-D bias sums
import itertools, torch, torch.nn.functional as F
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
print(f"copy x->y {t(lambda: y.copy_(x)):.1f} us (826 MB)", flush=True)
kind = 0
res = []
for bm, bn, w, cf in [(8, 512, 8, False), (8, 512, 4, False), (4, 1024, 4, True), (16, 256, 4, False), (8, 1024, 8, True), (16, 512, 8, False)]:
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, COLS_FIRST=cf)
    res.append((t(lambda: fa.launch_forward(x, b, y, kind, cfg)), cfg))
for us, cfg in sorted(res, key=lambda r: r[0]): print(f"  fwd {us:.1f} {cfg}", flush=True)
res = []
for bm, bn, w, k, cf in itertools.product((16, 32), (64, 128, 256), (4, 8), (1, 4), (False, True)):
    if bm * bn > 8192: continue
    cfg = dict(ROWS=bm * k, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, COLS_FIRST=cf)
    res.append((t(lambda: fa.launch_backward(x, b, dy, dx, kind, cfg)), cfg))
for us, cfg in sorted(res, key=lambda r: r[0])[:8]: print(f"  bwd {us:.1f} {cfg}", flush=True)
print(f"  bwd default {t(lambda: fa.launch_backward(x, b, dy, dx, kind)):.1f}", flush=True)
