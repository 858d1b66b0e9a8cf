"""AdamW with warm-up + cosine. GPU: megatron-core's optimizer (bf16 master weights, clipping,
optionally distributed). CPU: ``CpuOptimizer``, torch AdamW behind the same interface.

Param groups: weight decay on / off, times the layer-wise lr scale (optim.layer_decay), each
group annealed by megatron's OptimizerParamScheduler between its own ``max_lr`` / ``min_lr``.
Frozen parameters (model.freeze, task.lock_image: vitgraph.models.freeze, applied by
vitgraph.parallel.setup.parallelize before DDP) are in no group."""
from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from vitgraph.config import OptimConfig
from vitgraph.models.freeze import global_names
from vitgraph.models.vit import unwrap
from vitgraph.parallel import cpu_shims
from vitgraph.parallel.fsdp import is_dtensor, local
from vitgraph.plan import Plan
from vitgraph.train.health import skip_nonfinite_steps


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # biases, norms, tokens and position embeddings: no weight decay (as megatron and timm)
    return p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "dist_token", "registers"))


# ------------------------------------------------------------ layer-wise LR decay (BEiT)

# a tower's parameters that come before its first layer (classifier / image tower: patches,
# class token, registers, positions, CLIP's ln_pre; text tower: token and position embeddings)
EMBEDDINGS = ("patch_embed", "cls_token", "dist_token", "registers", "pos_embed", "ln_pre",
              "token_embed")


def layer_depths(chunks: list) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (i, L): its place in its tower, 0 the embeddings, 1..L the encoder
    layers (megatron's global ``layer_number``, so the same at every pp / vpp layout), L + 1
    what follows the last layer (final norm, pooling, head). A tower is any module holding a
    megatron ``TransformerBlock`` as ``decoder`` (the classifier, CLIP's image and text
    towers), L its config's num_layers. Parameters outside every tower (CLIP's logit scale
    and bias) are missing: they train at the head's lr."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer
    out: dict[int, tuple[int, int]] = {}
    for chunk in chunks:
        for tower in chunk.modules():
            block = getattr(tower, "decoder", None)
            if not isinstance(block, TransformerBlock):
                continue
            depth = block.config.num_layers
            for name, p in tower.named_parameters():
                out[id(p)] = (0 if name.split(".")[0] in EMBEDDINGS else depth + 1, depth)
            for layer in block.modules():
                if isinstance(layer, BaseTransformerLayer):
                    for p in layer.parameters():
                        out[id(p)] = (layer.layer_number, depth)
    return out


def lr_scales(chunks: list, decay: float | None, rules: tuple = ()) -> dict[int, float]:
    """id(parameter) -> its lr multiplier: decay^(L + 1 - i) (``layer_depths``), 1.0 without
    layer decay; times the multiplier of each of ``rules`` (the plan's ``lr_rules``: (config
    key, fnmatch pattern, multiplier), lm.tower_lr_scale) whose pattern matches the
    parameter's name in the whole model (vitgraph.models.freeze.global_names). Each tower of
    an image-text pair decays over its own depth (as EVA-CLIP's separate image / text layer
    decay, here with one rate): both heads at lr, both embeddings at lr x decay^(L + 1) of
    their tower."""
    params = [p for c in chunks for p in c.parameters()]
    if decay is None or decay == 1.0:
        out = {id(p): 1.0 for p in params}
    else:
        depths = layer_depths(chunks)
        out = {id(p): decay ** (depths[id(p)][1] + 1 - depths[id(p)][0]) if id(p) in depths
               else 1.0 for p in params}
    for chunk in chunks if rules else ():
        for pid, name in global_names(unwrap(chunk)).items():
            for _, pattern, scale in rules:
                if fnmatch.fnmatchcase(name, pattern):
                    out[pid] *= scale
    return out


def optim_line(o, scales: dict[int, float], rules: tuple = ()) -> str:
    """The start-up log's optimizer line (``o``: the optim section; ``scales``: lr_scales;
    ``rules``: the plan's lr_rules)."""
    line = (f"AdamW lr {o.lr:.2e} -> {o.min_lr:.2e}, weight decay {o.weight_decay:g}, "
            + (f"grad clip {o.clip_grad:g}" if o.clip_grad else "no grad clipping"))
    line += "".join(f", {key} {scale:g} ({pattern} at lr x {scale:g})"
                    for key, pattern, scale in rules)
    if o.layer_decay is None or o.layer_decay == 1.0:
        return line + ", no layer decay"
    return line + (f", layer decay {o.layer_decay:g} (encoder layer i of L at lr x "
                   f"{o.layer_decay:g}^(L + 1 - i), the embeddings x {min(scales.values()):.3g}, "
                   f"the head x 1)")


def _aligned(keys: list) -> list:
    """``keys`` (hashable, sortable) united over every rank, sorted: each rank makes the same
    param groups (empty where it holds none of a group's parameters), as megatron does,
    because a checkpoint's param groups are common state, one copy for all ranks."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(set(keys)))
        keys = [k for ks in every for k in ks]
    return sorted(set(keys))


# ------------------------------------------------------------ frozen parameters' state

FROZEN_FILL = "vitgraph_frozen_fill"


def _united(items: set) -> set:
    """``items`` united over every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(items, key=str))
        return {x for xs in every for x in xs}
    return set(items)


def frozen_slices(state: dict, model_sharded_state_dict: dict, frozen: set,
                  weights: bool = False) -> dict:
    """The sharded tensors that make ``state``'s tensors named after the model's whole.

    The model's checkpoint stacks a block's layers into one tensor per name ("decoder.layers.
    mlp.linear_fc1.weight", [L, ...]), and an optimizer (or an EMA) names its state after it
    ("optimizer.state.exp_avg.<that>"). With some layers frozen (ids in ``frozen``) that state
    has holes, which dist_checkpointing refuses ("Invalid access pattern"). Returned: for each
    frozen slice of each such state tensor, a ShardedTensor of the same key and place, zeros
    (``weights``: the frozen parameter itself, what an EMA of it is). Collective: the state
    prefixes and names are united over the ranks (a rank may hold only frozen slices)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    model = [t for t in nested_values(model_sharded_state_dict) if isinstance(t, ShardedTensor)]
    keys = {t.key for t in model}
    prefixes, trained = {}, set()  # state prefix -> dtype; model keys with state
    for t in nested_values(state):
        if not isinstance(t, ShardedTensor):
            continue
        parts = t.key.split(".")
        for i in range(1, len(parts)):  # the longest model key the state key ends with
            k = ".".join(parts[i:])
            if k in keys:
                prefixes[".".join(parts[:i])] = t.dtype
                trained.add(k)
                break
    prefixes = dict(_united(set(prefixes.items())))
    trained = _united(trained)

    def data(t, dtype):
        if weights:
            return t.data.detach().to(dtype).clone()
        return torch.zeros(t.local_shape, dtype=dtype, device=t.data.device)

    return {f"{pre}.{t.key}/{i}": replace(t, key=f"{pre}.{t.key}", dtype=dtype,
                                          data=data(t, dtype))
            for i, t in enumerate(model) if id(t.data) in frozen and t.key in trained
            for pre, dtype in prefixes.items()}


def fill_frozen_slices(optimizer, chunks: list) -> None:
    """``optimizer``'s checkpoint state made whole where some parameters are frozen
    (``frozen_slices``): ``sharded_state_dict`` adds zeros for the frozen slices (the frozen
    parameters still have no state in memory), ``load_state_dict`` drops them again. A no-op
    where nothing is frozen on any rank."""
    frozen = {id(p) for c in chunks for p in c.parameters() if not p.requires_grad}
    if not _united({bool(frozen)}) - {False}:
        return
    save, load = optimizer.sharded_state_dict, optimizer.load_state_dict

    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, **kwargs):
        sd = save(model_sharded_state_dict, is_loading=is_loading, **kwargs)
        fill = frozen_slices(sd, model_sharded_state_dict, frozen)
        if fill:  # (an empty dict would be common state on some ranks only)
            sd[FROZEN_FILL] = fill
        return sd

    def load_state_dict(state_dict):
        return load({k: v for k, v in state_dict.items() if k != FROZEN_FILL})

    optimizer.sharded_state_dict, optimizer.load_state_dict = sharded_state_dict, load_state_dict


def param_groups(chunks: list, o: OptimConfig, rules: tuple = ()) -> list[dict]:
    """The CPU optimizer's param groups, as megatron's ``_get_param_groups`` makes them on GPU
    from ``build_optimizer``'s overrides: one per (weight decay on / off, lr scale) of the
    trainable parameters, the same groups on every rank (``_aligned``). ``max_lr`` / ``min_lr``
    are what OptimizerParamScheduler anneals each group between; ``default_config`` marks the
    groups at the base lr, as megatron does. ``rules``: the plan's lr_rules."""
    scales = lr_scales(chunks, o.layer_decay, rules)
    by_key: dict[tuple, list] = {}
    for c in chunks:
        for n, p in c.named_parameters():
            if p.requires_grad:
                by_key.setdefault((_no_decay(n, p), scales[id(p)]), []).append(p)
    return [{"params": by_key.get((no_wd, s), []), "wd_mult": 0.0 if no_wd else 1.0,
             "max_lr": o.lr * s, "min_lr": o.min_lr * s, "lr_scale": s,
             "default_config": s == 1.0}
            for no_wd, s in _aligned(list(by_key))]  # decay groups first, as megatron


class CpuOptimizer:
    """torch AdamW with megatron's optimizer contract: ``step() -> (ok, grad_norm, None)``.

    Does what megatron's DDP + optimizer do on GPU: averages gradients over the data-parallel
    group, clips by the global norm (over the model-parallel group), steps.
    """

    def __init__(self, chunks: list[torch.nn.Module], o: OptimConfig, rules: tuple = ()):
        named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(param_groups(chunks, o, rules), lr=o.lr,
                                           betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.clip = o.clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def load_lr(self) -> None:
        """graphs.scope=step: nothing to do; the CPU rerun backend re-runs the Python step."""

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _all_reduce(grads: list, group, average: bool) -> None:
        if not grads or dist.get_world_size(group) == 1:
            return
        grads = [local(g) for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= dist.get_world_size(group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))

    def step(self):
        # sequence parallel: norms and row-parallel biases saw only this rank's tokens; their
        # gradients are summed over the tensor-parallel group (megatron's finalize_model_grads
        # does this on GPU)
        self._all_reduce([p.grad for p in self.params if p.grad is not None
                          and getattr(p, "sequence_parallel", False)],
                         ps.get_tensor_model_parallel_group(), average=False)
        # (parallel.fsdp: its reduce-scatter already averaged each piece over dp)
        self._all_reduce([p.grad for p in self.params if p.grad is not None
                          and not is_dtensor(p.grad)],
                         ps.get_data_parallel_group(), average=True)
        norm = cpu_shims.clip_grad_norm(self.params, self.clip, ps.get_model_parallel_group())
        if not torch.isfinite(torch.tensor(norm)):  # a NaN/inf loss or gradient: skip the step,
            return False, norm, None                # weights and AdamW state untouched
        self.optimizer.step()
        return True, norm, None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        if "steps_taken" in sd:  # from sharded_state_dict: put back AdamW's per-parameter step
            sd = dict(sd)
            step = torch.tensor(float(sd.pop("steps_taken")))
            sd["state"] = {k: {**v, "step": step.clone()} for k, v in sd["state"].items()}
        self.optimizer.load_state_dict(sd)

    def _init_state(self) -> None:
        """AdamW's state for every parameter (it is created lazily at the first step)."""
        for p in self.params:
            st = self.optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False, **_):
        """The optimizer state as sharded tensors named after the model's (as megatron's
        optimizers do), so a checkpoint loads at another tp / pp layout."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, optim_state_to_sharding_state)
        self._init_state()
        sd = self.optimizer.state_dict()
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        steps = [float(self.optimizer.state[p]["step"]) for p in order]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, order)
        optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
        sd["steps_taken"] = steps[0] if steps else 0.0
        return sd


class CapturableAdamW(torch.optim.AdamW):
    """torch's fused AdamW with ``capturable=True``, as the inner optimizer of a megatron-core
    optimizer when the whole step is a CUDA graph (TE's FusedAdam steps with a host-side
    count). The LR may be a device tensor; ``found_inf`` (a device flag) skips the update in
    the kernel. ``state_dict`` / ``load_state_dict`` use TE FusedAdam's layout (the step count
    in the param group, none per parameter), which megatron's checkpoint code expects when TE
    is installed, so checkpoints move freely between graphs.scope=step and the other scopes."""

    def __init__(self, param_groups: list, **defaults):
        torch_keys = ("capturable", "fused", "foreach", "differentiable", "amsgrad", "maximize",
                      "decoupled_weight_decay")
        groups = [{k: v for k, v in g.items() if k not in torch_keys} for g in param_groups]
        super().__init__(groups, fused=True, capturable=True, **defaults)
        self.state_complete = False

    def complete_state(self) -> None:
        """Every parameter's state, with its step count as a device tensor (megatron creates
        moments without a step, and puts a loaded step count in the param group). Eager only:
        before the first step, and before the first step (or capture) after a load."""
        if self.state_complete:
            return
        self.state_complete = True
        for g in self.param_groups:
            step = g.pop("step", None)
            for p in g["params"]:
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if step is not None or "step" not in st:
                    st["step"] = torch.tensor(float(step or 0), dtype=torch.float32, device=p.device)

    def step(self, closure=None):
        if not torch.cuda.is_current_stream_capturing():
            self.complete_state()
        return super().step(closure)

    def state_dict(self):
        sd = super().state_dict()
        # torch hands out the live per-parameter dicts: copy them, never pop from them (a
        # captured step keeps using those step tensors)
        steps = {float(st["step"]) for st in sd["state"].values() if "step" in st}
        sd["state"] = {k: {n: v for n, v in st.items() if n != "step"}
                       for k, st in sd["state"].items()}
        for g in sd["param_groups"]:
            if torch.is_tensor(g["lr"]):
                g["lr"] = float(g["lr"])
            if steps and g["params"]:
                g["step"] = int(max(steps))
        return sd

    def load_state_dict(self, state_dict):
        # TE layout in (a torch layout, per-parameter steps, is taken too). torch wants a step
        # on every parameter's state to take it; megatron's distributed optimizer then copies
        # the moments into that state key by key, and a 'step' there has no source in its
        # checkpoint. So the count is kept in the param group, as TE does, until
        # complete_state hands it to every parameter before the next step.
        groups = [dict(g) for g in state_dict["param_groups"]]
        state = {k: dict(v) for k, v in state_dict["state"].items()}
        for g in groups:
            steps = [float(state[i]["step"]) for i in g["params"] if "step" in state.get(i, {})]
            if "step" not in g and steps:
                g["step"] = int(max(steps))
            for i in g["params"]:
                if i in state and "step" not in state[i]:
                    state[i]["step"] = torch.tensor(float(g.get("step") or 0), dtype=torch.float32)
        super().load_state_dict({**state_dict, "state": state, "param_groups": groups})
        for st in self.state.values():
            st.pop("step", None)
        self.state_complete = False


class SyncFreeStep:
    """megatron-core's optimizer step with no host sync, so it can be captured in a CUDA
    graph (graphs.scope=step). Same contract as ``optimizer.step()``: ``(ok, grad_norm, None)``,
    here as device tensors.

    megatron's own step reads the gradient norm on the host (clipping, and vitgraph's skip of
    non-finite steps); here the norm is reduced over megatron's grad-stats group and the fused
    AdamW kernel clips, dividing each gradient by a device factor (its ``grad_scale``). A
    non-finite norm sets ``found_inf`` and the fused kernel
    leaves weights, moments and step counts as they were; the LR schedule still advances by
    one (the host cannot know). Uses megatron's pieces for the rest: ``prepare_grads`` (main
    gradients), ``get_main_grads_for_grad_norm`` (each shared gradient counted once) and
    ``step_with_ready_grads`` (inner step, bf16 copy, parameter all-gather)."""

    def __init__(self, optimizer, clip_grad: float):
        self.optimizer = optimizer
        self.parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        self.clip = clip_grad
        for part in self.parts:
            inner = part.optimizer
            d = inner.defaults
            part.optimizer = CapturableAdamW(inner.param_groups, lr=d["lr"], betas=d["betas"],
                                             eps=d["eps"], weight_decay=d["weight_decay"])
        dev = torch.device("cuda", torch.cuda.current_device())
        self.found_inf = torch.zeros((), device=dev)  # 0-dim, as the fused kernel's step counts
        self._lrs = [torch.zeros((), device=dev) for part in self.parts
                     for _ in part.optimizer.param_groups]

    def _groups(self):
        return [g for part in self.parts for g in part.optimizer.param_groups]

    def load_lr(self) -> None:
        """Eager, before each step (or its replay): the schedule's LR into the device tensors."""
        for part in self.parts:
            part.optimizer.complete_state()  # after a load: before a capture can need it
        for t, g in zip(self._lrs, self._groups()):
            t.fill_(float(g["lr"]))

    @torch.no_grad()
    def step(self):
        for part in self.parts:
            part.prepare_grads()
        grads = [g for part in self.parts for g in part.get_main_grads_for_grad_norm()]
        sq = (torch.stack(torch._foreach_norm(grads)).square().sum() if grads
              else torch.zeros((), device=self.found_inf.device))
        torch.distributed.all_reduce(sq, group=self.parts[0].get_grad_stats_parallel_group())
        norm = sq.sqrt()
        self.found_inf.copy_(torch.isfinite(norm).logical_not())
        # clipping as the fused kernel's grad_scale (it divides each gradient as it reads it):
        # no separate pass over the gradients
        scale = ((norm + 1e-6) / self.clip).clamp(min=1.0) if self.clip > 0 else None
        floats = []
        for t, g in zip(self._lrs, self._groups()):
            floats.append(g["lr"])
            g["lr"] = t
        try:
            for part in self.parts:
                part.optimizer.found_inf = self.found_inf
                part.optimizer.grad_scale = scale
                part.step_with_ready_grads()
        finally:
            for f, g in zip(floats, self._groups()):
                g["lr"] = f
        return self.found_inf == 0, norm, None


def _multi_tensor_copy(this: list, that: list) -> None:
    """``that[i].copy_(this[i])`` for all i in a few kernels (TE's multi-tensor scale by 1.0,
    which rounds as ``copy_`` does), one call per pair of dtypes."""
    from megatron.core.optimizer.optimizer import _multi_tensor_copy_this_to_that
    by_dtypes: dict = {}
    for a, b in zip(this, that):
        by_dtypes.setdefault((a.dtype, b.dtype), ([], []))
        by_dtypes[(a.dtype, b.dtype)][0].append(a)
        by_dtypes[(a.dtype, b.dtype)][1].append(b)
    for src, dst in by_dtypes.values():
        flag = torch.zeros(1, dtype=torch.int, device=dst[0].device)
        _multi_tensor_copy_this_to_that(this=src, that=dst, overflow_buf=flag)


def _copy_weights_in_one_kernel(optimizer) -> None:
    """megatron-core 0.16.1 copies the optimizer's fp32 weights into the bf16 model one tensor
    at a time: its bf16 optimizer passes no overflow buffer (apex's multi-tensor scale once
    lacked bf16) and its distributed optimizer loops over parameter shards. That is about 300
    kernel launches a step for a ViT-L, 0.9 ms of a 14 ms step at micro-batch 8 on an H200.
    Here the same copies go through one multi-tensor call. The distributed optimizer keeps
    megatron's own copy where it does more than copy (FSDP, FP8 parameters,
    precision-aware optimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    def float16_copy(part):
        model, main = part._get_model_and_main_params_data_float16()
        if model:
            _multi_tensor_copy(main, model)

    def distributed_copy(part):
        # megatron's copy_group_params, with the copies gathered into one call
        this, that = [], []
        for main_groups, model_groups in ((part.shard_fp32_from_float16_groups, part.model_float16_groups),
                                          (part.shard_fp32_groups, part.model_fp32_groups)):
            for main_group, model_group in zip(main_groups, model_groups):
                for main, param in zip(main_group, model_group):
                    world = part._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    gbuf, _, bucket = part.model_param_gbuf_map[param]
                    data = part.buffers[gbuf].buckets[bucket].param_data
                    this.append(main)
                    that.append(data.view(-1)[world.start:world.end])
        if this:
            _multi_tensor_copy(this, that)

    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(part, DistributedOptimizer):
            if (part.is_stub_optimizer or part.ddp_config.use_megatron_fsdp
                    or part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                    or part._get_fp8_params_and_shard_fp32_from_fp8()[0]):
                continue
            part._copy_main_params_to_model_params = lambda part=part: distributed_copy(part)
        elif isinstance(part, Float16OptimizerWithFloat16Params):
            part._copy_main_params_to_model_params = lambda part=part: float16_copy(part)


def _at_buffer_offsets(packed: torch.Tensor, buffer) -> torch.Tensor:
    """One buffer's gathered state as megatron's ``get_parameter_state_dp_zero`` packs it
    (bucket after bucket, each bucket's end padding left out) laid out at the buffer's own
    offsets, zeros in the padding; ``packed`` itself where no bucket but the last is padded."""
    buckets = buffer.buckets
    if all(b.grad_data.numel() == b.numel_unpadded for b in buckets[:-1]):
        return packed
    out = packed.new_zeros(buffer.numel)
    start = 0
    for b in buckets:
        out[b.offset:b.offset + b.numel_unpadded] = packed[start:start + b.numel_unpadded]
        start += b.numel_unpadded
    return out


def checkpoint_state_at_parameter_offsets(optimizer) -> None:
    """Each part of ``optimizer`` that is megatron's ``DistributedOptimizer`` saves every
    parameter's own fp32 weights and Adam moments in the ``fully_reshardable`` checkpoint
    format (vitgraph.train.checkpoint).

    megatron-core < 0.20 gathers a buffer's state with the padding at the end of each bucket
    left out (``get_parameter_state_dp_zero``), then cuts parameters out of it at their offsets
    in the padded buffer (``param_index_map``, in ``sharded_param_state_fully_reshardable``).
    Parameters start on multiples of 64 elements and buckets end on multiples of lcm(dp, 128)
    (with more than 40M elements, or 1M x dp, a buffer has several buckets): where a bucket
    other than the last needs padding to get there, every parameter in the later buckets was
    saved shifted by that padding, and the last parameters of the buffer came out short,
    zero-filled with the warning "'<name>' param range exceeds unpadded buffer by N
    elements" (megatron issue #504). ViT-B/16 with 10 classes (86M parameters, buckets of 40M
    elements): the head's 10-element bias leaves the first bucket 64 short, so the state of the
    other 45.6M elements (the embeddings, layers 0-5, layer 6's attention) was saved 64
    elements off, cls_token's last 64 as zeros; on resume those master weights overwrite the
    model at the first step.
    Here the gathered state is laid out at the buffer's offsets while that function cuts it,
    so each cut is exactly one parameter's state, whatever the layout."""
    from megatron.core import package_info
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    if (int(package_info.MAJOR), int(package_info.MINOR)) >= (0, 20):
        return  # megatron shifts its cuts itself from 0.20 (its PR #5077)
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(part, DistributedOptimizer):
            _cut_at_parameter_offsets(part)


def _cut_at_parameter_offsets(part) -> None:
    gather = part.get_parameter_state_dp_zero
    cut = part.sharded_param_state_fully_reshardable

    def gather_at_buffer_offsets(**kwargs):
        state = gather(**kwargs)
        if state is not None:  # (None on dp ranks > 0 in megatron's memory-efficient mode)
            for i, buffer in enumerate(part.buffers):
                for world in state[i].values():
                    for key in ("param", "exp_avg", "exp_avg_sq"):
                        if key in world:
                            world[key] = _at_buffer_offsets(world[key], buffer)
        return state

    def cut_at_parameter_offsets(*args, **kwargs):
        part.get_parameter_state_dp_zero = gather_at_buffer_offsets
        try:
            return cut(*args, **kwargs)
        finally:
            part.get_parameter_state_dp_zero = gather

    part.sharded_param_state_fully_reshardable = cut_at_parameter_offsets


def allocate_offloaded_state(optimizer) -> None:
    """Give megatron's CPU-offloading optimizer (optim.offload_fraction) its state before a
    checkpoint is loaded: without one, its load_state_dict allocates it by a step on random
    gradients whose copy back overwrites the weights the checkpoint load has just filled in
    place (the resumed run then departs from the uninterrupted one)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer) and not inner.state:
            inner.dummy_step()


def offload_pickled_classes() -> list:
    """The optimizer classes megatron's CPU-offloading optimizer keeps in its param groups,
    and so pickles into a checkpoint: a resume (offloaded or not) lets torch.load, which
    refuses classes under weights_only, take exactly these."""
    from megatron.core import optimizer as mo
    return sorted({mo.Adam, mo.SGD, mo.CPUAdam, mo.CPUSGD}, key=repr)


def build_optimizer(chunks: list, plan: Plan):
    """``chunks``: this rank's (wrapped) model chunks; ``plan``: the device, the graph path,
    its ``optim:`` section and megatron's distributed optimizer (parallel.
    distributed_optimizer). With graphs.scope=step on GPU the megatron optimizer's ``step``
    is replaced by a ``SyncFreeStep`` (its ``load_lr`` is called before every step)."""
    o, distributed = plan.optim, plan.parallel.distributed_optimizer
    if not plan.cuda:
        optimizer = CpuOptimizer(chunks, o, plan.lr_rules)
        fill_frozen_slices(optimizer, chunks)
        return optimizer
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride
    config = chunks[0].config
    ocfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
        bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed,
        # optim.offload_fraction: megatron's HybridDeviceOptimizer steps that share of the
        # state on the CPU; it keeps the master weights itself (the precision-aware path)
        **(dict(optimizer_cpu_offload=True, optimizer_offload_fraction=o.offload_fraction,
                use_precision_aware_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True)
           if o.offload_fraction else {}))
    # the same no-decay set as the CPU path (megatron's default decays pos_embed / tokens)
    no_decay = ParamKey(with_name_predicate=ParamWithNamePredicate(
        name="vitgraph_no_decay", fn=lambda p, n: _no_decay(n, p)))
    overrides = {no_decay: ParamGroupOverride(wd_mult=0.0)}
    # layer decay and lr_rules (lm.tower_lr_scale): one key per lr scale, matched by parameter
    # (megatron merges the matches of a parameter, so each (decay, scale) pair becomes one
    # group, aligned over all ranks)
    by_scale: dict[float, set] = {}
    for pid, s in lr_scales(chunks, o.layer_decay, plan.lr_rules).items():
        by_scale.setdefault(s, set()).add(pid)
    for s, ids in sorted(by_scale.items()):
        if s != 1.0:
            key = ParamKey(with_name_predicate=ParamWithNamePredicate(
                name=f"vitgraph_lr_scale_{s!r}", fn=lambda p, n, ids=frozenset(ids): id(p) in ids))
            overrides[key] = ParamGroupOverride(max_lr=o.lr * s, min_lr=o.min_lr * s)
    optimizer = get_megatron_optimizer(ocfg, chunks, config_overrides=overrides)
    checkpoint_state_at_parameter_offsets(optimizer)
    if not plan.fsdp:  # (multi-tensor kernels take no DTensors)
        _copy_weights_in_one_kernel(optimizer)
    fill_frozen_slices(optimizer, chunks)
    if plan.graphs.scope == "step":
        sync_free = SyncFreeStep(optimizer, o.clip_grad)
        optimizer.step, optimizer.load_lr = sync_free.step, sync_free.load_lr
        return optimizer
    # megatron's bf16 optimizer steps on a NaN gradient norm: skip such steps instead
    return skip_nonfinite_steps(optimizer)


def build_scheduler(optimizer, o: OptimConfig, total_steps: int) -> OptimizerParamScheduler:
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_fraction * total_steps)
    warmup = min(warmup, max(total_steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, 1), lr_decay_style="cosine",
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
