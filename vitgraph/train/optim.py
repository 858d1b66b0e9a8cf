"""AdamW with warm-up + cosine. GPU: megatron-core's optimizer (bf16 master weights, clipping,
optionally distributed). CPU: ``CpuOptimizer``, torch AdamW behind the same interface."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from vitgraph.config import OptimConfig
from vitgraph.parallel import cpu_shims


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # biases, norms, tokens and position embeddings: no weight decay (as megatron and timm)
    return p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "registers"))


class CpuOptimizer:
    """torch AdamW with megatron's optimizer contract: ``step() -> (ok, grad_norm, None)``.

    Does what megatron's DDP + optimizer do on GPU: averages gradients over the data-parallel
    group, clips by the global norm (over the model-parallel group), steps.
    """

    def __init__(self, chunks: list[torch.nn.Module], o: OptimConfig):
        named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        decay = [p for n, p in named if not _no_decay(n, p)]
        no_decay = [p for n, p in named if _no_decay(n, p)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
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
        self._all_reduce([p.grad for p in self.params if p.grad is not None],
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


def build_optimizer(chunks: list, plan, o: OptimConfig, distributed: bool):
    """``chunks``: this rank's (wrapped) model chunks; ``plan`` (vitgraph.plan.Plan): the
    device and the graph path; ``o``: the ``optim:`` section; ``distributed``: megatron's
    distributed optimizer (parallel.distributed_optimizer). With graphs.scope=step on GPU
    the megatron optimizer's ``step`` is replaced by a ``SyncFreeStep`` (its ``load_lr`` is
    called before every step)."""
    if not plan.cuda:
        return CpuOptimizer(chunks, o)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride
    config = chunks[0].config
    ocfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
        bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed)
    # the same no-decay set as the CPU path (megatron's default decays pos_embed / tokens)
    no_decay = ParamKey(with_name_predicate=ParamWithNamePredicate(
        name="vitgraph_no_decay", fn=lambda p, n: _no_decay(n, p)))
    optimizer = get_megatron_optimizer(
        ocfg, chunks, config_overrides={no_decay: ParamGroupOverride(wd_mult=0.0)})
    _copy_weights_in_one_kernel(optimizer)
    if plan.graphs.scope == "step":
        sync_free = SyncFreeStep(optimizer, o.clip_grad)
        optimizer.step, optimizer.load_lr = sync_free.step, sync_free.load_lr
        return optimizer
    # megatron's bf16 optimizer steps on a NaN gradient norm: skip such steps instead
    from vitgraph.train.health import skip_nonfinite_steps
    return skip_nonfinite_steps(optimizer)


def build_scheduler(optimizer, o: OptimConfig, total_steps: int) -> OptimizerParamScheduler:
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_fraction * total_steps)
    warmup = min(warmup, max(total_steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, 1), lr_decay_style="cosine",
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
