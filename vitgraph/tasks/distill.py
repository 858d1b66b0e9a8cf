"""Knowledge distillation (train.distill): the teacher and the distillation losses.

The teacher runs forward only on the images the student sees (augmented and mixed the same
way), on each rank whole: not wrapped by DDP, not split by tensor or pipeline parallelism
(with parallel.tp > 1 every rank of a tensor-parallel group runs the same full teacher on
the same images). Its logits come out of the task's ``prepare``: on the pipeline's last
stage, where the loss is, so that under graphs.scope=step they are one more input of the
step graph, computed outside it.

* ``soft``: KL(softmax(teacher / T) || softmax(student / T)) x T^2 (Hinton et al.);
* ``hard``: cross-entropy against the teacher's top class (DeiT's hard distillation);

both averaged over the microbatch's real samples, as the task's cross-entropy is, and mixed
as loss = (1 - weight) x task loss + weight x distillation loss.

Teachers (train.distill.teacher): a vitgraph run directory (its config.yaml's model section
and its newest complete checkpoint), a weights file of any naming vitgraph.convert reads
(the architecture is train.distill.model), or ``timm:<name>`` (timm.create_model with random
weights: for tests). A vitgraph teacher is one ViT chunk (torch spec on CPU, TE when
available on a GPU) in bf16 on a GPU, fp32 on CPU, in eval mode without gradients. On a GPU
it runs under its own forward-only CUDA graph, one per input shape (``ForwardGraphs``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from vitgraph.config import ConfigError, ModelConfig, run_model_config
from vitgraph.convert import ConvertError, init_from, load_into_model, read_checkpoint_weights
from vitgraph.convert.checkpoints import checkpoint_dir
from vitgraph.graphs.backend import default_backend
from vitgraph.models.build import build_model, use_fused_norm
from vitgraph.models.registry import CLIP_MODELS, resolve_arch, resolve_pos_interp
from vitgraph.models.specs import resolve_spec
from vitgraph.models.vit import sequence_length

TIMM = "timm:"
KEY = "train.distill.teacher"


# ---------------------------------------------------------------- losses

def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
              valid: torch.Tensor | None = None) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) x T^2, summed over classes and
    averaged over the ``valid`` samples (all when None; 0 when none is)."""
    t = temperature
    log_s = F.log_softmax(student.float() / t, dim=-1)
    log_t = F.log_softmax(teacher.float() / t, dim=-1)
    per = (log_t.exp() * (log_t - log_s)).sum(-1) * (t * t)
    return _mean(per, valid)


def hard_loss(student: torch.Tensor, teacher: torch.Tensor,
              valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's top class, over the ``valid``
    samples."""
    per = F.cross_entropy(student.float(), teacher.argmax(-1), reduction="none")
    return _mean(per, valid)


def distill_loss(kind: str, student, teacher, temperature: float, valid=None) -> torch.Tensor:
    if kind == "soft":
        return soft_loss(student, teacher, temperature, valid)
    if kind == "hard":
        return hard_loss(student, teacher, valid)
    raise ValueError(f"train.distill.kind={kind!r}: soft | hard")


def _mean(per: torch.Tensor, valid) -> torch.Tensor:
    if valid is None:
        return per.mean()
    return torch.where(valid, per, 0.0).sum() / valid.sum().clamp(min=1)


# ---------------------------------------------------------------- the forward graph

class ForwardGraphs:
    """``fn(x)`` (forward only, no autograd) replayed from a graph per input shape and dtype:
    the first call of a shape warms ``fn`` up on the backend's side stream, captures it with
    a static input, and replays it; later calls copy into the static input and replay. The
    result is a copy (the static output is overwritten by the next replay). The CPU
    ``RerunBackend`` runs the same bookkeeping with reruns."""

    def __init__(self, fn, backend, warmup: int = 2):
        self.fn, self.backend, self.warmup = fn, backend, warmup
        self.graphs: dict = {}  # (shape, dtype) -> (static input, Replayable)
        self.pool = None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(x)
            if getattr(self.backend, "capture_runs", False):  # the capture ran fn on x
                return entry[1].outputs[0].clone()
        static, rep = entry
        static.copy_(x)
        rep.replay()
        return rep.outputs[0].clone()

    def _capture(self, x: torch.Tensor):
        static = x.detach().clone()
        b = self.backend
        with b.side_stream():  # kernels' lazy set-up (cuBLAS handles, TE workspaces) first
            for _ in range(self.warmup):
                self.fn(static)
        b.synchronize()
        if self.pool is None:  # one pool for every shape: replays never overlap
            self.pool = b.make_pool()
        return static, b.capture(lambda: [self.fn(static)], self.pool)

    def reset(self) -> None:
        for _, rep in self.graphs.values():
            rep.reset()
        self.graphs.clear()


class Teacher:
    """A forward-only teacher: ``teacher(x)`` -> fp32 logits [b, classes] for the student's
    normalised images x [b, 3, s, s] (resized to the teacher's ``image_size`` when that is
    fixed and differs). ``graphs``: a capture backend (vitgraph.graphs.backend) to replay the
    forward from graphs, or None (eager)."""

    def __init__(self, module: torch.nn.Module, num_classes: int, dtype: torch.dtype,
                 image_size: int | None, describe: str, graphs=None):
        module.eval()
        module.requires_grad_(False)
        self.module, self.num_classes, self.dtype = module, num_classes, dtype
        self.image_size, self.describe = image_size, describe
        self.graphs = ForwardGraphs(self._forward, graphs) if graphs is not None else None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.image_size is not None and x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False, antialias=True)
        out = self.module(x.to(self.dtype))
        if out.dim() == 3:  # a teacher with a distillation token: its two heads' average
            out = out.mean(dim=1)
        return out.float()

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and not _capturing():
            return self.graphs(x)
        return self._forward(x)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------- building the teacher

def build_teacher(distill, plan, d, num_classes: int, graphs: bool | None = None):
    """The teacher of ``distill`` (train.distill, the plan's; see the module docstring) for a
    student of ``num_classes`` classes on this rank, or None on a rank that holds no last pipeline stage (no loss there); every
    rank must call it (under tp / pp it makes a process group). ``graphs``: replay its
    forward from CUDA graphs (default: on a GPU)."""
    src = distill.teacher
    if not src.startswith(TIMM) and (d.tp > 1 or d.pp > 1):
        single_rank_group()  # collective: before the ranks part
    if not d.is_last_stage:
        return None
    # the teacher's (discarded) random init must not move the run's random streams
    devices = [d.device] if d.cuda else []
    with torch.random.fork_rng(devices=devices):
        module, dtype, size, what = _teacher_module(distill, plan, d, num_classes)
    if graphs is None:
        graphs = d.cuda
    backend = None
    if graphs:
        backend = default_backend()
    return Teacher(module, num_classes, dtype, size, what, backend)


def _teacher_module(dt, plan, d, num_classes: int):
    src, device = dt.teacher, d.device
    if src.startswith(TIMM):
        module, size, what = _timm_teacher(src[len(TIMM):], num_classes, plan.arch.image_size)
        dtype = torch.bfloat16 if d.cuda else torch.float32
        module = module.to(device=device, dtype=dtype)
    else:
        path = Path(src).expanduser()
        if path.is_dir():
            module, size, what = _run_teacher(path, plan, d, num_classes)
        elif path.is_file():
            if not dt.model:
                raise ConfigError(f"{KEY}={src!r}: a weights file needs train.distill.model "
                                  f"(its architecture, a registry name: `vitgraph models`)")
            module, size, what = _vitgraph_teacher(ModelConfig(name=dt.model), plan, d,
                                                   num_classes, src, weights_file=path)
        else:
            raise ConfigError(f"{KEY}={src!r}: no such run directory or weights file (or "
                              f"'timm:<name>')")
        dtype = torch.bfloat16 if d.cuda else torch.float32  # built so (bf16=d.cuda)
    return module, dtype, size, what


def _timm_teacher(name: str, num_classes: int, image_size: int):
    import timm
    if not timm.is_model(name):
        raise ConfigError(f"{KEY}='timm:{name}': timm has no model {name!r} (timm.list_models)")
    try:  # a ViT at the student's resolution; models without an image size take any
        module = timm.create_model(name, pretrained=False, num_classes=num_classes,
                                   img_size=image_size)
    except TypeError:
        module = timm.create_model(name, pretrained=False, num_classes=num_classes)
    size = getattr(getattr(module, "patch_embed", None), "img_size", None)
    if isinstance(size, (tuple, list)):
        size = size[0]
    return module, size, f"timm {name} (random init)"


def _run_teacher(run: Path, plan, d, num_classes: int):
    """A vitgraph run directory: its model section and newest complete checkpoint."""
    src = str(run)
    saved = run / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{KEY}={src!r}: a directory without config.yaml (not a vitgraph run)")
    try:
        mcfg, raw = run_model_config(run)
    except ConfigError as e:
        raise ConfigError(f"{KEY}={src!r}: {e}") from e
    kind = (raw.get("task") or {}).get("kind", "auto")
    if mcfg.name in CLIP_MODELS or kind == "contrastive":
        raise ConfigError(f"{KEY}={src!r}: an image-text run ({mcfg.name}); a teacher is a "
                          f"classifier")
    if (raw.get("data") or {}).get("resolution") == "native":
        raise ConfigError(f"{KEY}={src!r}: a native-resolution run (packs); a teacher takes "
                          f"fixed-size images")
    try:
        step_dir = checkpoint_dir(run)
        sd, step = read_checkpoint_weights(step_dir)
    except ConvertError as e:
        raise ConfigError(f"{KEY}={src!r}: {e}") from e
    return _vitgraph_teacher(mcfg, plan, d, num_classes, src, state=sd,
                             what=f"{step_dir} (step {step})")


def _vitgraph_teacher(mcfg, plan, d, num_classes: int, src: str, weights_file=None,
                      state=None, what: str | None = None):
    """A whole single-chunk ViT of ``mcfg`` with the weights of ``weights_file`` (any naming,
    detected as model.init_from does) or of the full vitgraph ``state`` dict."""
    try:
        arch = resolve_arch(mcfg)
    except KeyError as e:
        key = "train.distill.model" if weights_file is not None else KEY
        raise ConfigError(f"{key}={mcfg.name!r}: {e.args[0]}") from e
    have = mcfg.num_classes
    if state is not None and "head.weight" in state:
        have = int(state["head.weight"].shape[0])
    if have is not None and have != num_classes:
        raise ConfigError(f"{KEY}={src!r}: the teacher has {have} classes, the run "
                          f"{num_classes}")
    spec = resolve_spec("auto") if d.cuda else "torch"
    seq = sequence_length(arch, mcfg.class_token, mcfg.num_registers, mcfg.distill_token)
    tplan = dataclasses.replace(
        plan, task="classification", arch=arch, pair=None, spec=spec, bf16=d.cuda,
        fp8_recipe=None, sequence_parallel=False, sequence_parallel_tp=1,
        fused_norm=use_fused_norm(mcfg.fused_norm, False, plan.micro_batch_size * seq),
        p2p={}, pack=None, pos_interp=resolve_pos_interp(mcfg))
    td = dataclasses.replace(d, tp=1, pp=1, vpp=1, tp_rank=0, pp_rank=0)
    with whole_model_groups(d):
        (chunk,) = build_model(tplan, mcfg, td, num_classes, 0)
    try:
        if weights_file is not None:
            report = init_from(chunk, str(weights_file), "auto")
        else:
            report = load_into_model(chunk, state, source=src)
    except ConvertError as e:
        raise ConfigError(f"{KEY}={src!r}: {e}") from e
    if report.get("head_reinitialised"):
        raise ConfigError(f"{KEY}={src!r}: its weights have no head of the run's "
                          f"{num_classes} classes")
    return chunk, arch.image_size, f"{mcfg.name} from {what or src}"


_SINGLE = {}


def single_rank_group():
    """This rank alone as a process group; made once, by every rank together."""
    world = dist.group.WORLD  # a new world (shut down and set up again): a new group
    if _SINGLE.get("world") is not world:
        _SINGLE.update(world=world, group=dist.new_subgroups(group_size=1)[0])
    return _SINGLE["group"]


@contextlib.contextmanager
def whole_model_groups(d):
    """megatron-core builds layers for parallel_state's tensor / pipeline groups (vitgraph's
    MLP, like megatron's, takes its group from there); a teacher is whole on every rank:
    under tensor or pipeline parallelism its layers are built while those groups are this
    rank alone. A layer keeps the group it was built with, so the swap lasts the build only."""
    if d.tp == 1 and d.pp == 1:
        yield
        return
    one, rank = single_rank_group(), dist.get_rank()
    swap = {"_TENSOR_MODEL_PARALLEL_GROUP": one, "_PIPELINE_MODEL_PARALLEL_GROUP": one,
            "_MODEL_PARALLEL_GROUP": one, "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": one,
            "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": [rank], "_PIPELINE_GLOBAL_RANKS": [rank],
            "_MODEL_PARALLEL_GLOBAL_RANKS": [rank],
            "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": 1, "_MPU_TENSOR_MODEL_PARALLEL_RANK": 0,
            "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": 1, "_MPU_PIPELINE_MODEL_PARALLEL_RANK": 0}
    saved = {k: getattr(ps, k) for k in swap}
    for k, v in swap.items():
        setattr(ps, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(ps, k, v)
