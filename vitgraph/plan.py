"""The run's config resolved once, before any process group exists: what every builder (process
groups, tasks, model, parallelize, optimizer, EMA, the loop) reads instead of the config.

``resolve(cfg, world_size)`` checks the layout against the world size, reads the registry,
chooses the graph path (once: the process groups need it for NCCL's settings, the capture
stream and the RNG), chooses the pack layout at native resolution (``resolve_pack``: packed
or padded slots; the data loader and the model take the one PackSpec) and resolves recompute,
freezing, EMA, distillation and the contrastive task's settings. Each component takes its
slice: the resolved facts and the config sections it reads (``model``, ``data``, ``optim``,
``train``, ``parallel``, ``checkpoint``), never the whole config.

It lives above ``config`` and ``models`` because it is made from both (the config's sections,
the registry's architectures); ``vitgraph.models`` knows the plan only by the fields it reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from vitgraph.config import (CheckpointConfig, Config, ConfigError, DistillConfig, EMAConfig,
                             ModelConfig, OptimConfig, ParallelConfig, TrainConfig, check_layout,
                             graph_constraints, padded_constraints, task_kind)
from vitgraph.data import (DataConfig, DataError, PackingConfig, images_per_pack,
                           native_size_sample, pack_fill, pack_spec, size_tokens)
from vitgraph.data.packing import PackSpec
from vitgraph.graphs.auto import GraphPath, choose_graphs
from vitgraph.models.build import Recompute, recompute_plan, token_multiple, use_fused_norm
from vitgraph.models.caption import LANGUAGE_MODEL, TOWER
from vitgraph.models.clip import IMAGE_TOWER
from vitgraph.models.registry import (CLIPArch, ViTArch, resolve_arch, resolve_clip_arch,
                                      resolve_pos_interp)
from vitgraph.models.specs import THD_HEAD_DIMS, resolve_spec
from vitgraph.models.vit import sequence_length
from vitgraph.text import tokenizer_kind, tokenizer_vocab_size


@dataclass(frozen=True)
class Contrastive:
    """The task: section of an image-text run, resolved for its pair (vitgraph.tasks.contrastive)."""
    loss: str  # clip | siglip
    context_length: int  # text positions used
    tokenizer: str  # byte | bpe
    templates: tuple | None  # zero-shot prompts (None: vitgraph.tasks.contrastive_metrics')
    lock_image: bool


@dataclass(frozen=True)
class Caption:
    """The lm: section of a caption run, resolved (vitgraph.tasks.caption,
    vitgraph.models.caption): the language model's sizes, its tokenizer and vocabulary."""
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    init_std: float
    text_length: int  # text positions: BOS, caption, EOS, padding
    tokenizer: str  # bpe | byte | hf:<name or folder>
    vocab_size: int  # the tokenizer's
    projector: str  # mlp | affine


@dataclass(frozen=True)
class PackLayout:
    """How a native-resolution microbatch holds its images, and why (data.packing.layout)."""
    name: str  # packed | padded
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@dataclass(frozen=True)
class Plan:
    task: str  # classification | contrastive | caption
    arch: ViTArch  # the image encoder (an image-text pair's image tower)
    pair: CLIPArch | None  # the image-text pair of a contrastive run, else None
    spec: str  # the layers: te | torch
    bf16: bool  # bf16 weights and activations (FP8 runs keep bf16 outside TE's FP8 GEMMs)
    fp8_recipe: str | None  # current | delayed | mxfp8; None: no FP8
    micro_batch_size: int
    sequence_parallel: bool
    sequence_parallel_tp: int  # the tp ranks the tokens are split over (1 without)
    fused_norm: bool  # ResidualNormLayer in the encoder layers
    graphs: GraphPath  # chosen here, once
    world: int  # processes: dp x tp x pp
    dp: int  # data-parallel size
    cuda: bool
    p2p: dict  # megatron's p2p settings (p2p_mode)
    # data.resolution=native: the pack layout of every microbatch (None: fixed resolution),
    # packed or padded slots (pack.padded), and why that one
    pack: PackSpec | None
    pack_layout: PackLayout | None
    pos_interp: str  # how a pack's images resample the position grid
    # train.recompute as megatron's TransformerConfig takes it (vitgraph.models.build)
    recompute: Recompute
    fsdp: bool  # parallel.fsdp: weights, gradients and optimizer state sharded over dp
    # (config key, fnmatch pattern) rules of the parameters left out of training
    # (model.freeze, task.lock_image), applied by vitgraph.parallel.setup.parallelize
    freeze: tuple
    # (config key, fnmatch pattern, lr multiplier) rules of parameters trained at a scaled lr
    # (lm.tower_lr_scale), applied with optim.layer_decay by vitgraph.train.optim
    lr_rules: tuple
    ema: EMAConfig | None  # train.ema; None: no EMA of the weights
    distill: DistillConfig | None  # train.distill; None: no teacher
    contrastive: Contrastive | None  # an image-text run's task settings
    caption: Caption | None  # a caption run's language model (task.kind=caption)
    # the sections the builders read as written
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    run_dir: Path

    @property
    def native(self) -> bool:
        return self.pack is not None

    @property
    def fp8(self) -> bool:
        return self.fp8_recipe is not None

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def num_microbatches(self) -> int:
        """Microbatches of one step on each data-parallel rank."""
        return self.train.global_batch_size // (self.micro_batch_size * self.dp)

    def token_padding(self, micro_batch_size: int) -> int:
        """The multiple a micro-batch of this size pads its token sequence to (1: none)."""
        return token_multiple(self.sequence_parallel_tp, self.fp8, micro_batch_size)

    @property
    def pads(self) -> bool:
        """Whether training micro-batches pad their tokens (their layers get a padding mask).
        Never a pack: its token budget is its length (a multiple of tp and of 16 for FP8, as
        config validation makes sure), its padding attention segments of their own."""
        return self.pack is None and self.token_padding(self.micro_batch_size) > 1

    @property
    def precision_name(self) -> str:
        if self.fp8:
            return f"fp8 ({self.fp8_recipe} scaling) + bf16"
        return "bf16" if self.bf16 else "fp32"


def resolve(cfg: Config, world_size: int) -> Plan:
    """``cfg`` for a world of ``world_size`` processes, resolved before any process group is
    made (a layout that cannot run is a ConfigError here)."""
    t, m, p, k = cfg.train, cfg.model, cfg.parallel, cfg.task
    freeze = freeze_rules(cfg)
    p2p = p2p_mode(p.pp, p.vpp, p.overlap_p2p_comm)
    check_layout(cfg, world_size)
    kind = task_kind(cfg)
    constraints = graph_constraints(cfg)
    cuda = torch.cuda.is_available()
    spec = resolve_spec(m.spec)
    if spec == "te" and not cuda:
        raise ConfigError("model.spec='te' needs CUDA and Transformer Engine; use "
                          "model.spec=torch on CPU")
    pair = resolve_clip_arch(m) if kind == "contrastive" else None
    arch = pair.vision if pair is not None else resolve_arch(m)
    recompute = recompute_plan(t, arch.num_layers // (p.pp * p.vpp))
    fp8 = t.precision == "fp8"
    # the fused norms are decided on the image tower's tokens (for both towers of a pair); a
    # pack's prefix tokens are the class token and registers (a pair's image tower: its
    # registry's class token and none)
    if pair is not None:
        prefix, seq = int(pair.class_token), sequence_length(arch, pair.class_token)
    else:
        prefix = int(m.class_token) + m.num_registers
        seq = sequence_length(arch, m.class_token, m.num_registers, m.distill_token)
    native = cfg.data.resolution == "native"
    tokens = cfg.data.packing.tokens_per_microbatch if native else t.micro_batch_size * seq
    fused_norm = use_fused_norm(m.fused_norm, fp8, tokens) and t.recompute != "full"
    pos_interp = resolve_pos_interp(m)
    pack, pack_layout = resolve_pack(cfg, arch, prefix, spec) if native else (None, None)
    graphs = choose_graphs(cfg.graphs, cuda, t.precision, t.fp8_recipe, p.tp, **constraints)
    contrastive = None
    if pair is not None:
        loss = k.loss if k.loss != "auto" else \
            "siglip" if pair.init_logit_bias is not None else "clip"
        contrastive = Contrastive(
            loss=loss, context_length=k.context_length or pair.text.context_length,
            tokenizer=tokenizer_kind(k.tokenizer, pair.text.vocab_size),
            templates=tuple(k.templates) if k.templates else None, lock_image=k.lock_image)
    return Plan(task=kind, arch=arch, pair=pair, spec=spec,
                bf16=cuda if t.precision == "auto" else t.precision in ("bf16", "fp8"),
                fp8_recipe=t.fp8_recipe if fp8 else None, micro_batch_size=t.micro_batch_size,
                sequence_parallel=p.sequence_parallel,
                sequence_parallel_tp=p.tp if p.sequence_parallel else 1, fused_norm=fused_norm,
                graphs=graphs, world=world_size, dp=world_size // (p.tp * p.pp), cuda=cuda,
                p2p=p2p, pack=pack, pack_layout=pack_layout, pos_interp=pos_interp,
                recompute=recompute, fsdp=p.fsdp,
                freeze=freeze, lr_rules=lr_rules(cfg),
                ema=t.ema if t.ema.decay is not None else None,
                distill=t.distill if t.distill.teacher else None, contrastive=contrastive,
                caption=resolve_caption(cfg) if kind == "caption" else None,
                model=m, data=cfg.data, optim=cfg.optim, train=t, parallel=p,
                checkpoint=cfg.checkpoint, run_dir=cfg.run_dir)


# data.packing.layout=auto. Per image, padded slots compute max_len tokens; packs compute its
# mean tokens / the packs' fill (the packer run on the sample) times 1 + the packed path's
# extra cost per token; padded where it costs no more. One H200, bf16, step graphs, the bench's
# stream (benchmarks/BENCHMARKS.md, "Native resolution"), 256 patches at most (images of ~231
# tokens fill 90% of a 257-token slot): 16,384-token packs of up to 80-96 images (99.8% full)
# against 64 slots ran SO400M/16 (head dim 72: slots) 158.3k real tokens/s against 147.3k and
# ViT-B/16 (head dim 64: thd) 645.8k against 608.6k, for 11% fewer tokens: +3% and +5% a
# token packed (native-so400m16-256-m96.json, native-b16-256-m96.json). The torch spec on 2
# shared CPU cores, the tiny native demo (54 tokens an image, 65 a slot): level within the
# noise, packed / padded time per image 0.96-1.03 over four runs, +15-23% a token. The
# constants put each of these on the side it was measured on (the demo: packs, by ~2%).
PACKED_OVERHEAD = {
    "thd": 0.05,  # TE's ragged (thd) attention, at the head dims THD_HEAD_DIMS
    "slots": 0.03,  # TE at other head dims: a pack's rows gathered into slots and back
    "torch": 0.17,  # the torch spec's SDPAttention: slots too
}


def packed_path(spec: str, head_dim: int) -> str:
    """Which attention a pack runs on (PACKED_OVERHEAD's keys): TE's thd at the head dims it
    runs fast, TE over slots at other head dims, the torch spec's slots."""
    if spec != "te":
        return "torch"
    return "thd" if head_dim in THD_HEAD_DIMS else "slots"


def choose_layout(packed: PackSpec, padded: PackSpec, mean_tokens: float, fill: float,
                  path: str, sampled: int = 0) -> tuple[PackSpec, PackLayout]:
    """data.packing.layout=auto's rule: padded slots where they cost no more tokens per image
    than packs (see PACKED_OVERHEAD), given an image's ``mean_tokens`` (prefix included) over
    ``sampled`` images, the share of a pack they ``fill`` and the packed ``path``
    (``packed_path``)."""
    overhead = PACKED_OVERHEAD[path]
    cost = mean_tokens / fill * (1 + overhead)
    slot = padded.max_len
    name = "padded" if slot <= cost else "packed"
    why = (f"data.packing.layout=auto: {name}: an image costs {slot} tokens in a padded slot, "
           f"~{cost:.1f} in a pack (mean {mean_tokens:.1f} tokens"
           + (f" over {sampled} sampled images" if sampled else "")
           + f" / fill {fill:.3f} x {1 + overhead:.2f} for {path} attention)")
    return (padded if name == "padded" else packed), PackLayout(name, why)


def resolve_pack(cfg: Config, arch: ViTArch, prefix: int, spec: str
                 ) -> tuple[PackSpec, PackLayout]:
    """The PackSpec of a native-resolution run's microbatches (data loader and model) and its
    layout: data.packing.layout as written, or auto's choice (``choose_layout``) from a sample
    of the training set's image sizes (vitgraph.data.native_size_sample); packed where padded
    slots cannot run or the sizes cannot be had cheaply. data.packing.max_images=0 resolved
    from the same sample (``resolve_max_images``)."""
    k = cfg.data.packing
    sizes, unread = None, ""
    if k.layout == "auto" or not k.max_images:
        try:
            sizes = native_size_sample(cfg.data, cfg.train.seed)
        except DataError as e:
            unread = str(e)
    k, images = resolve_max_images(k, sizes, arch.patch_size, prefix,
                                   cfg.train.global_batch_size)
    packed = pack_spec(k, arch.patch_size, prefix)
    if k.layout == "packed":
        return packed, PackLayout("packed", "data.packing.layout=packed in the config" + images)
    try:
        padded = pack_spec(k, arch.patch_size, prefix, padded=True, **padded_constraints(cfg))
    except ValueError as e:
        if k.layout == "padded":  # config validation says so first
            raise ConfigError(f"data.packing.layout=padded: {e}") from None
        return packed, PackLayout("packed", f"data.packing.layout=auto: packed: no padded slots "
                                            f"({e})" + images)
    if k.layout == "padded":
        return padded, PackLayout("padded", "data.packing.layout=padded in the config")
    if sizes is None:
        return packed, PackLayout("packed", f"data.packing.layout=auto: packed: the images' "
                                            f"sizes are not to be had cheaply ({unread})" + images)
    tokens = size_tokens(sizes, packed)
    # with micro-batches of one pack, the global batch counts a step's packs
    fill = pack_fill(tokens, packed, cfg.train.global_batch_size, k.window)
    path = packed_path(spec, arch.hidden_size // arch.num_heads)
    chosen, layout = choose_layout(packed, padded, float(tokens.mean()), fill, path, len(sizes))
    return chosen, PackLayout(layout.name, layout.reason + ("" if chosen.padded else images))


def resolve_max_images(k: PackingConfig, sizes, patch_size: int, prefix: int, num_packs: int
                       ) -> tuple[PackingConfig, str]:
    """data.packing with max_images resolved where it is 0: as many images as let tokens, not
    the image count, end a pack of the ``sizes`` sampled (vitgraph.data.images_per_pack); with
    no sample, as many as images of half max_patches need. The reason, for the log line."""
    if k.max_images:
        return k, ""
    one = pack_spec(dataclasses.replace(k, max_images=1), patch_size, prefix)
    if sizes is None:
        m = 8 * -(-2 * k.tokens_per_microbatch // one.max_len // 8)
        why = "as many as images of half max_patches need (no size sample)"
    else:
        tokens = size_tokens(sizes, one)
        m = images_per_pack(tokens, one, num_packs, k.window)
        why = (f"tokens, not images, end a pack of the {len(sizes)} sampled images "
               f"(mean {tokens.mean():.1f} tokens)")
    return dataclasses.replace(k, max_images=m), f"; data.packing.max_images=0: {m}: {why}"


def resolve_caption(cfg: Config) -> Caption:
    lm = cfg.lm
    return Caption(num_layers=lm.num_layers, hidden_size=lm.hidden_size,
                   num_heads=lm.num_heads, ffn_hidden_size=lm.ffn_hidden_size or 4 * lm.hidden_size,
                   init_std=lm.init_std, text_length=lm.text_length, tokenizer=lm.tokenizer,
                   vocab_size=tokenizer_vocab_size(lm.tokenizer),
                   projector=lm.projector)


def freeze_rules(cfg: Config) -> tuple:
    """(config key, fnmatch pattern) pairs of what a run leaves out of training:
    model.freeze, task.lock_image's image tower (vitgraph.models.clip.IMAGE_TOWER), and a
    caption run's lm.freeze_tower / lm.freeze_lm (vitgraph.models.caption)."""
    rules = [("model.freeze", pat) for pat in cfg.model.freeze or ()]
    if cfg.task.lock_image:
        rules.append(("task.lock_image", IMAGE_TOWER))
    if task_kind(cfg) == "caption":
        if cfg.lm.freeze_tower:
            rules.append(("lm.freeze_tower", TOWER))
        if cfg.lm.freeze_lm:
            rules.append(("lm.freeze_lm", LANGUAGE_MODEL))
    return tuple(rules)


def lr_rules(cfg: Config) -> tuple:
    """(config key, fnmatch pattern, lr multiplier) of the parameters trained at a scaled lr:
    a caption run's vision tower at lm.tower_lr_scale (vitgraph.models.caption.TOWER)."""
    if task_kind(cfg) == "caption" and cfg.lm.tower_lr_scale != 1.0:
        return (("lm.tower_lr_scale", TOWER, cfg.lm.tower_lr_scale),)
    return ()


def p2p_mode(pp: int, vpp: int, overlap: bool) -> dict:
    """How stages exchange activations and gradients (megatron's p2p settings), the same on
    CPU (gloo) and GPU (NCCL).

    Batched: one batch_isend_irecv per exchange. Not for two stages with interleaving: there
    each rank's previous and next stage are the same peer, and one exchange sends it both the
    activation (to next) and the gradient (to prev). Batched sends to one peer are matched to
    its receives in posting order, which megatron's batch lists differently on the two sides,
    so activation and gradient swap, silently (same shape; on two H200s the gradient norm
    read 1e12). Unbatched, megatron sends one direction through another communicator.
    ``overlap`` (interleaved only): posted one by one and overlapped with compute.
    No device-wide sync after a batch: megatron's workaround for old PyTorch, and a sync
    cannot be captured in a whole-step graph."""
    batch = not overlap and not (pp == 2 and vpp > 1)
    return dict(batch_p2p_comm=batch, overlap_p2p_comm=overlap, batch_p2p_sync=False)
