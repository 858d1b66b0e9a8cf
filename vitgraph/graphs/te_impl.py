"""impl: te -- Transformer Engine's make_graphed_callables behind vitgraph's slots.

Needed for FP8: TE owns the scaling state (amax histories, scale updates, weight caches)
and its graphed callables update it around each replay. vitgraph keeps its own
bookkeeping -- keys, slots per microbatch in flight, unseen shapes, stats -- and asks TE to
capture one (layer, key, slot) at a time:

* TE's graphed function must take and return tensors only (TE before 2.13 crashed on the
  `None` a megatron TransformerLayer returns as its context). A private wrapper module
  takes only the tensor leaves of the call, rebuilds the real arguments (None kwargs,
  flags, megatron's PackedSeqParams around its cu_seqlens leaves) from the key's spec, and
  returns only the tensor leaves of the output;
  vitgraph puts the None / non-tensor leaves back afterwards. This works on every TE
  release, with or without TE's own fix.
* One graph pool per slot, as in the local impl (slots are captured on demand, not in
  one call in schedule order as with TE's `_order`; see callable.py, "Memory").
* Keyword names changed across TE releases (fp8_enabled -> enabled, fp8_recipe ->
  recipe, fp8_group -> amax_reduction_group); they are looked up with inspect.signature.
* FP8: captured with whatever FP8 autocast is active at the layer call (megatron wraps
  each layer in its fp8 context), with that recipe and amax group.
* RNG: TE registers the generators of its own RNG registry with each graph and restores
  them after warm-up. megatron's graph-safe tracker generators are added to that registry
  for the duration of the capture, so dropout inside megatron/TE forks is graph-safe.
* Released TE (<= 2.18) returns parameter gradients that alias its static buffers; newer
  TE clones them unless `clone_param_grads_on_return=False`. vitgraph passes False where it
  exists and applies its own copy-on-conflict guard at forward time (the buffers' addresses
  are learnt from the first backward of each slot), so .grad accumulation stays exact.
  Input gradients for autograd leaves get a copy through a tensor hook (once per tensor).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

import torch

from . import tree
from .backend import megatron_rng_tracker
from .callable import GraphedCallable, ParamSideEffects, Slot, capture_flags


def te_make_graphed_callables() -> Callable:
    try:
        from transformer_engine.pytorch import make_graphed_callables
    except ImportError:  # pragma: no cover - depends on TE layout
        from transformer_engine.pytorch.graph import make_graphed_callables
    return make_graphed_callables


def fp8_state_manager() -> Any:
    """TE's FP8GlobalStateManager if TE is loaded (never imports TE itself)."""
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name, fromlist=["FP8GlobalStateManager"])
            except ImportError:
                continue
        mgr = getattr(mod, "FP8GlobalStateManager", None)
        if mgr is not None:
            return mgr
    return None


def fp8_active() -> bool:
    mgr = fp8_state_manager()
    if mgr is None:
        return False
    try:
        return bool(mgr.is_fp8_enabled())
    except Exception:  # pragma: no cover - defensive
        return False


class _with_megatron_rng_in_te_registry:
    """Add megatron's graph-safe tracker generators to TE's RNG registry for a capture."""

    def __enter__(self):
        self.added: list = []
        mod = sys.modules.get("transformer_engine.pytorch.distributed")
        self.reg = mod.get_all_rng_states() if mod is not None and hasattr(mod, "get_all_rng_states") else None
        tracker = megatron_rng_tracker()
        if not isinstance(self.reg, dict) or tracker is None:
            return self
        present = {id(v) for v in self.reg.values()}
        for name, gen in (getattr(tracker, "states_", None) or {}).items():
            if isinstance(gen, torch.Generator) and id(gen) not in present:
                key = f"vitgraph/megatron/{name}"
                self.reg[key] = gen
                self.added.append(key)
        return self

    def __exit__(self, *exc):
        for key in self.added:
            self.reg.pop(key, None)


class _TensorsOnly(torch.nn.Module):
    """What TE graphs: f(*tensor leaves) -> tuple of tensor leaves."""

    def __init__(self, layer: torch.nn.Module, forward_fn: Callable, spec: tuple):
        super().__init__()
        self.layer = layer  # registered so that TE sees the layer's parameters and TE modules
        self._forward_fn = forward_fn
        self._spec = spec
        self.out_spec: Optional[tuple] = None
        self.out_rg: list = []

    def forward(self, *tensors):
        args, kwargs = tree.unflatten(tensors, self._spec)
        out = self._forward_fn(*args, **kwargs)
        leaves, self.out_spec = tree.flatten(out)
        self.out_rg = [t.requires_grad for t in leaves]
        return tuple(leaves)


def _kwargs_for(fn: Callable, *, warmup_iters: int, pool: Any, fp8: bool) -> dict:
    params = inspect.signature(fn).parameters
    kw: dict = {}

    def put(names: tuple, value: Any) -> None:
        for n in names:
            if n in params:
                kw[n] = value
                return

    put(("num_warmup_iters",), warmup_iters)
    put(("allow_unused_input",), True)
    put(("pool",), pool)
    put(("clone_param_grads_on_return",), False)
    put(("enabled", "fp8_enabled"), fp8)
    if fp8:
        mgr = fp8_state_manager()
        put(("recipe", "fp8_recipe"), mgr.get_fp8_recipe())
        group = mgr.get_fp8_group() if hasattr(mgr, "get_fp8_group") else None
        if group is not None:
            put(("amax_reduction_group", "fp8_group"), group)
    return kw


class TEGraphedCallable(GraphedCallable):
    impl = "te"

    def __init__(self, *args, make_graphed_callables: Optional[Callable] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._mgc = make_graphed_callables

    def _capture(self, index: int, flat: list, spec: tuple) -> Slot:
        mgc = self._mgc or te_make_graphed_callables()
        slot = Slot(index)
        params = [p for p in self.module.parameters() if p.requires_grad]
        wrapper = _TensorsOnly(self.module, self.forward_fn, spec)
        sample = tuple(self._static_inputs(flat))
        kw = _kwargs_for(mgc, warmup_iters=max(1, self.warmup_iters), pool=self.backend.make_pool(),
                        fp8=fp8_active())
        backend = self.backend
        before = None
        if backend.memory_reserved() is not None:
            backend.synchronize()
            torch.cuda.empty_cache()
            before = backend.memory_reserved()
        # TE warms up with autograd.backward (not autograd.grad): megatron's capture flag
        # makes DDP's grad hooks return early, TE restores .grad, vitgraph restores main_grad
        with ParamSideEffects(params) as side, capture_flags(te=False), _with_megatron_rng_in_te_registry():
            if params or any(x.requires_grad for x in sample):
                graphed = mgc(wrapper, sample, **kw)
            else:  # a frozen layer on inputs that need no gradient (model.freeze): TE's
                wrapper(*sample)  # warm-up would ask autograd.grad for no inputs; run eagerly
                graphed = None
        if before is not None:
            backend.synchronize()
            torch.cuda.empty_cache()
            slot.pool_bytes = max(0, backend.memory_reserved() - before)
        slot.te_callable = graphed if graphed is not None else wrapper
        slot.static_in = list(sample)
        slot.params = params
        slot.out_spec = wrapper.out_spec
        slot.out_rg = list(wrapper.out_rg)
        slot.fused = side.fused
        return slot

    def run(self, slot: Slot, flat: list) -> Any:
        self.replays += 1
        if slot.grad_ptrs:
            for p in slot.params:
                pg = p.grad
                if pg is not None and pg.data_ptr() in slot.grad_ptrs:
                    p.grad = pg.clone()
        for p in slot.fused:
            p.grad_added_to_main_grad = True
        for x in flat:
            # TE hands back its static input-grad buffer; an autograd leaf (a pipeline
            # stage's received activation) would keep it as .grad -> give leaves a copy
            if x.requires_grad and x.grad_fn is None and not getattr(x, "_vitgraph_grad_copy", False):
                x.register_hook(torch.clone)
                x._vitgraph_grad_copy = True
        outs = slot.te_callable(*flat)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        outs = list(outs)
        node = None
        for i, rg in enumerate(slot.out_rg):
            if not rg:
                outs[i] = outs[i].detach()
            elif node is None and outs[i].grad_fn is not None:
                node = outs[i].grad_fn
        if node is None:
            slot.busy = False
        else:
            node.register_hook(_after_backward(slot))
        return tree.unflatten(outs, slot.out_spec)


def _after_backward(slot: Slot) -> Callable:
    def hook(grad_inputs, grad_outputs):
        if slot.grad_ptrs is None:
            slot.grad_ptrs = {g.data_ptr() for g in grad_inputs if isinstance(g, torch.Tensor)}
        slot.busy = False

    return hook
