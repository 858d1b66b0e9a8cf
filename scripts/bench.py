"""Training-step throughput of vitgraph and its peers, in one process, on one GPU.

Every system runs the same full training step (forward, backward, AdamW step) on the same
shapes: a ViT at 224 with random bf16 inputs and labels. Prints a table with the ratios and
writes ``{"provenance": ..., "rows": [...]}`` JSON (docs/design.md, "Tests and numbers").

    python scripts/bench.py --model vit_l16_224 --micro-batches 8 256 \
        --systems vitgraph vitgraph+graphs timm timm+compile-reduce-overhead \
        --precisions bf16 fp8-current --out benchmarks/h200/NAME.json
    # several GPUs: the vitgraph systems only, one process per GPU, rank 0 writes the JSON
    torchrun --nproc-per-node 2 scripts/bench.py --model vit_l16_224 --micro-batches 8 \
        --microbatches 8 --systems vitgraph vitgraph+graphs --override parallel.pp=2 --out ...

Systems:
  vitgraph               vitgraph's Trainer step: megatron-core schedule, TE spec, megatron
                         DDP + distributed optimizer, eager
  vitgraph+graphs        the same with graphs.enabled=true (per-layer CUDA graphs, impl local;
                         impl te for FP8)
  vitgraph+graphs-te     the same with graphs.impl=te
  vitgraph+step-graphs   the same with graphs.scope=step: the whole step (forward, backward,
                         gradient reduction, clipping, AdamW) as one CUDA graph, no host sync
  timm                   timm ViT, autocast bf16, fused torch AdamW
  timm+compile           the same under torch.compile (default mode)
  timm+compile-reduce-overhead   torch.compile(mode="reduce-overhead") (CUDA graphs)
  timm+compile+checkpointing  timm + torch.compile with timm's grad checkpointing of every
                         block (set_grad_checkpointing): the peer of --recompute full
  timm+compile+float8    timm + torch.compile with torchao's float8 training (tensorwise
                         scaling): the FP8 peer a user would pick; runs for fp8 precisions
  open_clip[+compile]    for --model clip_vit_b16 / clip_vit_l14: open_clip's CLIP of the same
                         geometry (QuickGELU), autocast bf16, ClipLoss, fused AdamW; vitgraph's
                         rows are then its contrastive step (byte-level captions of 128 tokens
                         for the tiny pair, the tower's 77 here)

Inputs: the peers and, by default, vitgraph train on random images already on the device.
``--data DIR`` (a JPEG ImageFolder, ``DIR/train/<class>/*.jpg``, or JPEG shards,
scripts/make_shards.py) runs every vitgraph row a second time with the training loop's own
input pipeline: files read in threads and decoded by nvJPEG (``data.decode=cuda``, plus any
--override such as data.cpu_decode_share), prefetched as `vitgraph train` does. Those rows say
``"input": "imagefolder"`` or ``"shards"`` and their ratio to the synthetic row is printed.

The process runs with the hardware queues `vitgraph train` sets (CUDA_DEVICE_MAX_CONNECTIONS,
32 unless set: vitgraph.set_hardware_queues), peers included; the provenance records the value.

``--configs CONFIG ... | all --imagefolder DIR --shards DIR``: the bundled configs as a user
runs them (``vitgraph train`` in a process of its own, on a JPEG ImageFolder or image-text
shards), each the first steps of its shipped schedule (a quarter of its warm-up, at least 150,
or ``--window-s`` seconds; then SIGTERM), against vitgraph's best bench row at its micro-batch
in this run (``bench_config``, ``run_configs``): rows with ``config``, ``images_per_s``,
``best_images_per_s``, ``graphs`` (what auto chose), ``steps``, ``lr_share_of_peak``, the
window's ``losses`` and ``loss_fell`` (the last third's mean 2% under the first third's), and
``window_samples`` against ``warmup_samples`` (the warm-up at the config's own global batch:
a window of one GPU's batch sees a small share of it; a classifier's losses still at
ln(classes) are named there as the reason); ``recipe_images_per_s``: the bench row
with the config's recipe (drop path, EMA, label smoothing, clipping, augmentation) on synthetic
input, between the best row and the as-shipped one. A config at native resolution (the VLM's)
is held against its own packs, on a stream of its data's image sizes and, for a caption
config, its captions and language model (``config_bench_rows``); image-text configs (pairs
and captions) read --shards.

Precisions (--precisions): bf16, fp8-current, fp8-delayed (TE recipes for vitgraph). The timm
peers other than timm+compile+float8 always run bf16 and are measured once per micro-batch.

Native resolution (``--native``): one fixed stream of ``--images`` image sizes (seeded; aspect
ratio 0.5-2, shorter side 128-512, each at its NaFlex grid for ``--max-patches``) through

    python scripts/bench.py --native --models vit_b16_224 --max-patches 576 1024 \
        --out benchmarks/h200/native-vit_b16.json

  vitgraph+packed[+graphs|+step-graphs]  the Trainer at data.resolution=native: packs of
                         --pack-tokens tokens (--packs-per-step a step), thd attention, eager /
                         layer graphs / the step as one graph
  vitgraph+padded[+step-graphs]  each image in a slot of max_patches tokens of its own (a
                         key-padding mask; data.packing.layout=padded), --timm-batch slots a
                         step: what a fixed-shape graph needs without packing
  timm-naflex[+compile]  timm's NaFlexVit (vitgraph's geometry, or --timm-arch) as timm's NaFlex
                         loader feeds it: --timm-batch images padded to max_patches with
                         patch_valid masks, autocast bf16, fused AdamW; a step that runs out
                         of GPU memory runs again in 2, 4, ... microbatches (gradients
                         accumulated; the row's ``microbatches`` and ``fitted_after``)
Rows report ``images_per_s``, ``real_tokens_per_s`` (patch tokens of real images per second),
``tokens_per_s`` (computed, padding included) and ``real_share``.

The tower inside a VLM (``--vlm``): the native stream through vitgraph's captioning VLM
(task.kind=caption: the tower -> megatron-core's MLP projector -> a GPT decoder of
--lm-layers x --lm-width x --lm-heads, default 24 x 1280 x 20, 0.60B with CLIP BPE's
embedding and output layer: configs/vlm-so400m16-native.yaml's), each image with a synthetic caption of
--min-text to --text-length ids (BOS to EOS, seeded; only the lengths matter to the time):

    python scripts/bench.py --vlm --max-patches 256 576 1024 --timm-batch 32 \
        --out benchmarks/h200/vlm-so400m16.json   # the graphed systems by default

  vitgraph+packed[+graphs|+step-graphs]  data.resolution=native: the tower on image packs,
                         the GPT on one thd pack of each pack's samples (image tokens, then the
                         caption up to EOS); eager / layer graphs / the step as one graph
  vitgraph+padded[+graphs]  the tower's images in max_patches slots (data.packing.layout=
                         padded); the caption task packs the GPT's sequences in this layout too
  vitgraph+dense[+graphs|+step-graphs]  the model padded: the fixed composition at the square
                         grid of max_patches, --timm-batch images a step, every image padded to
                         that grid and every caption to --text-length
Rows are samples (``images_per_s``) and ``real_tokens_per_s``: image patches + caption tokens
actually in the samples; ``tokens_per_s`` counts the positions computed the same way (the
tower's tokens once, then each sample's text budget), so ``real_share`` is the padding of both
packs, comparable across systems. ``tower_share``: the tower alone (a class head, the same system on the
same images: the native classifier's packs / slots, the fixed classifier at that size) runs
after each row; its seconds per step over the VLM's (--no-tower-share skips it). The
microbatches are on the device, the GPT's pack layout appended (the caption task's
``host_fields``), as the training loop's prefetcher hands them over.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vitgraph import set_hardware_queues  # noqa: E402

set_hardware_queues()  # as `vitgraph train` does, before anything initialises CUDA
import torch  # noqa: E402

PEAK_FLOPS = 790e12
# system -> (graphs.impl or None for no graphs, graphs.scope)
VITGRAPH_SYSTEMS = {"vitgraph": (None, "layer"), "vitgraph+graphs": ("local", "layer"),
                    "vitgraph+graphs-te": ("te", "layer"), "vitgraph+step-graphs": ("local", "step")}
TIMM_NAMES = {"vit_l16_224": "vit_large_patch16_224", "vit_b16_224": "vit_base_patch16_224",
              "vit_h14_224": "vit_huge_patch14_224", "vit_g14_224": "vit_giant_patch14_224"}
# image-text pairs: vitgraph's contrastive step against open_clip's (same geometry and batch)
OPEN_CLIP_NAMES = {"clip_vit_b16": "ViT-B-16-quickgelu", "clip_vit_l14": "ViT-L-14-quickgelu"}
VITGRAPH_ONLY = ("siglip_vit_b16",)  # vitgraph rows only: no peer of the same geometry here
# classifiers with vitgraph rows only (timm has no entry of their geometry to compare)
VITGRAPH_ONLY_TOWERS = ("vit_bigG14_224", "vit_6b14_224")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


PROFILE = None  # --profile N: cProfile N steps after warm-up, print the top functions
KERNELS = None  # --kernels N: torch.profiler over N steps after warm-up, print the top kernels


# kernel name -> kind, first match wins (attention before gemm: cuDNN's names hold "gemm" too)
KERNEL_KINDS = [("attention", r"fmha|flash|sdpa|attn|softmax"), ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|sm90_"),
                ("norm", r"layer_?norm|ln_fwd|ln_bwd|rmsnorm"), ("optimizer", r"adam|multi_tensor|foreach"),
                ("triton (inductor)", r"triton"), ("copy/cast", r"memcpy|memset|copy|cast|cat|transpose"),
                ("reduce", r"reduce"), ("elementwise", r".")]


def _kernel_report(prof, steps: int, wall: float) -> dict:
    """GPU time per step by kind of kernel and by kernel (graph replays included): what stands
    between the step and the matmul ceiling. Idle is wall time the GPU had nothing to run.
    Printed, and returned for the JSON row."""
    import re
    from torch.autograd import DeviceType
    # user annotations (an optimizer's record_function) land on the GPU timeline as ranges
    # over kernels already counted: left out
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"profile: {steps} steps, {wall / steps * 1e3:.2f} ms/step wall, GPU busy "
          f"{busy / steps * 1e3:.2f} ms/step ({100 * busy / wall:.0f}%)", flush=True)
    kinds: dict[str, list] = {k: [0.0, 0] for k, _ in KERNEL_KINDS}
    for e in kernels:
        kind = next(k for k, rx in KERNEL_KINDS if re.search(rx, e.key.lower()))
        kinds[kind][0] += e.self_device_time_total / 1e3 / steps
        kinds[kind][1] += e.count / steps
    for k, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if n:
            print(f"  {k:18s} {ms:8.2f} ms/step {n:7.0f} kernels/step", flush=True)
    print(f"  {'ms/step':>8s} {'n/step':>7s} {'us/call':>8s}  kernel")
    top = []
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]:
        ms, n = e.self_device_time_total / 1e3 / steps, e.count / steps
        us = e.self_device_time_total / max(e.count, 1)
        print(f"  {ms:8.2f} {n:7.0f} {us:8.1f}  {e.key[:150]}", flush=True)
        top.append({"ms_per_step": round(ms, 3), "per_step": n, "us_per_call": round(us, 1),
                    "kernel": e.key[:200]})
    return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3,
            "gpu_busy_ms_per_step": busy / steps * 1e3,
            "kinds_ms_per_step": {k: round(v[0], 3) for k, v in kinds.items() if v[1]},
            "top": top}


SW_POWER_CAP = 0x4  # nvidia-smi's clocks_throttle_reasons bit: clocks held down by the power cap


class GpuSampler:
    """nvidia-smi every 200 ms while the timed steps run: mean board power, median SM clock and
    the share of samples held at the power cap. An H200 at micro-batch 256 runs at its 700 W
    cap (clocks ~1.7 GHz, not 1.98), so two systems' speeds depend on their clocks as well as
    their kernels: every row says what its clocks were. Nothing without nvidia-smi."""

    def __init__(self, device: int | None = None):
        self.proc, self.lines = None, []
        exe = shutil.which("nvidia-smi")
        if exe is None or not torch.cuda.is_available():
            return
        uuid = str(torch.cuda.get_device_properties(
            torch.cuda.current_device() if device is None else device).uuid)
        self.cmd = [exe, "-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",
                    "--query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active",
                    "--format=csv,noheader,nounits", "-lms", "200"]

    def __enter__(self):
        if getattr(self, "cmd", None):
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.lines = out.splitlines()
        return False

    def summary(self) -> dict:
        return summarize_gpu_samples(self.lines)


def summarize_gpu_samples(lines: list[str]) -> dict:
    """'612.3, 1710, 0x0000000000000004' lines -> mean power (W), median SM clock (MHz), share
    of samples at the power cap; {} when there are none (or nvidia-smi printed no numbers)."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except (ValueError, IndexError):
            continue
    if not samples:
        return {}
    clocks = sorted(c for _, c, _ in samples)
    return {"gpu_power_w": round(sum(p for p, _, _ in samples) / len(samples), 1),
            "gpu_sm_clock_mhz": clocks[len(clocks) // 2],
            "gpu_power_capped": round(sum(bool(r & SW_POWER_CAP) for *_, r in samples) / len(samples), 2),
            "gpu_samples": len(samples)}


def _profile(step) -> dict:
    """--profile N (the top Python functions) and --kernels N (GPU time by kernel, graph
    replays included: what stands between the step and the matmul ceiling; the idle share is
    wall time the GPU had nothing to do) over N calls of ``step``, after the warm-up."""
    if PROFILE:
        import cProfile
        import pstats
        _sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(PROFILE):
            step()
        _sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if KERNELS:
        from torch.profiler import ProfilerActivity, profile
        _sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(KERNELS):
                step()
            _sync()
        return {"kernels": _kernel_report(prof, KERNELS, time.perf_counter() - t0)}
    return {}


def _measure(step, warmup: int, iters: int) -> dict:
    """Seconds per step (median of 3 timed blocks), peak allocated and peak reserved GiB, and
    the GPU's power and clocks over the timed blocks (``GpuSampler``).

    Reserved memory is the fair comparison with graphs: a graph's private pool keeps its
    blocks reserved between replays while the allocator counts them as free."""
    for _ in range(warmup):
        step()
    kernels = _profile(step)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # graphs were captured in the warm-up: their pools count
    blocks = []
    with GpuSampler() as gpu:
        for _ in range(3):
            t0 = _sync_time()
            for _ in range(iters):
                step()
            blocks.append((_sync_time() - t0) / iters)
    blocks.sort()
    return {"sec": blocks[1], "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, **gpu.summary(),
            **kernels}


# ---------------------------------------------------------------- vitgraph

def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def stand_in_data(num_classes: int) -> list[str]:
    """The overrides of a bench run's data: a small shapes set the Trainer builds and the bench
    never reads (it feeds its own tensors), and a head of ``num_classes`` (the peers'), which
    the config checks against the shapes' class count: at most all of theirs."""
    from vitgraph.data import SHAPES_CLASSES
    return ["data.kind=shapes", "data.num_train=64", "data.num_val=64", "data.render_size=32",
            f"data.num_classes={min(num_classes, len(SHAPES_CLASSES))}",
            f"model.num_classes={num_classes}"]


def bench_vitgraph(model: str, mb: int, graphs: str | None, precision: str, warmup: int,
                   iters: int, num_classes: int, microbatches: int,
                   overrides: list[str] = (), scope: str = "layer", data: str | None = None) -> dict:
    from vitgraph.config import load_config
    from vitgraph.train.loop import Trainer
    prec = ["train.precision=bf16"] if precision == "bf16" else [
        "train.precision=fp8", f"train.fp8_recipe={precision.split('-', 1)[1]}"]
    if graphs == "local" and precision != "bf16":
        graphs = "te"  # TE owns the FP8 state around a replay
    over = [f"model.name={model}", "model.spec=te", *stand_in_data(num_classes),
            f"train.micro_batch_size={mb}", "train.steps=100000", *prec,
            "train.tensorboard=false", "train.progress=false", "optim.clip_grad=1.0",
            # the peers train on ready tensors with plain cross-entropy: so does this step
            "data.augment.enabled=false", "train.label_smoothing=0",
            f"run.dir=/tmp/vitgraph-bench/{model}-{mb}-{graphs}-{scope}-{precision}"]
    if graphs:
        over += ["graphs.enabled=true", f"graphs.impl={graphs}", f"graphs.scope={scope}",
                 "graphs.warmup_steps=2"]
    else:
        over += ["graphs.enabled=false"]
    if data:  # the training loop's input pipeline from JPEG files (nvJPEG, prefetched)
        kind = "imagefolder" if input_kind(data) == "imagefolder" else "webdataset"
        over += [f"data.kind={kind}", f"data.path={data}", "data.decode=cuda",
                 "data.preload=false", "data.augment.enabled=false",
                 "data.render_size=224",  # decoded straight to the model's size (all 224 here)
                 f"data.workers={min(16, os.cpu_count() or 1)}", "data.prefetch=true"]
    over += [*overrides]
    probe = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                        [*over, f"train.global_batch_size={mb * _world()}"])
    dp = _world() // (probe.parallel.tp * probe.parallel.pp)
    global_batch = mb * microbatches * dp
    over += [f"train.global_batch_size={global_batch}"]
    if not data:
        over += [f"data.num_train={max(64, global_batch)}"]
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml", over)
    trainer = Trainer(cfg)
    size = trainer.task.image_size
    gen = torch.Generator().manual_seed(trainer.d.dp_rank)
    batches = [(torch.randint(0, 256, (mb, size, size, 3), dtype=torch.uint8, generator=gen),
                torch.randint(0, num_classes, (mb,), generator=gen)) for _ in range(microbatches)]
    if trainer.task.name == "contrastive":  # + caption token ids, end of text last
        n = trainer.task.context_length
        batches = [(*b, _tokens(mb, n, gen)) for b in batches]
    # the loop's prefetcher hands a step its microbatches on the device (copied on a side
    # stream during the step before), as the peers' inputs are: so does the bench
    batches = [tuple(t.to(trainer.d.device) for t in b) for b in batches]
    state = {"step": 0}

    def step():
        trainer.graphs.step_begin(state["step"])
        if data:  # as the loop does: this step's microbatches, the next staged during it
            trainer.train_step(trainer.loader.next_step(), getattr(trainer.loader, "stage_next", None))
        else:
            trainer.train_step(batches)
        state["step"] += 1

    try:
        m = _measure(step, warmup, iters)
        sec = m.pop("sec")
        extra = _graph_stats(trainer)
        flops = trainer.flops_per_sample
        p = cfg.parallel
        layout = f"tp{p.tp}pp{p.pp}" + (f"vpp{p.vpp}" if p.vpp > 1 else "") + f"dp{dp}"
        layout = layout.replace("tp1", "").replace("pp1", "") or "dp1"
        if p.sequence_parallel:
            layout += "sp"
        return {"images_per_s": global_batch / sec, **m, "flops_per_image": flops, "layout": layout,
                "global_batch": global_batch,
                "distributed_optimizer": p.distributed_optimizer, **extra}
    finally:
        trainer.close(shutdown_dist=False)
        del trainer


def input_kind(data: str | None) -> str:
    """What ``--data`` names: an ImageFolder (``train/<class>/`` inside) or JPEG shards."""
    if not data:
        return "synthetic"
    return "imagefolder" if os.path.isdir(os.path.join(data, "train")) else "shards"


def _tokens(b: int, n: int, gen=None) -> torch.Tensor:
    """Random byte-level captions filling the context: [sot, bytes..., eot] (vitgraph.text)."""
    t = torch.randint(1, 257, (b, n), generator=gen)
    t[:, 0], t[:, -1] = 257, 258
    return t


# ---------------------------------------------------------------- open_clip peer

def bench_open_clip(model: str, mb: int, compile_mode: str | None, warmup: int,
                    iters: int) -> dict:
    """open_clip's CLIP of the same geometry: autocast bf16, its ClipLoss, fused AdamW, the
    logit scale clamped after each step, as its training script does."""
    import open_clip
    from open_clip.loss import ClipLoss
    net = open_clip.create_model(OPEN_CLIP_NAMES[model], pretrained=None, output_dict=True).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    fwd = net if compile_mode is None else torch.compile(
        net, mode=None if compile_mode == "default" else compile_mode)
    loss_fn = ClipLoss()
    size = net.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    x = torch.randn(mb, 3, size, size, device="cuda")
    text = torch.randint(1, 49406, (mb, 77), device="cuda")
    text[:, -1] = 49407  # end of text

    def step():
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(x, text)
            loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            net.logit_scale.clamp_(0, 4.6052)

    m = _measure(step, warmup, iters)
    return {"images_per_s": mb / m.pop("sec"), **m}


# ---------------------------------------------------------------- timm peers

def bench_timm(model: str, mb: int, compile_mode: str | None, warmup: int, iters: int,
               num_classes: int, float8: bool = False, checkpointing: bool = False) -> dict:
    import timm
    net = timm.create_model(TIMM_NAMES[model], num_classes=num_classes).cuda()
    if checkpointing:  # timm's activation checkpointing of every block
        net.set_grad_checkpointing(True)
    if float8:
        # torchao's float8 training (tensorwise scaling) on the Linear layers, as its README
        # recommends: every Linear whose dims are multiples of 16 (not the head)
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(
            net, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    fwd = net if compile_mode is None else torch.compile(
        net, mode=None if compile_mode == "default" else compile_mode)
    x = torch.randn(mb, 3, 224, 224, device="cuda")
    y = torch.randint(0, num_classes, (mb,), device="cuda")

    def step():
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(fwd(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = _measure(step, warmup, iters)
    return {"images_per_s": mb / m.pop("sec"), **m}


# ---------------------------------------------------------------- native resolution (--native)

# system -> (attention layout, graphs.impl or None, graphs.scope) of vitgraph's native rows
NATIVE_SYSTEMS = {"vitgraph+packed": ("thd", None, "layer"),
                  "vitgraph+packed+graphs": ("thd", "local", "layer"),
                  "vitgraph+packed+step-graphs": ("thd", "local", "step"),
                  "vitgraph+padded": ("padded", None, "layer"),
                  "vitgraph+padded+step-graphs": ("padded", "local", "step")}
NATIVE_PEERS = ("timm-naflex", "timm-naflex+compile")
NATIVE_MODELS = ("vit_b16_224", "vit_l16_224", "vit_so400m16_256", "vit_so400m14_378",
                 "vit_pico_patch4_32")  # pico: the CPU tests'


def native_stream(n: int, seed: int, patch: int, max_patches: int, sides=(128, 512),
                  aspect=(0.5, 2.0)) -> list[tuple[int, int]]:
    """The benchmark's fixed stream: ``n`` image sizes, aspect ratio (w / h) log-uniform in
    ``aspect``, shorter side uniform in ``sides``, each at its NaFlex grid
    (vitgraph.data.packing.native_grid) for ``max_patches``. Seeded: every system of a run,
    and every run, sees the same images."""
    import random
    from vitgraph.data.packing import native_grid
    rng = random.Random(seed)
    lo, hi = math.log(aspect[0]), math.log(aspect[1])
    grids = []
    for _ in range(n):
        a, s = math.exp(rng.uniform(lo, hi)), rng.randint(*sides)
        h, w = (s, round(s * a)) if a >= 1 else (round(s / a), s)
        grids.append(native_grid(h, w, patch, max_patches))
    return grids


def packed_steps(grids: list, spec, packs_per_step: int) -> list[list[list[int]]]:
    """The stream packed as the loader packs it: each step's ``packs_per_step`` packs filled
    first-fit from a window of ``packs_per_step * max_images`` images (those that fit nowhere
    wait at the head of the next window), in stream order; steps while a full window is left."""
    from vitgraph.data.packing import fill_packs
    window = packs_per_step * spec.max_images
    steps, carry, at = [], [], 0
    while at + window - len(carry) <= len(grids):
        order = carry + list(range(at, at + window - len(carry)))
        at += window - len(carry)
        packs, carry = fill_packs(order, lambda i: spec.image_tokens(grids[i]), spec,
                                  packs_per_step)
        steps.append(packs)
    return steps


def batched_steps(grids: list, per_step: int) -> list[list[int]]:
    """The stream in batches of ``per_step`` images (whole batches only)."""
    return [list(range(i, i + per_step)) for i in range(0, len(grids) - per_step + 1, per_step)]


class _Pixels:
    """Patch rows for any image: slices of one random pool (only the sizes matter here)."""

    def __init__(self, patch_dim: int, seed: int, rows: int = 8192):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (rows, patch_dim), generator=g, dtype=torch.uint8)

    def rows(self, i: int, grid) -> torch.Tensor:
        n = grid[0] * grid[1]
        idx = (torch.arange(n) + i * 977) % self.pool.shape[0]
        return self.pool[idx]


def _measure_cycle(steps: list, counts: list, warmup: int, iters: int) -> dict:
    """Images and real (patch) tokens per second: ``steps`` (callables) run in a cycle, each
    with its ``counts`` (images, real tokens, tokens computed); ``warmup`` steps first, then
    3 blocks of ``iters`` steps, the median block's rates. Peak memory and the GPU's clocks as
    ``_measure`` records them."""
    k = 0
    for _ in range(warmup):
        steps[k % len(steps)]()
        k += 1

    def next_step():
        nonlocal k
        steps[k % len(steps)]()
        k += 1
    kernels = _profile(next_step)
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    blocks = []
    with GpuSampler() as gpu:
        for _ in range(3):
            done = [0, 0, 0]
            _sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[k % len(steps)]()
                done = [a + b for a, b in zip(done, counts[k % len(steps)])]
                k += 1
            _sync()
            sec = time.perf_counter() - t0
            blocks.append((done[1] / sec, done[0] / sec, done[2] / sec, sec / iters))
    blocks.sort()
    real, images, computed, sec = blocks[1]
    out = {"images_per_s": images, "real_tokens_per_s": real, "tokens_per_s": computed,
           "real_share": real / computed, "sec_per_step": sec, **gpu.summary(), **kernels}
    if torch.cuda.is_available():
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def _graph_stats(trainer) -> dict:
    """The Trainer's graph counters for a row's JSON (nothing without graphs)."""
    stats = trainer.graphs.stats()
    if not stats:
        return {}
    return {"graph_stats": {k: v for k, v in stats.items()
                            if isinstance(v, (int, float, str, bool))}}


def _measure_trainer(trainer, steps: list, counts: list, warmup: int, iters: int) -> dict:
    """``_measure_cycle`` over the Trainer's steps (each a list of the step's microbatches),
    with its graph counters."""
    state = {"step": 0}

    def one(mbs):
        def step():
            trainer.graphs.step_begin(state["step"])
            trainer.train_step(mbs)
            state["step"] += 1
        return step

    m = _measure_cycle([one(b) for b in steps], counts, warmup, iters)
    return {**m, **_graph_stats(trainer)}


def bench_vitgraph_native(model: str, system: str, grids: list, max_patches: int, *,
                          pack_tokens: int, max_images: int, packs_per_step: int,
                          padded_images: int, warmup: int, iters: int, num_classes: int,
                          overrides: list[str] = (), seed: int = 0,
                          captions: "Captions | None" = None) -> dict:
    """vitgraph's Trainer step on the stream at native resolution: packs of ``pack_tokens``
    (``packs_per_step`` a step, thd attention), or each image padded to ``max_patches`` in a
    slot of its own (``padded_images`` slots, one microbatch a step; a key-padding mask:
    data.packing.layout=padded), as ``system`` (NATIVE_SYSTEMS) says. Its microbatches, made
    from the stream beforehand, are on the device as the loader's prefetcher hands them over.

    ``captions``: the captioning VLM's step instead (task.kind=caption, --vlm): each image
    with its caption's ids, and the language model's pack laid out from them on the host
    (the task's ``host_fields``, as the prefetcher appends them) before they go to the
    device; real tokens count the text's too."""
    from vitgraph.config import load_config
    from vitgraph.data import images_per_pack
    from vitgraph.data.packing import PackSpec, assemble
    from vitgraph.train.loop import Trainer
    attention, impl, scope = {**NATIVE_SYSTEMS, **VLM_SYSTEMS}[system]
    padded = attention == "padded"
    k = 1 if padded else packs_per_step
    over = [f"model.name={model}", "model.spec=te", *stand_in_data(num_classes),
            "data.resolution=native", f"data.packing.max_patches={max_patches}",
            f"data.packing.layout={'padded' if padded else 'packed'}",
            "train.micro_batch_size=1", "train.steps=100000", "train.precision=bf16",
            "train.tensorboard=false", "train.progress=false", "optim.clip_grad=1.0",
            "data.augment.enabled=false", "train.label_smoothing=0",
            "data.augment.mixup_alpha=0", "data.augment.cutmix_alpha=0",
            f"run.dir=/tmp/vitgraph-bench/native-{model}-{max_patches}-{system}"
            + ("-vlm" if captions else "")]
    over += (["graphs.enabled=true", f"graphs.impl={impl}", f"graphs.scope={scope}",
              "graphs.warmup_steps=2"] if impl else ["graphs.enabled=false"])
    over += [*overrides, *(captions.overrides if captions else [])]
    probe = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml",
                        [*over, f"data.packing.tokens_per_microbatch={pack_tokens}",
                         f"train.global_batch_size={_world()}"])
    from vitgraph.models.registry import resolve_arch
    prefix = int(probe.model.class_token) + probe.model.num_registers
    patch = resolve_arch(probe.model).patch_size
    tokens = padded_images * (prefix + max_patches) if padded else pack_tokens
    spec = PackSpec(tokens=tokens, max_images=padded_images if padded else max_images or 1,
                    max_patches=max_patches, num_prefix=prefix, patch_size=patch, padded=padded)
    dp = _world() // (probe.parallel.tp * probe.parallel.pp)
    if not padded and not max_images:  # as data.packing.max_images=0 resolves it, on the stream
        spec = dataclasses.replace(spec, max_images=images_per_pack(
            [spec.image_tokens(g) for g in grids], spec, k * dp))
    slots = spec.max_images
    over += [f"data.packing.tokens_per_microbatch={tokens}", f"data.packing.max_images={slots}",
             f"train.global_batch_size={k * dp}"]
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml", over)
    trainer = Trainer(cfg)
    if trainer.plan.pack != spec:  # the microbatches below are made for this spec
        trainer.close(shutdown_dist=False)
        raise RuntimeError(f"the run's packs {trainer.plan.pack} are not the bench's {spec}")
    rank = trainer.d.dp_rank
    pixels = _Pixels(spec.patch_dim, seed)
    labels = torch.randint(0, num_classes, (len(grids),), generator=torch.Generator().manual_seed(seed))
    text = captions.ids(trainer.task.tokenizer, len(grids)) if captions else None
    text_len = caption_lengths(text, trainer.task.tokenizer) if captions else None
    device = trainer.d.device
    if padded:  # this rank's share of each step's images, one microbatch of slots
        plan = [[b[rank * padded_images:(rank + 1) * padded_images]]
                for b in batched_steps(grids, padded_images * dp)]
    else:
        plan = [s[rank * k:(rank + 1) * k] for s in packed_steps(grids, spec, k * dp)]
    if not plan:
        trainer.close(shutdown_dist=False)
        raise ValueError(f"a stream of {len(grids)} images fills no step of {k * dp} packs of "
                         f"{spec.max_images} images (--images)")
    batches, counts = [], []
    for step in plan:
        mbs = []
        for idx in step:
            g = [grids[i] for i in idx]
            fields = assemble([pixels.rows(i, grids[i]) for i in idx], g,
                              [int(labels[i]) for i in idx], spec)
            if text is not None:  # [slots, text_length], zero for empty slots
                fields = (*fields, torch.zeros(spec.max_images, text.shape[1], dtype=text.dtype))
                fields[-1][:len(idx)] = text[idx]
                fields = (*fields, *trainer.task.host_fields(fields))
            mbs.append(tuple(t.to(device) for t in fields))
        batches.append(mbs)
        n_img = sum(len(idx) for idx in step)
        real = sum(grids[i][0] * grids[i][1] for idx in step for i in idx)
        computed = len(step) * spec.tokens
        if text is not None:  # + each caption's tokens (BOS to EOS) and the LM pack's text
            # positions: its image positions are the tower's tokens, counted once either way
            real += sum(text_len[i] for idx in step for i in idx)
            computed += len(step) * (trainer.task.text_pack.tokens - spec.tokens)
        counts.append((n_img * dp, real * dp, computed * dp))
    try:
        m = _measure_trainer(trainer, batches, counts, warmup, iters)
        return {**m, "attention": attention, "pack_tokens": spec.tokens,
                "max_images": spec.max_images, "microbatches": k, "steps_in_stream": len(plan),
                "images_in_stream": sum(c[0] for c in counts)}
    finally:
        trainer.close(shutdown_dist=False)
        del trainer


# ---------------------------------------------------------------- the tower inside a VLM (--vlm)

# system -> (image layout, graphs.impl or None, graphs.scope) of the captioning VLM's rows.
# packed / padded: data.resolution=native (padded: the tower's images in max_patches slots;
# the caption task packs the language model's sequences either way); dense: the fixed
# composition at the max_patches grid, every image padded to it and every text to
# lm.text_length (one dense [batch, image + text] sequence: the padded model a fixed-shape
# graph needs without packing)
VLM_SYSTEMS = {"vitgraph+packed": ("thd", None, "layer"),
               "vitgraph+packed+graphs": ("thd", "local", "layer"),
               "vitgraph+packed+step-graphs": ("thd", "local", "step"),
               "vitgraph+padded": ("padded", None, "layer"),
               "vitgraph+padded+graphs": ("padded", "local", "layer"),
               "vitgraph+dense": ("dense", None, "layer"),
               "vitgraph+dense+graphs": ("dense", "local", "layer"),
               "vitgraph+dense+step-graphs": ("dense", "local", "step")}


class Captions(NamedTuple):
    """The VLM rows' language model (``lm.*``) and each image's synthetic caption: BOS,
    random ids, EOS, ``length(i)`` tokens in all (seeded, uniform in [min_length,
    text_length]); only the lengths matter to the step's time."""
    layers: int
    width: int
    heads: int
    tokenizer: str
    text_length: int
    min_length: int
    seed: int = 0
    # a data set's captions (cycled over the stream's images): their ids instead of random ones
    texts: tuple[str, ...] = ()

    @property
    def overrides(self) -> list[str]:
        return ["task.kind=caption", f"lm.num_layers={self.layers}",
                f"lm.hidden_size={self.width}", f"lm.num_heads={self.heads}",
                f"lm.tokenizer={self.tokenizer}", f"lm.text_length={self.text_length}"]

    def length(self, i: int) -> int:
        import random
        return random.Random(self.seed * 1_000_003 + i).randint(self.min_length, self.text_length)

    def ids(self, tok, n: int) -> torch.Tensor:
        """int64 [n, text_length]: the first ``n`` images' captions in ``tok``'s special ids."""
        if self.texts:
            return tok([self.texts[i % len(self.texts)] for i in range(n)])
        special = {tok.sot_id, tok.eot_id, tok.pad_id}
        plain = next(i for i in range(tok.vocab_size) if i not in special)
        out = torch.full((n, self.text_length), tok.pad_id, dtype=torch.int64)
        g = torch.Generator().manual_seed(self.seed)
        for i in range(n):
            k = self.length(i)
            body = torch.randint(0, tok.vocab_size, (k - 2,), generator=g)
            for sid in special:  # no early EOS: the caption is k tokens
                body[body == sid] = plain
            out[i, 0], out[i, 1:k - 1], out[i, k - 1] = tok.sot_id, body, tok.eot_id
        return out


def caption_lengths(ids: torch.Tensor, tok) -> list[int]:
    """Each caption's tokens, BOS to EOS, of ids [n, text_length] (a cut caption keeps EOS)."""
    return ((ids == tok.eot_id).int().argmax(1) + 1).tolist()


def bench_vlm_dense(model: str, system: str, grids: list, max_patches: int, *, batch: int,
                    warmup: int, iters: int, num_classes: int, overrides: list[str] = (),
                    seed: int = 0, captions: Captions | None = None) -> dict:
    """The captioning VLM padded (``VLM_SYSTEMS``' dense): the fixed composition at the
    square grid of ``max_patches`` (model.image_size = patch x its side), ``batch`` images a
    step (one microbatch), each image padded to that grid and each text to lm.text_length;
    real tokens are the stream's (each image's patches, each caption's BOS to EOS).
    ``captions`` None: the tower alone on the same images (a class head, task.kind
    classification): the tower's share of the VLM's step."""
    from vitgraph.config import load_config
    from vitgraph.models.registry import get_arch
    from vitgraph.train.loop import Trainer
    _, impl, scope = VLM_SYSTEMS[system]
    patch, side = get_arch(model).patch_size, math.isqrt(max_patches)
    if side * side != max_patches:
        raise ValueError(f"the dense rows need a square max_patches (not {max_patches})")
    size = patch * side
    over = [f"model.name={model}", "model.spec=te", f"model.image_size={size}",
            *stand_in_data(num_classes), f"train.micro_batch_size={batch}",
            f"train.global_batch_size={batch * _world()}", "train.steps=100000",
            "train.precision=bf16", "train.tensorboard=false", "train.progress=false",
            "optim.clip_grad=1.0", "data.augment.enabled=false", "train.label_smoothing=0",
            "data.augment.mixup_alpha=0", "data.augment.cutmix_alpha=0",
            f"run.dir=/tmp/vitgraph-bench/vlm-{model}-{max_patches}-{system}"
            + ("" if captions else "-tower")]
    over += (["graphs.enabled=true", f"graphs.impl={impl}", f"graphs.scope={scope}",
              "graphs.warmup_steps=2"] if impl else ["graphs.enabled=false"])
    over += [*overrides, *(captions.overrides if captions else [])]
    cfg = load_config(ROOT / "configs" / "vit-b16-imagefolder.yaml", over)
    trainer = Trainer(cfg)
    rank, dp = trainer.d.dp_rank, _world() // (cfg.parallel.tp * cfg.parallel.pp)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (len(grids),), generator=gen)
    text = captions.ids(trainer.task.tokenizer, len(grids)) if captions else None
    text_len = caption_lengths(text, trainer.task.tokenizer) if captions else None
    device = trainer.d.device
    steps, counts = [], []
    for b in batched_steps(grids, batch * dp):
        idx = b[rank * batch:(rank + 1) * batch]
        images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen)
        fields = (images, labels[idx]) + ((text[idx],) if text is not None else ())
        steps.append(tuple(t.to(device) for t in fields))
        real = sum(grids[i][0] * grids[i][1] for i in b)
        computed = len(b) * (max_patches + int(cfg.model.class_token) + cfg.model.num_registers)
        if captions:
            real += sum(text_len[i] for i in b)
            computed += len(b) * captions.text_length
        counts.append((len(b), real, computed))
    try:
        m = _measure_trainer(trainer, [[f] for f in steps], counts, warmup, iters)
        return {**m, "attention": "dense", "image_size": size, "batch": batch,
                "steps_in_stream": len(steps), "images_in_stream": sum(c[0] for c in counts)}
    finally:
        trainer.close(shutdown_dist=False)
        del trainer


def bench_vlm(args, model: str, system: str, grids: list, max_patches: int,
              captions: Captions | None) -> dict:
    """One VLM row's step (``captions``), or the tower alone on the same images (None)."""
    if VLM_SYSTEMS[system][0] == "dense":
        return bench_vlm_dense(model, system, grids, max_patches, batch=args.timm_batch,
                               warmup=args.warmup, iters=args.iters,
                               num_classes=args.num_classes, overrides=args.override,
                               seed=args.seed, captions=captions)
    return bench_vitgraph_native(model, system, grids, max_patches,
                                 pack_tokens=args.pack_tokens, max_images=args.max_images,
                                 packs_per_step=args.packs_per_step,
                                 padded_images=args.timm_batch, warmup=args.warmup,
                                 iters=args.iters, num_classes=args.num_classes,
                                 overrides=args.override, seed=args.seed, captions=captions)


def vlm_row(args, model: str, system: str, grids: list, max_patches: int) -> dict:
    """The VLM's step, then (``--tower-share``) the tower alone on the same microbatches'
    images under the same system: ``tower_share`` = the tower's seconds per step over the
    VLM's (the tower's forward, backward and optimizer step; its share of the VLM's step
    where the language model's work does not overlap it, as it does not here: one stream)."""
    captions = Captions(args.lm_layers, args.lm_width, args.lm_heads, args.lm_tokenizer,
                        args.text_length, args.min_text, args.seed)
    res = bench_vlm(args, model, system, grids, max_patches, captions)
    res["lm"] = {k: v for k, v in captions._asdict().items() if k not in ("seed", "texts")}
    if args.tower_share:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        tower = bench_vlm(args, model, system, grids, max_patches, None)
        res["tower_alone"] = {k: tower[k] for k in ("sec_per_step", "images_per_s",
                                                    "real_tokens_per_s") if k in tower}
        res["tower_share"] = tower["sec_per_step"] / res["sec_per_step"]
    return res


def timm_naflex_model(model: str, num_classes: int, arch_name: str | None = None):
    """timm's NaFlexVit with the geometry of vitgraph's ``model`` (class token, token pooling,
    no LayerScale: the same function), or timm's entry ``arch_name`` at that width and depth
    (e.g. naflexvit_base_patch16_gap: LayerScale, 4 registers, average pooling). Position
    grid resampled by grid_sample (no host sync, as vitgraph's)."""
    import timm
    from vitgraph.convert.naflex import naflex_model_args
    from vitgraph.models.registry import get_arch
    arch = get_arch(model)
    args = naflex_model_args(arch, class_token=True, num_registers=0, pool="cls",
                             activation="gelu", pos_interp="bicubic", num_classes=num_classes)
    if arch_name:
        keep = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio",
                "pos_embed_grid_size", "pos_embed_use_grid_sample", "num_classes")
        args = {k: args[k] for k in keep}
    # the SigLIP entry has no LayerScale (create_model drops init_values=None): every other
    # choice is in args
    return timm.create_model(arch_name or "naflexvit_base_patch16_siglip", **args), \
        arch_name or "NaFlexVit(vitgraph geometry)"


def bench_timm_naflex(model: str, grids: list, max_patches: int, compile_mode: str | None, *,
                      batch: int, warmup: int, iters: int, num_classes: int,
                      arch_name: str | None = None, seed: int = 0, microbatches: int = 1) -> dict:
    """timm's NaFlexVit on the stream as timm's NaFlex loader feeds it: ``batch`` images a
    step, each padded to the collator's sequence length (``max_patches``, timm's
    NaFlexCollator(max_seq_len)), patch_coord and patch_valid masks; autocast bf16, fused
    AdamW, grad clipping at 1. ``microbatches``: the step's images in that many equal parts,
    their gradients accumulated (timm's ``--grad-accum-steps``)."""
    if batch % microbatches:
        raise ValueError(f"{batch} images a step do not split into {microbatches} microbatches")
    part = batch // microbatches
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    net, name = timm_naflex_model(model, num_classes, arch_name)
    net = net.to(dev).train()
    p = net.embeds.patch_size[0]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=dev == "cuda")
    # every step has the same shapes (batch, max_patches): static shapes, so compile does not
    # turn to dynamic ones, with which timm's NaFlexVit failed at max_patches 1024
    fwd = net if compile_mode is None else torch.compile(
        net, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
    pixels = _Pixels(3 * p * p, seed)
    labels = torch.randint(0, num_classes, (len(grids),), generator=torch.Generator().manual_seed(seed))
    batches, counts = [], []
    for idx in batched_steps(grids, batch):
        x = torch.zeros(batch, max_patches, 3 * p * p, dtype=torch.uint8)
        coord = torch.zeros(batch, max_patches, 2, dtype=torch.int64)
        valid = torch.zeros(batch, max_patches, dtype=torch.bool)
        for j, i in enumerate(idx):
            gh, gw = grids[i]
            n = gh * gw
            # timm's patches are (row, col, channel); ours (channel, row, col)
            x[j, :n] = pixels.rows(i, grids[i]).view(n, 3, p, p).permute(0, 2, 3, 1).reshape(n, -1)
            r = torch.arange(n)
            coord[j, :n, 0], coord[j, :n, 1] = r // gw, r % gw
            valid[j, :n] = True
        batches.append(tuple(t.to(dev) for t in (x, coord, valid, labels[idx])))
        real = sum(grids[i][0] * grids[i][1] for i in idx)
        counts.append((batch, real, batch * (max_patches + net.num_prefix_tokens)))
    scale = torch.tensor(1 / 127.5, device=dev)

    def one(b):
        def step():
            for c in range(0, batch, part):
                if compile_mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                x8, coord, valid, y = (t[c:c + part] for t in b)
                x = x8.float() * scale - 1.0  # (v / 255 - 0.5) / 0.5, as the loader normalises
                with torch.autocast(dev, dtype=torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(
                        fwd(x, patch_coord=coord, patch_valid=valid), y)
                (loss / microbatches).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    m = _measure_cycle([one(b) for b in batches], counts, warmup, iters)
    return {**m, "timm_model": name, "batch": batch, "microbatches": microbatches,
            "padded_to": max_patches,
            "steps_in_stream": len(batches), "images_in_stream": sum(c[0] for c in counts)}


def timm_naflex_fitting(args, model: str, grids: list, max_patches: int,
                        compile_mode: str | None) -> dict:
    """``bench_timm_naflex`` with ``args.timm_batch`` images a step in one microbatch, or, where
    that runs out of GPU memory, in 2, 4, ... (gradients accumulated, as a timm user would fit
    the step); the row says how many and why."""
    k, oom = 1, None
    while True:
        try:
            res = bench_timm_naflex(model, grids, max_patches, compile_mode,
                                    batch=args.timm_batch, warmup=args.warmup, iters=args.iters,
                                    num_classes=args.num_classes, arch_name=args.timm_arch,
                                    seed=args.seed, microbatches=k)
            break
        except torch.OutOfMemoryError as e:
            if args.timm_batch % (2 * k):
                raise
            oom = f"{args.timm_batch} images in {k} microbatch(es) ran out of memory: {e}"[:300]
        # the failed attempt's model, optimizer and compiled graphs go before the next one
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        k *= 2
        print(f"timm-naflex at max_patches {max_patches}: out of memory, again in {k} "
              f"microbatches of {args.timm_batch // k}", flush=True)
    return {**res, **({"fitted_after": oom} if oom else {})}


def native_jobs(args) -> list[tuple[str, int, str]]:
    """(model, max_patches, system) in run order; the timm peers once per (model, max_patches),
    in a single-GPU run only."""
    jobs = []
    for model in args.models:
        for mp in args.max_patches:
            for system in args.systems:
                if system in NATIVE_PEERS and _world() > 1:
                    continue
                jobs.append((model, mp, system))
    return jobs


def run_native(args) -> int:
    """--native (and --vlm): every (model, max_patches, system) row on one fixed stream; the
    JSON is rewritten after each row."""
    vlm = getattr(args, "vlm", False)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    rows, streams = [], {}
    t_all = time.time()
    for model, mp, system in native_jobs(args):
        from vitgraph.models.registry import get_arch
        patch = get_arch(model).patch_size
        key = (patch, mp)
        if key not in streams:
            streams[key] = native_stream(args.images, args.seed, patch, mp)
        grids = streams[key]
        if rank0 and (KERNELS or PROFILE):
            print(f"\n== {model} max_patches {mp} {system}", flush=True)
        t0 = time.time()
        try:
            if vlm:
                res = vlm_row(args, model, system, grids, mp)
            elif system in NATIVE_PEERS:
                res = timm_naflex_fitting(args, model, grids, mp,
                                          "default" if system.endswith("+compile") else None)
            else:
                res = bench_vitgraph_native(model, system, grids, mp,
                                            pack_tokens=args.pack_tokens,
                                            max_images=args.max_images,
                                            packs_per_step=args.packs_per_step,
                                            padded_images=args.timm_batch,
                                            warmup=args.warmup, iters=args.iters,
                                            num_classes=args.num_classes,
                                            overrides=args.override, seed=args.seed)
            err = None
        except Exception as e:
            traceback.print_exc()
            res, err = {}, f"{type(e).__name__}: {e}"[:500]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        graphs = False
        systems = VLM_SYSTEMS if vlm else NATIVE_SYSTEMS
        if system in systems and systems[system][1]:
            graphs = systems[system][2]
        row = {"system": system, "model": model, "resolution": "native", "max_patches": mp,
               **({"task": "caption"} if vlm else {}),
               "stream": {"images": args.images, "seed": args.seed, "shorter_side": [128, 512],
                          "aspect": [0.5, 2.0]},
               "precision": "bf16", "graphs": graphs, "gpus": _world(),
               "num_classes": args.num_classes, **res, "error": err,
               "wall_s": round(time.time() - t0, 1)}
        rows.append(row)
        if rank0:
            print(f"{model:18s} max_patches {mp:5d} {system:28s}: "
                  f"{res.get('images_per_s', float('nan')):8.1f} img/s "
                  f"{res.get('real_tokens_per_s', float('nan')) / 1e3:8.1f}k real tok/s "
                  f"({100 * res.get('real_share', float('nan')):.0f}% real) "
                  + (f"tower {100 * res['tower_share']:.0f}% of the step "
                     if "tower_share" in res else "")
                  + (f"in {res['microbatches']} microbatches "
                     if system in NATIVE_PEERS and res.get("microbatches", 1) > 1 else "")
                  + f"peak {res.get('peak_reserved_gib', float('nan')):5.1f} GiB reserved "
                  f"({row['wall_s']}s, {time.time() - t_all:.0f}s in all)"
                  + (f"  ERROR {err}" if err else ""), flush=True)
            write_rows(args, rows)
    if rank0:
        bases = (("vitgraph+dense+graphs", "vitgraph+dense", "vitgraph+padded+graphs") if vlm
                 else ("timm-naflex+compile", "vitgraph+padded+step-graphs", "vitgraph+padded"))
        print(f"\nreal tokens/s against {', '.join(bases)} (same model, max_patches):")
        for model in args.models:
            for mp in args.max_patches:
                same = [r for r in rows if r["model"] == model and r["max_patches"] == mp
                        and r.get("real_tokens_per_s")]
                for base_name in bases:
                    base = next((r for r in same if r["system"] == base_name), None)
                    if base is None:
                        continue
                    for r in same:
                        print(f"  {model:18s} {mp:5d} {r['system']:28s} "
                              f"{r['real_tokens_per_s'] / base['real_tokens_per_s']:5.2f}x "
                              f"{base_name}")
    if _world() > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


# ---------------------------------------------------------------- bundled configs as shipped

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def bundled_gpu_configs() -> list[Path]:
    """``--configs all``: every bundled config but the CPU demos."""
    return sorted(p for p in (ROOT / "configs").glob("*.yaml") if "tiny" not in p.name)


def recipe_overrides(cfg) -> list[str]:
    """The training recipe of ``cfg`` as overrides of a bench row (which turns it off): the
    layers' random masks (drop path, dropout), the EMA, label smoothing, gradient clipping and
    the device augmentation, each key resolved. A bench row with them, on synthetic input, is
    the config's step without its input pipeline."""
    from vitgraph.config import random_layer_keys
    from vitgraph.config_keys import yaml_value
    t = cfg.train
    over = [f"{k}={v}" for k, v in random_layer_keys(cfg).items()]
    over += [f"train.ema.decay={yaml_value(t.ema.decay)}",
             f"train.label_smoothing={t.label_smoothing}", f"optim.clip_grad={cfg.optim.clip_grad}"]
    return over + section_overrides(cfg.data.augment, "data.augment")


def section_overrides(section, prefix: str) -> list[str]:
    """Every key of a config section as ``prefix.key=value`` overrides."""
    from vitgraph.config_keys import yaml_value
    return [f"{prefix}.{f.name}={yaml_value(getattr(section, f.name))}"
            for f in dataclasses.fields(section)]


def config_stream(cfg, n: int, seed: int) -> tuple[list, tuple]:
    """A native-resolution config's bench stream: ``n`` images drawn (seeded, with
    replacement) from its data's training split, each at the grid it trains at, and their
    captions (() where the data has none)."""
    import numpy as np
    from vitgraph.data import build_datasets, pack_spec
    from vitgraph.models.registry import resolve_arch
    train, _ = build_datasets(cfg.data, cfg.train.seed, native=True)
    pick = np.random.default_rng(seed).integers(0, len(train), n).tolist()
    spec = pack_spec(cfg.data.packing, resolve_arch(cfg.model).patch_size,
                     int(cfg.model.class_token) + cfg.model.num_registers)
    grids = [tuple(g) for g in train.grids(spec)[pick].tolist()]
    return grids, tuple(train.captions[i] for i in pick) if train.captions else ()


def config_bench_rows(cfg, k: int, args) -> list[tuple]:
    """(name, run) of the bench rows a config is held against, each ``run()`` the row's
    images/s on synthetic input: layer and step graphs, then the config's recipe
    (``recipe_overrides``) with step graphs. Fixed resolution: the model at its micro-batch
    (``bench_vitgraph``, ``k`` microbatches). Native resolution: its packs (size, images a
    pack, ``k`` a step) over a stream of its data's image sizes and, for a caption config,
    captions and language model (``bench_vitgraph_native``)."""
    from vitgraph.config import task_kind
    from vitgraph.config_keys import yaml_value
    recipe = recipe_overrides(cfg)
    if cfg.data.resolution != "native":
        # the config's activation recompute: the 6B tower's micro-batch fits only with it
        memory = [f"train.{key}={yaml_value(getattr(cfg.train, key))}" for key in
                  ("recompute", "recompute_method", "recompute_layers", "recompute_modules")]

        def fixed(system, over):
            impl, scope = VITGRAPH_SYSTEMS[system]
            return lambda: bench_vitgraph(cfg.model.name, cfg.train.micro_batch_size, impl, "bf16",
                                          args.warmup, args.iters, args.num_classes, k,
                                          [*memory, *over, *args.override], scope)["images_per_s"]
        return [("vitgraph+graphs", fixed("vitgraph+graphs", [])),
                ("vitgraph+step-graphs", fixed("vitgraph+step-graphs", [])),
                ("recipe", fixed("vitgraph+step-graphs", recipe))]
    p = cfg.data.packing
    if p.layout == "padded":
        raise ValueError("data.packing.layout=padded: the bench rows of a config at native "
                         "resolution are packed ones")
    grids, texts = config_stream(cfg, args.images, args.seed)
    captions, keep = None, [f"data.packing.min_patches={p.min_patches}"]
    if task_kind(cfg) == "caption":
        lm = cfg.lm
        captions = Captions(lm.num_layers, lm.hidden_size, lm.num_heads, lm.tokenizer,
                            lm.text_length, 3, args.seed, texts)
        keep += section_overrides(lm, "lm")

    def native(system, over):
        return lambda: bench_vitgraph_native(
            cfg.model.name, system, grids, p.max_patches, pack_tokens=p.tokens_per_microbatch,
            max_images=p.max_images, packs_per_step=k, padded_images=0, warmup=args.warmup,
            iters=args.iters, num_classes=args.num_classes,
            overrides=[*keep, *over, *args.override],
            seed=args.seed, captions=captions)["images_per_s"]
    return [(s, native(s, [])) for s in ("vitgraph+packed+graphs", "vitgraph+packed+step-graphs")] \
        + [("recipe", native("vitgraph+packed+step-graphs", recipe))]


ONE_GPU_LAYOUT = ("parallel.tp=1", "parallel.pp=1", "parallel.vpp=1",
                  "parallel.sequence_parallel=false")


def one_gpu_overrides(data: str | None) -> list[str]:
    """A bundled config as ``--configs`` runs it: on ``data`` (None: its own), tp / pp 1."""
    return [*([f"data.path={data}"] if data else []), *ONE_GPU_LAYOUT]


def one_gpu_config(path: Path, data: str | None):
    from vitgraph.config import load_config
    return load_config(path, one_gpu_overrides(data))


def shipped_window(path: Path, data: str | None, steps: int | None, microbatches: int,
                   run_dir: Path) -> tuple:
    """(config, overrides, window steps, warm-up steps, log interval) of ``bench_config``'s
    run: the config as shipped on one GPU, ``train.steps`` far past the window (it replaces an
    epoch count: giving one of the two drops the other), the shipped warm-up, nothing saved."""
    cfg = one_gpu_config(path, data)
    o = cfg.optim  # the shipped warm-up, in steps (a fraction of train.steps where it is one)
    warmup = o.warmup_steps if o.warmup_steps is not None else \
        int(o.warmup_fraction * cfg.train.steps) if cfg.train.steps else 0
    steps = steps or max(150, warmup // 4)
    log_every = max(5, steps // 15)
    over = [f"train.steps={max(100 * steps, 4 * warmup)}",
            f"optim.warmup_steps={warmup}", f"train.log_every={log_every}",
            "train.eval_every=0", "checkpoint.every=0", "checkpoint.save=false",
            "train.progress=false", "checkpoint.resume=false", f"run.dir={run_dir}",
            f"train.global_batch_size={microbatches * cfg.train.micro_batch_size}",
            *one_gpu_overrides(data)]
    return cfg, over, steps, warmup, log_every


def bench_config(path: Path, data: str | None, steps: int | None, window_s: float, runs: Path,
                 microbatches: int = 2, gpu_mem: float | None = None) -> dict:
    """``vitgraph train CONFIG`` as a user runs it, in a process of its own, on ``data`` (its
    own kind: an ImageFolder for a classifier, shards for a pair; None: the config's own): the
    first ``steps`` steps of the shipped schedule (None: a quarter of its warm-up, at least
    150), ended by SIGTERM there or ``window_s`` seconds after the first logged step, whichever
    comes first (exit 75; checkpoint.save=false: nothing written). ``train.steps`` is set far
    past the window, so the warm-up is the config's (``build_scheduler`` cuts a warm-up longer
    than the run). The row: the loop's rate (the first logged window, with the captures, left
    out), the losses of the window and whether they fell, how far the warm-up got, and the
    graph path auto chose. One GPU: the global batch is ``microbatches`` microbatches and tp /
    pp are 1, the rest as shipped. Not run where `vitgraph plan` says the run does not fit the
    GPU (``gpu_mem`` GiB; None: this machine's): the row says so (``fits`` false)."""
    import re
    from vitgraph.train.preempt import PREEMPTED_EXIT
    run_dir = runs / path.stem
    cfg, over, steps, warmup, log_every = shipped_window(path, data, steps, microbatches, run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    # a world of one of its own, even where this bench runs under torchrun
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    # a big tower at tp 1 can outgrow one GPU (the 6B one an H100's): said in seconds on CPU
    # instead of an out-of-memory minutes into the run
    plan = subprocess.run([sys.executable, "-m", "vitgraph", "plan", str(path), *over,
                           *(["--gpu-mem", str(gpu_mem)] if gpu_mem else [])],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if plan.returncode == 1:
        peak = [x for x in plan.stdout.splitlines() if x.startswith("peak ")]
        return {"config": name, "model": cfg.model.name, "micro_batch": cfg.train.micro_batch_size,
                "overrides": over, "fits": False,
                "error": f"not run: `vitgraph plan` says it does not fit one GPU at tp 1: "
                         f"{peak[0] if peak else plan.stdout[-300:]}"}
    proc = subprocess.Popen([sys.executable, "-m", "vitgraph", "train", str(path), *over],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    records = _watch_window(proc, run_dir / "log.jsonl", steps, window_s)
    out = proc.stdout.read()
    windows = [r for r in records if r.get("images_per_s") and r["step"] > log_every]
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").is_file() else ""
    graphs = re.search(r"graphs: (\w+) \(", log)
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    reached = records[-1]["step"] if records else 0
    third = max(1, len(losses) // 3)
    fell = bool(losses) and sum(losses[-third:]) / third < 0.98 * sum(losses[:third]) / third
    share = min(1.0, reached / warmup) if warmup else 1.0
    plateau = _uniform_plateau(cfg, run_dir, losses[-third:]) if losses and not fell else None
    # the recipe warms up over warmup x its own global batch samples (images; packs at native
    # resolution): how much of that the window saw says whether its loss could fall yet
    batch, shipped_batch = microbatches * cfg.train.micro_batch_size, cfg.train.global_batch_size
    seen, warmup_seen = reached * batch, warmup * shipped_batch
    row = {"config": name,
           "model": cfg.model.name, "micro_batch": cfg.train.micro_batch_size,
           "global_batch": batch, "shipped_global_batch": shipped_batch,
           "input": "the config's" if not data else
                    "imagefolder" if os.path.isdir(os.path.join(data, "train")) else "shards",
           "overrides": over, "fits": True, "exit": proc.returncode,
           "graphs": graphs.group(1) if graphs else None, "steps": reached,
           "warmup_steps": warmup, "lr_share_of_peak": share,
           # equal images per window: the rate over them is the harmonic mean
           "images_per_s": len(windows) / sum(1 / r["images_per_s"] for r in windows) if windows else None,
           "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
           "losses": losses, "loss_fell": fell,
           "window_samples": seen, "warmup_samples": warmup_seen,
           "window": f"steps 1-{reached} of the shipped schedule at a global batch of {batch}: "
                     f"the warm-up ({warmup} steps) took the learning rate to {share:.1%} of its "
                     f"peak; {seen:,} samples, {seen / warmup_seen if warmup_seen else 1:.1%} "
                     f"of the {warmup_seen:,} the recipe warms up over at its batch of "
                     f"{shipped_batch}" + (f"; {plateau}" if plateau else "")}
    if proc.returncode not in (0, PREEMPTED_EXIT):
        row["error"] = out[-800:]
    return row


def _uniform_plateau(cfg, run_dir: Path, tail: list[float]) -> str | None:
    """Why a classifier's window did not fall, where its last losses sit at ln(classes) (within
    0.5%): the model still predicts every class alike, the plateau a from-scratch run under
    heavy augmentation holds for thousands of steps (benchmarks/BENCHMARKS.md); else None."""
    from vitgraph.config import task_kind
    from vitgraph.convert.export_files import read_classes
    from vitgraph.data.augment import augment_line
    classes = read_classes(run_dir) if task_kind(cfg) == "classification" else None
    if not classes:
        return None
    n = len(classes)
    uniform = math.log(n)
    if abs(sum(tail) / len(tail) - uniform) > 0.005 * uniform:
        return None
    start = f"from {cfg.model.init_from}" if cfg.model.init_from else "from scratch"
    return (f"the loss sat at ln {n} = {uniform:.4f}, a uniform prediction over its {n} "
            f"classes (no class learned yet), {start}, data.augment: "
            f"{augment_line(cfg.data.augment)}")


STARTUP_S = 600  # a config's start-up (data, build, the first steps' captures) at most


def _watch_window(proc, log_path: Path, steps: int, window_s: float) -> list[dict]:
    """The log records of ``proc``'s run once it is ended: SIGTERM when a record reaches step
    ``steps`` or ``window_s`` seconds after the first record; killed if it does not stop, or
    logs no step within STARTUP_S."""
    import signal
    first, records, deadline = None, [], time.time() + STARTUP_S
    while proc.poll() is None:
        time.sleep(0.5)
        if first is None and time.time() > deadline:  # no step logged: stuck in start-up
            proc.kill()
            proc.wait()
            break
        if log_path.is_file():
            records = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
        steps_seen = [r["step"] for r in records if "loss" in r]
        if steps_seen and first is None:
            first = time.time()
        if steps_seen and (max(steps_seen) >= steps or time.time() - first >= window_s):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            break
    if log_path.is_file():
        records = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    return [r for r in records if "loss" in r or "images_per_s" in r]


def run_configs(args) -> int:
    """--configs: each config's as-shipped row, then vitgraph's bench rows at its model and
    micro-batch (synthetic input, layer and step graphs) in this process; the best of those is
    the row's ``best_images_per_s``."""
    runs = Path("/tmp/vitgraph-bench-configs")
    rows = []
    configs = args.configs
    if [str(c) for c in configs] == ["all"]:
        configs = bundled_gpu_configs()
    from vitgraph.config import load_config, task_kind
    for path in configs:
        kind = task_kind(load_config(path, ["data.kind=shapes"]))
        # image-text configs (pairs, captions) on the shards, classifiers on the folder
        data = args.shards if kind in ("contrastive", "caption") else args.imagefolder
        k = 1 if kind == "contrastive" else 2  # a pair's micro-batch of 512: ~0.16 s a step
        t0 = time.time()
        row, rows_of, rates = {"config": str(path)}, [], {}
        try:
            row = bench_config(path, data, args.steps, args.window_s, runs, k)
            write_rows(args, [*rows, row])  # kept if a limit cuts the bench rows
            if row["fits"]:  # else its bench rows would not fit either
                rows_of = config_bench_rows(one_gpu_config(path, data), k, args)
        except Exception as e:
            traceback.print_exc()
            row["error"] = (row.get("error", "") + f" {type(e).__name__}: {e}").strip()[:800]
        # eager is left out: at every bundled config's micro-batch it ran at 0.38-0.87x of the
        # graphed paths (benchmarks/h200/*-paths.json). "recipe": the config's recipe on
        # synthetic input (step graphs, as auto picks on one GPU): what of the gap to the best
        # row is the recipe's, what is the input pipeline's
        for name, run in rows_of:
            try:
                rates[name] = run()
            except Exception:
                traceback.print_exc()
                rates[name] = None
            gc.collect()
            torch.cuda.empty_cache()
        row["recipe_images_per_s"] = rates.pop("recipe", None)
        best = rates
        done = {k: v for k, v in best.items() if v}
        row["bench_images_per_s"] = best
        row["best_system"] = max(done, key=done.get) if done else None
        row["best_images_per_s"] = max(done.values()) if done else None
        if row.get("images_per_s") and row["best_images_per_s"]:
            row["ratio"] = row["images_per_s"] / row["best_images_per_s"]
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(f"{row['config']:34s} graphs {row.get('graphs')}: {row.get('images_per_s') or float('nan'):8.1f} "
              f"img/s as shipped ({row.get('input')}), best bench row {row['best_system']} "
              f"{row['best_images_per_s'] or float('nan'):8.1f} -> {row.get('ratio', float('nan')):.3f}x; "
              f"{row.get('steps')} steps (lr {100 * (row.get('lr_share_of_peak') or 0):.1f}% of its "
              f"peak), loss {row.get('loss_first') or float('nan'):.4f} -> "
              f"{row.get('loss_last') or float('nan'):.4f} ({'fell' if row.get('loss_fell') else 'did not fall'}; "
              f"{row.get('window_samples') or 0:,} samples, the recipe warms up over "
              f"{row.get('warmup_samples') or 0:,}); its recipe on synthetic input "
              f"{row.get('recipe_images_per_s') or float('nan'):8.1f} img/s"
              + (f"  ERROR {row['error'][-300:]}" if row.get("error") else ""), flush=True)
        write_rows(args, rows)
    return 0


# ---------------------------------------------------------------- driver

def write_rows(args, rows: list[dict]) -> None:
    """``args.out``: the provenance (taken at the first write) and the rows so far, rewritten
    after each row, so a limit that cuts the run keeps what it measured."""
    if not hasattr(args, "provenance"):
        args.provenance = provenance(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": args.provenance, "rows": rows}, indent=1))


def provenance(args) -> dict:
    def ver(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return None
    try:  # the device copy of the tree may have no usable git: record None, never "HEAD"
        commit = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    cudnn_te = None
    try:
        from vitgraph.graphs.cudnn import attention_report
        cudnn_te = attention_report()
    except Exception as e:  # report, never fail the benchmark on it
        cudnn_te = {"error": repr(e)}
    import hashlib
    tree = hashlib.sha256()  # the code measured, also where the device copy's git is stale
    for f in sorted([*ROOT.glob("vitgraph/**/*.py"), *ROOT.glob("scripts/*.py")]):
        tree.update(f.relative_to(ROOT).as_posix().encode() + f.read_bytes())
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "source_sha256": tree.hexdigest(),
            "command": " ".join([sys.executable, *sys.argv]), "git_commit": commit,
            "git_dirty": dirty,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "gpus": _world(), "host": platform.node(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn_torch": torch.backends.cudnn.version(),
            "transformer_engine": ver("transformer_engine"), "megatron_core": _mcore_version(),
            "timm": ver("timm"), "torchao": ver("torchao"), "python": platform.python_version(), "attention": cudnn_te,
            "warmup": args.warmup, "iters": args.iters, "vitgraph_overrides": args.override,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "method": "median of 3 blocks of `iters` steps, after `warmup` steps; "
                      "peak memory over the timed steps (torch.cuda.max_memory_allocated)",
            **(native_provenance(args) if getattr(args, "native", False)
               or getattr(args, "vlm", False) else {})}


def native_provenance(args) -> dict:
    vlm = {"vlm": {k: getattr(args, k) for k in (
        "lm_layers", "lm_width", "lm_heads", "lm_tokenizer", "text_length", "min_text",
        "tower_share")}} if getattr(args, "vlm", False) else {}
    return {"native": {k: getattr(args, k) for k in (
                "images", "seed", "max_patches", "pack_tokens", "max_images", "packs_per_step",
                "timm_batch", "timm_arch")}, **vlm,
            "method": "median of 3 blocks of `iters` steps (cycling over the stream's steps), "
                      "after `warmup` steps; a block's rates: its images and its real tokens "
                      "(image patches; --vlm: and each caption's BOS to EOS) over its time; "
                      "peak memory over the timed steps"}


def _mcore_version():
    try:
        import megatron.core
        return megatron.core.__version__
    except Exception:
        return None


def _jobs(args) -> list[tuple[int, str, str, str, str]]:
    """(micro-batch, system, precision, input, recompute) in run order. vitgraph systems run at
    every precision and every --recompute, and with --data once more fed from the shards; the
    bf16 timm peers once per micro-batch, timm+compile+float8 once per micro-batch when an fp8
    precision is asked for; peers only in a single-GPU run. --system-batches limits a system
    to its own micro-batches."""
    fp8 = [p for p in args.precisions if p != "bf16"]
    only = {}
    for spec in getattr(args, "system_batches", None) or []:
        name, _, mbs = spec.partition("=")
        only[name] = {int(x) for x in mbs.split(",")}
    jobs = []
    for mb in args.micro_batches:
        for i, precision in enumerate(args.precisions):
            for system in args.systems:
                if system in only and mb not in only[system]:
                    continue
                if system == "vitgraph+step-graphs" and precision == "fp8-delayed":
                    continue  # a config error: delayed scaling updates from the host
                if system.startswith(("timm", "open_clip")):
                    first = precision == (fp8[0] if system.endswith("float8") else args.precisions[0])
                    if _world() > 1 or not first or (system.endswith("float8") and not fp8):
                        continue
                if not system.startswith("vitgraph"):
                    rc = "full" if system.endswith("checkpointing") else "none"
                    jobs.append((mb, system, precision, "synthetic", rc))
                    continue
                for rc in getattr(args, "recompute", None) or ["none"]:
                    jobs.append((mb, system, precision, "synthetic", rc))
                    if getattr(args, "data", None):
                        jobs.append((mb, system, precision, input_kind(args.data), rc))
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_l16_224",
                    choices=sorted([*TIMM_NAMES, *OPEN_CLIP_NAMES, *VITGRAPH_ONLY,
                                    *VITGRAPH_ONLY_TOWERS]))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--system-batches", nargs="*", default=[],
                    help="SYSTEM=MB[,MB...]: run SYSTEM only at these of --micro-batches")
    ap.add_argument("--recompute", nargs="+", default=["none"],
                    choices=["none", "selective", "full"],
                    help="vitgraph rows once per train.recompute (timm+compile+checkpointing "
                         "is timm's full recompute)")
    ap.add_argument("--systems", nargs="+", default=None,
                    help="default: vitgraph vitgraph+graphs timm timm+compile-reduce-overhead; "
                         "with --native every native system")
    ap.add_argument("--native", action="store_true",
                    help="native resolution: one fixed stream of images of mixed sizes through "
                         "packed / padded vitgraph and timm's NaFlexVit (see Native resolution)")
    ap.add_argument("--vlm", action="store_true",
                    help="the tower inside a captioning VLM (task.kind=caption) on the native "
                         "stream: packed / padded / dense (see The tower inside a VLM)")
    ap.add_argument("--models", nargs="+", default=None, choices=NATIVE_MODELS,
                    help="--native / --vlm: the towers (default vit_b16_224 / vit_so400m16_256)")
    ap.add_argument("--lm-layers", type=int, default=24, help="--vlm: lm.num_layers")
    ap.add_argument("--lm-width", type=int, default=1280, help="--vlm: lm.hidden_size")
    ap.add_argument("--lm-heads", type=int, default=20, help="--vlm: lm.num_heads")
    ap.add_argument("--lm-tokenizer", default="bpe",
                    help="--vlm: lm.tokenizer (its vocabulary sizes the output layer)")
    ap.add_argument("--text-length", type=int, default=64,
                    help="--vlm: lm.text_length, each caption's budget (BOS and EOS included)")
    ap.add_argument("--min-text", type=int, default=16,
                    help="--vlm: the shortest caption; lengths uniform up to --text-length")
    ap.add_argument("--no-tower-share", dest="tower_share", action="store_false",
                    help="--vlm: skip the tower-alone run that gives each row's tower_share")
    ap.add_argument("--max-patches", type=int, nargs="+", default=[576, 1024],
                    help="--native: each image's patch grid at most")
    ap.add_argument("--images", type=int, default=2048, help="--native: images in the stream")
    ap.add_argument("--seed", type=int, default=0, help="--native: the stream's seed")
    ap.add_argument("--pack-tokens", type=int, default=16384,
                    help="--native: tokens of a pack (data.packing.tokens_per_microbatch)")
    ap.add_argument("--max-images", type=int, default=0,
                    help="--native: images in a pack at most (0: as data.packing.max_images=0 "
                         "resolves it, from the stream's sizes)")
    ap.add_argument("--packs-per-step", type=int, default=4,
                    help="--native: packs (microbatches) per step and data-parallel rank")
    ap.add_argument("--timm-batch", type=int, default=64,
                    help="--native: images per step of timm-naflex and of vitgraph+padded")
    ap.add_argument("--timm-arch", default=None,
                    help="--native: a timm naflexvit entry for the peer, at the model's width "
                         "and depth (default: NaFlexVit of vitgraph's geometry)")
    ap.add_argument("--precisions", nargs="+", default=["bf16"],
                    choices=["bf16", "fp8-current", "fp8-delayed"])
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--microbatches", type=int, default=1,
                    help="microbatches per step and data-parallel rank (pipelines need several)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--override", nargs="*", default=[],
                    help="extra vitgraph config overrides (key=value) for the vitgraph systems")
    ap.add_argument("--data", help="a JPEG ImageFolder or JPEG shards: each vitgraph row again, "
                                   "fed from them by the training loop's input pipeline (see Inputs)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many steps per system")
    ap.add_argument("--kernels", type=int, default=0,
                    help="torch.profiler over this many steps per system: top kernels by GPU time")
    ap.add_argument("--configs", nargs="+", type=Path,
                    help="bundled configs (or `all`: every one but the CPU demos): each as "
                         "shipped through `vitgraph train` on --imagefolder (classifiers) or "
                         "--shards (image-text pairs), against the bench rows")
    ap.add_argument("--imagefolder", help="--configs: a JPEG ImageFolder for the classifiers")
    ap.add_argument("--shards", help="--configs: JPEG image-text shards for the pairs")
    ap.add_argument("--steps", type=int, default=None,
                    help="--configs: the steps of each run's window (default: a quarter of the "
                         "config's warm-up, at least 150)")
    ap.add_argument("--window-s", type=float, default=120,
                    help="--configs: a run's window ends this many seconds after its first "
                         "logged step, if --steps have not come first")
    args = ap.parse_args()
    global PROFILE, KERNELS
    PROFILE, KERNELS = args.profile, args.kernels
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if args.configs:
        return run_configs(args)
    if args.vlm:
        args.models = args.models or ["vit_so400m16_256"]
        args.systems = args.systems or [s for s in VLM_SYSTEMS if "graphs" in s]
        unknown = [s for s in args.systems if s not in VLM_SYSTEMS]
        if unknown:
            ap.error(f"--vlm systems: {', '.join(VLM_SYSTEMS)} (not {', '.join(unknown)})")
        if not 3 <= args.min_text <= args.text_length:
            ap.error(f"--min-text {args.min_text}: 3 (BOS, a token, EOS) to --text-length")
        return run_native(args)
    args.models = args.models or ["vit_b16_224"]
    if args.native:
        args.systems = args.systems or [*NATIVE_SYSTEMS, *NATIVE_PEERS]
        unknown = [s for s in args.systems if s not in NATIVE_SYSTEMS and s not in NATIVE_PEERS]
        if unknown:
            ap.error(f"--native systems: {', '.join([*NATIVE_SYSTEMS, *NATIVE_PEERS])} "
                     f"(not {', '.join(unknown)})")
        return run_native(args)
    args.systems = args.systems or ["vitgraph", "vitgraph+graphs", "timm",
                                    "timm+compile-reduce-overhead"]

    rows = []
    for mb, system, precision, inputs, recompute in _jobs(args):
        t0 = time.time()
        try:
            if system.startswith("vitgraph"):
                impl, scope = VITGRAPH_SYSTEMS[system]
                over = [*args.override] + ([f"train.recompute={recompute}"]
                                           if recompute != "none" else [])
                res = bench_vitgraph(args.model, mb, impl, precision, args.warmup, args.iters,
                                     args.num_classes, args.microbatches, over, scope,
                                     args.data if inputs != "synthetic" else None)
            elif system.startswith("open_clip"):
                mode = {"open_clip": None, "open_clip+compile": "default"}[system]
                res = bench_open_clip(args.model, mb, mode, args.warmup, args.iters)
            else:
                mode = {"timm": None, "timm+compile": "default",
                        "timm+compile-reduce-overhead": "reduce-overhead",
                        "timm+compile+float8": "default",
                        "timm+compile+checkpointing": "default"}[system]
                res = bench_timm(args.model, mb, mode, args.warmup, args.iters, args.num_classes,
                                 float8=system.endswith("float8"),
                                 checkpointing=system.endswith("checkpointing"))
            err = None
        except Exception as e:
            traceback.print_exc()
            res, err = {}, f"{type(e).__name__}: {e}"[:500]
        gc.collect()
        torch.cuda.empty_cache()
        graphs = False
        if system in VITGRAPH_SYSTEMS and VITGRAPH_SYSTEMS[system][0]:
            graphs = VITGRAPH_SYSTEMS[system][1]
        elif "reduce-overhead" in system:
            graphs = "step"
        row = {"system": system, "model": args.model, "micro_batch": mb,
               "precision": "fp8-tensorwise-torchao" if system.endswith("float8") else
               (precision if system.startswith("vitgraph") else "bf16"),
               "graphs": graphs, "gpus": _world(), "layout": "dp1",
               "num_classes": args.num_classes, "input": inputs, "recompute": recompute,
               **res, "error": err,
               "wall_s": round(time.time() - t0, 1)}
        fpi = res.get("flops_per_image")
        if fpi is None:
            fpi = next((r.get("flops_per_image") for r in rows if r.get("flops_per_image")), None)
        if res.get("images_per_s") and fpi:
            row["mfu"] = res["images_per_s"] * fpi / PEAK_FLOPS / _world()
        rows.append(row)
        if rank0:
            name = system + (f" <- {inputs}" if inputs != "synthetic" else "")
            print(f"{name:28s} {row['precision']:12s} mb {mb:4d} {row['layout']:10s}: "
                  f"{res.get('images_per_s', float('nan')):9.1f} img/s "
                  f"peak {res.get('peak_mem_gib', float('nan')):6.1f} GiB allocated "
                  f"{res.get('peak_reserved_gib', float('nan')):6.1f} GiB reserved  ({row['wall_s']}s)"
                  + (f"  {res['gpu_power_w']:.0f} W, SM {res['gpu_sm_clock_mhz']:.0f} MHz, "
                     f"{res['gpu_power_capped']:.0%} at the power cap" if "gpu_power_w" in res else "")
                  + (f"  ERROR {err}" if err else ""), flush=True)
            write_rows(args, rows)

    if rank0:
        print("\nratios against timm+compile (bf16, same micro-batch), else vitgraph eager:")
        for mb in args.micro_batches:
            base = next((r for r in rows if r["system"] == "timm+compile" and r["micro_batch"] == mb
                         and r.get("images_per_s")), None) or next(
                (r for r in rows if r["system"] == "vitgraph" and r["micro_batch"] == mb
                 and r.get("images_per_s")), None)
            for r in rows:
                if r["micro_batch"] != mb or not r.get("images_per_s") or base is None:
                    continue
                print(f"  mb {mb:4d} {r['system']:28s} {r['precision']:12s} "
                      f"{r['images_per_s'] / base['images_per_s']:5.2f}x speed  "
                      f"{r['peak_reserved_gib'] / base['peak_reserved_gib']:5.2f}x reserved memory")
        for r in rows:
            if r["input"] == "synthetic" or not r.get("images_per_s"):
                continue
            twin = next((q for q in rows if q["input"] == "synthetic" and q.get("images_per_s")
                         and all(q[k] == r[k] for k in ("system", "micro_batch", "precision"))), None)
            if twin:
                print(f"  mb {r['micro_batch']:4d} {r['system']:28s} {r['precision']:12s} "
                      f"from {r['input']}: {r['images_per_s'] / twin['images_per_s']:5.3f}x its "
                      f"synthetic-input rate")
    if _world() > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
