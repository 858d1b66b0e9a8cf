"""(Call 3 ran it without the warm-up loop: every stream waited, in every mode, on the
first load of the add kernel. Call 5 runs it as it is now.)
Does CUDA_DEVICE_MAX_CONNECTIONS take effect when set at a given point of the process?
A long sleep kernel runs on one stream; a tiny kernel on each of 24 other streams. A stream
that shares the sleeping stream's hardware queue finishes only after the sleep: with 8 queues
about 3 do, with 32 none. usage: queues_probe.py MODE (see below)."""
import os
import sys

mode = sys.argv[1]
KEY = "CUDA_DEVICE_MAX_CONNECTIONS"
if mode == "vitgraph_first":  # what `vitgraph train` and bench.py do now
    sys.path.insert(0, os.getcwd())
    import vitgraph
    vitgraph.set_hardware_queues()
import torch  # noqa: E402

if mode == "after_available":
    torch.cuda.is_available()
    os.environ[KEY] = "32"
if mode == "after_megatron_te":  # what init_distributed did in 8a03f12
    import megatron.core  # noqa: F401
    import transformer_engine.pytorch  # noqa: F401
    sys.path.insert(0, os.getcwd())
    import vitgraph
    print("  driver initialised by then:", vitgraph._driver_initialised())
    os.environ[KEY] = "32"
a = torch.cuda.Stream()
streams = [torch.cuda.Stream() for _ in range(24)]
x = torch.zeros(1024, device="cuda")
for s in [a, *streams]:  # load the kernels first: a lazy module load waits for the device
    with torch.cuda.stream(s):
        x.add_(1)
        torch.cuda._sleep(10)
torch.cuda.synchronize()
start = torch.cuda.Event(enable_timing=True)
with torch.cuda.stream(a):
    start.record()
    torch.cuda._sleep(int(3e8))
ends = []
for s in streams:
    with torch.cuda.stream(s):
        x.add_(1)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        ends.append(e)
done = torch.cuda.Event(enable_timing=True)
with torch.cuda.stream(a):
    done.record()
torch.cuda.synchronize()
sleep_ms = start.elapsed_time(done)
late = sum(start.elapsed_time(e) > 0.5 * sleep_ms for e in ends)
print(f"{mode:18s} {KEY}={os.environ.get(KEY)}: {late} of {len(ends)} streams waited for the "
      f"{sleep_ms:.0f} ms sleep")
