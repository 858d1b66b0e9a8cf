# session 8, call 3: the GPU idle time nvJPEG adds to a ViT-B/16 step-graph step (call 2: busy
# 66.9 of 78.2 ms). Is it per call or per image (decode in 4 calls of 64, or one call of 512
# every other step), and a chrome trace of two steps with the decode beside them.
import glob, time, torch
from pathlib import Path
from torch.profiler import profile, ProfilerActivity
from vitgraph.config import load_config
from vitgraph.train.loop import Trainer
from vitgraph.data.shards import EncodedImages, finish_on_device
over = ["model.name=vit_b16_224", "model.spec=te", "data.kind=shapes", "data.num_train=256", "data.num_val=64",
        "data.render_size=32", "model.num_classes=10", "train.micro_batch_size=256", "train.global_batch_size=256",
        "train.steps=100000", "train.progress=false", "data.augment.enabled=false",
        "train.label_smoothing=0", "graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=2",
        "run.dir=/tmp/s8_trace"]
files = sorted(glob.glob("/tmp/s8_sf/train/*/*.jpg"))[:256]
raw = [open(f, "rb").read() for f in files]
tr = Trainer(load_config(Path("configs/vit-b16-imagefolder.yaml"), over))
dev = tr.d.device
batch = [(torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device=dev), torch.randint(0, 10, (256,), device=dev))]
enc = EncodedImages([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw], 224)
enc512 = EncodedImages(enc.data * 2, 224)
side = torch.cuda.Stream(dev)
state = {"step": 0}
def on_side(fn):
    def f():
        with torch.cuda.stream(side):
            fn()
    return f
def every_other():
    if state["step"] % 2 == 0:
        finish_on_device(enc512, dev)
def run(n, between=None):
    for _ in range(n):
        tr.graphs.step_begin(state["step"]); tr.train_step(batch, between); state["step"] += 1
run(5)
cases = {"step alone": None,
         "+ 1 call of 256": on_side(lambda: finish_on_device(enc, dev)),
         "+ 4 calls of 64": on_side(lambda: [finish_on_device(e, dev) for e in enc.split(64)]),
         "+ 1 call of 512 every other step": on_side(every_other),
         "+ 1 call of 64 (a quarter of the images)": on_side(lambda: finish_on_device(enc.split(64)[0], dev))}
for name, between in cases.items():
    run(4, between); torch.cuda.synchronize(); t0 = time.perf_counter(); run(16, between); torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 16
    print(f"{name:44s} {dt * 1e3:7.2f} ms/step {256 / dt:8.1f} img/s", flush=True)
run(2, cases["+ 1 call of 256"]); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    run(2, cases["+ 1 call of 256"]); torch.cuda.synchronize()
p.export_chrome_trace("/tmp/s8c3/trace_decode.json")
tr.close(shutdown_dist=False)
