# nvJPEG decode of one 256-image batch from the shards' source JPEGs: host thread CPU time and GPU time
import glob, time, torch
from vitgraph.data.shards import EncodedImages, decode_on_device
from torchvision.io import decode_jpeg, ImageReadMode
files = sorted(glob.glob("/tmp/sf_b16/train/*/*.jpg"))[:256]
print(len(files), "files")
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
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))
