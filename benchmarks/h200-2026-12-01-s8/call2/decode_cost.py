# session 8, call 2: where nvJPEG's ~7.5 ms per ViT-B/16 step-graph step goes. Times the step
# alone, with the decode beside it (a side stream, as the prefetcher does), and with the decode
# before it on the training stream; profiles the first two (GPU busy time, idle gaps, GEMM
# time per call, the CUDA runtime calls made while decoding); times PIL on this host's threads.
import glob, time, os, statistics, torch
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from torch.profiler import profile, ProfilerActivity
from vitgraph.config import load_config
from vitgraph.train.loop import Trainer
from vitgraph.data.shards import EncodedImages, finish_on_device, decode_full, decode_image
over = ["model.name=vit_b16_224", "model.spec=te", "data.kind=shapes", "data.num_train=256", "data.num_val=64",
        "data.render_size=32", "model.num_classes=10", "train.micro_batch_size=256", "train.global_batch_size=256",
        "train.steps=100000", "train.progress=false", "data.augment.enabled=false",
        "train.label_smoothing=0", "graphs.enabled=true", "graphs.scope=step", "graphs.warmup_steps=2",
        "run.dir=/tmp/s8_cost"]
files = sorted(glob.glob("/tmp/s8_sf/train/*/*.jpg"))[:256]
raw = [open(f, "rb").read() for f in files]
# --- CPU: PIL on this host
for name, fn in (("decode_full (no resize)", lambda b: decode_full(b, 224)),
                 ("decode_image (+resize/crop)", lambda b: decode_image(b, 224))):
    for threads in (1, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, raw[:32]))
            t0 = time.perf_counter(); list(pool.map(fn, raw)); dt = time.perf_counter() - t0
        print(f"cpu {name:28s} {threads:2d} threads: {256 / dt:7.0f} img/s", flush=True)
full = [torch.from_numpy(decode_full(b, 224)) for b in raw[:77]]
t0 = time.perf_counter()
for _ in range(5):
    pinned = [t.pin_memory() for t in full]
print(f"pin_memory of 77 full-size images: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms", flush=True)
# --- GPU
tr = Trainer(load_config(Path("configs/vit-b16-imagefolder.yaml"), over))
dev = tr.d.device
batch = [(torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device=dev), torch.randint(0, 10, (256,), device=dev))]
enc = EncodedImages([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw], 224)
side = torch.cuda.Stream(dev)
def beside():
    with torch.cuda.stream(side):
        finish_on_device(enc, dev)
state = {"step": 0}
def run(n, between=None, before=None):
    for _ in range(n):
        if before: before()
        tr.graphs.step_begin(state["step"]); tr.train_step(batch, between); state["step"] += 1
run(5)
for _ in range(3): finish_on_device(enc, dev)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(10): finish_on_device(enc, dev)
torch.cuda.synchronize(); print(f"decode+resize alone: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms per 256 (wall)", flush=True)
cases = {"step alone": {}, "+ decode beside (side stream)": {"between": beside},
         "+ decode before, training stream": {"before": lambda: finish_on_device(enc, dev)}}
for name, kw in cases.items():
    run(3, **kw); torch.cuda.synchronize(); t0 = time.perf_counter(); run(15, **kw); torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 15
    print(f"{name:36s} {dt * 1e3:7.2f} ms/step {256 / dt:8.1f} img/s", flush=True)
def busy(events):
    iv = sorted((e.time_range.start, e.time_range.end) for e in events)
    tot, cur_s, cur_e, gaps = 0, None, None, []
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s; gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    tot += cur_e - cur_s
    return tot, (iv[-1][1] - iv[0][0]), sorted(gaps)[-5:]
for name, kw in list(cases.items())[:2]:
    run(2, **kw); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run(3, **kw); torch.cuda.synchronize()
    ev = p.events()
    kern = [e for e in ev if e.device_type.name == "CUDA"]
    b, span, gaps = busy(kern)
    print(f"--- {name}: span {span / 3e3:.2f} ms/step, GPU busy {b / 3e3:.2f} ms/step, largest idle gaps (us) {[round(g) for g in gaps]}")
    by = {}
    for e in kern:
        d = by.setdefault(e.name[:90], [0, 0.0]); d[0] += 1; d[1] += e.time_range.end - e.time_range.start
    for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {t / 3e3:8.2f} ms/step {n / 3:6.1f}/step {t / n:8.1f} us/call  {k}")
    rt = {}
    for e in ev:
        if e.device_type.name == "CPU" and e.name.startswith("cuda") and e.name[4:5].isupper():
            d = rt.setdefault(e.name, [0, 0.0]); d[0] += 1; d[1] += e.time_range.end - e.time_range.start
    print("  runtime calls:", {k: (n // 3, round(t / 3e3, 2)) for k, (n, t) in sorted(rt.items(), key=lambda kv: -kv[1][1])[:10]})
tr.close(shutdown_dist=False)
