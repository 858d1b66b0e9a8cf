# session 7: nvJPEG decode + matmul resize of one 256-image batch: host and GPU time; the fp16
# matmul resize against torch's fp32 antialiased interpolate on the same decoded images
import glob, time, torch, torch.nn.functional as F
from vitgraph.data.shards import EncodedImages, decode_on_device
from torchvision.io import decode_jpeg, ImageReadMode
files = sorted(glob.glob("/tmp/s7_sf/train/*/*.jpg"))[:256]
print(len(files), "files")
enc = EncodedImages([torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files], 224)
raw = decode_jpeg(enc.data, device="cuda", mode=ImageReadMode.RGB)
for name, fn in [("decode+resize", lambda: decode_on_device(enc, "cuda")),
                 ("decode only", lambda: decode_jpeg(enc.data, device="cuda", mode=ImageReadMode.RGB)),
                 ("resize only", lambda: decode_on_device(enc, "cuda", decoder=lambda d: raw))]:
    fn(); torch.cuda.synchronize()
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(5): fn()
    c1, w1 = time.thread_time(), time.perf_counter()
    torch.cuda.synchronize(); w2 = time.perf_counter()
    print(f"{name}: host thread cpu {(c1-c0)/5*1e3:.1f} ms, host wall {(w1-w0)/5*1e3:.1f} ms, to sync {(w2-w0)/5*1e3:.1f} ms per 256", flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    decode_on_device(enc, "cuda"); torch.cuda.synchronize()
ev = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
print(f"GPU time per 256: {sum(e.self_device_time_total for e in ev) / 1e3:.2f} ms")
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))
got = decode_on_device(enc, "cuda", decoder=lambda d: raw).float()
ref = []
for im in raw:
    h, w = im.shape[-2:]; s = 224
    nh, nw = max(s, round(h * s / min(h, w))), max(s, round(w * s / min(h, w)))
    r = F.interpolate(im[None].float(), size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    t, l = (nh - s) // 2, (nw - s) // 2
    ref.append(r[0].round().clamp(0, 255)[:, t:t + s, l:l + s].permute(1, 2, 0))
d = (got - torch.stack(ref)).abs()
print(f"fp16 matmul resize vs fp32 interpolate: max {d.max().item():.0f} levels, "
      f"{(d > 0).float().mean().item() * 100:.3f}% of values differ, mean {d.mean().item():.4f}")
