"""AdamW with warm-up + cosine. GPU: megatron-core's optimizer (bf16 master weights, clipping,
optionally distributed). CPU: ``CpuOptimizer``, torch AdamW behind the same interface."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from vitgraph.config import Config
from vitgraph.parallel import cpu_shims


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # biases, norms, tokens and position embeddings: no weight decay (as megatron and timm)
    return p.ndim <= 1 or name.endswith(("pos_embed", "cls_token", "registers"))


class CpuOptimizer:
    """torch AdamW with megatron's optimizer contract: ``step() -> (ok, grad_norm, None)``.

    Does what megatron's DDP + optimizer do on GPU: averages gradients over the data-parallel
    group, clips by the global norm (over the model-parallel group), steps.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config):
        o = cfg.optim
        self.params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for n, p in model.named_parameters() if p.requires_grad and not _no_decay(n, p)]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and _no_decay(n, p)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        self.clip = o.clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        dp = ps.get_data_parallel_group()
        if dist.get_world_size(dp) > 1:
            grads = [p.grad for p in self.params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp)
            flat /= dist.get_world_size(dp)
            for g, new in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(new.view_as(g))
        norm = cpu_shims.clip_grad_norm(self.params, self.clip, ps.get_model_parallel_group())
        if not torch.isfinite(torch.tensor(norm)):  # a NaN/inf loss or gradient: skip the step,
            return False, norm, None                # weights and AdamW state untouched
        self.optimizer.step()
        return True, norm, None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)


def build_optimizer(model, cfg: Config, cuda: bool):
    o = cfg.optim
    if not cuda:
        return CpuOptimizer(model, cfg)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ocfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
        bf16=model.config.bf16, params_dtype=model.config.params_dtype,
        use_distributed_optimizer=False)
    # megatron's bf16 optimizer steps on a NaN gradient norm: skip such steps instead
    from vitgraph.train.health import skip_nonfinite_steps
    return skip_nonfinite_steps(get_megatron_optimizer(ocfg, [model]))


def build_scheduler(optimizer, cfg: Config, total_steps: int) -> OptimizerParamScheduler:
    o = cfg.optim
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_fraction * total_steps)
    warmup = min(warmup, max(total_steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, 1), lr_decay_style="cosine",
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
