"""Experiment configuration: YAML -> typed dataclasses, dotted overrides, strict validation.

Everything is checked here, before any process group or model exists, so a typo costs a
second instead of a queue slot. Every error is a ``ConfigError`` whose message names the
file, the key and the value; the CLI turns it into exit code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from vitgraph.data.augment import AugmentConfig
from vitgraph.graphs.config import GraphsConfig


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key and value."""


@dataclass
class ModelConfig:
    # a registry name (vitgraph.models.registry), e.g. vit_pico_patch4_32, vit_b16_224
    name: str = "vit_pico_patch4_32"
    # layer spec: te (Transformer Engine modules), torch (plain PyTorch, runs on CPU),
    # auto (te when CUDA and TE are present, else torch)
    spec: str = "auto"
    # None: take the registry's value
    image_size: Optional[int] = None
    patch_size: Optional[int] = None
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_classes: Optional[int] = None  # None: the dataset's class count
    num_registers: int = 0
    class_token: bool = True
    pool: str = "cls"  # cls | mean (mean over patch tokens)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-6
    # std of the normal init of the linears (megatron's init_method_std); output layers get
    # std / sqrt(2 * num_layers). 0.02 suits widths of hundreds; narrow models learn faster
    # with ~1/sqrt(width)
    init_std: float = 0.02
    # TE spec on GPU: weight-gradient GEMMs accumulate straight into megatron DDP's fp32
    # main_grad (no per-parameter accumulation hook work); ignored by the torch spec
    gradient_accumulation_fusion: bool = True
    # each residual add inside the LayerNorm that reads it, one Triton kernel each way on a
    # GPU (vitgraph.models.specs.ResidualNormLayer): always | never | auto (when a training
    # micro-batch holds at least vitgraph.models.build.FUSED_NORM_MIN_TOKENS tokens: faster
    # for large micro-batches, slower for small ones). Never with train.precision=fp8, whose
    # TE norms write FP8 for the GEMM after them
    fused_norm: str = "auto"
    # start from these weights (.safetensors, .pth, .bin; timm, Hugging Face or vitgraph names,
    # see vitgraph/convert). A head of another class count is re-initialised, position
    # embeddings are resized to model.image_size. HF ViT weights want layernorm_epsilon: 1e-12
    init_from: Optional[str] = None
    init_format: str = "auto"  # auto | timm | hf | open_clip | vitgraph


@dataclass
class DataConfig:
    kind: str = "shapes"  # shapes (embedded, procedural) | imagefolder | webdataset
    # imagefolder: root holding train/ and val/; webdataset: folder of train-*.tar, val-*.tar
    path: Optional[str] = None
    num_train: int = 50000  # shapes only
    num_val: int = 2000  # shapes only
    render_size: int = 32  # size images are drawn / decoded at; resized to model.image_size
    num_classes: int = 10  # shapes only
    # shapes: the caption of each image. full: size, colours, shape, background, place and
    # rotation ("a large white star on a dark blue background, in the top left, rotated 30
    # degrees"); short: size, colour and shape ("a large white star")
    captions: str = "full"
    # shapes, training split only: each of a caption's size word and its shape's colour is left
    # out with this probability, drawn anew for every pair at every step (seeded by train.seed;
    # held-out captions stay whole): "a large white star" is also seen as "a white star",
    # "a large star" and "a star", so the text tower learns partial and shape-only captions
    caption_dropout: float = 0.0
    # the fraction of the run's steps after which caption dropout begins. From the first step
    # (0) the pair learned next to nothing on the shapes (10% zero-shot after 500 steps, loss
    # flat): the colour words are what it first aligns images and texts by
    caption_dropout_start: float = 0.0
    # shapes: the dataset's own seed; runs with other train.seed values share its cache entry
    # (null: derive the data from train.seed)
    seed: Optional[int] = 0
    # generated datasets are cached here (`vitgraph cache` shows it, `vitgraph cache --clear`
    # empties it), least recently used first out beyond cache_max_mb
    cache_dir: Optional[str] = "~/.cache/vitgraph"
    cache_max_mb: float = 1024.0
    workers: int = 2
    # imagefolder: decode every image up front (fast steps, memory ~ N x size^2 x 3 bytes);
    # false decodes each batch on demand in `workers` threads (large folders, e.g. ImageNet)
    preload: bool = True
    # training-time augmentation, batched on the device (vitgraph/data/augment.py); off for
    # held-out data always
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # webdataset: where JPEGs are decoded: cpu (PIL in `workers` threads), cuda (nvJPEG via
    # torchvision, batched on the GPU), auto (cuda when CUDA and torchvision are there)
    decode: str = "cpu"
    # decode=cuda: this share of each microbatch is decoded in the loader's threads instead
    # (simplejpeg or PIL, at full size), the rest by nvJPEG; the GPU resizes all of them. On
    # the H200 host neither share 0.6 nor 1.0 beat nvJPEG alone (benchmarks/BENCHMARKS.md,
    # eighth session): 0 by default
    cpu_decode_share: float = 0.0
    # webdataset: shards are shuffled, and samples within windows of this many shards
    shuffle_shards: int = 4
    # make the next step's microbatches while this one trains, in a thread: shard reads and
    # decoding, and on a GPU the copies to the device (pinned) and nvJPEG decode on a side
    # stream (vitgraph/data/prefetch.py). Changes no batch; off: made between steps
    prefetch: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    warmup_steps: Optional[int] = None  # None: warmup_fraction of the run
    warmup_fraction: float = 0.05


@dataclass
class TrainConfig:
    global_batch_size: int = 32
    micro_batch_size: int = 32
    # the run's length: exactly one of steps / epochs
    steps: Optional[int] = None
    epochs: Optional[float] = None
    label_smoothing: float = 0.0
    seed: int = 1234
    # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 | fp8 (TE spec on a GPU: FP8 GEMMs inside
    # the encoder layers, bf16 elsewhere, fp32 master weights in the optimizer as for bf16)
    precision: str = "auto"
    # TE scaling recipe for precision=fp8: current (per-tensor current scaling), delayed
    # (amax history), mxfp8 (Blackwell only: a config error on Hopper)
    fp8_recipe: str = "current"
    log_every: int = 50
    eval_every: int = 500  # 0: only at the end
    eval_batch_size: int = 256
    progress: bool = True  # progress bar on rank 0
    tensorboard: bool = True
    peak_flops: float = 790e12  # bf16 dense matmul rate (measured on the H200) for MFU
    # a step with a non-finite loss or gradient norm is skipped (weights and optimizer state
    # untouched); this many in a row stop the run with an error
    max_bad_steps: int = 10
    # test-only fault injection: steps (1-based) whose loss is multiplied by NaN, e.g. "5" or
    # "5-7,9". Leave empty
    inject_nan_steps: str = ""


@dataclass
class ParallelConfig:
    """Layout: world = dp x tp x pp; data parallel is what is left of the world size."""
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline stages
    # virtual stages per pipeline rank (interleaved 1F1B); 1 = plain 1F1B. Needs pp > 1, layers
    # divisible by pp x vpp, and microbatches per step a multiple of pp
    vpp: int = 1
    # sequence parallel: norms, dropout and the residual stream split along the tokens across
    # the tp ranks (needs tp > 1); tokens are padded to a multiple of tp and masked
    sequence_parallel: bool = False
    # GPU: shard the optimizer state (and fp32 master weights) over data-parallel ranks
    # (megatron's distributed optimizer). It also pads every parameter's gradient to a
    # 256-byte boundary, which TE's fused weight-gradient GEMMs need to run at full speed.
    # The CPU path (gloo, fp32 torch AdamW) has no distributed optimizer and ignores this.
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True  # GPU: reduce gradient buckets during the backward pass
    # GPU: gradients kept, accumulated over microbatches and reduced across ranks in fp32
    # (megatron's accumulate_allreduce_grads_in_fp32). false: in bf16, as Megatron-LM's default
    grad_reduce_in_fp32: bool = True
    overlap_param_gather: bool = False  # GPU, distributed optimizer: gather params in forward
    # interleaved pipelining (vpp > 1): post stage-to-stage sends and receives one by one and
    # overlap them with compute (megatron's overlap_p2p_comm). Off: batched exchanges (two
    # stages: one at a time, vitgraph.parallel.setup.p2p_mode says why)
    overlap_p2p_comm: bool = False
    # a collective that has not finished after this long ends the run with an error naming
    # the rank and the operation (NCCL watchdog / gloo timeout)
    timeout_minutes: float = 10.0
    # NCCL user-buffer registration inside CUDA graphs (NCCL_GRAPH_REGISTER); off by default
    # because it has hung tensor-parallel runs with graphs (Megatron-Bridge reports)
    nccl_graph_register: bool = False


@dataclass
class TaskConfig:
    # classification: a ViT with a class head on labelled images. contrastive: an image-text
    # pair (CLIP / SigLIP; model.name from the image-text registry, `vitgraph models`) on
    # captioned images, with zero-shot and retrieval eval. auto: contrastive for those names
    kind: str = "auto"
    # contrastive: clip (InfoNCE, learnable scale) | siglip (sigmoid, learnable scale and bias)
    # | auto (siglip when the model has a logit bias)
    loss: str = "auto"
    # contrastive: text positions used (null: the tower's registered context length); longer
    # captions are cut, keeping the end of text
    context_length: Optional[int] = None
    # contrastive: byte (vitgraph's byte-level ids, any tower) | bpe (OpenAI CLIP's BPE from
    # open_clip's packaged vocabulary; towers with its 49,408 ids, as pretrained CLIP weights
    # need) | auto (bpe for such towers, else byte). Nothing is downloaded either way
    tokenizer: str = "auto"
    # contrastive: zero-shot prompts, "{}" the class name; each class's text embedding is the
    # mean over them (null: OpenAI CLIP's style, vitgraph.tasks.contrastive_metrics.TEMPLATES)
    templates: Optional[list] = None


def task_kind(cfg: "Config") -> str:
    """task.kind with auto resolved from model.name."""
    if cfg.task.kind != "auto":
        return cfg.task.kind
    from vitgraph.models.registry import CLIP_MODELS
    return "contrastive" if cfg.model.name in CLIP_MODELS else "classification"


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between saves; 0: only at the end
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # resume from the run directory's latest checkpoint


@dataclass
class RunConfig:
    name: str = "vitgraph"
    dir: Optional[str] = None  # default runs/<name>


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or os.path.join("runs", self.run.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "model.spec": ("auto", "te", "torch"),
    "model.pool": ("cls", "mean"),
    "model.fused_norm": ("auto", "always", "never"),
    "model.init_format": ("auto", "timm", "hf", "open_clip", "vitgraph"),
    "data.kind": ("shapes", "imagefolder", "webdataset"),
    "data.decode": ("cpu", "cuda", "auto"),
    "train.precision": ("auto", "bf16", "fp32", "fp8"),
    "train.fp8_recipe": ("current", "delayed", "mxfp8"),
    "task.kind": ("auto", "classification", "contrastive"),
    "task.loss": ("auto", "clip", "siglip"),
    "task.tokenizer": ("auto", "byte", "bpe"),
    "data.captions": ("full", "short"),
}


# ---------------------------------------------------------------- loading and overrides

def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read YAML, apply ``key.sub=value`` overrides, validate what needs no process group."""
    src = str(path) if path else "<defaults>"
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{src}: config file not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{src}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{src}: the top level must be a mapping, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
        key = key.strip()
        _set_dotted(raw, key, yaml.safe_load(value) if value != "" else None, "override")
        # a duration given on the command line replaces the file's other duration
        other = {"train.steps": "epochs", "train.epochs": "steps"}.get(key)
        if other and isinstance(raw.get("train"), dict):
            raw["train"].pop(other, None)
    cfg = _build(Config, raw, src, prefix="")
    validate(cfg, src)
    return cfg


def _set_dotted(raw: dict, key: str, value: Any, src: str) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{src}: {key}: {part} is not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls, raw: Any, src: str, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: {prefix.rstrip('.') or '<top>'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        full = prefix + str(key)
        if key not in fields:
            raise ConfigError(f"{src}: unknown key {full!r}{_suggest(prefix, str(key), list(fields))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value if value is not None else {}, src, full + ".")
        else:
            kwargs[key] = _coerce(hint, value, src, full)
    try:
        return cls(**kwargs)
    except ValueError as e:  # sections that validate themselves (GraphsConfig)
        raise ConfigError(f"{src}: {e}") from None


def _suggest(prefix: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {prefix + close[0]!r}?)"
    return f" (valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(valid)})"


def _coerce(hint, value, src: str, key: str):
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{src}: {key} must be a {hint.__name__}, got null")
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif hint is list:
        ok = isinstance(value, list)
    else:  # pragma: no cover - only the types above are used
        ok = True
    if not ok:
        raise ConfigError(f"{src}: {key} must be a {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


# ---------------------------------------------------------------- validation

def _validate_contrastive(cfg: Config, err) -> None:
    from vitgraph.models.registry import CLIP_MODELS, resolve_clip_arch
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
    from vitgraph.text import BPE_VOCAB_SIZE, tokenizer_kind
    from vitgraph.text.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
    if tokenizer_kind(cfg.task.tokenizer, arch.text.vocab_size) == "bpe":
        from vitgraph.text.bpe import available
        if arch.text.vocab_size != BPE_VOCAB_SIZE:
            err("task.tokenizer", "bpe", f"CLIP's BPE has {BPE_VOCAB_SIZE} ids; the text tower of "
                                         f"{cfg.model.name} has {arch.text.vocab_size}: use byte")
        missing = available()
        if missing:
            err("task.tokenizer", cfg.task.tokenizer, f"{cfg.model.name}'s text tower takes CLIP's "
                f"BPE ids, which need {missing}; or set task.tokenizer=byte to train it on bytes")
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
    tpl = cfg.task.templates
    if tpl is not None and (not tpl or not all(isinstance(x, str) and "{}" in x for x in tpl)):
        err("task.templates", tpl, 'a non-empty list of prompts, each with "{}" for the class name')
    for key in ("num_heads", "ffn_hidden_size"):
        if getattr(arch.text, key) % p.tp:
            err("parallel.tp", p.tp, f"the text tower's {key}={getattr(arch.text, key)} is not "
                                     "divisible by it")


def validate(cfg: Config, src: str = "<config>") -> None:
    """Checks that need nothing but the config (and the torchrun environment)."""
    from vitgraph.models.registry import CLIP_MODELS, resolve_arch

    def err(key, value, why):
        raise ConfigError(f"{src}: {key}={value!r}: {why}")

    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            err(key, value, f"must be one of {', '.join(choices)}")
    try:
        cfg.graphs.validate()
        cfg.data.augment.validate()
    except ValueError as e:
        raise ConfigError(f"{src}: {e}") from None

    if not 0.0 <= cfg.data.cpu_decode_share <= 1.0:
        err("data.cpu_decode_share", cfg.data.cpu_decode_share, "must be in [0, 1]")
    if cfg.data.cpu_decode_share and (cfg.data.kind != "webdataset" or cfg.data.decode == "cpu"):
        err("data.cpu_decode_share", cfg.data.cpu_decode_share,
            f"splits the decoding of data.decode=cuda shards (data.kind={cfg.data.kind}, "
            f"data.decode={cfg.data.decode})")
    if not 0.0 <= cfg.data.caption_dropout <= 1.0:
        err("data.caption_dropout", cfg.data.caption_dropout, "must be in [0, 1]")
    if not 0.0 <= cfg.data.caption_dropout_start < 1.0:
        err("data.caption_dropout_start", cfg.data.caption_dropout_start, "must be in [0, 1)")
    if cfg.data.caption_dropout and cfg.data.kind != "shapes":
        err("data.caption_dropout", cfg.data.caption_dropout,
            f"only the shapes data has size and colour words to drop (data.kind={cfg.data.kind})")

    try:
        arch = resolve_arch(cfg.model)
    except KeyError as e:
        err("model.name", cfg.model.name, e.args[0])
    if arch.image_size % arch.patch_size:
        err("model.image_size", arch.image_size,
            f"not divisible by model.patch_size={arch.patch_size}")
    if arch.hidden_size % arch.num_heads:
        err("model.hidden_size", arch.hidden_size, f"not divisible by model.num_heads={arch.num_heads}")

    if cfg.model.init_from and not Path(cfg.model.init_from).expanduser().is_file():
        err("model.init_from", cfg.model.init_from, "no such file")

    t = cfg.train
    for key in ("global_batch_size", "micro_batch_size", "eval_batch_size", "log_every"):
        if getattr(t, key) <= 0:
            err(f"train.{key}", getattr(t, key), "must be positive")
    if (t.steps is None) == (t.epochs is None):
        err("train.steps", t.steps, f"give exactly one of train.steps and train.epochs (epochs={t.epochs})")
    if t.steps is not None and t.steps <= 0:
        err("train.steps", t.steps, "must be positive")
    if t.epochs is not None and t.epochs <= 0:
        err("train.epochs", t.epochs, "must be positive")
    if t.eval_every < 0:
        err("train.eval_every", t.eval_every, "must be >= 0")
    if t.max_bad_steps < 1:
        err("train.max_bad_steps", t.max_bad_steps, "must be >= 1")
    try:
        parse_steps(t.inject_nan_steps)
    except ValueError:
        err("train.inject_nan_steps", t.inject_nan_steps, "expected steps such as '5' or '5-7,9'")

    p = cfg.parallel
    for key in ("tp", "pp", "vpp"):
        if getattr(p, key) < 1:
            err(f"parallel.{key}", getattr(p, key), "must be >= 1")
    if p.timeout_minutes <= 0:
        err("parallel.timeout_minutes", p.timeout_minutes, "must be positive")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (p.tp * p.pp):
        raise ConfigError(f"{src}: parallel.tp x parallel.pp = {p.tp} x {p.pp}: world size {world} "
                          f"(WORLD_SIZE) is not divisible by it")
    dp = world // (p.tp * p.pp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        err("train.global_batch_size", t.global_batch_size,
            f"not divisible by micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}")
    if arch.num_heads % p.tp:
        err("parallel.tp", p.tp, f"model.num_heads={arch.num_heads} is not divisible by it")
    if arch.ffn_hidden_size % p.tp:
        err("parallel.tp", p.tp, f"model.ffn_hidden_size={arch.ffn_hidden_size} is not divisible by it")
    if p.vpp > 1 and p.pp == 1:
        err("parallel.vpp", p.vpp, "virtual pipeline stages need parallel.pp > 1")
    if arch.num_layers % (p.pp * p.vpp):
        err("parallel.pp", p.pp, f"model.num_layers={arch.num_layers} is not divisible by "
                                 f"parallel.pp x parallel.vpp = {p.pp} x {p.vpp}")
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if p.vpp > 1 and microbatches % p.pp:
        err("train.global_batch_size", t.global_batch_size,
            f"interleaved pipelining (parallel.vpp={p.vpp}) needs the microbatches per step "
            f"({microbatches} = global / (micro x dp)) to be a multiple of parallel.pp={p.pp}")
    if task_kind(cfg) == "contrastive":
        _validate_contrastive(cfg, err)
    elif cfg.model.name in CLIP_MODELS:
        err("task.kind", cfg.task.kind, f"model.name={cfg.model.name!r} is an image-text pair: "
                                        "train it with task.kind=contrastive (or auto)")
    if p.overlap_p2p_comm and p.vpp == 1:
        err("parallel.overlap_p2p_comm", True, "megatron overlaps p2p only in the interleaved "
                                              "schedule: needs parallel.vpp > 1")
    if cfg.graphs.enabled and cfg.graphs.scope == "step" and t.precision == "fp8" \
            and t.fp8_recipe != "current":
        # current scaling computes each scale from its tensor, on the device, inside the step;
        # delayed scaling keeps an amax history that TE updates from the host between steps
        err("graphs.scope", "step", f"with train.precision=fp8 only with train.fp8_recipe=current "
                                    f"(got {t.fp8_recipe!r}); or use graphs.scope=layer with "
                                    "graphs.impl=te")
    if cfg.graphs.pool == "shared" and p.pp > 1:
        err("graphs.pool", "shared", "needs parallel.pp=1: a pipeline schedule replays the layer "
                                     "graphs in another order than they were captured (use auto)")
    if p.sequence_parallel and p.tp == 1:
        err("parallel.sequence_parallel", True, "needs parallel.tp > 1")
    if t.precision == "fp8" and cfg.model.spec == "torch":
        err("train.precision", "fp8", "FP8 needs Transformer Engine layers (model.spec=te or auto on a GPU)")
    if t.precision == "fp8" and cfg.graphs.enabled and cfg.graphs.impl != "te" \
            and cfg.graphs.scope == "layer":
        err("graphs.impl", cfg.graphs.impl, "train.precision=fp8 with graphs needs graphs.impl=te "
                                             "(TE owns the FP8 scaling state around each replay)")

    o = cfg.optim
    if o.lr <= 0:
        err("optim.lr", o.lr, "must be positive")
    if not 0 <= o.warmup_fraction < 1:
        err("optim.warmup_fraction", o.warmup_fraction, "must be in [0, 1)")
    if o.warmup_steps is not None and o.warmup_steps < 0:
        err("optim.warmup_steps", o.warmup_steps, "must be >= 0")

    d = cfg.data
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
        if d.shuffle_shards < 1:
            err("data.shuffle_shards", d.shuffle_shards, "must be >= 1")
    elif d.num_train <= 0 or d.num_val <= 0:
        err("data.num_train", d.num_train, "data.num_train and data.num_val must be positive")
    if d.render_size <= 0:
        err("data.render_size", d.render_size, "must be positive")
    if d.workers < 1:
        err("data.workers", d.workers, "must be >= 1")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        err("checkpoint.keep", cfg.checkpoint.keep, "checkpoint.every >= 0 and checkpoint.keep >= 1")


def validate_machine(cfg: Config, src: str = "<config>") -> None:
    """Checks against this machine, made before a run starts (``validate`` leaves them out so
    that GPU configs still load anywhere)."""
    if cfg.model.spec == "te":
        import torch

        from vitgraph.models.specs import te_available
        if not (torch.cuda.is_available() and te_available()):
            raise ConfigError(f"{src}: model.spec='te': needs CUDA and Transformer Engine "
                              f"(pip install -e .[te]); use model.spec=torch or auto without them")


def parse_steps(text: str) -> set[int]:
    """'5-7,9' -> {5, 6, 7, 9}; '' -> set()."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return steps


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
