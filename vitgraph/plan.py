"""The run's config resolved once, after the process groups exist: what every builder (model,
tasks, parallelize, optimizer, graphs, the loop) reads instead of re-interpreting the config.

It lives here, above ``config``, ``models`` and ``parallel``, because it is made from all
three (the config's sections, the registry's architectures, the process groups' sizes) and
holds more than the model (the graph path, the data-parallel size); ``vitgraph.models`` stays
below the config (config.py validates through the registry) and knows the plan only by the
fields it reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vitgraph.config import Config, ConfigError, graph_constraints, task_kind
from vitgraph.data.packing import PackSpec
from vitgraph.graphs.auto import GraphPath, choose_graphs
from vitgraph.models.build import token_multiple, use_fused_norm
from vitgraph.models.clip import IMAGE_TOWER
from vitgraph.models.registry import (CLIP_MODELS, CLIPArch, ViTArch, resolve_arch,
                                      resolve_clip_arch, resolve_pos_interp)
from vitgraph.models.specs import resolve_spec
from vitgraph.models.vit import sequence_length


@dataclass(frozen=True)
class Plan:
    task: str  # classification | contrastive
    arch: ViTArch  # the image encoder (an image-text pair's image tower)
    pair: CLIPArch | None  # the image-text pair of a contrastive run, else None
    spec: str  # the layers: te | torch
    bf16: bool  # bf16 weights and activations (FP8 runs keep bf16 outside TE's FP8 GEMMs)
    fp8_recipe: str | None  # current | delayed | mxfp8; None: no FP8
    micro_batch_size: int
    sequence_parallel: bool
    sequence_parallel_tp: int  # the tp ranks the tokens are split over (1 without)
    fused_norm: bool  # ResidualNormLayer in the encoder layers
    graphs: GraphPath
    dp: int  # data-parallel size, from the process groups
    cuda: bool
    p2p: dict = field(default_factory=dict)  # megatron's p2p settings (p2p_mode)
    # data.resolution=native: the pack layout of every microbatch (None: fixed resolution)
    pack: PackSpec | None = None
    pos_interp: str = "bicubic"  # how a pack's images resample the position grid
    # train.recompute as megatron's TransformerConfig takes it (vitgraph.models.build)
    recompute: "Recompute" = None
    fsdp: bool = False  # parallel.fsdp: weights, gradients and optimizer state sharded over dp

    @property
    def native(self) -> bool:
        return self.pack is not None

    @property
    def fp8(self) -> bool:
        return self.fp8_recipe is not None

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

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


@dataclass(frozen=True)
class Recompute:
    """train.recompute resolved: megatron-core's recompute_granularity (None: off),
    recompute_method and recompute_num_layers (full), recompute_modules (selective)."""
    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple | None = None

    @property
    def name(self) -> str:
        return self.granularity or "none"


def recompute_plan(cfg: Config, d=None) -> Recompute:
    """train.recompute* for a layout with ``d.pp`` x ``d.vpp`` chunks of the encoder (the
    config's parallel section without ``d``)."""
    t = cfg.train
    if t.recompute == "none":
        return Recompute()
    if t.recompute == "selective":
        return Recompute("selective", modules=tuple(t.recompute_modules or ("core_attn",)))
    chunks = (d.pp * d.vpp) if d is not None else cfg.parallel.pp * cfg.parallel.vpp
    per_chunk = resolve_arch(cfg.model).num_layers // chunks
    n = t.recompute_layers or (1 if t.recompute_method == "uniform" else per_chunk)
    return Recompute("full", t.recompute_method, min(n, per_chunk))


def pack_spec(cfg: Config) -> PackSpec | None:
    """The pack layout of a data.resolution=native run (None at fixed resolution): the
    data.packing keys and the (image) encoder's patch size and prefix tokens (class token and
    registers; an image-text pair's image tower has its registry's class token and none)."""
    if cfg.data.resolution != "native":
        return None
    k, m = cfg.data.packing, cfg.model
    if task_kind(cfg) == "contrastive" and m.name in CLIP_MODELS:
        arch = resolve_clip_arch(m)
        prefix, patch = int(arch.class_token), arch.vision.patch_size
    else:
        prefix, patch = int(m.class_token) + m.num_registers, resolve_arch(m).patch_size
    return PackSpec(tokens=k.tokens_per_microbatch, max_images=k.max_images,
                    max_patches=k.max_patches, num_prefix=prefix, patch_size=patch,
                    min_patches=k.min_patches)


def graph_path(cfg: Config, d) -> GraphPath:
    """The graph path of this run, and why (``graphs.enabled: auto`` resolved by
    vitgraph.graphs.auto): chosen once, before the process groups were made (they need it for
    NCCL's settings, the capture stream and the RNG)."""
    if d.graphs is not None:
        return d.graphs
    return choose_graphs(cfg.graphs, d.cuda, cfg.train.precision, cfg.train.fp8_recipe, d.tp,
                         **graph_constraints(cfg))


def resolve_plan(cfg: Config, d) -> Plan:
    """``cfg`` resolved for this rank (``d``: the process groups, made already)."""
    t, m, p = cfg.train, cfg.model, cfg.parallel
    graphs = graph_path(cfg, d)
    p2p = p2p_mode(d.pp, d.vpp, p.overlap_p2p_comm)
    kind = task_kind(cfg)
    spec = resolve_spec(m.spec)
    if spec == "te" and not d.cuda:
        raise ConfigError("model.spec='te' needs CUDA and Transformer Engine; use "
                          "model.spec=torch on CPU")
    pair = resolve_clip_arch(m) if kind == "contrastive" else None
    arch = pair.vision if pair is not None else resolve_arch(m)
    fp8 = t.precision == "fp8"
    # the fused norms are decided on the image tower's tokens (for both towers of a pair)
    seq = sequence_length(arch, pair.class_token) if pair is not None \
        else sequence_length(arch, m.class_token, m.num_registers, m.distill_token)
    pack = pack_spec(cfg)
    tokens = pack.tokens if pack is not None else t.micro_batch_size * seq
    return Plan(task=kind, arch=arch, pair=pair, spec=spec,
                bf16=d.cuda if t.precision == "auto" else t.precision in ("bf16", "fp8"),
                fp8_recipe=t.fp8_recipe if fp8 else None, micro_batch_size=t.micro_batch_size,
                sequence_parallel=p.sequence_parallel,
                sequence_parallel_tp=p.tp if p.sequence_parallel else 1,
                fused_norm=use_fused_norm(m.fused_norm, fp8, tokens) and t.recompute != "full",
                graphs=graphs, dp=d.dp, cuda=d.cuda, p2p=p2p, pack=pack,
                pos_interp=resolve_pos_interp(m), recompute=recompute_plan(cfg, d),
                fsdp=p.fsdp)


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


def freeze_rules(cfg: Config) -> list[tuple[str, str]]:
    """(config key, fnmatch pattern) pairs of what a run leaves out of training:
    model.freeze, and task.lock_image's image tower (vitgraph.models.clip.IMAGE_TOWER)."""
    rules = [("model.freeze", pat) for pat in cfg.model.freeze or ()]
    if cfg.task.lock_image:
        rules.append(("task.lock_image", IMAGE_TOWER))
    return rules
