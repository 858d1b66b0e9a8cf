"""``vitgraph plan``: what a config's run holds on each GPU of its layout, before it runs.

Parameters are counted exactly, from the config's own model built on the meta device (one
process, tp = pp = 1; tensor-parallel and pipeline shares follow from each parameter's
megatron attributes and layer index). The rest is counted from the layout:

* weights (bf16 or fp32), megatron DDP's gradient buffer (fp32 with
  parallel.grad_reduce_in_fp32), the optimizer's fp32 master weights and Adam moments
  (sharded over dp by the distributed optimizer; the offloaded share off the GPU),
  train.ema's fp32 copy (sharded as the optimizer is); with parallel.fsdp weights, gradients
  (in the weights' dtype: no DDP buffer) and optimizer state all over dp, plus the whole
  weights of two layers (the one running and the one gathered ahead) and one layer's whole
  gradient before its reduce-scatter (not yet measured on a GPU);
* activations: what autograd keeps per encoder layer and token (TE's layers, flash
  attention: no per-pair terms) times the microbatches in flight on the stage (1F1B:
  pp - stage; interleaved: megatron's warm-up count), less what train.recompute drops, plus
  the transient working set of one layer's backward (and of one recomputed unit); a caption
  model adds its language model over each image's tokens and its text budget (the tower
  whole on the first stage, the LM's layers over the stages) and its text logits;
* a runtime term (cuBLAS / cuDNN / TE workspaces, NCCL, the caching allocator's slack).

The total is what ``torch.cuda.max_memory_reserved`` reaches (the logs' ``peak_reserved_gib``);
the CUDA context (~0.5 GiB) comes on top and is left for ``--gpu-mem``'s check. On an H200
the plan was within -0.5..+7.1% of the measured peak of eight bundled configs and -1.9..+6.0%
of fifteen bench rows, FP8 ones included (benchmarks/BENCHMARKS.md; scripts/plan_check.py
holds it to 10%).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace

import torch

from vitgraph.config import check_layout, graph_constraints, load_config, task_kind
from vitgraph.data import DataError, class_count
from vitgraph.graphs.auto import choose_graphs
from vitgraph.models.build import Recompute, recompute_plan, token_multiple
from vitgraph.models.caption import TextPackSpec
from vitgraph.models.freeze import freeze, global_names
from vitgraph.models.specs import THD_HEAD_DIMS
from vitgraph.models.vit import sequence_length
from vitgraph.output import plural
from vitgraph.parallel.setup import init_distributed, shutdown
from vitgraph.plan import resolve
from vitgraph.tasks import make_task

GIB = 2 ** 30
# outside what is counted per tensor: workspaces, communicator buffers, allocator slack
RUNTIME_BYTES = int(1.0 * GIB)
# reserved over counted tensors: the caching allocator's rounding and fragmentation
SLACK = 1.03
# the CUDA context: on the GPU, outside what torch's allocator reserves
CUDA_CONTEXT_GIB = 0.5
# one layer's backward: its gradient temporaries, as a share of what the layer keeps
BACKWARD_WORKING = 0.7


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    fsdp: bool = False  # parallel.fsdp: weights, gradients and optimizer state over dp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def name(self) -> str:
        s = f"tp{self.tp} pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "")
        return (s + f" dp{self.dp}" + (" sp" if self.sequence_parallel else "")
                + (" fsdp" if self.fsdp else ""))


@dataclass(frozen=True)
class Stack:
    """One encoder stack, as activations see it: ``tokens`` per sample (padding included).
    ``pipelined``: its layers are split over the pipeline stages (else it sits whole on the
    first stage: a caption model's tower; a CLIP pair runs on one stage)."""
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    tokens: int
    pipelined: bool = True
    # a pack whose attention runs in slots (TE at head widths outside THD_HEAD_DIMS,
    # vitgraph.models.specs): max_images x max_len places, each image from its slot's start
    slot_tokens: int = 0


@dataclass(frozen=True)
class Param:
    numel: int
    split: bool  # tensor-parallel: each tp rank holds numel / tp
    trainable: bool
    layer: int | None  # the encoder layer it belongs to (None: embedding or head side)
    first: bool  # outside the layers: on the first pipeline stage (else the last)


@dataclass(frozen=True)
class Model:
    """What the plan needs of a config's model: its parameters and its encoder stacks."""
    params: tuple
    stacks: tuple
    num_layers: int  # layers of the pipelined stack (the image encoder; a caption's LM)
    image_bytes: int  # one input image on the device, bytes (a pack's pixels: per token)
    # a caption model's text logits on the last stage, bytes per sample at tp 1: bf16 out of
    # the output layer, the loss's fp32 copy and its gradient
    logit_bytes: int = 0
    pairs: int = 1  # samples a micro-batch unit holds (a pack: its image slots)


@dataclass
class Stage:
    stage: int
    params: int
    trainable: int
    weights: int
    grads: int
    optimizer: int
    ema: int
    activations: int  # kept over the microbatches in flight
    in_flight: int
    working: int  # transient: one layer's backward (and one recomputed unit)
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        counted = (self.weights + self.grads + self.optimizer + self.ema + self.activations
                   + self.working)
        return int(counted * SLACK) + self.runtime


@dataclass
class MemoryPlan:
    layout: Layout
    micro_batch: int
    microbatches: int  # per step and data-parallel rank
    recompute: str
    graphs: str
    precision: str
    stages: list = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(s.total for s in self.stages)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


def _stacks(cfg, plan) -> tuple:
    a = plan.arch
    if plan.pack is not None:
        tokens = plan.pack.tokens
    else:
        tokens = (sequence_length(a, plan.pair.class_token) if plan.pair is not None
                  else sequence_length(a, cfg.model.class_token, cfg.model.num_registers,
                                  cfg.model.distill_token))
    c = plan.caption
    k = plan.pack
    slots = (k.max_images * k.max_len if k is not None and not k.padded
             and a.hidden_size // a.num_heads not in THD_HEAD_DIMS else 0)
    stacks = [Stack("image", a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_heads, tokens,
                    pipelined=c is None, slot_tokens=slots)]
    if task_kind(cfg) == "contrastive" and plan.pair is not None:
        t = plan.pair.text  # a pack's captions: one per image slot
        stacks.append(Stack("text", t.num_layers, t.hidden_size, t.ffn_hidden_size, t.num_heads,
                            t.context_length * _pairs(plan), pipelined=False))
    if c is not None:  # the language model over each image's tokens and its text budget
        lm_tokens = (TextPackSpec.of(plan.pack, c.text_length).tokens if plan.pack is not None
                     else tokens + c.text_length)
        stacks.append(Stack("language", c.num_layers, c.hidden_size, c.ffn_hidden_size,
                            c.num_heads, lm_tokens))
    return tuple(stacks)


def _pairs(plan) -> int:
    """Samples (images, and their texts) of one micro-batch unit: a pack's image slots."""
    return plan.pack.max_images if plan.pack is not None else 1


def _caption_param(name: str) -> tuple[int | None, bool]:
    """(its language-model layer, on the first stage) of a caption model's parameter: the
    tower, the projector and the embedding sit on the first stage, the final norm and the
    output layer on the last."""
    m = re.match(r"language_model\.decoder\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)), False
    return None, not name.startswith(("language_model.decoder.", "language_model.output_layer"))


# one CPU process, the model as training builds it at tp = pp = 1 (its names are the global ones)
SINGLE = ["model.spec=torch", "train.precision=fp32", "graphs.enabled=false", "parallel.tp=1",
          "parallel.pp=1", "parallel.vpp=1", "parallel.sequence_parallel=false",
          "parallel.overlap_p2p_comm=false", "train.recompute=none"]


def single_process_chunks(single, num_classes: int | None = None, meta: bool = False):
    """The model of ``single`` (a config loaded with SINGLE's overrides last) as one CPU
    process builds it, with model.freeze / task.lock_image applied: ``(chunks, plan)``.
    ``meta``: on the meta device (no memory, no initialisation: for counting). The caller
    shuts the process group down (vitgraph.parallel.setup.shutdown)."""
    plan = resolve(single, 1)
    d = init_distributed(plan)
    task = make_task(plan, d)
    task.num_classes = single.model.num_classes or num_classes or 1000
    if meta:
        with torch.device("meta"):
            chunks = task.build_model(with_init_from=False)
    else:
        chunks = task.build_model(with_init_from=False)
    freeze(chunks, plan.freeze)
    return chunks, plan


def model_of(path, overrides=()) -> Model:
    """Count the parameters of the config at ``path`` with ``overrides`` on the meta device
    (no image read: a classifier without model.num_classes gets the data's class count where
    it is known without the images, else a 1000-class head, a rounding error of the total)."""
    single = load_config(path, [*overrides, *SINGLE], data=False)
    # one process: the step's batch is one micro-batch (nothing is trained)
    single.train.global_batch_size = single.train.micro_batch_size
    try:
        classes = class_count(single.data)
    except DataError:  # data.path not on this machine
        classes = None
    chunks, plan = single_process_chunks(single, classes, meta=True)
    try:
        names = global_names(chunks[0])
        params = []
        for p in chunks[0].parameters():
            name = names[id(p)]
            if plan.caption is not None:
                layer, first = _caption_param(name)
            else:
                m = re.search(r"(?:^|\.)decoder\.layers\.(\d+)\.", name)
                image_layer = m is not None and not name.startswith("text.")
                layer = int(m.group(1)) if image_layer else None
                first = not image_layer and _embedding_side(name)
            params.append(Param(
                numel=p.numel(), split=bool(getattr(p, "tensor_model_parallel", False)),
                trainable=p.requires_grad, layer=layer, first=first))
        stacks = _stacks(single, plan)
    finally:
        shutdown()
    c = 3 * (plan.arch.patch_size ** 2 if plan.pack is not None else plan.arch.image_size ** 2)
    lm = plan.caption
    return Model(tuple(params), stacks, lm.num_layers if lm else plan.arch.num_layers,
                 image_bytes=4 * c, pairs=_pairs(plan),
                 logit_bytes=lm.text_length * lm.vocab_size * (2 + 4 + 4) if lm else 0)


def _embedding_side(name: str) -> bool:
    base = name.split(".", 1)[1] if name.startswith("visual.") else name
    return base.split(".")[0] in ("cls_token", "dist_token", "pos_embed", "patch_embed", "registers",
                                   "ln_pre")


def layer_bytes_per_token(s: Stack, tp: int, sp: bool, fp8: bool) -> float:
    """What autograd keeps of one encoder layer per token, bf16 (TE's fused norm + linear
    layers and flash attention): the norms' inputs and outputs (8 h, split over tp only under
    sequence parallel), q, k, v and the attention output (8 h), the MLP's pre- and
    post-activation (4 f), fp32 norm statistics and the attention's softmax statistics. FP8
    keeps the GEMMs' inputs in one byte (both norm outputs, the projection's and fc2's
    inputs)."""
    h, f = s.hidden, s.ffn
    norm = 8 * h + 16 - (2 * h if fp8 else 0)
    split = 8 * h + 4 * f - ((h + f) if fp8 else 0) + 4 * s.heads
    return split / tp + norm / (tp if sp else 1)


def checkpoint_bytes_per_token(s: Stack, tp: int, sp: bool) -> float:
    """A checkpointed unit keeps its input only: the residual stream, bf16."""
    return 2 * s.hidden / (tp if sp else 1)


def in_flight(layout: Layout, stage: int, microbatches: int) -> int:
    """Chunk-microbatches whose activations a pipeline stage holds at once (megatron's
    schedules: 1F1B warms up pp - stage - 1 forwards; interleaved (pp - stage - 1) x 2 +
    (vpp - 1) x pp, each holding one chunk's layers)."""
    if layout.pp == 1:
        return 1
    if layout.vpp == 1:
        return min(layout.pp - stage, microbatches)
    warm = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp
    return min(warm + 1, microbatches * layout.vpp)


def _stack_activations(s: Stack, layers: int, tokens: int, layout: Layout, fp8: bool,
                       recompute) -> tuple[int, int]:
    """(kept per microbatch, transient working set) of ``layers`` layers of ``s``."""
    sp = layout.sequence_parallel
    full = layer_bytes_per_token(s, layout.tp, sp, fp8) * tokens
    if s.slot_tokens:  # q, k, v and the attention's output kept in the slots' places, and
        # the output taken back to the tokens as the projection's input
        full += (8 * s.hidden * (s.slot_tokens - tokens) + 2 * s.hidden * tokens) / layout.tp
    ckpt = checkpoint_bytes_per_token(s, layout.tp, sp) * tokens
    working = BACKWARD_WORKING * full
    g = recompute.granularity if recompute is not None else None
    if g == "full":
        n = min(recompute.num_layers or 1, layers)
        if recompute.method == "uniform":
            units = math.ceil(layers / n)
            return int(units * ckpt), int(working + n * full)
        return int(n * ckpt + (layers - n) * full), int(working + full)
    kept = layers * full
    if g == "selective" and "mlp" in (recompute.modules or ()):
        # the MLP keeps its input only (the norm's input is kept anyway): its norm output and
        # both activations of the MLP go
        h, f = s.hidden, s.ffn
        mlp = ((2 * h) / (layout.tp if sp else 1) + 4 * f / layout.tp) * tokens
        kept -= layers * mlp
        working += mlp
    # core_attn: flash attention keeps no per-pair tensors, so recomputing it drops nothing
    return int(kept), int(working)


def plan_memory(cfg, model: Model, layout: Layout, micro_batch: int | None = None,
                recompute=None, offload_fraction: float | None = None) -> MemoryPlan:
    """The memory of each pipeline stage (the first GPU of each, tp ranks being alike) at
    ``layout`` with ``micro_batch`` (default: train.micro_batch_size) and ``recompute``
    (a vitgraph.models.build.Recompute; default: the config's)."""
    t, p = cfg.train, cfg.parallel
    mb = micro_batch or t.micro_batch_size
    fp8 = t.precision == "fp8"
    bf16 = t.precision in ("bf16", "fp8")
    if recompute is None:
        recompute = recompute_plan(t, model.num_layers // (layout.pp * layout.vpp))
    offload = cfg.optim.offload_fraction if offload_fraction is None else offload_fraction
    microbatches = max(1, t.global_batch_size // (mb * layout.dp))
    graphs = choose_graphs(cfg.graphs, True, t.precision, t.fp8_recipe, layout.tp,
                           **graph_constraints(cfg))
    packed = cfg.data.resolution == "native"
    # FP8 under step graphs: the captured step reserves what the bf16 one does, plus TE's FP8
    # copy of each weight and its transpose (2 bytes a parameter); eager FP8 keeps its GEMM
    # inputs in one byte. Fitted to ViT-L/16 and ViT-g/14 on an H200 (BENCHMARKS.md)
    step_fp8 = fp8 and graphs.config.enabled and graphs.scope == "step"
    # TE's make_graphed_callables (graphs.impl=te) warms each layer up eagerly, and the
    # allocator keeps those activations cached beside the graphs' own pool: held twice
    # (ViT-L/16 FP8 layer graphs on an H200: 69.2 GiB reserved, 38.1 eager)
    twice = graphs.config.enabled and graphs.scope == "layer" and graphs.config.impl == "te"
    chunks = layout.pp * layout.vpp
    per_chunk = model.num_layers // chunks
    out = MemoryPlan(layout, mb, microbatches, recompute.name,
                     graphs.scope if graphs.config.enabled else "eager", t.precision)
    for stage in range(layout.pp):
        mine = {vp * layout.pp + stage for vp in range(layout.vpp)}  # its model chunks
        n, n_tr = _stage_params(model, layout, stage, mine, per_chunk)
        shard = layout.dp if layout.distributed_optimizer or layout.fsdp else 1
        weights = n * (2 if bf16 else 4) + (2 * n if step_fp8 else 0)
        grads = n_tr * (4 if (p.grad_reduce_in_fp32 or not bf16) else 2)
        if layout.fsdp:
            layer = max(sum(q.numel // layout.tp if q.split else q.numel
                            for q in model.params if q.layer == i and q.layer // per_chunk in mine)
                        for i in range(model.num_layers))
            weights = -(-n // layout.dp) * (2 if bf16 else 4) + 2 * layer * (2 if bf16 else 4)
            grads = (-(-n_tr // layout.dp) + layer) * (2 if bf16 else 4)
        state = n_tr * ((4 if bf16 else 0) + 8) / shard
        optimizer = int(state * (1 - offload))
        ema = int(n_tr * 4 / shard) if t.ema.decay is not None else 0
        kept, working = _stage_activations(model, layout, stage, mb, per_chunk, packed, fp8,
                                           step_fp8, recompute)
        held = in_flight(layout, stage, microbatches)
        out.stages.append(Stage(stage, n, n_tr, weights, grads, optimizer, ema,
                                kept * held * (2 if twice else 1), held, working))
    return out


def _stage_params(model: Model, layout: Layout, stage: int, chunks: set[int],
                  per_chunk: int) -> tuple[int, int]:
    """(parameters, trainable parameters) on one GPU of pipeline stage ``stage``, which holds
    the model chunks ``chunks`` (the embedding on the first stage, the head on the last)."""
    n = n_tr = 0
    for q in model.params:
        if q.layer is not None:
            on = q.layer // per_chunk in chunks
        else:
            on = (stage == 0) if q.first else (stage == layout.pp - 1)
        if not on:
            continue
        k = q.numel // layout.tp if q.split else q.numel
        n += k
        n_tr += k if q.trainable else 0
    return n, n_tr


def _stage_activations(model: Model, layout: Layout, stage: int, mb: int, per_chunk: int,
                       packed: bool, fp8: bool, step_fp8: bool, recompute) -> tuple[int, int]:
    """(kept per microbatch, transient working set) of pipeline stage ``stage``: every
    tower's layers, embedding and norms, the input images on the first stage."""
    kept = working = 0
    for s in model.stacks:
        if not s.pipelined and stage > 0:
            continue
        padded = s.name == "image" and not packed
        tokens = mb * (_padded(s.tokens, mb, layout, fp8) if padded else s.tokens)
        layers = per_chunk if s.pipelined else s.layers
        k, w = _stack_activations(s, layers, tokens, layout, fp8 and not step_fp8, recompute)
        # the embedding (patches, positions) and the head's norm: 8 h per token
        side = 8 * s.hidden * tokens // (layout.tp if layout.sequence_parallel else 1)
        if s.name == "image" and stage == 0:
            side += mb * model.image_bytes if not packed else s.tokens * model.image_bytes
        kept += k + side
        working = max(working, w)
    pairs = mb * model.pairs
    if any(s.name == "text" for s in model.stacks):  # contrastive logits over the global
        kept += 3 * 4 * pairs * pairs * layout.dp  # batch, fp32, and grads
    if stage == layout.pp - 1:
        kept += pairs * model.logit_bytes // layout.tp
    return kept, working


def _padded(seq: int, mb: int, layout: Layout, fp8: bool) -> int:
    """An image's tokens as the model pads them (sequence parallel, FP8 GEMMs)."""
    m = token_multiple(layout.tp if layout.sequence_parallel else 1, fp8, mb)
    return -(-seq // m) * m


def layout_of(cfg, gpus: int) -> Layout:
    p = cfg.parallel
    return Layout(p.tp, p.pp, p.vpp, max(1, gpus // (p.tp * p.pp)), p.sequence_parallel,
                  p.distributed_optimizer, p.fsdp)


def largest_micro_batch(cfg, model: Model, layout: Layout, budget: int, recompute=None,
                        cap: int = 4096) -> int:
    """The largest micro-batch whose plan fits ``budget`` bytes (0: not even 1)."""
    return _largest(lambda mb: plan_memory(cfg, model, layout, mb, recompute).peak <= budget, cap)


def with_pack_tokens(model: Model, tokens: int) -> Model:
    """A native-resolution ``model`` with image packs of ``tokens`` tokens (a caption
    model's language-model pack grows by as many; slots, where attention runs in them, in
    proportion: the images a pack holds grow with it)."""
    image = model.stacks[0]
    more = tokens - image.tokens
    return replace(model, stacks=tuple(
        replace(s, tokens=s.tokens + more, slot_tokens=s.slot_tokens * tokens // image.tokens)
        if s.name in ("image", "language") else s for s in model.stacks))


# data.packing.tokens_per_microbatch: a multiple of this (as the packs' FP8 and tp rounding
# ask at most), up to 1M tokens
PACK_STEP = 256


def largest_pack(cfg, model: Model, layout: Layout, budget: int, recompute=None) -> int:
    """Native resolution (one pack a microbatch): the largest pack, in tokens, a multiple of
    PACK_STEP, whose plan fits ``budget`` bytes (0: not even PACK_STEP)."""
    return PACK_STEP * _largest(lambda n: plan_memory(
        cfg, with_pack_tokens(model, n * PACK_STEP), layout, 1, recompute).peak <= budget, 4096)


def _largest(fits, cap: int) -> int:
    """The largest n in 1..cap with fits(n), fits growing false with n (0: not even 1)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def alternatives(cfg, model: Model, layout: Layout, budget: int) -> list[str]:
    """What would fit ``budget`` when the config's layout does not: full recompute, then tp,
    pp and more data-parallel ranks for the distributed optimizer, each on its own."""
    mb = cfg.train.micro_batch_size
    full = Recompute("full", "uniform", 1)
    tries = []
    if cfg.train.recompute != "full":
        tries.append(("train.recompute=full", layout, full))
    for tp in range(layout.tp + 1, 9):  # within a node: the heads must split evenly
        if all(s.heads % tp == 0 for s in model.stacks):
            tries.append((f"parallel.tp={tp}", replace(layout, tp=tp), None))
            break
    for pp in range(layout.pp + 1, 9):  # CLIP pairs run on one stage
        if model.num_layers % pp == 0 and len(model.stacks) == 1:
            tries.append((f"parallel.pp={pp}", replace(layout, pp=pp), None))
            break
    for dp in (2, 4, 8, 16, 32, 64):
        if dp > layout.dp and not layout.fsdp:
            tries.append((f"{dp} data-parallel ranks (the distributed optimizer shards its "
                          "state over them)", replace(layout, dp=dp, distributed_optimizer=True),
                          None))
    if layout.pp == 1:  # FSDP: weights and gradients over dp too
        for dp in (2, 4, 8, 16, 32, 64):
            if dp >= layout.dp and (dp > layout.dp or not layout.fsdp):
                tries.append((f"parallel.fsdp=true on {dp} data-parallel ranks",
                              replace(layout, dp=dp, fsdp=True, distributed_optimizer=False),
                              None))
    found, done = [], set()
    for what, lay, rc in tries:
        more_dp = lay.dp != layout.dp or lay.fsdp != layout.fsdp
        if more_dp and lay.fsdp in done:
            continue  # the smallest dp that fits is enough, with FSDP and without
        plan = plan_memory(cfg, model, lay, mb, rc)
        if plan.peak <= budget:
            found.append(f"{what}: {plan.peak_gib:.1f} GiB at micro-batch {mb}")
            if more_dp:
                done.add(lay.fsdp)
    return found


def report(path, overrides, gpus: int | None, gpu_mem_gib: float,
           micro_batch: int | None = None, as_json: bool = False,
           gpu_mem_source: str = "") -> tuple[str, bool]:
    """The text (or JSON) of ``vitgraph plan`` and whether the run fits ``gpu_mem_gib`` per
    GPU (``gpu_mem_source``: where that number came from, said beside it); ``gpus`` None:
    parallel.tp x parallel.pp (dp 1)."""
    cfg = load_config(path, overrides, data=False)
    gpus = gpus or cfg.parallel.tp * cfg.parallel.pp
    check_layout(cfg, gpus, str(path), "--gpus")  # tp x pp itself always divides
    model = model_of(path, overrides)
    layout = layout_of(cfg, gpus)
    budget = int((gpu_mem_gib - CUDA_CONTEXT_GIB) * GIB)
    plan = plan_memory(cfg, model, layout, micro_batch)
    total = sum(q.numel for q in model.params)
    lines = [f"{cfg.model.name}: {total / 1e6:,.1f}M parameters; {layout.name()} "
             f"({plural(layout.gpus, 'GPU')}), micro-batch {plan.micro_batch} x "
             f"{plural(plan.microbatches, 'microbatch')} a step, {plan.precision}, recompute "
             f"{plan.recompute}, graphs {plan.graphs}"
             + (f", optimizer {cfg.optim.offload_fraction:.0%} offloaded"
                if cfg.optim.offload_fraction else ""),
             f"{'GiB per GPU':<24}" + "".join(f"{'stage ' + str(s.stage):>10}" for s in plan.stages)]
    lines.append(f"{'parameters (M)':<24}" + "".join(f"{s.params / 1e6:>10.1f}" for s in plan.stages))
    rows = [("weights", lambda s: s.weights), ("gradients", lambda s: s.grads),
            ("optimizer", lambda s: s.optimizer), ("ema", lambda s: s.ema),
            ("activations", lambda s: s.activations), ("backward working", lambda s: s.working),
            ("runtime + slack", lambda s: s.total - s.weights - s.grads - s.optimizer - s.ema
             - s.activations - s.working), ("total", lambda s: s.total)]
    for name, get in rows:
        lines.append(f"{name:<24}" + "".join(f"{get(s) / GIB:>10.1f}" for s in plan.stages))
    lines.append(f"{'microbatches in flight':<24}" + "".join(f"{s.in_flight:>10}" for s in plan.stages))
    fits = plan.peak <= budget
    lines.append(f"peak {plan.peak_gib:.1f} GiB of {gpu_mem_gib:g} GiB per GPU "
                 + (f"({gpu_mem_source}; " if gpu_mem_source else "(")
                 + f"{CUDA_CONTEXT_GIB} GiB kept for the CUDA context): "
                 + ("fits" if fits else "DOES NOT FIT"))
    # native resolution: a microbatch is one pack, so its size is the pack's tokens
    native = cfg.data.resolution == "native"
    largest, what = ((largest_pack, "data.packing.tokens_per_microbatch") if native
                     else (largest_micro_batch, "micro-batch"))
    best = largest(cfg, model, layout, budget)
    full = Recompute("full", "uniform", 1)
    best_full = largest(cfg, model, layout, budget, full) \
        if cfg.train.recompute != "full" else best
    lines.append(f"largest {what} that fits: {best or 'none'} (recompute "
                 f"{plan.recompute})" + (f", {best_full or 'none'} with train.recompute=full"
                                         if cfg.train.recompute != "full" else ""))
    alt = alternatives(cfg, model, layout, budget) if not fits else []
    if not fits:
        lines.append("would fit: " + ("; ".join(alt) if alt else
                     "none of recompute, tp, pp or more dp alone; combine them"))
    if as_json:
        return json.dumps({
            "model": cfg.model.name, "parameters": total, "layout": asdict(layout),
            "micro_batch": plan.micro_batch, "microbatches": plan.microbatches,
            "precision": plan.precision, "recompute": plan.recompute, "graphs": plan.graphs,
            "stages": [{**asdict(s), "total": s.total} for s in plan.stages],
            "peak_gib": plan.peak_gib, "gpu_mem_gib": gpu_mem_gib,
            **({"gpu_mem_source": gpu_mem_source} if gpu_mem_source else {}), "fits": fits,
            **({"largest_pack_tokens": best, "largest_pack_tokens_full_recompute": best_full}
               if native else {"largest_micro_batch": best,
                               "largest_micro_batch_full_recompute": best_full}),
            "would_fit": alt}, indent=1), fits
    return "\n".join(lines), fits

