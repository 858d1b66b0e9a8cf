# tile sweep for vitgraph.models.fused_act on this GPU, then nvJPEG decode GPU/host cost
import glob, itertools, time, torch, torch.nn.functional as F
from vitgraph.models import fused_act as fa
def t(fn, n=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1000
for m in (256 * 197, 8 * 197):
    n = 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x); y = torch.empty_like(x); dx = torch.empty_like(x)
    print(f"M={m}: torch gelu fwd {t(lambda: F.gelu(x)):.1f} us", flush=True)
    for kind in (0, 1):
        res = []
        for bm, bn, w in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8)):
            if not 2048 <= bm * bn <= 16384: continue
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
            res.append((t(lambda: fa.launch_forward(x, b, y, kind, cfg)), cfg))
        res.sort(key=lambda r: r[0])
        print(f"  kind {kind} fwd default {t(lambda: fa.launch_forward(x, b, y, kind)):.1f} us; best:", flush=True)
        for us, cfg in res[:4]: print(f"    {us:.1f} {cfg}")
        res = []
        for bm, bn, w, k in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (1, 4)):
            if not 2048 <= bm * bn <= 16384: continue
            cfg = dict(ROWS=bm * k, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
            res.append((t(lambda: fa.launch_backward(x, b, dy, dx, kind, cfg)), cfg))
        res.sort(key=lambda r: r[0])
        print(f"  kind {kind} bwd default {t(lambda: fa.launch_backward(x, b, dy, dx, kind)):.1f} us; best:", flush=True)
        for us, cfg in res[:4]: print(f"    {us:.1f} {cfg}")
# nvJPEG: host (thread) time and GPU time per 256-image batch
files = sorted(glob.glob("/tmp/sf_b16/train/*/*.jpg"))[:256]
if files:
    from vitgraph.data.shards import EncodedImages, decode_on_device
    from torchvision.io import decode_jpeg, ImageReadMode
    enc = EncodedImages([torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files], 224)
    for name, fn in [("decode+resize", lambda: decode_on_device(enc, "cuda")),
                     ("decode only", lambda: decode_jpeg(enc.data, device="cuda", mode=ImageReadMode.RGB))]:
        fn(); torch.cuda.synchronize()
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(5): fn()
        c1, w1 = time.thread_time(), time.perf_counter()
        torch.cuda.synchronize(); w2 = time.perf_counter()
        print(f"{name}: host thread cpu {(c1-c0)/5*1e3:.1f} ms, host wall {(w1-w0)/5*1e3:.1f} ms, to sync {(w2-w0)/5*1e3:.1f} ms per 256", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        decode_on_device(enc, "cuda"); torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
