"""GraphManager: per-layer CUDA graphs for the TransformerLayers of a model.

    manager = GraphManager.for_model(model_chunks, cfg.graphs)   # patches layer.forward
    for step in range(steps):
        manager.step_begin(step)      # eager for the first `warmup_steps` steps, then graphs
        ...forward/backward through megatron's schedule...
        log(manager.stats())
    manager.reset()                   # after a checkpoint load / parameter replacement
    manager.restore()                 # original forwards back

How a call is routed (each layer's instance attribute `forward` is replaced; `state_dict`
names do not change):

* eager, counted by reason, when: still warming up (`warmup`), grad mode is off
  (`no_grad`) or the layer is in eval mode (`eval`) -- training graphs bake in dropout and
  saved activations --, an argument is neither a tensor, a plain constant nor a known
  dataclass (`unsupported_arg`; megatron's PackedSeqParams is known: its cu_seqlens are
  static inputs, its qkv_format and max_seqlen part of the key, see tree.py), FP8 is
  active under impl local
  (`fp8_needs_te`), a shape first seen after the capture step under
  `on_new_shape: eager` (`unseen_shape`), or every slot of the shape is busy and
  max_slots are captured (`slots_exhausted`);
* otherwise the layer's graphs for the call's key: replay a free slot, or capture one.

Steps are counted by `step_begin()` calls since the manager was built (the step number
passed is only recorded for logs), so a run resumed from a checkpoint warms up eagerly
again before capturing. The first non-warm-up step is the capture step: every shape seen
up to and including it is expected; a shape first seen later is counted in
`unseen_shapes` and handled by `on_new_shape`. `step_begin()` also frees slots whose
backward never ran (a forward with grad whose output was not differentiated), counted as
`leaked_slots`; call it before each step's first forward, after the previous backward.

Requirements on a GPU (checked, with the fix in the error message):
* training runs on a side stream -- call `vitgraph.graphs.use_side_stream()` before the
  model and its megatron DDP wrapper are built. DDP keeps each parameter's autograd
  accumulator node, which remembers the stream it was made on; on the legacy default
  stream the captured backward would have to wait on that stream, which CUDA forbids
  (megatron's own graphs switch streams the same way). Graphs are then captured and
  replayed on the training stream itself.
* with Transformer Engine attention, megatron's RNG tracker must be TE's
  (`model_parallel_cuda_manual_seed(seed, te_rng_tracker=True)`): TE asserts it under
  capture. It is graph-safe; without TE, `use_cudagraphable_rng=True` is.

Memory (`pool`): without a pipeline (`shared`; `auto` when megatron DDP wraps the layers and
megatron's pipeline size, or the `pipeline_size` passed, is 1) each layer's first slot is
captured in the order the step runs it -- forwards first, each backward at its first
backward -- and all of them share one pool per capture step, so temporaries are reused
across layers as in eager mode; the next step replays them in the same order. Under a
pipeline schedule (`slot`) every slot (a layer's forward + backward graph for one shape and
one microbatch in flight) has its own pool, because there no capture order matches every
replay order; see callable.py.

Parameter replacement (a new tensor assigned to a parameter, `.data` swapped, requires_grad
flipped, megatron's main_grad buffer re-made) is detected once per step per layer by
comparing a tuple of (id, data_ptr, requires_grad, main_grad ptr) taken at capture; the
layer's graphs are then dropped and re-captured (`recaptures.params_changed`). Loading a
checkpoint in place (`load_state_dict` copies into the existing tensors) keeps graphs
valid; `reset()` drops everything anyway, for any state the graphs may have baked in.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Mapping, Optional, Sequence

import torch

from . import tree
from .backend import LEGACY_STREAM_HELP, CaptureBackend, default_backend, megatron_tracker_is_graph_safe
from .callable import GraphedCallable, OrderedGroup, call_key, preflight
from .config import GraphsConfig
from .cudnn import te_attention_backend
from .te_impl import TEGraphedCallable, fp8_active

log = logging.getLogger("vitgraph.graphs")


class _Layer:
    __slots__ = ("index", "module", "orig_forward", "prev_instance_forward", "callable", "checked", "patched",
                 "preflighted")

    def __init__(self, index: int, module: torch.nn.Module):
        self.index = index
        self.module = module
        self.prev_instance_forward = module.__dict__.get("forward")
        self.orig_forward = module.forward  # bound method (or an earlier instance override)
        self.callable: Optional[GraphedCallable] = None
        self.checked = -1
        self.patched = False
        self.preflighted = False


def _megatron_pipeline_size() -> Optional[int]:
    """megatron's pipeline size where its parallel state is set up, else None (unknown)."""
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_pipeline_model_parallel_world_size()
    except Exception:  # megatron missing or half set up: unknown
        pass
    return None


def find_transformer_layers(model_chunks: Any) -> list:
    """The layers of every megatron TransformerBlock in the chunks, in model order.

    Falls back to any module whose class derives from megatron's BaseTransformerLayer (or,
    without megatron, is named *TransformerLayer) when no TransformerBlock is present.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    try:
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_layer import BaseTransformerLayer
    except ImportError:  # pragma: no cover - megatron is a hard dependency
        TransformerBlock = BaseTransformerLayer = None
    layers: list = []
    seen: set = set()
    for chunk in chunks:
        for m in chunk.modules():
            if TransformerBlock is not None and isinstance(m, TransformerBlock):
                for layer in m.layers:
                    if id(layer) not in seen:
                        seen.add(id(layer))
                        layers.append(layer)
    if layers:
        return layers
    for chunk in chunks:
        for m in chunk.modules():
            is_layer = (BaseTransformerLayer is not None and isinstance(m, BaseTransformerLayer)) or \
                type(m).__name__.endswith("TransformerLayer")
            if is_layer and id(m) not in seen:
                seen.add(id(m))
                layers.append(m)
    return layers


class GraphManager:
    def __init__(self, cfg: GraphsConfig | Mapping | None, layers: Sequence[torch.nn.Module], *,
                 backend: Optional[CaptureBackend] = None,
                 te_make_graphed_callables: Any = None, pipeline_size: Optional[int] = None):
        if cfg is None:
            cfg = GraphsConfig()
        elif isinstance(cfg, Mapping):
            cfg = GraphsConfig.from_dict(cfg)
        elif not isinstance(cfg, GraphsConfig):  # a config object from elsewhere with the same fields
            cfg = GraphsConfig(**{k: getattr(cfg, k) for k in GraphsConfig.__dataclass_fields__ if hasattr(cfg, k)})
        cfg.validate()
        self.cfg = cfg
        self._backend = backend
        self._te_mgc = te_make_graphed_callables
        self.layers = [_Layer(i, m) for i, m in enumerate(layers)]
        self._applied = False
        self._nsteps = 0  # step_begin() calls
        self._step: Optional[int] = None
        self._capture_index: Optional[int] = None  # 0-based step index of the capture step
        self._known: set = set()
        self._unseen: set = set()
        self._fallbacks: collections.Counter = collections.Counter()
        self._recaptures: collections.Counter = collections.Counter()
        self._leaked = 0
        self._capture_time = 0.0
        self._captures = 0
        self._attention_backend: Optional[dict] = None
        self._warned: set = set()
        self._ddp = False  # megatron DDP around the layers (for_model finds out)
        self._pipeline_size = pipeline_size
        self.shared_pool = cfg.pool == "shared"  # auto is settled by apply()
        self._group = OrderedGroup(lambda: self.backend.make_pool())

    # construction ----------------------------------------------------------------------
    @classmethod
    def for_model(cls, model_chunks: Any, cfg: GraphsConfig | Mapping | None, *,
                  backend: Optional[CaptureBackend] = None, apply: bool = True,
                  te_make_graphed_callables: Any = None,
                  pipeline_size: Optional[int] = None) -> "GraphManager":
        """Manager over every TransformerLayer of `model_chunks` (a module or a list of
        them; DDP / Float16Module wrappers are fine). With `cfg.enabled` false it is inert:
        nothing is patched and step_begin/reset/restore do nothing."""
        mgr = cls(cfg, find_transformer_layers(model_chunks), backend=backend,
                  te_make_graphed_callables=te_make_graphed_callables, pipeline_size=pipeline_size)
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        mgr._ddp = any(type(m).__name__ == "DistributedDataParallel" and hasattr(m, "grad_accs")
                       for chunk in chunks for m in chunk.modules())
        if apply and mgr.cfg.enabled:
            mgr.apply()
        return mgr

    @property
    def backend(self) -> CaptureBackend:
        if self._backend is None:
            self._backend = default_backend()
            if self._backend.name == "rerun":
                log.warning("graphs: no CUDA; layers run through the CPU rerun backend (correct, not faster)")
        return self._backend

    def apply(self) -> "GraphManager":
        if self._applied:
            return self
        if not self.layers:
            log.warning("graphs: no TransformerLayer found; nothing is graphed")
        cls = TEGraphedCallable if self.cfg.impl == "te" else GraphedCallable
        backend = self.backend
        if self.cfg.pool == "auto":
            # measured on an H200 under megatron DDP (gradients leave for main_grad in each
            # backward); plain .grad accumulation and pipelines keep per-slot pools
            pp = self._pipeline_size if self._pipeline_size is not None else _megatron_pipeline_size()
            self.shared_pool = pp == 1 and self._ddp
        for st in self.layers:
            kwargs = {}
            if cls is TEGraphedCallable:
                kwargs["make_graphed_callables"] = self._te_mgc
            elif self.shared_pool:
                kwargs["group"] = self._group
            st.callable = cls(st.module, st.orig_forward, backend,
                              max_slots=self.cfg.max_slots, warmup_iters=self.cfg.capture_warmup_iters,
                              name=f"layer{st.index}", on_capture=self._on_capture, **kwargs)
            st.module.forward = self._make_forward(st)
            st.patched = True
        self._applied = True
        log.info("graphs: %d layers, impl=%s, backend=%s, warmup_steps=%d, on_new_shape=%s, max_slots=%d, "
                 "pool=%s", len(self.layers), self.cfg.impl, backend.name, self.cfg.warmup_steps,
                 self.cfg.on_new_shape, self.cfg.max_slots, self._pool_mode())
        return self

    def restore(self, drop_graphs: bool = True) -> None:
        """Put the original forwards back (and, by default, free every graph)."""
        for st in self.layers:
            if not st.patched:
                continue
            if st.prev_instance_forward is not None:
                st.module.forward = st.prev_instance_forward
            else:
                st.module.__dict__.pop("forward", None)
            st.patched = False
            if drop_graphs and st.callable is not None:
                st.callable.drop()
        self._applied = False

    def _pool_mode(self) -> str:
        return "shared" if self.shared_pool and self.cfg.impl == "local" else "slot"

    # steps -----------------------------------------------------------------------------
    def step_begin(self, step: Optional[int] = None) -> None:
        if not self._applied:
            return
        self._group.new_capture_step()  # graphs captured from here on replay in this step's order
        self._step = step
        self._nsteps += 1
        idx = self._nsteps - 1
        if self._capture_index is None and idx >= self.cfg.warmup_steps:
            self._capture_index = idx
        for st in self.layers:
            if st.callable is not None:
                self._leaked += st.callable.release_all()

    @property
    def active(self) -> bool:
        return self._applied and self._capture_index is not None

    def in_flight(self) -> int:
        """Graphed calls whose backward has not run yet (busy slots): a step may begin only
        when there are none, or step_begin() frees slots a backward still needs."""
        return sum(s.busy for st in self.layers if st.callable is not None
                   for slots in st.callable.sets.values() for s in slots)

    def reset(self) -> None:
        """Drop every graph (after a checkpoint load or parameter replacement); the layers
        re-capture at their next graphed call. Counters and known shapes are kept."""
        self._group.new_capture_step()
        for st in self.layers:
            if st.callable is not None and st.callable.sets:
                self._recaptures["reset"] += st.callable.num_slots()
                st.callable.drop()

    # routing ---------------------------------------------------------------------------
    def _make_forward(self, st: _Layer):
        manager = self

        def forward(*args, **kwargs):
            return manager._forward(st, args, kwargs)

        forward.__vitgraph_layer__ = st.index  # type: ignore[attr-defined]
        return forward

    def _eager(self, st: _Layer, reason: str, args: tuple, kwargs: dict) -> Any:
        self._fallbacks[reason] += 1
        return st.orig_forward(*args, **kwargs)

    def _forward(self, st: _Layer, args: tuple, kwargs: dict) -> Any:
        if self._capture_index is None:
            if self._nsteps == 0:
                self._warn_once("no_step", "graphs: step_begin() was never called; layers run eagerly")
            else:  # remember the shapes of warm-up steps
                try:
                    flat, spec = tree.flatten((args, kwargs))
                    self._known.add(call_key(flat, spec))
                except tree.Unsupported:
                    pass
            return self._eager(st, "warmup", args, kwargs)
        if not torch.is_grad_enabled():
            return self._eager(st, "no_grad", args, kwargs)
        if not st.module.training:
            return self._eager(st, "eval", args, kwargs)
        try:
            flat, spec = tree.flatten((args, kwargs))
            key = call_key(flat, spec)
            hash(key)
        except (tree.Unsupported, TypeError):
            return self._eager(st, "unsupported_arg", args, kwargs)
        gc = st.callable
        if gc.impl == "te":
            key = key + (fp8_active(),)
        elif fp8_active():
            self._warn_once("fp8", "graphs: FP8 is active but impl is 'local'; FP8 layers need "
                                   "graphs.impl=te (TE owns the FP8 scaling state). Running eagerly.")
            return self._eager(st, "fp8_needs_te", args, kwargs)

        if st.checked != self._nsteps:
            st.checked = self._nsteps
            sig = gc.param_signature()
            if gc.sets and gc.sig is not None and sig != gc.sig:
                n = gc.num_slots()
                gc.drop()
                self._recaptures["params_changed"] += n
                log.info("graphs: layer %d parameters were replaced; re-capturing", st.index)
            gc.sig = sig

        if key not in gc.sets:
            base = key[:3]
            idx = self._nsteps - 1
            if base not in self._known:
                if idx > self._capture_index:
                    self._unseen.add(base)
                    if self.cfg.on_new_shape == "eager":
                        return self._eager(st, "unseen_shape", args, kwargs)
                    log.info("graphs: new input shapes after the capture step %s; capturing",
                             [m[0] for m in base[1]])
                self._known.add(base)
        if not st.preflighted:
            preflight(st.module)
            on_default = getattr(self.backend, "on_default_stream", None)
            if self._ddp and on_default is not None and on_default():
                raise RuntimeError(LEGACY_STREAM_HELP)
            st.preflighted = True
        slot = gc.acquire(key, flat, spec)
        if slot is None:
            return self._eager(st, "slots_exhausted", args, kwargs)
        return gc.run(slot, flat)

    def _on_capture(self, gc: GraphedCallable, slot: Any, seconds: float) -> None:
        self._captures += 1
        self._capture_time += seconds
        if self._captures == 1:
            safe = megatron_tracker_is_graph_safe()
            if safe is False and self.backend.name == "cuda":
                self._warn_once("rng", "graphs: megatron's RNG tracker is not graph-safe; dropout inside "
                                       "tracker forks cannot be captured. Seed with model_parallel_cuda_manual_seed"
                                       "(seed, use_cudagraphable_rng=True).")
            hooked = [n for n, m in gc.module.named_modules() if n and any(
                not getattr(h, "graph_safe", False)
                for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))]
            if hooked:
                self._warn_once("hooks", "graphs: submodules with forward hooks (%s...) -- hooks inside a "
                                         "graphed layer run at capture only, not on replay" % ", ".join(hooked[:3]))
        backend_used = te_attention_backend()
        if backend_used is not None:
            self._attention_backend = backend_used
        log.debug("graphs: captured %s slot %d in %.3fs", gc.name, slot.index, seconds)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

    # stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        gcs = [st.callable for st in self.layers if st.callable is not None]
        measured = self._backend is not None and self._backend.memory_reserved() is not None
        return {
            "enabled": bool(self.cfg.enabled),
            "impl": self.cfg.impl,
            "pool": self._pool_mode(),
            "backend": self._backend.name if self._backend is not None else None,
            "active": self.active,
            "steps": self._nsteps,
            "step": self._step,
            "layers": len(self.layers),
            "graph_sets": sum(len(gc.sets) for gc in gcs),
            "slots": sum(gc.num_slots() for gc in gcs),
            "graphs": sum(gc.num_graphs() for gc in gcs),
            "captures": self._captures,
            "capture_time_s": round(self._capture_time, 6),
            "pool_bytes": sum(gc.pool_bytes() for gc in gcs) if measured else 0,
            "pool_bytes_measured": measured,
            "replays": sum(gc.replays for gc in gcs),
            "eager_fallbacks": dict(self._fallbacks),
            "unseen_shapes": len(self._unseen),
            "recaptures": dict(self._recaptures),
            "leaked_slots": self._leaked,
            "attention_backend": self._attention_backend,
        }
