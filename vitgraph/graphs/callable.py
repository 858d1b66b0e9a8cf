"""A graphed callable: one module's forward and backward replayed behind an autograd.Function.

Layout: a `GraphedCallable` wraps one module (a TransformerLayer). For every *key* (the call
signature: argument structure, non-tensor arguments, tensor shapes/dtypes/requires_grad,
autocast state) it keeps a list of *slots*. A slot is one complete graph pair with its own
static buffers:

    static inputs   -- detached copies of the tensor arguments (requires_grad as the real ones)
    forward graph   -- module forward on the static inputs -> static outputs (tensor leaves)
    backward graph  -- torch.autograd.grad(static outputs that require grad,
                                           static inputs that require grad + parameters,
                                           grad_outputs = static grad buffers)
    static grads    -- what the backward graph writes, one per differentiable input

Microbatches in flight (pipeline schedules): a forward takes the first *free* slot and
marks it busy; that microbatch's backward replays the same slot (the slot travels in the
autograd ctx) and frees it. With every slot busy a new one is captured (up to max_slots).
Replaying one slot for every microbatch is the classic 1F1B failure: microbatch 1's forward
overwrites the activations microbatch 0's backward still needs.

Memory, `pool="slot"`: one private pool per slot (its forward and backward graph). Graphs
sharing a pool may be handed, as *live* memory (saved activations, outputs), blocks another
graph freed during its capture (its temporaries). That is only safe when the graphs replay in
capture order -- torch's and TE's make_graphed_callables capture everything at once in replay
order (megatron passes TE the pipeline schedule as `_order`). Slots are captured on demand:
the second microbatch in flight, a new shape, a re-capture after parameters were replaced.
Under a pipeline schedule no capture order matches every replay order, and with one shared
pool (checked on an H200) slot 0's backward wrote its temporaries over slot 1's saved
activations: the second microbatch's gradients were 20% off. Inside a slot the forward
replays before the backward, as captured, so the backward may reuse memory the forward freed
and its own saved activations (retain_graph=False); the backward's outputs may therefore sit
in memory the next forward replay of the slot overwrites, which is why the parameter-gradient
guard below runs before each forward replay. The cost: every slot keeps its own temporaries
(ViT-L at micro-batch 256: layer graphs reserved 1.52x eager's memory on an H200).

Memory, with an `OrderedGroup` (the manager's `pool: shared`, chosen where one microbatch
runs forward and backward before the next starts, i.e. no pipeline): slot 0 of every layer is
captured *in the order the step runs it* -- the forward at its first call, the backward at
its first backward, from inside autograd's backward pass -- into the group's one pool for
that capture step. Every later step replays the same graphs in that
same order, so a block one graph freed at capture (its temporaries, or saved activations a
finished backward no longer needs) is only reused by graphs that replay after it within the
step, as the allocator reused it in eager mode. What a graph hands out must therefore be used
before the cycle comes round again: layer outputs and input gradients are; parameter
gradients autograd keeps as `.grad` are copied out before the next replay (OrderedGroup).
Such a slot keeps no copy of what another ordered slot owns: its static input is the
previous layer's static output and its incoming-gradient buffer the next layer's input
gradient, so a replay copies nothing between layers. Further slots of the layer
(microbatches in flight) keep private pools and copies.

Output contract (as torch's and TE's graphed callables): the tensors returned by a forward
are the slot's static outputs (detached views). They stay valid until that slot replays its
forward again, which happens only after the slot's backward ran -- i.e. after everything
downstream of them was differentiated. Code that keeps a layer output longer than its
backward (e.g. logging it after the step) must clone it.

Gradient contract: gradients are returned to autograd exactly where eager would put them:
inputs that require grad and parameters (autograd accumulates parameter grads into .grad
and fires megatron DDP's grad-accumulation hooks, which move them to main_grad). Returned
gradients are static buffers; autograd may *steal* a buffer as `param.grad` when .grad was
None. Before a slot replays (forward or backward), any parameter whose .grad still aliases
that slot's buffers gets a private copy (copy-on-conflict: free in the usual cases where
megatron DDP or zero_grad(set_to_none=True) clears .grad). Input gradients are cloned only
for inputs that are autograd leaves (a pipeline stage's received activation), for the same
reason.

Non-eager side effects: Python code inside the module runs at capture only. Transformer
Engine's fused weight-gradient accumulation sets `param.grad_added_to_main_grad = True`
during backward; the parameters for which the captured backward did that get it set again
on every replay, so megatron DDP does not add TE's dummy weight gradient to main_grad.
Warm-up runs touch main_grad (fused accumulation) and RNG state; both are restored, so the
capture step computes what eager would.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Optional

import torch

from . import tree
from .backend import CaptureBackend, Replayable


# ---------------------------------------------------------------------------------------------
# helpers shared with the TE implementation


@contextlib.contextmanager
def capture_flags(megatron: bool = True, te: bool = True):
    """Tell megatron-core and TE that a graph capture (and its warm-up) is under way.

    megatron: DDP's forward pre-hooks and grad hooks return early; TE: attention backend
    selection for graphs, no FP8 amax reduction inside the graph.
    """
    ends: list[Callable[[], None]] = []
    mg = sys.modules.get("megatron.core.transformer.cuda_graphs") if megatron else None
    if mg is not None and hasattr(mg, "_set_capture_start") and not mg.is_graph_capturing():
        mg._set_capture_start()
        ends.append(mg._set_capture_end)
    teg = sys.modules.get("transformer_engine.pytorch.graph") if te else None
    if teg is not None and hasattr(teg, "set_capture_start") and not teg.is_graph_capturing():
        teg.set_capture_start()
        ends.append(teg.set_capture_end)
    try:
        yield
    finally:
        for end in reversed(ends):
            end()


def te_rng_tracker_class() -> type | None:
    """TE's CudaRNGStatesTracker, the one TE's attention accepts under capture (None until
    Transformer Engine is imported)."""
    te_dist = sys.modules.get("transformer_engine.pytorch.distributed")
    return getattr(te_dist, "CudaRNGStatesTracker", None) if te_dist is not None else None


def preflight(module: torch.nn.Module) -> None:
    """Fail early, with the fix, on setups whose capture is known to fail.

    TE's DotProductAttention asserts, under graph capture, that its RNG tracker is TE's
    CudaRNGStatesTracker; megatron hands it megatron's own tracker unless seeded with
    model_parallel_cuda_manual_seed(..., te_rng_tracker=True).
    """
    te_tracker = te_rng_tracker_class()
    if te_tracker is None:
        return
    for name, m in module.named_modules():
        tracker = getattr(m, "rng_states_tracker", None)
        if tracker is not None and not isinstance(tracker, te_tracker):
            raise RuntimeError(
                f"graphs: {name or type(module).__name__} is Transformer Engine attention with megatron's "
                f"{type(tracker).__name__}; TE only captures attention with TE's RNG tracker. Seed with "
                "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True) "
                "before building the model (it is graph-safe as well).")


class ParamSideEffects:
    """Save/restore what warm-up and capture may change on parameters.

    main_grad (TE's fused wgrad accumulation writes it during the warm-up backward) is
    restored; `grad_added_to_main_grad` is cleared before and restored after, and the
    parameters on which the captured code set it are reported in `.fused`.
    """

    def __init__(self, params: list):
        self.params = params
        self.fused: list = []

    def __enter__(self) -> "ParamSideEffects":
        self._main = [(p, p.main_grad.detach().clone()) for p in self.params
                      if isinstance(getattr(p, "main_grad", None), torch.Tensor)]
        self._flags = [(p, p.grad_added_to_main_grad) for p in self.params
                       if hasattr(p, "grad_added_to_main_grad")]
        for p, _ in self._flags:
            p.grad_added_to_main_grad = False
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for p, saved in self._main:
                p.main_grad.copy_(saved)
        self.fused = [p for p, _ in self._flags if p.grad_added_to_main_grad]
        for p, old in self._flags:
            p.grad_added_to_main_grad = old


def call_key(flat: list, spec: tuple) -> tuple:
    """Hashable description of a call: graphs are only valid for identical keys."""
    metas = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in flat)
    dev = flat[0].device.type if flat else "cpu"
    try:
        ac = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
    except (TypeError, RuntimeError):  # pragma: no cover - old torch signatures
        ac = None
    return (spec, metas, ac)


def autocast_without_cache(flat: list) -> Callable[[], Any]:
    """The ambient autocast state with its cast cache off, as a context factory.

    With the cache on, a weight cast cached by the warm-up (or an earlier eager call in the
    same autocast region) would be reused by the capture, and the graph would read a cache
    entry that is freed when the region ends; with it off the cast kernels are captured.
    """
    dev = flat[0].device.type if flat else "cpu"
    if not torch.is_autocast_enabled(dev):
        return contextlib.nullcontext
    dtype = torch.get_autocast_dtype(dev)
    return lambda: torch.autocast(dev, dtype=dtype, cache_enabled=False)


class Slot:
    """One graph pair with its static buffers (see module docstring)."""

    def __init__(self, index: int):
        self.index = index
        self.busy = False
        self.static_in: list = []
        self.params: list = []  # parameters passed to the Function (requires_grad at capture)
        self.fwd: Optional[Replayable] = None
        self.bwd: Optional[Replayable] = None
        self.out_spec: tuple = ()
        self.out_rg: list = []
        self.grad_bufs: list = []  # per static output: buffer or None
        self.grad_map: list = []  # per Function tensor input: index into bwd.outputs or -1
        self.param_grads: list = []  # (param, static grad) for the copy-on-conflict guard
        self.fused: list = []  # params needing grad_added_to_main_grad = True each replay
        self.pool_bytes = 0
        # ordered slots: captures the backward at the slot's first backward (grads in)
        self.capture_backward: Optional[Callable[[tuple], None]] = None
        self.group: Optional["OrderedGroup"] = None
        # TE implementation
        self.te_callable: Any = None
        self.grad_ptrs: Optional[set] = None

    def owned(self) -> list:
        """The tensors this slot's graphs write and keep (static outputs, gradients)."""
        return [t for g in (self.fwd, self.bwd) if g is not None for t in g.outputs if t is not None]

    @property
    def num_graphs(self) -> int:
        if self.te_callable is not None:
            return 2 if any(self.out_rg) else 1
        return int(self.fwd is not None) + int(self.bwd is not None)


def _unalias_param_grads(slot: Slot) -> None:
    """copy-on-conflict: a .grad that still aliases this slot's gradient buffer (autograd
    stole it at an earlier backward of the slot) must not be overwritten by the next replay
    of the slot -- the backward writes the buffer, the forward may reuse its memory. Between
    a slot's forward and its backward no backward of the slot can alias it again."""
    for p, g in slot.param_grads:
        pg = p.grad
        if pg is not None and pg.data_ptr() == g.data_ptr():
            p.grad = pg.clone()


class OrderedGroup:
    """The ordered slots of every layer of one manager (`pool: shared`).

    A tensor one of them owns may be another one's static input or gradient buffer as it is
    (the previous layer's output, the next layer's input gradient); anything else -- the
    caller's input, a mask, the loss's gradient -- is copied into a buffer of the slot's own.
    A parameter gradient autograd took as `.grad` from a slot's buffer must be copied out
    before *any* graph of the shared pool replays again, not only that slot's forward: a
    graph captured earlier may use the buffer's memory for its temporaries.

    The group also holds the pool its slots are captured into: one per capture step, so that
    every graph in a pool replays in the order it was captured (`new_capture_step`)."""

    def __init__(self, make_pool: Callable[[], Any]):
        self.slots: list = []
        self.dirty = False  # an ordered backward handed out parameter gradients
        self._make_pool = make_pool
        self._pool: Any = None

    def pool(self) -> Any:
        """This capture step's pool (made at its first capture)."""
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def new_capture_step(self) -> None:
        """Graphs captured from here on go into a new pool (a new step, or after a reset)."""
        self._pool = None

    def owns(self, t: torch.Tensor) -> bool:
        ptr, shape, stride = t.data_ptr(), t.shape, t.stride()
        return any(o.data_ptr() == ptr and o.shape == shape and o.stride() == stride
                   for slot in self.slots for o in slot.owned())

    def before_replay(self) -> None:
        if self.dirty:
            for slot in self.slots:
                _unalias_param_grads(slot)
            self.dirty = False


class _Replay(torch.autograd.Function):
    """Forward: copy inputs into the slot, replay. Backward: copy grads in, replay."""

    @staticmethod
    def forward(ctx, slot: Slot, leaf_mask: tuple, *tensors):  # type: ignore[override]
        _unalias_param_grads(slot)
        for static, real in zip(slot.static_in, tensors):
            if static.data_ptr() != real.data_ptr():
                # through .data: the captured forward saved this buffer for its backward, and
                # an ordered slot captures that backward after this copy; a tracked copy would
                # bump the version autograd checks
                static.data.copy_(real)
        slot.fwd.replay()
        outs = tuple(o.detach() for o in slot.fwd.outputs)
        nondiff = [o for o, rg in zip(outs, slot.out_rg) if not rg]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        ctx.set_materialize_grads(False)
        ctx.slot = slot
        ctx.leaf_mask = leaf_mask
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        slot: Slot = ctx.slot
        if slot.capture_backward is not None:  # an ordered slot's first backward: capture it now
            capture, slot.capture_backward = slot.capture_backward, None
            if capture(grads):  # the backend executed it while capturing (CPU rerun)
                return _Replay._grads(ctx, slot)
        for buf, g in zip(slot.grad_bufs, grads):
            if buf is None:
                continue
            if g is None:
                buf.zero_()
            elif buf.data_ptr() != g.data_ptr():
                buf.copy_(g)
        slot.bwd.replay()
        return _Replay._grads(ctx, slot)

    @staticmethod
    def _grads(ctx, slot: Slot) -> tuple:
        if slot.group is not None:
            slot.group.dirty = True
        static = slot.bwd.outputs
        out: list = [None, None]
        n_in = len(slot.static_in)
        for i, j in enumerate(slot.grad_map):
            if j < 0 or static[j] is None:
                out.append(None)
            elif i < n_in and ctx.leaf_mask[i]:
                out.append(static[j].clone())
            else:
                out.append(static[j].detach())
        slot.busy = False
        return tuple(out)


class GraphedCallable:
    """All graphs of one module: per key a list of slots. Impl `local`."""

    impl = "local"

    def __init__(self, module: torch.nn.Module, forward_fn: Callable, backend: CaptureBackend,
                 *, max_slots: int = 8, warmup_iters: int = 2, name: str = "",
                 on_capture: Optional[Callable[["GraphedCallable", Slot, float], None]] = None,
                 group: Optional[OrderedGroup] = None):
        self.group = group  # slot 0 captured in run order into the group's pool (see "Memory")
        self.module = module
        self.forward_fn = forward_fn
        self.backend = backend
        self.max_slots = max_slots
        self.warmup_iters = warmup_iters
        self.name = name
        self.on_capture = on_capture
        self.sets: dict = {}
        self.sig: Optional[tuple] = None
        self.replays = 0

    # parameters ------------------------------------------------------------------------
    def param_signature(self) -> tuple:
        # cached (module, name) pairs: module.parameters() recurses through named_modules,
        # which cost ~6 ms per step for ViT-L's 24 layers at micro-batch 8 (H200 profile)
        if getattr(self, "_param_owners", None) is None:
            self._param_owners = [(m, n) for m in self.module.modules()
                                  for n, p in m._parameters.items() if p is not None]
        sig = []
        for m, n in self._param_owners:
            p = m._parameters[n]
            mg = getattr(p, "main_grad", None)
            sig.append((id(p), p.data_ptr(), p.requires_grad,
                        mg.data_ptr() if isinstance(mg, torch.Tensor) else 0))
        return tuple(sig)

    def drop(self) -> None:
        """Forget every graph. Slots still referenced by a pending backward stay alive
        through the autograd ctx until that backward ran."""
        if self.group is not None:
            mine = {id(s) for v in self.sets.values() for s in v}
            self.group.slots = [s for s in self.group.slots if id(s) not in mine]
        self.sets = {}
        self.sig = None

    # slots -----------------------------------------------------------------------------
    def num_slots(self) -> int:
        return sum(len(v) for v in self.sets.values())

    def num_graphs(self) -> int:
        return sum(s.num_graphs for v in self.sets.values() for s in v)

    def pool_bytes(self) -> int:
        return sum(s.pool_bytes for v in self.sets.values() for s in v)

    def release_all(self) -> int:
        n = 0
        for slots in self.sets.values():
            for s in slots:
                if s.busy:
                    s.busy = False
                    n += 1
        return n

    def acquire(self, key: tuple, flat: list, spec: tuple) -> Optional[Slot]:
        slots = self.sets.setdefault(key, [])
        for s in slots:
            if not s.busy:
                s.busy = True
                return s
        if len(slots) >= self.max_slots:
            return None
        if self.sig is None:
            self.sig = self.param_signature()
        t0 = time.perf_counter()
        slot = self._capture(len(slots), flat, spec)
        dt = time.perf_counter() - t0
        slots.append(slot)
        slot.busy = True
        if self.on_capture is not None:
            self.on_capture(self, slot, dt)
        return slot

    # capture ---------------------------------------------------------------------------
    def _static_inputs(self, flat: list, share: Optional[Callable[[torch.Tensor], bool]] = None) -> list:
        with torch.no_grad():
            return [(x.detach() if share is not None and share(x) else x.detach().clone())
                    .requires_grad_(x.requires_grad) for x in flat]

    def _capture_forward(self, flat: list, static_in: list, spec: tuple, params: list,
                         diff_in: list, pool) -> tuple:
        """Warm up on a side stream (``warmup_iters`` eager forwards and backwards into zero
        gradients), then capture the forward on ``static_in`` into ``pool``: (the forward
        graph, its output spec, the parameters whose fused wgrad wrote main_grad)."""
        backend = self.backend
        holder: dict = {}
        forward_fn = self.forward_fn
        autocast = autocast_without_cache(flat)

        def run_forward() -> list:
            with torch.enable_grad(), autocast():
                args, kwargs = tree.unflatten(static_in, spec)
                out = forward_fn(*args, **kwargs)
            leaves, out_spec = tree.flatten(out)
            holder["spec"] = out_spec
            return leaves

        rng = backend.rng_snapshot()
        try:
            with ParamSideEffects(params) as side, capture_flags():
                with backend.side_stream():
                    for _ in range(self.warmup_iters):
                        outs = run_forward()
                        roots = [o for o in outs if o.requires_grad]
                        if roots and diff_in:
                            torch.autograd.grad(roots, diff_in, grad_outputs=[torch.zeros_like(o) for o in roots],
                                                allow_unused=True)
                        del outs, roots
                fwd = backend.capture(run_forward, pool)
        finally:
            backend.rng_restore(rng)
        return fwd, holder["spec"], side.fused

    def _capture(self, index: int, flat: list, spec: tuple) -> Slot:
        backend = self.backend
        slot = Slot(index)
        group = self.group if index == 0 else None  # further slots: private pools, copies
        params = [p for p in self.module.parameters() if p.requires_grad]
        static_in = self._static_inputs(flat, group.owns if group is not None else None)
        diff_in = [s for s in static_in if s.requires_grad] + params
        pool = group.pool() if group is not None else backend.make_pool()  # see "Memory" above
        fwd, out_spec, fused = self._capture_forward(flat, static_in, spec, params, diff_in, pool)
        outs = fwd.outputs
        out_rg = [o.requires_grad for o in outs]

        slot.static_in = static_in
        slot.params = params
        slot.fwd = fwd
        slot.out_spec = out_spec
        slot.out_rg = out_rg
        slot.grad_bufs = [None] * len(outs)
        slot.fused = fused
        slot.pool_bytes = fwd.pool_bytes
        has_bwd = any(out_rg) and bool(diff_in)
        slot.grad_map, j = [], 0
        for s in static_in + params:
            slot.grad_map.append(j if has_bwd and s.requires_grad else -1)
            j += int(has_bwd and s.requires_grad)
        if not has_bwd:
            return slot
        idx = [i for i, rg in enumerate(out_rg) if rg]

        def capture_backward(grads: Optional[tuple] = None) -> bool:
            """The slot's backward graph. ``grads``: the incoming gradients of the slot's first
            backward (an ordered slot keeps them as its buffers); None: zero buffers.
            Returns whether the backend executed it while capturing."""
            slot.grad_bufs = [None] * len(outs)
            for i in idx:
                g = None if grads is None else grads[i]
                if g is not None and group is not None and group.owns(g):
                    slot.grad_bufs[i] = g.detach()
                else:  # a buffer of its own, holding this backward's gradient
                    buf = torch.zeros_like(outs[i])
                    slot.grad_bufs[i] = buf if g is None else buf.copy_(g)

            def run_backward() -> list:
                roots = fwd.grad_roots()
                return list(torch.autograd.grad([roots[i] for i in idx], diff_in,
                                                grad_outputs=[slot.grad_bufs[i] for i in idx],
                                                allow_unused=True))

            with ParamSideEffects(params) as bwd_side, capture_flags():
                bwd = backend.capture(run_backward, pool)
            slot.bwd = bwd
            slot.fused = list({id(p): p for p in [*slot.fused, *bwd_side.fused]}.values())
            slot.pool_bytes += bwd.pool_bytes
            n_in = len(static_in)
            slot.param_grads = [(p, bwd.outputs[slot.grad_map[n_in + k]]) for k, p in enumerate(params)
                                if bwd.outputs[slot.grad_map[n_in + k]] is not None]
            return bool(getattr(backend, "capture_runs", False))

        if group is not None:
            slot.group = group
            group.slots.append(slot)
            slot.capture_backward = capture_backward
        else:
            capture_backward()
        return slot

    # replay ----------------------------------------------------------------------------
    def run(self, slot: Slot, flat: list) -> Any:
        self.replays += 1
        for p in slot.fused:
            p.grad_added_to_main_grad = True
        leaf_mask = tuple(x.requires_grad and x.grad_fn is None for x in flat)
        if slot.group is not None:
            slot.group.before_replay()
        outs = _Replay.apply(slot, leaf_mask, *flat, *slot.params)
        if (slot.bwd is None and slot.capture_backward is None) or \
                not any(o.requires_grad for o in outs):
            slot.busy = False  # no backward will come for this call
        return tree.unflatten(outs, slot.out_spec)
