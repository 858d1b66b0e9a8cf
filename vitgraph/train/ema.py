"""train.ema: an exponential moving average of the weights, in fp32 on the device.

One EMA tensor per fp32 weight the optimizer steps: megatron's main params on GPU
(``Float16OptimizerWithFloat16Params``: ``fp32_from_float16_groups``; ``DistributedOptimizer``:
``shard_fp32_from_float16_groups`` / ``shard_fp32_groups``, this rank's shard only, so the EMA
is sharded as the optimizer state is), the parameters themselves on CPU (``CpuOptimizer``) or
with megatron's fp32 optimizer. ``ChainedOptimizer`` parts are walked one by one.

After each optimizer step ``ema += w x (weights - ema)``, ``w = (1 - decay_n) x ok``:
``decay_n = min(decay, (1 + n) / (10 + n))`` with warm-up, ``n`` the updates applied before
this one (0 at the first step; skipped steps do not count), and ``ok`` the step's "applied"
flag. Both ``n`` and ``w`` are device tensors, so the update has no host read and runs inside
a captured step (graphs.scope=step) as it runs eagerly. A skipped step leaves the EMA as it
was.

Checkpoints hold the EMA as full model-shaped tensors named ``ema.<the model's sharded key>``
(the distributed optimizer's dp shards gathered at save, this rank's shard taken at load), so
they load at any tp / pp / dp layout, and ``steps`` (n) in the common state.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from vitgraph.train.optim import frozen_slices

log = logging.getLogger("vitgraph")

PREFIX = "ema"
_CHUNK = 1 << 26  # elements per update batch: bounds the temporary (weights - ema) to 256 MiB


class _Entry:
    """One model parameter: ``master`` the fp32 weight the optimizer steps (a shard of the
    parameter with the distributed optimizer, None where this rank holds none of it), ``ema``
    its average, ``span`` (start, end) of the flattened parameter that ``master`` covers (None:
    all of it), ``group`` the group holding the other shards."""

    def __init__(self, param, master, span=None, group=None):
        self.param, self.master, self.span, self.group = param, master, span, group
        self.ema = None if master is None else master.detach().clone().float()


def _weights(optimizer) -> list[tuple]:
    """(parameter, fp32 weight or None, span, group) for every parameter ``optimizer`` steps."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    out = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(part, DistributedOptimizer):
            if part.is_stub_optimizer:
                continue
            if part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise NotImplementedError("train.ema with the precision-aware optimizer (its "
                                          "main weights live inside the optimizer)")
            mine = {}
            for models, mains in ((part.model_float16_groups, part.shard_fp32_from_float16_groups),
                                  (part.model_fp32_groups, part.shard_fp32_groups)):
                for model_group, main_group in zip(models, mains):
                    for param, main in zip(model_group, main_group):
                        mine[param] = main
            # every parameter of the part's buffers, in the same order on every dp rank: the
            # gather at save lays all of them out in one flat buffer
            for param in part.model_param_gbuf_map:
                if param in mine:
                    r = part._get_model_param_range_map(param)["param"]
                    out.append((param, mine[param], (r.start, r.end), part.data_parallel_group))
                else:
                    out.append((param, None, (0, 0), part.data_parallel_group))
        elif isinstance(part, Float16OptimizerWithFloat16Params):
            for models, mains in ((part.float16_groups, part.fp32_from_float16_groups),
                                  (part.fp32_from_fp32_groups, part.fp32_from_fp32_groups)):
                for model_group, main_group in zip(models, mains):
                    out += [(p, m, None, None) for p, m in zip(model_group, main_group)]
        else:  # CpuOptimizer, megatron's FP32Optimizer: the parameters are the fp32 weights
            out += [(p, p, None, None) for g in part.param_groups for p in g["params"]]
    return out


def _batches(entries: list[_Entry]):
    batch, n = [], 0
    for e in entries:
        batch.append(e)
        n += e.ema.numel()
        if n >= _CHUNK:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


class WeightEMA:
    """The EMA of ``optimizer``'s weights (see the module's docstring). ``cfg``: train.ema."""

    def __init__(self, optimizer, cfg, device):
        self.decay, self.warmup = float(cfg.decay), bool(cfg.warmup)
        self.entries = [_Entry(*w) for w in _weights(optimizer)]
        self._local = [e for e in self.entries if e.ema is not None and e.ema.numel()]
        # the updates applied so far (n); fp32 counts exactly up to 2^24 steps
        self.count = torch.zeros((), dtype=torch.float32, device=device)

    def rebind(self, optimizer) -> None:
        """Point at ``optimizer``'s fp32 weights again (after its state was loaded, in case
        the load replaced tensors rather than copying into them)."""
        weights = _weights(optimizer)
        if [id(w[0]) for w in weights] != [id(e.param) for e in self.entries]:
            raise RuntimeError("train.ema: the optimizer holds other parameters than at the start")
        for e, (_, master, _, _) in zip(self.entries, weights):
            e.master = master

    @property
    def sharded(self) -> bool:
        return any(e.span is not None for e in self.entries)

    # ------------------------------------------------------------------ the update

    def decay_now(self) -> torch.Tensor:
        """decay_n of the next update, a device tensor."""
        if not self.warmup:
            return torch.full_like(self.count, self.decay)
        return ((1 + self.count) / (10 + self.count)).clamp(max=self.decay)

    @torch.no_grad()
    def update(self, ok=True) -> None:
        """After an optimizer step. ``ok``: the step was applied, a bool (eager: the host
        knows; False skips) or a device tensor (a captured step: folded into the weight)."""
        if not torch.is_tensor(ok):
            if not ok:
                return
            ok = None
        w = 1 - self.decay_now()
        if ok is not None:
            ok = ok.to(w.dtype)
            w = w * ok
            self.count.add_(ok)
        else:
            self.count.add_(1)
        for batch in _batches(self._local):
            ema = [e.ema for e in batch]
            diff = torch._foreach_sub([e.master for e in batch], ema)
            torch._foreach_mul_(diff, w)  # the Tensor overload: w stays on the device
            torch._foreach_add_(ema, diff)

    @torch.no_grad()
    def restart(self) -> None:
        """The EMA from the current weights, n = 0 (a checkpoint without an EMA)."""
        for e in self._local:
            e.ema.copy_(e.master)
        self.count.zero_()

    # ------------------------------------------------------------------ full tensors

    @torch.no_grad()
    def full(self) -> list[torch.Tensor]:
        """Every entry's EMA as a full fp32 tensor of its parameter's (local, tp-sharded)
        shape; the distributed optimizer's dp shards gathered (a collective on the dp group:
        every rank calls it)."""
        out: list = [None] * len(self.entries)
        groups: dict = {}
        for i, e in enumerate(self.entries):
            if e.span is None:
                out[i] = e.ema.view_as(e.param)
            else:
                groups.setdefault(e.group, []).append(i)
        for group, idx in groups.items():
            for i, t in zip(idx, gather_shards([self.entries[i] for i in idx], group)):
                out[i] = t
        return out

    def named(self, modules: list) -> dict[str, torch.Tensor]:
        """Copies of ``full()`` by parameter name in ``modules`` (this rank's model chunks;
        names are prefixed "<chunk index>." when there are several): what tests compare."""
        names = {}
        for i, m in enumerate(modules):
            for n, p in m.named_parameters():
                names.setdefault(id(p), f"{i}.{n}" if len(modules) > 1 else n)
        return {names[id(e.param)]: t.clone() for e, t in zip(self.entries, self.full())}

    @torch.no_grad()
    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """The inverse of ``full``: this rank's part of each full tensor into the EMA."""
        for e, t in zip(self.entries, tensors):
            if e.ema is None:
                continue
            t = t.to(e.ema.device, torch.float32)
            e.ema.copy_(t.reshape(-1)[e.span[0]:e.span[1]] if e.span else t.view_as(e.ema))

    # ------------------------------------------------------------------ checkpoints

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool = False) -> dict:
        """{"weights": {i: ShardedTensor "ema.<model key>"}, "steps": n}; ``model_sharded``:
        the chunks' sharded state dicts, whose tensors name the parameters."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
        by_param = {id(t.data): t for t in nested_values(
            extract_sharded_tensors_and_factories(model_sharded)[0])}
        if is_loading:
            tensors = [torch.empty(e.param.shape, dtype=torch.float32, device=e.param.device)
                       for e in self.entries]
        else:
            tensors = self.full()
        weights = {}
        for i, (e, t) in enumerate(zip(self.entries, tensors)):
            sh = by_param.get(id(e.param))
            if sh is None:
                raise RuntimeError(f"train.ema: a parameter of shape {tuple(e.param.shape)} has "
                                   f"no sharded tensor in the model's state dict")
            weights[str(i)] = make_sharded_optimizer_tensor(sh, t, PREFIX)
        out = {"weights": weights, "steps": 0 if is_loading else int(self.count.item())}
        # some layers of a stacked tensor frozen: their slices (the frozen weights, their own
        # average) make the saved tensor whole. Collective: every rank calls it
        frozen = {id(t.data) for t in by_param.values() if not t.data.requires_grad}
        fill = frozen_slices({"weights": weights}, model_sharded, frozen, weights=True)
        if fill:
            out["frozen"] = fill
        return out

    def load_sharded(self, state: dict) -> None:
        """What ``dist_checkpointing.load`` returned for ``sharded_state_dict(is_loading=True)``."""
        self.load_full([state["weights"][str(i)] for i in range(len(self.entries))])
        self.count.fill_(float(state["steps"]))

    # ------------------------------------------------------------------ evaluation

    @contextlib.contextmanager
    def swapped(self, wrapped: list | None = None):
        """The EMA weights in the model's parameters (cast to their dtype) inside the block,
        the raw ones back after. ``wrapped``: the DDP chunks; with the distributed optimizer's
        overlapped parameter gather its forward hooks are paused (after a synchronous gather)
        so that they do not overwrite the swapped weights."""
        hooked = [w for w in wrapped or [] if getattr(w, "use_forward_hook", False)]
        for w in hooked:
            w.disable_forward_pre_hook(param_sync=True)
        full = self.full()
        with torch.no_grad():
            saved = [e.param.detach().clone() for e in self.entries]
            for e, t in zip(self.entries, full):
                e.param.data.copy_(t)
        del full
        try:
            yield
        finally:
            with torch.no_grad():
                for e, t in zip(self.entries, saved):
                    e.param.data.copy_(t)
            for w in hooked:
                w.enable_forward_pre_hook()


def gather_shards(entries: list, group) -> list[torch.Tensor]:
    """Full fp32 tensors of ``entries`` (each ``param``, ``ema`` (None: no shard here) and
    ``span``) from every rank's shards: one flat buffer, each rank's shards in their places,
    zeros elsewhere, summed over ``group`` (each element is held by exactly one rank)."""
    sizes = [e.param.numel() for e in entries]
    device = next((e.ema.device for e in entries if e.ema is not None), entries[0].param.device)
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    offset = 0
    for e, n in zip(entries, sizes):
        if e.ema is not None and e.span[1] > e.span[0]:
            flat[offset + e.span[0]:offset + e.span[1]].copy_(e.ema.view(-1))
        offset += n
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    return [t.view(e.param.shape) for t, e in zip(flat.split(sizes), entries)]


def build_ema(cfg, optimizer, device) -> WeightEMA | None:
    """train.ema's EMA of ``optimizer``'s weights (``cfg``: the plan's ``ema``), or None
    without one."""
    if cfg is None:
        return None
    ema = WeightEMA(optimizer, cfg, device)
    log.info("ema: decay %g%s over %d weight tensors in fp32%s", ema.decay,
             ", warm-up min(decay, (1 + n) / (10 + n))" if ema.warmup else "",
             len(ema._local), ", sharded like the distributed optimizer" if ema.sharded else "")
    return ema
