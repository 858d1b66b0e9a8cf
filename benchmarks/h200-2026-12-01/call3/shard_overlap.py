# session 7: what decoding the next step costs a ViT-B/16 step-graph step (mb 256), by part:
# the step alone, then with the next batch decoded on a side stream while it runs
import glob, time, torch
from pathlib import Path
from vitgraph.config import load_config
from vitgraph.train.loop import Trainer
from vitgraph.data.shards import EncodedImages, decode_on_device
from torchvision.io import decode_jpeg, ImageReadMode
ROOT = Path(".")
over = ["model.name=vit_b16_224", "model.spec=te", "data.kind=shapes", "data.num_train=256", "data.num_val=64",
        "data.render_size=32", "model.num_classes=10", "train.micro_batch_size=256", "train.global_batch_size=256",
        "train.steps=100000", "train.tensorboard=false", "train.progress=false", "data.augment.enabled=false",
        "train.label_smoothing=0", "graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=2",
        "run.dir=/tmp/s7_overlap"]
cfg = load_config(ROOT / "configs/vit-b16-imagefolder.yaml", over)
tr = Trainer(cfg)
dev = tr.d.device
batch = [(torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device=dev), torch.randint(0, 10, (256,), device=dev))]
files = sorted(glob.glob("/tmp/s7_sf/train/*/*.jpg"))[:256]
enc = EncodedImages([torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files], 224)
raw = decode_jpeg(enc.data, device=dev, mode=ImageReadMode.RGB)
side = torch.cuda.Stream(dev)
keep = []
def on_side(fn):
    def between():
        with torch.cuda.stream(side):
            keep.append(fn())
            if len(keep) > 2: keep.pop(0)
    return between
cases = {"step alone": None,
         "+ decode+resize (side stream)": on_side(lambda: decode_on_device(enc, dev)),
         "+ decode only": on_side(lambda: decode_jpeg(enc.data, device=dev, mode=ImageReadMode.RGB)),
         "+ resize only": on_side(lambda: decode_on_device(enc, dev, decoder=lambda d: raw)),
         "+ host sleep 18 ms": lambda: time.sleep(0.018)}
state = {"step": 0}
def run(between, n):
    for _ in range(n):
        tr.graphs.step_begin(state["step"]); tr.train_step(batch, between); state["step"] += 1
run(None, 6)
hp = torch.cuda.Stream(dev, priority=-1)
for rep in range(2):
    for name, between in cases.items():
        run(between, 3); torch.cuda.synchronize(); t0 = time.perf_counter(); run(between, 20); torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 20
        print(f"{name:34s} {dt * 1e3:7.2f} ms/step {256 / dt:8.1f} img/s", flush=True)
    if rep == 0:
        print("-- training on a high-priority stream", flush=True)
        ctx = torch.cuda.stream(hp); ctx.__enter__()
tr.close(shutdown_dist=False)
