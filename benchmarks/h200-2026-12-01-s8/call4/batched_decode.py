# session 8, call 4: nvJPEG's batched GPU-Huffman decode (vitgraph/data/nvjpeg.py) against
# torchvision's decode_jpeg: same pixels? time alone, and its cost beside a ViT-B/16 step-graph step
import glob, time, torch
from pathlib import Path
from torch.profiler import profile, ProfilerActivity
from vitgraph.config import load_config
from vitgraph.train.loop import Trainer
from vitgraph.data.shards import EncodedImages, finish_on_device
from nvjpeg_batched import batch_decoder  # vitgraph/data/nvjpeg.py when measured; removed after
from torchvision.io import decode_jpeg, ImageReadMode
files = sorted(glob.glob("/tmp/s8_sf/train/*/*.jpg"))[:256]
raw = [open(f, "rb").read() for f in files]
data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
dev = torch.device("cuda")
bd = batch_decoder(dev)
a = bd(data); b = decode_jpeg(data, device=dev, mode=ImageReadMode.RGB); torch.cuda.synchronize()
d = torch.stack([(x.int() - y.int()).abs().float() for x, y in zip(a, b)])
print(f"batched vs torchvision: shapes equal {all(x.shape == y.shape for x, y in zip(a, b))}, "
      f"max |diff| {d.max().item():.0f}, mean {d.mean().item():.3f}, share > 2: {(d > 2).float().mean().item():.4f}", flush=True)
for name, fn in (("batched", lambda: bd(data)), ("torchvision", lambda: decode_jpeg(data, device=dev, mode=ImageReadMode.RGB))):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(10): fn()
    torch.cuda.synchronize(); print(f"{name:12s} decode alone: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms per 256 (wall)", flush=True)
over = ["model.name=vit_b16_224", "model.spec=te", "data.kind=shapes", "data.num_train=256", "data.num_val=64",
        "data.render_size=32", "model.num_classes=10", "train.micro_batch_size=256", "train.global_batch_size=256",
        "train.steps=100000", "train.progress=false", "data.augment.enabled=false",
        "train.label_smoothing=0", "graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=2",
        "run.dir=/tmp/s8_batched"]
tr = Trainer(load_config(Path("configs/vit-b16-imagefolder.yaml"), over))
batch = [(torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device=dev), torch.randint(0, 10, (256,), device=dev))]
side = torch.cuda.Stream(dev)
def beside(decoder):
    enc = EncodedImages(data, 224, decoder)
    def f():
        with torch.cuda.stream(side):
            finish_on_device(enc, dev)
    return f
state = {"step": 0}
def run(n, between=None):
    for _ in range(n):
        tr.graphs.step_begin(state["step"]); tr.train_step(batch, between); state["step"] += 1
run(5)
cases = {"step alone": None, "+ torchvision decode beside": beside("torchvision"), "+ batched decode beside": beside("batched")}
for name, between in cases.items():
    run(4, between); torch.cuda.synchronize(); t0 = time.perf_counter(); run(16, between); torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 16
    print(f"{name:32s} {dt * 1e3:7.2f} ms/step {256 / dt:8.1f} img/s", flush=True)
run(2, cases["+ batched decode beside"]); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    run(2, cases["+ batched decode beside"]); torch.cuda.synchronize()
p.export_chrome_trace("/tmp/s8c4/trace_batched.json")
print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
tr.close(shutdown_dist=False)
