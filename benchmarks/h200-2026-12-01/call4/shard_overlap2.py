# session 7 (last call): is nvJPEG's cost to a step-graph step a device-wide wait? decode from a
# thread two steps ahead, and with pinned bitstreams
import glob, time, torch
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from vitgraph.config import load_config
from vitgraph.train.loop import Trainer
from vitgraph.data.shards import EncodedImages, decode_on_device
over = ["model.name=vit_b16_224", "model.spec=te", "data.kind=shapes", "data.num_train=256", "data.num_val=64",
        "data.render_size=32", "model.num_classes=10", "train.micro_batch_size=256", "train.global_batch_size=256",
        "train.steps=100000", "train.progress=false", "data.augment.enabled=false",
        "train.label_smoothing=0", "graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=2",
        "run.dir=/tmp/s7_overlap2"]
tr = Trainer(load_config(Path("configs/vit-b16-imagefolder.yaml"), over))
dev = tr.d.device
batch = [(torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device=dev), torch.randint(0, 10, (256,), device=dev))]
files = sorted(glob.glob("/tmp/s7_sf/train/*/*.jpg"))[:256]
enc = EncodedImages([torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files], 224)
pinned = EncodedImages([t.pin_memory() for t in enc.data], 224)
side = torch.cuda.Stream(dev)
def dec(e):
    with torch.cuda.stream(side):
        out = decode_on_device(e, dev); ev = torch.cuda.Event(); ev.record(side)
    return out, ev
pool = ThreadPoolExecutor(1); futs = []
def threaded():
    futs.append(pool.submit(dec, enc))
    if len(futs) > 2: futs.pop(0).result()
cases = {"step alone": None, "+ decode (training thread)": lambda: dec(enc),
         "+ decode (pinned bitstreams)": lambda: dec(pinned), "+ decode (thread, 2 ahead)": threaded}
state = {"step": 0}
def run(between, n):
    for _ in range(n):
        tr.graphs.step_begin(state["step"]); tr.train_step(batch, between); state["step"] += 1
run(None, 5)
for name, between in cases.items():
    run(between, 3); torch.cuda.synchronize(); t0 = time.perf_counter(); run(between, 15); torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 15
    print(f"{name:32s} {dt * 1e3:7.2f} ms/step {256 / dt:8.1f} img/s", flush=True)
for f in futs: f.result()
tr.close(shutdown_dist=False)
