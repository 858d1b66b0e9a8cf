"""Experiment configuration: YAML -> typed dataclasses, dotted overrides, strict validation.

Everything is checked here, before any process group or model exists, so a typo costs a
second instead of a queue slot. Each key declares on its field what its value may be and
whether a resumed run may change it (``key()``, vitgraph.config_keys); ``validate`` adds the
rules between keys, ``check_layout`` those that need the world size. Every error is a
``ConfigError`` whose message names the file (or the override), the key and the value; the
CLI turns it into exit code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from vitgraph.config_keys import (ConfigError, check_section, coerce_field, key, resume_ok,
                                  where)
from vitgraph.data.config import DataConfig
from vitgraph.data.native import pack_spec
from vitgraph.graphs.config import GraphsConfig
from vitgraph.models.registry import CLIP_MODELS, resolve_arch, resolve_clip_arch
from vitgraph.models.specs import te_available
from vitgraph.output import unwritable
from vitgraph.text import BPE_VOCAB_SIZE, hf_name, tokenizer_kind
from vitgraph.text.bpe import available
from vitgraph.text.hf import problem as hf_problem
from vitgraph.text.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE


@dataclass
class ModelConfig:
    # a registry name (vitgraph.models.registry), e.g. vit_pico_patch4_32, vit_b16_224
    name: str = "vit_pico_patch4_32"
    # layer spec: te (Transformer Engine modules), torch (plain PyTorch, runs on CPU),
    # auto (te when CUDA and TE are present, else torch)
    spec: str = key("auto", choices=("auto", "te", "torch"))
    # None: take the registry's value
    image_size: Optional[int] = key(None, above=0)
    patch_size: Optional[int] = key(None, above=0)
    hidden_size: Optional[int] = key(None, above=0)
    num_layers: Optional[int] = key(None, above=0)
    num_heads: Optional[int] = key(None, above=0)
    ffn_hidden_size: Optional[int] = key(None, above=0)
    # a classifier's head; None: the dataset's class count. Fewer than the data's classes
    # leave labels without an output (checked against the data: _validate_classes)
    num_classes: Optional[int] = key(None, above=0)
    num_registers: int = key(0, min=0)
    class_token: bool = True
    # DeiT's distillation token: a second prefix token after the class token with a head of
    # its own (head_dist). With train.distill.teacher the class head takes the task's loss and
    # the distillation head the teacher's; otherwise, and in evaluation, the two heads'
    # logits are averaged (DeiT, timm's VisionTransformerDistilled)
    distill_token: bool = False
    # mean: over the patch tokens; map: attention pooling by a learned query (SigLIP's head)
    pool: str = key("cls", choices=("cls", "mean", "map"))
    # data.resolution=native: how the learned position grid is resampled to each image's
    # patch grid (F.grid_sample per token); auto: bilinear for SigLIP towers, else bicubic
    pos_interp: str = key("auto", choices=("auto", "bicubic", "bilinear"))
    hidden_dropout: float = key(0.0, min=0, below=1)
    attention_dropout: float = key(0.0, min=0, below=1)
    # stochastic depth (DeiT): each sample skips a layer's attention and MLP branches with a
    # probability rising linearly over the global layer index, from 0 at the first layer to
    # this at the last; survivors are scaled by 1 / (1 - p)
    drop_path_rate: float = key(0.0, min=0, below=1)
    # parameters left out of training: fnmatch patterns over the model's parameter names,
    # e.g. ["patch_embed.*", "cls_token", "pos_embed", "decoder.layers.0.*"] (a pair's:
    # "visual.*", "text.decoder.layers.1[01].*"). `vitgraph params CONFIG [key=value ...]`
    # lists every name with its shape, lr scale, weight decay and whether it is frozen.
    # Frozen parameters get no gradient, no gradient buffer and no optimizer state, and stay
    # in checkpoints. A pattern matching nothing, or freezing everything, is an error
    freeze: Optional[list] = key(
        None, check=lambda v, _: all(isinstance(x, str) and x for x in v),
        why="a list of parameter-name patterns (strings)")
    layernorm_epsilon: float = key(1e-6, above=0)
    # std of the normal init of the linears (megatron's init_method_std); output layers get
    # std / sqrt(2 * num_layers). 0.02 suits widths of hundreds; narrow models learn faster
    # with ~1/sqrt(width)
    init_std: float = key(0.02, above=0)
    # TE spec on GPU: weight-gradient GEMMs accumulate straight into megatron DDP's fp32
    # main_grad (no per-parameter accumulation hook work); ignored by the torch spec
    gradient_accumulation_fusion: bool = True
    # each residual add inside the LayerNorm that reads it, one Triton kernel each way on a
    # GPU (vitgraph.models.specs.ResidualNormLayer): always | never | auto (when a training
    # micro-batch holds at least vitgraph.models.build.FUSED_NORM_MIN_TOKENS tokens: faster
    # for large micro-batches, slower for small ones). Never with train.precision=fp8, whose
    # TE norms write FP8 for the GEMM after them
    fused_norm: str = key("auto", choices=("auto", "always", "never"))
    # start from these weights (.safetensors, .pth, .bin; timm, Hugging Face or vitgraph names,
    # see vitgraph/convert; hf_vision: a Hugging Face CLIP / SigLIP / SigLIP 2 vision model).
    # A head of another class count is re-initialised, position embeddings are resized to
    # model.image_size. HF ViT weights want layernorm_epsilon: 1e-12
    init_from: Optional[str] = None
    init_format: str = key("auto", choices=("auto", "timm", "timm_naflex", "hf", "open_clip",
                                            "hf_vision", "vitgraph"))


def _validate_model(m: ModelConfig, err):
    """model.*: the architecture it names, its keys against each other and init_from's file;
    returns the architecture (vitgraph.models.registry.ViTArch)."""
    try:
        arch = resolve_arch(m)
    except KeyError as e:
        err("model.name", m.name, e.args[0])
    if arch.image_size % arch.patch_size:
        err("model.image_size", arch.image_size,
            f"not divisible by model.patch_size={arch.patch_size}")
    if arch.hidden_size % arch.num_heads:
        err("model.hidden_size", arch.hidden_size, f"not divisible by model.num_heads={arch.num_heads}")
    if m.init_from and not Path(m.init_from).expanduser().is_file():
        err("model.init_from", m.init_from, "no such file")
    if m.distill_token and (not m.class_token or m.pool != "cls"):
        err("model.distill_token", True, "needs model.class_token=true and model.pool=cls (its "
            "head reads the token after the class token)")
    return arch


def _validate_data(d: DataConfig, err) -> None:
    """data.*: its keys against each other (the folders: ``_validate_data_path``)."""
    if d.path and d.kind == "shapes":  # the shapes are drawn, not read: data.path unused
        err("data.path", d.path, "unused: data.kind=shapes draws the embedded data; set "
            "data.kind=imagefolder or data.kind=webdataset to train on this folder")
    if d.cpu_decode_share and (d.kind not in ("webdataset", "imagefolder") or d.decode == "cpu"
                               or d.resolution == "native"
                               or (d.kind == "imagefolder" and d.preload)):
        err("data.cpu_decode_share", d.cpu_decode_share,
            "splits the device decoding of fixed-resolution shards or an ImageFolder read as "
            f"drawn (data.kind={d.kind}, data.decode={d.decode}, data.preload={d.preload}, "
            f"data.resolution={d.resolution})")
    if d.caption_dropout and d.kind != "shapes":
        err("data.caption_dropout", d.caption_dropout,
            f"only the shapes data has size and colour words to drop (data.kind={d.kind})")
    if d.caption_dropout and d.captions == "shape_first":
        err("data.caption_dropout", d.caption_dropout, "drops words of captions that begin "
            "\"a <size> <colour>\": set data.captions=full or short")
    if d.resolution == "native" and d.augment.enabled \
            and d.augment.auto == "3augment":  # a pack's ops are per patch: no blur
        err("data.augment.auto", "3augment", "not with data.resolution=native (gaussian blur "
            "needs an image's neighbouring patches): set data.augment.auto=none or randaugment")


def _validate_data_path(d: DataConfig, err) -> None:
    """data.path: the folder data.kind reads is there."""
    if d.kind == "imagefolder":
        if not d.path:
            err("data.path", d.path, "data.kind=imagefolder needs data.path (a folder with train/ and val/)")
        root = Path(d.path).expanduser()
        if not root.is_dir():
            err("data.path", d.path, "no such directory")
        for split in ("train", "val"):
            if not (root / split).is_dir():
                err("data.path", d.path, f"has no {split}/ folder")
    elif d.kind == "webdataset":
        if not d.path or not Path(d.path).expanduser().is_dir():
            err("data.path", d.path, "data.kind=webdataset needs data.path (a folder of "
                "train-*.tar and val-*.tar shards)")


@dataclass
class OptimConfig:
    lr: float = key(1e-3, above=0)
    # the cosine schedule's floor (megatron's scheduler asserts min_lr <= lr)
    min_lr: float = key(1e-5, min=0, check=lambda v, o: v <= o.lr, why="must be <= optim.lr")
    weight_decay: float = key(0.05, min=0)
    beta1: float = key(0.9, min=0, below=1)
    beta2: float = key(0.999, min=0, below=1)
    eps: float = key(1e-8, above=0)
    clip_grad: float = key(1.0, min=0)  # 0 disables clipping
    warmup_steps: Optional[int] = key(None, min=0)  # None: warmup_fraction of the run
    warmup_fraction: float = key(0.05, min=0, below=1)
    # layer-wise LR decay (BEiT): the head at lr, encoder layer i (1..L) at
    # lr x layer_decay^(L + 1 - i), the embeddings (patches, tokens, positions) at
    # lr x layer_decay^(L + 1); null: one lr for all
    layer_decay: Optional[float] = key(None, above=0, max=1)
    # GPU, distributed optimizer: the share of the optimizer's state (fp32 master weights and
    # Adam moments) kept, and stepped, on the CPU (megatron's optimizer_cpu_offload /
    # optimizer_offload_fraction); the step then leaves the GPU, so not under graphs.scope=step
    offload_fraction: float = key(0.0, min=0, max=1)


@dataclass
class EMAConfig:
    """train.ema: an exponential moving average of the weights, kept in fp32."""
    # null: no EMA; else each step ema = decay x ema + (1 - decay) x weights
    decay: Optional[float] = key(None, above=0, below=1)
    # the decay of step n is min(decay, (1 + n) / (10 + n)), so the early average is not
    # dominated by the random initialisation (false: decay from the first step)
    warmup: bool = True
    # evaluate the EMA weights (the raw weights' metrics are logged beside them)
    eval: bool = key(False, resume_ok=True)


@dataclass
class DistillConfig:
    """train.distill: knowledge distillation from a teacher that runs forward only."""
    # null: no distillation. A vitgraph run directory (its newest checkpoint and config), a
    # weights file (.safetensors / .pth / .bin in any naming vitgraph.convert reads; the
    # architecture is train.distill.model), or "timm:<name>" (a timm model, random init:
    # for tests)
    teacher: Optional[str] = None
    # a weights-file teacher's architecture: a registry name (`vitgraph models`)
    model: Optional[str] = None
    # soft: KL between the temperature-softened distributions (x T^2, as Hinton et al.);
    # hard: cross-entropy against the teacher's top class (DeiT's hard distillation)
    kind: str = key("soft", choices=("soft", "hard"))
    # loss = (1 - weight) x the task's loss + weight x the distillation loss
    weight: float = key(0.5, min=0, max=1)
    temperature: float = key(1.0, above=0)


def _validate_distill(dt: DistillConfig, err) -> None:
    """train.distill.*: the teacher is there, and a weights file comes with its architecture.
    The class count and the weights are checked when the teacher is built."""
    if dt.teacher:
        teacher = Path(dt.teacher).expanduser()
        if dt.teacher.startswith("timm:"):
            if not dt.teacher[5:]:
                err("train.distill.teacher", dt.teacher, "'timm:<name>' needs a timm model name")
            elif importlib.util.find_spec("timm") is None:
                err("train.distill.teacher", dt.teacher, "needs the timm package (pip install "
                    "timm, or pip install -e .[test])")
        elif teacher.is_dir():
            if not (teacher / "config.yaml").is_file():
                err("train.distill.teacher", dt.teacher, "a directory without config.yaml "
                    "(not a vitgraph run)")
        elif not teacher.is_file():
            err("train.distill.teacher", dt.teacher, "no such run directory or weights file "
                "(or 'timm:<name>')")
        elif not dt.model:
            err("train.distill.model", dt.model, f"a weights-file teacher ({dt.teacher}) needs "
                "its architecture: a registry name (`vitgraph models`)")
    if dt.model and (not dt.teacher or dt.teacher.startswith("timm:")
                     or Path(dt.teacher).expanduser().is_dir()):
        err("train.distill.model", dt.model, "names the architecture of a weights-file "
            "teacher only (train.distill.teacher)")


# megatron-core's selective-recompute modules that a ViT layer has (the rest are MoE / MLA;
# its layernorm is fused into the linears in the TE spec and in model.fused_norm's layer)
RECOMPUTE_MODULES = ("core_attn", "mlp")


@dataclass
class TrainConfig:
    global_batch_size: int = key(32, above=0)
    # may change on resume: the same global batch in other microbatches trains the same
    micro_batch_size: int = key(32, above=0, resume_ok=True)
    # the run's length: exactly one of steps / epochs
    steps: Optional[int] = key(None, above=0, resume_ok=True)
    epochs: Optional[float] = key(None, above=0, resume_ok=True)
    label_smoothing: float = key(0.0, min=0, below=1)
    seed: int = key(1234, min=0)  # numpy's generators take no negative seed
    # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | fp8 (TE spec on a GPU: FP8 GEMMs inside
    # the encoder layers, bf16 elsewhere, fp32 master weights in the optimizer as for bf16)
    precision: str = key("auto", choices=("auto", "bf16", "fp32", "fp8"))
    # TE scaling recipe for precision=fp8: current (per-tensor current scaling), delayed
    # (amax history), mxfp8 (Blackwell only: a config error on Hopper)
    fp8_recipe: str = key("current", choices=("current", "delayed", "mxfp8"))
    log_every: int = key(50, above=0, resume_ok=True)
    eval_every: int = key(500, min=0, resume_ok=True)  # 0: only at the end
    eval_batch_size: int = key(256, above=0, resume_ok=True)
    progress: bool = key(True, resume_ok=True)  # progress bar on rank 0
    tensorboard: bool = key(True, resume_ok=True)
    # bf16 dense matmul rate (measured on the H200) for MFU
    peak_flops: float = key(790e12, above=0, resume_ok=True)
    # a step with a non-finite loss or gradient norm is skipped (weights and optimizer state
    # untouched); this many in a row stop the run with an error
    max_bad_steps: int = key(10, min=1, resume_ok=True)
    # activation recompute, through megatron-core's TransformerConfig (recompute_granularity):
    # none | selective (recompute_modules of each layer: megatron's names) | full (whole
    # layers: their inputs are kept, the rest is recomputed in the backward pass)
    recompute: str = key("none", choices=("none", "selective", "full"), resume_ok=True)
    # full: which layers, as megatron's recompute_method: uniform (the stage's layers in
    # units of recompute_layers, each unit's input kept) | block (the first recompute_layers
    # of each pipeline stage recomputed, the rest not)
    recompute_method: str = key("uniform", choices=("uniform", "block"), resume_ok=True)
    # full: layers per unit (uniform) or recomputed per stage (block); null: 1 (uniform),
    # every layer of the stage (block)
    recompute_layers: Optional[int] = key(None, above=0, resume_ok=True)
    # selective: megatron's recompute_modules. TE's fused attention keeps no score matrix, so
    # core_attn saves only its output; mlp (fc1 and GELU outputs: 2 x ffn per token) saves most
    # (null: megatron's default, core_attn)
    recompute_modules: Optional[list] = key(
        None, resume_ok=True, check=lambda v, _: all(m in RECOMPUTE_MODULES for m in v),
        why=f"a list of megatron recompute modules for a ViT layer: {', '.join(RECOMPUTE_MODULES)}")
    ema: EMAConfig = field(default_factory=EMAConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


def _validate_train(t: TrainConfig, err) -> None:
    """train.*: the run's length, the batch split, recompute's keys, the EMA and distillation."""
    if (t.steps is None) == (t.epochs is None):
        err("train.steps", t.steps, f"give exactly one of train.steps and train.epochs (epochs={t.epochs})")
    if t.global_batch_size % t.micro_batch_size:
        err("train.global_batch_size", t.global_batch_size,
            f"not divisible by train.micro_batch_size={t.micro_batch_size}")
    if t.recompute_layers is not None and t.recompute != "full":
        err("train.recompute_layers", t.recompute_layers,
            f"counts layers of train.recompute=full (got {t.recompute!r})")
    if t.recompute_modules is not None and t.recompute != "selective":
        err("train.recompute_modules", t.recompute_modules,
            f"names what train.recompute=selective recomputes (got {t.recompute!r})")
    if t.ema.eval and t.ema.decay is None:
        err("train.ema.eval", True, "evaluates the EMA of the weights: set train.ema.decay "
            "(e.g. 0.9998) too")
    _validate_distill(t.distill, err)


@dataclass
class ParallelConfig:
    """Layout: world = dp x tp x pp; data parallel is what is left of the world size.

    Every key but distributed_optimizer may change when a run resumes: checkpoints hold
    sharded tensors under global names, which load at any layout."""
    tp: int = key(1, min=1, resume_ok=True)  # tensor parallel
    pp: int = key(1, min=1, resume_ok=True)  # pipeline stages
    # virtual stages per pipeline rank (interleaved 1F1B); 1 = plain 1F1B. Needs pp > 1, layers
    # divisible by pp x vpp, and microbatches per step a multiple of pp
    vpp: int = key(1, min=1, resume_ok=True)
    # sequence parallel: norms, dropout and the residual stream split along the tokens across
    # the tp ranks (needs tp > 1); tokens are padded to a multiple of tp and masked
    sequence_parallel: bool = key(False, resume_ok=True)
    # GPU: shard the optimizer state (and fp32 master weights) over data-parallel ranks
    # (megatron's distributed optimizer). It also pads every parameter's gradient to a
    # 256-byte boundary, which TE's fused weight-gradient GEMMs need to run at full speed.
    # The CPU path (gloo, fp32 torch AdamW) has no distributed optimizer and ignores this.
    # Fixed for a run: megatron names the fp32 master weights differently with and without it
    # (param / fp32_param), so its checkpoints do not load across that switch (seen on the H200)
    distributed_optimizer: bool = True
    # fully sharded data parallel: parameters, gradients and optimizer state split over the
    # data-parallel ranks (megatron-core's TorchFullyShardedDataParallel, PyTorch FSDP2), each
    # layer's weights gathered just before it runs; for towers whose weights and optimizer do
    # not fit per GPU. Eager (no graphs: the gathers allocate as they go), pp=1, no EMA, no
    # frozen parameters and no offload; needs distributed_optimizer=false (FSDP shards the
    # optimizer state itself).
    # Checkpoints are the same as without it: a run may resume with it switched either way
    # (both sides with distributed_optimizer=false)
    fsdp: bool = key(False, resume_ok=True)
    # GPU: reduce gradient buckets during the backward pass
    overlap_grad_reduce: bool = key(True, resume_ok=True)
    # GPU: gradients kept, accumulated over microbatches and reduced across ranks in fp32
    # (megatron's accumulate_allreduce_grads_in_fp32). false: in bf16, as Megatron-LM's default
    grad_reduce_in_fp32: bool = key(True, resume_ok=True)
    # GPU, distributed optimizer: gather params in forward
    overlap_param_gather: bool = key(False, resume_ok=True)
    # interleaved pipelining (vpp > 1): post stage-to-stage sends and receives one by one and
    # overlap them with compute (megatron's overlap_p2p_comm). Off: batched exchanges (two
    # stages: one at a time, vitgraph.plan.p2p_mode says why)
    overlap_p2p_comm: bool = key(False, resume_ok=True)
    # a collective that has not finished after this long ends the run with an error naming
    # the rank and the operation (NCCL watchdog / gloo timeout)
    timeout_minutes: float = key(10.0, above=0, resume_ok=True)
    # NCCL user-buffer registration inside CUDA graphs (NCCL_GRAPH_REGISTER); off by default
    # because it has hung tensor-parallel runs with graphs (Megatron-Bridge reports)
    nccl_graph_register: bool = key(False, resume_ok=True)


def _validate_parallel(p: ParallelConfig, err) -> None:
    """parallel.*: its keys against each other (against the model: ``_validate_layout``)."""
    if p.vpp > 1 and p.pp == 1:
        err("parallel.vpp", p.vpp, "virtual pipeline stages need parallel.pp > 1")
    if p.overlap_p2p_comm and p.vpp == 1:
        err("parallel.overlap_p2p_comm", True, "megatron overlaps p2p only in the interleaved "
                                              "schedule: needs parallel.vpp > 1")
    if p.sequence_parallel and p.tp == 1:
        err("parallel.sequence_parallel", True, "needs parallel.tp > 1")


@dataclass
class TaskConfig:
    # classification: a ViT with a class head on labelled images. contrastive: an image-text
    # pair (CLIP / SigLIP; model.name from the image-text registry, `vitgraph models`) on
    # captioned images, with zero-shot and retrieval eval. caption: the ViT inside a VLM (a
    # projector and a GPT language model, the lm: section) trained by next-token loss on the
    # captions (docs/vlm.md). auto: contrastive for those names
    kind: str = key("auto", choices=("auto", "classification", "contrastive", "caption"))
    # contrastive: clip (InfoNCE, learnable scale) | siglip (sigmoid, learnable scale and bias)
    # | auto (siglip when the model has a logit bias)
    loss: str = key("auto", choices=("auto", "clip", "siglip"))
    # contrastive: text positions used (null: the tower's registered context length); longer
    # captions are cut, keeping the end of text
    context_length: Optional[int] = None
    # contrastive: byte (vitgraph's byte-level ids, any tower) | bpe (OpenAI CLIP's BPE from
    # open_clip's packaged vocabulary; towers with its 49,408 ids, as pretrained CLIP weights
    # need) | auto (bpe for such towers, else byte). Nothing is downloaded either way
    tokenizer: str = key("auto", choices=("auto", "byte", "bpe"))
    # contrastive: zero-shot prompts, "{}" the class name; each class's text embedding is the
    # mean over them (null: OpenAI CLIP's style, vitgraph.tasks.contrastive_metrics.TEMPLATES)
    # contrastive: LiT, the image tower frozen (its parameters get no gradient and no
    # optimizer state); the text tower trains against it. Usually with model.init_from
    lock_image: bool = False
    templates: Optional[list] = key(
        None, check=lambda v, _: bool(v) and all(isinstance(x, str) and "{}" in x for x in v),
        why='a non-empty list of prompts, each with "{}" for the class name')


@dataclass
class LMConfig:
    """task.kind=caption: the language model (megatron-core's GPTModel: causal, learned
    positions) and the projector between it and the vision tower (model:)."""
    num_layers: int = key(2, above=0)
    hidden_size: int = key(64, above=0)
    num_heads: int = key(4, above=0)
    ffn_hidden_size: Optional[int] = key(None, above=0)  # null: 4 x hidden_size
    init_std: float = key(0.02, above=0)
    # text positions: BOS, the caption, EOS, padding; longer captions are cut, keeping EOS
    text_length: int = key(16, min=3)
    # bpe (OpenAI CLIP's BPE, 49,408 ids) | byte (vitgraph's byte-level ids, 259) |
    # hf:<name or folder> (a transformers tokenizer, read offline: a hub name must be in the
    # local Hugging Face cache; BOS / EOS / pad as vitgraph.text.hf says); the vocabulary
    # is the tokenizer's
    tokenizer: str = key("bpe", check=lambda v, _: v in ("bpe", "byte") or (
        v.startswith("hf:") and len(v) > 3), why="must be bpe, byte or hf:<name or folder>")
    # megatron-core's MultimodalProjector: mlp (two linears, GELU) | affine (one linear)
    projector: str = key("mlp", choices=("mlp", "affine"))
    freeze_tower: bool = False  # the vision tower gets no gradient and no optimizer state
    # the vision tower's lr: optim.lr (and optim.min_lr) x this, through the optimizer's param
    # groups; the projector and the language model at optim.lr. 0 is not a freeze: the tower
    # still gets gradients and optimizer state, its weights stay (lm.freeze_tower freezes it)
    tower_lr_scale: float = key(1.0, min=0)
    freeze_lm: bool = False  # the language model likewise (the projector always trains)


def task_kind(cfg: "Config") -> str:
    """task.kind with auto resolved from model.name."""
    if cfg.task.kind != "auto":
        return cfg.task.kind
    return "contrastive" if cfg.model.name in CLIP_MODELS else "classification"


@dataclass
class CheckpointConfig:
    every: int = key(0, min=0, resume_ok=True)  # steps between saves; 0: only at the end
    keep: int = key(2, min=1, resume_ok=True)  # newest checkpoints kept
    # resume from the run directory's latest checkpoint
    resume: bool = key(True, resume_ok=True)
    # false: no checkpoint is written, at the end or on a stop signal (smoke runs and
    # benchmarks of towers whose state is tens of GB: ViT-6B's is 77 GB)
    save: bool = key(True, resume_ok=True)


@dataclass
class RunConfig:
    name: str = key("vitgraph", resume_ok=True)
    dir: Optional[str] = key(None, resume_ok=True)  # default runs/<name>


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    lm: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # where load_config read the values: (the file, dotted key -> the override that set it),
    # for the checks made after loading (validate_machine); an attribute, not a key
    origin = ("<config>", {})

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or os.path.join("runs", self.run.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def may_change_on_resume(dotted: str) -> bool:
    """Whether a resumed run may change the key ``dotted`` (declared with resume_ok=True)."""
    return resume_ok(Config, dotted)


# ---------------------------------------------------------------- loading and overrides

def load_config(path: str | os.PathLike | None, overrides: list[str] = (),
                data: bool = True) -> Config:
    """Read YAML (merged over its ``base:`` files), apply ``key.sub=value`` overrides,
    validate what needs no process group. ``data=False``: data.path need not exist, nor CLIP's
    BPE be installed (for what reads no data: ``vitgraph plan``).

    A file may say ``base: other.yaml`` (a path relative to the file; the base may have a
    base of its own): its sections are merged over the base's key by key, mappings merged,
    other values (scalars, lists) replaced."""
    src = str(path) if path else "<defaults>"
    raw: dict = {}
    given: dict[str, str] = {}  # dotted key -> the override that set it
    if path is not None:
        raw, bases = _read(Path(path), [])
        if bases:
            src += f" (base {' -> '.join(bases)})"
    for item in overrides:
        dotted, sep, value = item.partition("=")
        if not sep or not dotted:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
        dotted = dotted.strip()
        value = yaml.safe_load(value) if value != "" else None
        _check_override(item, dotted, value)
        _set_dotted(raw, dotted, value, f"override {item!r}")
        given[dotted] = item
    _command_line_wins(raw, given)
    cfg = _build(Config, raw, src, "", given)
    validate(cfg, src, data, given)
    cfg.origin = (src, given)
    return cfg


def _command_line_wins(raw: dict, given: dict[str, str]) -> None:
    """What an override replaces in the file beyond its own key: a duration the file's other
    duration (two on one command line are an error), data.kind=shapes the file's data.path
    (the shapes read none)."""
    durations = [k for k in ("train.steps", "train.epochs") if k in given]
    if len(durations) == 2 and None not in (raw["train"]["steps"], raw["train"]["epochs"]):
        raise ConfigError(f"override {given['train.steps']!r} and override "
                          f"{given['train.epochs']!r}: give exactly one of train.steps and "
                          "train.epochs")
    if len(durations) == 1:
        _replace_duration(raw, {durations[0].split(".")[1]})
    if "data.kind" in given and "data.path" not in given and raw["data"]["kind"] == "shapes":
        raw["data"].pop("path", None)


def _read_yaml(path: Path) -> dict:
    """The mapping a YAML config file holds."""
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: line {e.line}: key {e.key!r} given twice (first on line "
                          f"{e.first}); YAML would keep the last") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if raw is None:
        raise ConfigError(f"{path}: the file is empty (a config sets at least train.steps or "
                          "train.epochs)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return raw


def read_run_folder(folder: str | os.PathLike) -> dict:
    """The config a run folder keeps (its config.yaml, as the run resolved it), with ``run.dir``
    that folder: a run folder named on the command line is the run, wherever it was trained
    (a copied or moved run's config.yaml still names the folder it was trained in)."""
    path = Path(folder) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{folder}: not a run folder (no config.yaml in it)")
    raw = _read_yaml(path)
    raw["run"] = {**(raw.get("run") or {}), "dir": str(folder)}
    return raw


def _read(path: Path, chain: list[Path], base: Optional[str] = None) -> tuple[dict, list[str]]:
    """The mapping in ``path`` merged over its bases, and the bases' paths (nearest first).
    ``chain``: the files whose bases led here; ``base``: how the last of them names it."""
    if not chain and path.is_dir() and (path / "config.yaml").is_file():
        return read_run_folder(path), []
    name = str(path)
    if not path.is_file():
        what = "is a directory, not a config file (nor a run directory with config.yaml)" \
            if path.is_dir() else "config file not found"
        if chain:
            raise ConfigError(f"{chain[-1]}: base {base!r}: {name} {what}")
        raise ConfigError(f"{name}: {what}")
    if any(path.resolve() == c.resolve() for c in chain):
        files = " -> ".join(str(c) for c in [*chain, path])
        raise ConfigError(f"{chain[0]}: the base files make a cycle: {files}")
    raw = _read_yaml(path)
    parent = raw.pop("base", None)
    unknown = _unknown_key(Config, raw)
    if unknown:
        raise ConfigError(f"{name}: {unknown}")
    if parent is None:
        return raw, []
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{name}: base={parent!r}: must be the path of another config file "
                          "(relative to this one)")
    # normpath: "configs/../x.yaml" named as "x.yaml" in messages
    below_path = Path(os.path.normpath(path.parent / Path(parent).expanduser()))
    below, bases = _read(below_path, [*chain, path], parent)
    merged = _merge(below, raw)
    if isinstance(raw.get("train"), dict):  # a duration here replaces the base's other one
        _replace_duration(merged, set(raw["train"]) & {"steps", "epochs"})
    return merged, [str(below_path), *bases]


class _DuplicateKey(yaml.YAMLError):
    """A mapping key written twice (``_UniqueKeyLoader``)."""

    def __init__(self, key: str, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader refusing a key written twice in one mapping (yaml keeps the last,
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise _DuplicateKey(key_node.value, line, seen[key_node.value])
                seen[key_node.value] = line
        return super().construct_mapping(node, deep)


def _merge(base: dict, over: dict) -> dict:
    """``over`` over ``base``: mappings merged key by key (an empty section changes nothing),
    other values replaced."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(out.get(k), dict) and (isinstance(v, dict) or v is None):
            out[k] = _merge(out[k], v or {})
        else:
            out[k] = v
    return out


def _replace_duration(raw: dict, given: set[str]) -> None:
    """The run's length is one of train.steps / train.epochs: giving one drops the other."""
    train = raw.get("train")
    if isinstance(train, dict) and len(given) == 1:
        train.pop({"steps": "epochs", "epochs": "steps"}[given.pop()], None)


def _unknown_key(cls, tree: dict, prefix: str = "") -> Optional[str]:
    """'unknown key ...' for the first key of ``tree`` that the dataclass ``cls`` lacks."""
    hints = typing.get_type_hints(cls)
    for k, v in tree.items():
        if k not in hints:
            return f"unknown key {prefix + str(k)!r}{_suggest(prefix, str(k), list(hints))}"
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
            found = _unknown_key(hints[k], v, f"{prefix}{k}.")
            if found:
                return found
    return None


def _check_override(item: str, dotted: str, value: Any) -> None:
    """An override naming no key, or giving a key a value of another type, is an error of the
    override (not of the file)."""
    tree = node = {}
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    unknown = _unknown_key(Config, tree)
    if unknown:
        raise ConfigError(f"override {item!r}: {unknown}")
    cls = Config
    for part in parts[:-1]:
        cls = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(cls):
            return  # a key under a value: _set_dotted says so
    hint = typing.get_type_hints(cls)[parts[-1]]
    if not dataclasses.is_dataclass(hint):
        f = next(f for f in dataclasses.fields(cls) if f.name == parts[-1])
        coerce_field(f, hint, value, f"override {item!r}: {dotted}")


def _set_dotted(raw: dict, dotted: str, value: Any, src: str) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if nxt is None:  # an empty section in the file
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{src}: {dotted}: {part} is not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls, raw: Any, src: str, prefix: str, overrides: dict | None = None):
    """``raw`` as the dataclass ``cls``; ``overrides``: dotted key -> the override that set it
    (an error about such a key names the command line, not ``src``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: {prefix.rstrip('.') or '<top>'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        full = prefix + str(name)
        if name not in fields:
            raise ConfigError(f"{src}: unknown key {full!r}"
                              f"{_suggest(prefix, str(name), list(fields))}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, src, full + ".",
                                  overrides)
        else:
            kwargs[name] = coerce_field(fields[name], hint, value, where(src, full, overrides))
    try:
        return cls(**kwargs)
    except ConfigError as e:  # sections that check themselves when made (GraphsConfig)
        name = str(e).split("=", 1)[0]  # "graphs.pool='shard': must be one of ..."
        raise ConfigError(f"{where(src, name, overrides)}{str(e)[len(name):]}") from None


def _suggest(prefix: str, name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {prefix + close[0]!r}?)"
    return f" (valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(valid)})"




# ---------------------------------------------------------------- validation

def _validate_contrastive(cfg: Config, err) -> None:
    if cfg.model.name not in CLIP_MODELS:
        err("model.name", cfg.model.name, f"task.kind=contrastive needs an image-text pair; "
                                          f"known: {', '.join(sorted(CLIP_MODELS))}")
    arch = resolve_clip_arch(cfg.model)
    p, a = cfg.parallel, cfg.data.augment
    if p.pp > 1:
        err("parallel.pp", p.pp, "image-text pairs run on one pipeline stage (pipeline "
                                 "parallelism for the pair of towers is not supported): use tp / dp")
    if p.sequence_parallel:
        err("parallel.sequence_parallel", True, "the text tower has no sequence parallelism yet")
    if tokenizer_kind(cfg.task.tokenizer, arch.text.vocab_size) == "bpe":
        if arch.text.vocab_size != BPE_VOCAB_SIZE:
            err("task.tokenizer", "bpe", f"CLIP's BPE has {BPE_VOCAB_SIZE} ids; the text tower of "
                                         f"{cfg.model.name} has {arch.text.vocab_size}: use byte")
    elif arch.text.vocab_size < BYTE_VOCAB_SIZE:
        err("task.tokenizer", cfg.task.tokenizer, f"byte ids need a text tower of >= "
            f"{BYTE_VOCAB_SIZE} ids; {cfg.model.name} has {arch.text.vocab_size}")
    n = cfg.task.context_length
    if n is not None and not 3 <= n <= arch.text.context_length:
        err("task.context_length", n, f"must be between 3 and the text tower's "
                                      f"{arch.text.context_length} positions ({cfg.model.name})")
    if a.enabled and (a.mixup_alpha > 0 or a.cutmix_alpha > 0) and a.mix_prob > 0:
        err("data.augment.mixup_alpha", a.mixup_alpha, "mixup / cutmix mix class labels; an "
            "image-text pair has none to mix: set data.augment.mixup_alpha=0 cutmix_alpha=0")
    if cfg.train.label_smoothing:
        err("train.label_smoothing", cfg.train.label_smoothing, "classification only")
    for dim in ("num_heads", "ffn_hidden_size"):
        if getattr(arch.text, dim) % p.tp:
            err("parallel.tp", p.tp, f"the text tower's {dim}={getattr(arch.text, dim)} is not "
                                     "divisible by it")


def _validate_native(cfg: Config, arch, err) -> None:
    """data.resolution=native: the packing keys against each other, the model and the layout."""
    k, t, p = cfg.data.packing, cfg.train, cfg.parallel
    if task_kind(cfg) == "contrastive" and cfg.model.name in CLIP_MODELS:
        prefix = int(resolve_clip_arch(cfg.model).class_token)  # a pair's own image tower
    else:
        prefix = int(cfg.model.class_token) + cfg.model.num_registers
    if k.min_patches > k.max_patches:
        err("data.packing.min_patches", k.min_patches,
            f"above data.packing.max_patches={k.max_patches}")
    if k.tokens_per_microbatch < prefix + k.max_patches:
        err("data.packing.tokens_per_microbatch", k.tokens_per_microbatch,
            f"cannot hold one image of data.packing.max_patches={k.max_patches} patches and "
            f"{prefix} class / register tokens")
    if t.micro_batch_size != 1:
        err("train.micro_batch_size", t.micro_batch_size,
            "with data.resolution=native a microbatch is one pack: set it to 1 (the pack's size "
            "is data.packing.tokens_per_microbatch; train.global_batch_size counts packs)")
    if t.precision == "fp8" and k.tokens_per_microbatch % 16:
        err("data.packing.tokens_per_microbatch", k.tokens_per_microbatch,
            "FP8 GEMMs need a multiple of 16 tokens")
    if p.sequence_parallel and k.tokens_per_microbatch % p.tp:
        err("data.packing.tokens_per_microbatch", k.tokens_per_microbatch,
            f"sequence parallel splits a pack's tokens over parallel.tp={p.tp} ranks: "
            "not divisible by it")
    if cfg.data.augment.mixes:
        err("data.augment.mixup_alpha", cfg.data.augment.mixup_alpha,
            "mixup / cutmix blend images of one size; at native resolution each image has its "
            "own: set data.augment.mixup_alpha=0 cutmix_alpha=0")
    if k.layout == "padded" and k.tokens_per_microbatch >= prefix + k.max_patches:
        try:
            pack_spec(k, arch.patch_size, prefix, padded=True, **padded_constraints(cfg))
        except ValueError as e:
            err("data.packing.layout", k.layout, str(e))


def padded_constraints(cfg: Config) -> dict:
    """What of the config limits padded slots (vitgraph.data.native.pack_spec): the multiple
    FP8 GEMMs need their tokens to be, the ranks sequence parallel splits a slot over."""
    p = cfg.parallel
    return dict(multiple=16 if cfg.train.precision == "fp8" else 1,
                split=p.tp if p.sequence_parallel else 1)


def random_layer_keys(cfg: Config) -> dict:
    """The model keys that make the encoder layers draw random masks, with their values."""
    m = cfg.model
    return {k: v for k, v in (("model.drop_path_rate", m.drop_path_rate),
                              ("model.hidden_dropout", m.hidden_dropout),
                              ("model.attention_dropout", m.attention_dropout)) if v}


def graph_constraints(cfg: Config) -> dict:
    """What of the config limits the graph path (vitgraph.graphs.auto.choose_graphs)."""
    return dict(recompute=cfg.train.recompute, random_layers=bool(random_layer_keys(cfg)),
                host_optimizer=cfg.optim.offload_fraction > 0, fsdp=cfg.parallel.fsdp)


def _validate_fsdp(cfg: Config, graphs: bool, err) -> None:
    p = cfg.parallel
    if p.distributed_optimizer:
        err("parallel.fsdp", True, "shards the optimizer state itself: set "
            "parallel.distributed_optimizer=false with it")
    if graphs:
        # FSDP2 gathers each layer's weights into memory it allocates and frees as it goes:
        # a replayed graph would read freed addresses
        err("parallel.fsdp", True, "not under CUDA graphs (graphs.enabled=true): use "
            "graphs.enabled=auto or false, which run it eagerly")
    if p.pp > 1:
        err("parallel.fsdp", True, f"needs parallel.pp=1 (got {p.pp}): not built for pipeline "
            "stages yet")
    if cfg.train.ema.decay is not None:
        err("train.ema.decay", cfg.train.ema.decay, "not with parallel.fsdp (the EMA is "
            "kept per optimizer layout and has no FSDP layout yet)")
    if cfg.model.freeze or cfg.task.lock_image:
        # the frozen parameters' zero-filled optimizer slices have no FSDP layout yet (a
        # checkpoint save under both hung two CPU ranks)
        key_, val = (("model.freeze", cfg.model.freeze) if cfg.model.freeze
                     else ("task.lock_image", True))
        err(key_, val, "not with parallel.fsdp yet")


def _validate_recompute(cfg: Config, graphs: bool, err) -> None:
    t, m = cfg.train, cfg.model
    if t.recompute == "full" and m.fused_norm == "always":
        # megatron's block checkpoint hands tensors between its units; the fused layer passes
        # the unsummed residual stream on as a tuple (output, bias, drop-path factor)
        err("model.fused_norm", "always", "not with train.recompute=full (use auto or never)")
    if not graphs:
        return
    if t.recompute == "selective":
        # megatron checkpoints a module with a reentrant autograd function: a layer graph's
        # backward is captured with torch.autograd.grad, which it refuses, and inside a step
        # graph it has not been made to work
        err("train.recompute", "selective", "not under graphs (megatron's module checkpoint "
            "cannot be captured): use train.recompute=full, or graphs off")
    if t.recompute == "none":
        return
    rand = random_layer_keys(cfg)
    if rand:
        # under graphs the RNG streams are graph-safe generator states that megatron's
        # checkpoint cannot rewind: the recomputed masks would differ from the forward's
        name, value = next(iter(rand.items()))
        err("train.recompute", t.recompute, f"with {name}={value} under graphs: the recompute "
            "would draw other random masks than the forward did; use graphs off, or no "
            "recompute")


def _validate_layout(cfg: Config, arch, err) -> None:
    """The parallel layout against the model."""
    p = cfg.parallel
    if arch.num_heads % p.tp:
        err("parallel.tp", p.tp, f"model.num_heads={arch.num_heads} is not divisible by it")
    if arch.ffn_hidden_size % p.tp:
        err("parallel.tp", p.tp, f"model.ffn_hidden_size={arch.ffn_hidden_size} is not divisible by it")
    # (a caption model's tower sits whole on the first stage: _validate_caption)
    if arch.num_layers % (p.pp * p.vpp) and task_kind(cfg) != "caption":
        err("parallel.pp", p.pp, f"model.num_layers={arch.num_layers} is not divisible by "
                                 f"parallel.pp x parallel.vpp = {p.pp} x {p.vpp}")
    if cfg.graphs.pool == "shared" and p.pp > 1:
        err("graphs.pool", "shared", "needs parallel.pp=1: a pipeline schedule replays the layer "
                                     "graphs in another order than they were captured (use auto)")


def _validate_caption(cfg: Config, err) -> None:
    """task.kind=caption: what is built so far (docs/vlm.md)."""
    m, p, lm = cfg.model, cfg.parallel, cfg.lm
    if m.name in CLIP_MODELS:
        err("model.name", m.name, "task.kind=caption takes a vision tower from the ViT "
            "registry (`vitgraph models`), not an image-text pair")
    if p.vpp > 1:
        err("parallel.vpp", p.vpp, "task.kind=caption: the tower sits whole on the first "
            "pipeline stage; no interleaved stages (parallel.vpp=1)")
    if lm.num_layers % p.pp:
        err("parallel.pp", p.pp, f"lm.num_layers={lm.num_layers} is not divisible by it "
            "(the language model's layers are split evenly over the stages)")
    for key, size in (("lm.num_heads", lm.num_heads),
                      ("lm.ffn_hidden_size", lm.ffn_hidden_size or 4 * lm.hidden_size),
                      ("lm.hidden_size", lm.hidden_size)):
        if size % p.tp:
            err("parallel.tp", p.tp, f"{key}={size} is not divisible by it")
    if lm.projector == "affine" and p.tp > 1:
        err("lm.projector", "affine", "not at parallel.tp > 1: megatron-core 0.16.1's affine "
            "MultimodalProjector adds its tp-split bias to its gathered output (a shape "
            "error); use lm.projector=mlp")
    if cfg.data.resolution != "fixed" and (p.tp > 1 or p.pp > 1):
        err("data.resolution", cfg.data.resolution, "task.kind=caption under parallel.tp / "
            "pp takes fixed-size images (packed images and text run at tp=1, pp=1)")
    if lm.hidden_size % lm.num_heads:
        err("lm.num_heads", lm.num_heads, f"lm.hidden_size={lm.hidden_size} is not "
            "divisible by it")
    if hf_name(lm.tokenizer) and hf_problem(hf_name(lm.tokenizer)):
        err("lm.tokenizer", lm.tokenizer, hf_problem(hf_name(lm.tokenizer)))
    if lm.freeze_tower and lm.freeze_lm:
        err("lm.freeze_lm", True, "with lm.freeze_tower only the projector would train: "
            "freeze one of them at most")
    if lm.freeze_tower and lm.tower_lr_scale != 1.0:
        err("lm.tower_lr_scale", lm.tower_lr_scale, "lm.freeze_tower leaves the tower out of "
            "the optimizer: it has no lr to scale")
    if cfg.data.augment.mixes:
        err("data.augment.mixup_alpha", cfg.data.augment.mixup_alpha, "mixup / cutmix mix "
            "class labels; captions have none to mix: set data.augment.mixup_alpha=0 "
            "cutmix_alpha=0")
    if cfg.data.caption_dropout:
        err("data.caption_dropout", cfg.data.caption_dropout, "task.kind=contrastive only")


def _validate_task(cfg: Config, err) -> None:
    """What the task kind asks of the model, the data and the other keys."""
    kind = task_kind(cfg)
    if kind == "contrastive":
        _validate_contrastive(cfg, err)
    elif kind == "caption":
        _validate_caption(cfg, err)
    elif cfg.model.name in CLIP_MODELS:
        err("task.kind", cfg.task.kind, f"model.name={cfg.model.name!r} is an image-text pair: "
                                        "train it with task.kind=contrastive (or auto)")
    native = cfg.data.resolution == "native"
    if cfg.model.distill_token and (kind != "classification" or native):
        err("model.distill_token", True, "needs task.kind=classification"
            if kind != "classification" else
            "not with data.resolution=native (packs have one class token an image)")
    dt = cfg.train.distill
    if dt.teacher and kind != "classification":
        err("train.distill.teacher", dt.teacher, "distillation is for task.kind="
            "classification (this run is contrastive)")
    if dt.teacher and native:
        err("train.distill.teacher", dt.teacher, "not with data.resolution=native: the "
            "teacher takes fixed-size images, not packs")
    if kind == "classification" and cfg.data.kind == "shapes":  # its count is a key
        why = head_problem(cfg.model.num_classes, cfg.data.num_classes, "data.num_classes")
        if why:
            err("model.num_classes", cfg.model.num_classes, why)
    if cfg.task.lock_image and kind != "contrastive":
        err("task.lock_image", True, "freezes an image-text pair's image tower (LiT): "
            "task.kind=contrastive only; a classifier's parts are frozen by model.freeze")


def head_problem(num_classes: Optional[int], found: int, source: str) -> Optional[str]:
    """Why a classifier head of model.num_classes outputs cannot train on data of ``found``
    classes (``source``: where that count comes from), or None. A larger head is fine (a
    fine-tune may keep its weights' head); a smaller one has no output for some labels."""
    if num_classes is None or num_classes >= found:
        return None
    return (f"the training data has {found} classes ({source}), labels up to {found - 1}: "
            f"set model.num_classes=null (the data's count) or at least {found}")


def _validate_tokenizer_files(cfg: Config, err) -> None:
    """CLIP's BPE is installed where the captions are to be tokenized with it (``vitgraph
    plan`` needs only its vocabulary size, a constant)."""
    kind, missing = task_kind(cfg), available()
    if not missing:
        return
    if kind == "contrastive" and tokenizer_kind(
            cfg.task.tokenizer, resolve_clip_arch(cfg.model).text.vocab_size) == "bpe":
        err("task.tokenizer", cfg.task.tokenizer, f"{cfg.model.name}'s text tower takes CLIP's "
            f"BPE ids, which need {missing}; or set task.tokenizer=byte to train it on bytes")
    if kind == "caption" and cfg.lm.tokenizer == "bpe":
        err("lm.tokenizer", "bpe", f"CLIP's BPE needs {missing}; or use lm.tokenizer=byte")


def _validate_precision(cfg: Config, graphs: bool, err) -> None:
    """train.precision=fp8 against the layer spec and the graphs."""
    t, g = cfg.train, cfg.graphs
    if t.precision != "fp8":
        return
    if graphs and g.scope == "step" and t.fp8_recipe != "current":
        # current scaling computes each scale from its tensor, on the device, inside the step;
        # delayed scaling keeps an amax history that TE updates from the host between steps
        err("graphs.scope", "step", f"with train.precision=fp8 only with train.fp8_recipe=current "
                                    f"(got {t.fp8_recipe!r}); or use graphs.scope=layer with "
                                    "graphs.impl=te")
    if cfg.model.spec == "torch":
        err("train.precision", "fp8", "FP8 needs Transformer Engine layers (model.spec=te or auto on a GPU)")
    if graphs and g.impl != "te" and g.scope == "layer":
        err("graphs.impl", g.impl, "train.precision=fp8 with graphs needs graphs.impl=te "
                                   "(TE owns the FP8 scaling state around each replay)")


def _validate_offload(cfg: Config, graphs: bool, err) -> None:
    """optim.offload_fraction: megatron's CPU optimizer against the layout, graphs and EMA."""
    share = cfg.optim.offload_fraction
    if not share:
        return
    if not cfg.parallel.distributed_optimizer:
        err("optim.offload_fraction", share, "megatron offloads the distributed optimizer's "
            "state: needs parallel.distributed_optimizer=true")
    if graphs and cfg.graphs.scope == "step":
        err("optim.offload_fraction", share, "not under graphs.scope=step: the CPU part of the "
            "optimizer step cannot be captured (graphs.scope=layer, or graphs.enabled=auto, "
            "which picks it)")
    if cfg.train.ema.decay is not None:
        err("optim.offload_fraction", share, "not with train.ema: the EMA follows the fp32 "
            "master weights, which megatron's CPU optimizer keeps")


def _validate_between(cfg: Config, arch, err) -> None:
    """The rules between sections, by topic."""
    # graphs.enabled=auto picks a path these rules allow: they bind an explicit true
    graphs = cfg.graphs.enabled is True
    _validate_layout(cfg, arch, err)
    _validate_task(cfg, err)
    _validate_precision(cfg, graphs, err)
    _validate_recompute(cfg, graphs, err)
    _validate_offload(cfg, graphs, err)
    if cfg.parallel.fsdp:
        _validate_fsdp(cfg, graphs, err)
    if cfg.data.resolution == "native":
        _validate_native(cfg, arch, err)


def validate(cfg: Config, src: str = "<config>", data: bool = True,
             overrides: dict | None = None) -> None:
    """Every key against its declaration (vitgraph.config_keys), each section's rules (beside
    its dataclass), then the rules between sections; ``data=False`` leaves out data.path's
    folders and whether CLIP's BPE is installed (what only reading the data needs: ``vitgraph
    plan``). Nothing else here depends on the machine or the launch (``check_layout`` takes the
    world size). ``overrides``: dotted key -> the override that set it: an error about that
    key names the command line, not ``src``."""

    def err(name, value, why):
        raise ConfigError(f"{where(src, name, overrides)}={value!r}: {why}")

    check_section(cfg, "", src, overrides)
    _validate_data(cfg.data, err)
    arch = _validate_model(cfg.model, err)
    _validate_train(cfg.train, err)
    _validate_parallel(cfg.parallel, err)
    _validate_between(cfg, arch, err)
    if data:
        _validate_data_path(cfg.data, err)
        _validate_tokenizer_files(cfg, err)


def check_layout(cfg: Config, world_size: int, src: str = "<config>",
                 world_from: str = "WORLD_SIZE") -> None:
    """The rules that need the world size (world = dp x tp x pp): checked by the CLI before
    launching and by ``init_distributed`` before any process group is made. ``world_from``:
    where the world size came from, for the message (`vitgraph plan`: its --gpus)."""
    p, t = cfg.parallel, cfg.train
    if world_size % (p.tp * p.pp):
        raise ConfigError(f"{src}: parallel.tp x parallel.pp = {p.tp} x {p.pp}: world size "
                          f"{world_size} ({world_from}) is not divisible by it")
    dp = world_size // (p.tp * p.pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"{src}: train.global_batch_size={t.global_batch_size}: not divisible "
                          f"by train.micro_batch_size x data-parallel size = "
                          f"{t.micro_batch_size} x {dp} (world size {world_size})")
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if p.vpp > 1 and microbatches % p.pp:
        raise ConfigError(
            f"{src}: train.global_batch_size={t.global_batch_size}: interleaved pipelining "
            f"(parallel.vpp={p.vpp}) needs the microbatches per step ({microbatches} = global / "
            f"(micro x dp {dp})) to be a multiple of parallel.pp={p.pp}")


def validate_machine(cfg: Config) -> None:
    """Checks against this machine, made before a run starts (``validate`` leaves them out so
    that GPU configs still load anywhere): the layer spec and the run folder."""
    src, given = cfg.origin
    if cfg.model.spec == "te":
        if not (torch.cuda.is_available() and te_available()):
            raise ConfigError(f"{where(src, 'model.spec', given)}='te': needs CUDA and "
                              "Transformer Engine (pip install -e .[te]); use model.spec=torch "
                              "or auto without them")
    name, value = ("run.dir", cfg.run.dir) if cfg.run.dir else ("run.name", cfg.run.name)
    why = unwritable(cfg.run_dir)
    if why:
        raise ConfigError(f"{where(src, name, given)}={value!r}: the run folder {why}")


def run_model_config(run_dir) -> tuple[ModelConfig, dict]:
    """A run folder's ``model:`` section and its whole config (``read_run_folder``)."""
    raw = read_run_folder(run_dir)
    return _build(ModelConfig, raw.get("model") or {}, str(Path(run_dir) / "config.yaml"),
                  "model."), raw
