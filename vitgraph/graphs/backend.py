"""Capture and replay behind a small interface.

A backend turns a function into something that can be replayed:

    rep = backend.capture(fn, pool)   # runs/records fn once; rep.outputs is what fn returned
    rep.replay()                      # redo fn's work; results land in rep.outputs' tensors

`fn` returns a list whose items are tensors or None; those tensors are the *static*
results: after every replay they hold the new values, at the same addresses. Everything a
graphed callable does around this (static inputs, copying real inputs in, static gradient
buffers, slots, returning gradients) is backend independent, so the CPU-only
`RerunBackend` exercises exactly the bookkeeping the CUDA path uses:

* `CudaBackend`: fn is captured into a `torch.cuda.CUDAGraph` on a side stream, in the
  memory pool the caller passes (one per slot, see callable.py); replay relaunches the
  recorded kernels.
* `RerunBackend`: "capture" runs fn once and keeps its results as the static tensors;
  "replay" runs fn again and copies the fresh results into them.

One asymmetry cannot be hidden: a backward graph replays the kernels recorded against the
forward *capture*'s autograd graph, whereas under the rerun backend the backward must
differentiate the autograd graph of the *latest* forward rerun. `grad_roots()` gives the
tensors to differentiate: the captured static outputs (CUDA) or the latest rerun's (CPU).

RNG: warm-up and capture must not consume random numbers (dropout), so that the first
replay draws what eager would have drawn. `rng_snapshot()` / `rng_restore()` save and
restore torch's default generator(s) and megatron's RNG-tracker states; the CUDA backend
also registers every graph-safe generator (megatron's tracker with
`use_cudagraphable_rng=True`, Transformer Engine's tracker) with each graph
(`CUDAGraph.register_generator_state`; torch registers its default CUDA generator itself).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any, Callable, Iterator, Optional

import torch

Fn = Callable[[], list]


class Replayable:
    outputs: list
    pool_bytes: int = 0  # memory the capture added to the graph pool (best effort)

    def replay(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def grad_roots(self) -> list:
        return self.outputs

    def reset(self) -> None:
        """Free what the capture holds (graphs); the object is unusable afterwards."""


class CaptureBackend:
    """Interface; see the module docstring."""

    name = "abstract"
    counts_graphs = False

    def make_pool(self) -> Any:
        return None

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        pass

    def capture(self, fn: Fn, pool: Any) -> Replayable:  # pragma: no cover - interface
        raise NotImplementedError

    def memory_reserved(self) -> Optional[int]:
        return None

    # RNG ---------------------------------------------------------------------------------
    def rng_snapshot(self) -> list:
        snap: list = [("cpu", torch.get_rng_state())]
        snap.extend(_tracker_snapshot())
        return snap

    def rng_restore(self, snap: list) -> None:
        for item in snap:
            kind = item[0]
            if kind == "cpu":
                torch.set_rng_state(item[1])
            elif kind == "gen":
                item[1].set_state(item[2])
            elif kind == "tracker_tensors":
                tracker, states = item[1], item[2]
                tracker.states_.update(states)


# -------------------------------------------------------------------------------------------
# megatron / Transformer Engine RNG trackers (imported only if the program already uses them)


def megatron_rng_tracker() -> Any:
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    if mod is None or not getattr(mod, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return None
    return getattr(mod, "_CUDA_RNG_STATE_TRACKER", None)


def megatron_tracker_is_graph_safe() -> Optional[bool]:
    """None when megatron's tracker is not in use; else whether its states are graph-safe."""
    tracker = megatron_rng_tracker()
    if tracker is None:
        return None
    states = getattr(tracker, "states_", None) or {}
    if getattr(tracker, "use_cudagraphable_rng", False):
        return True
    if type(tracker).__name__ == "TECudaRNGStatesTracker":
        return True
    return all(isinstance(s, torch.Generator) for s in states.values()) and bool(states)


def _te_rng_registry() -> Optional[dict]:
    mod = sys.modules.get("transformer_engine.pytorch.distributed")
    if mod is None or not hasattr(mod, "get_all_rng_states"):
        return None
    try:
        reg = mod.get_all_rng_states()
    except Exception:  # pragma: no cover - defensive
        return None
    return reg if isinstance(reg, dict) else None


def graph_safe_generators() -> list:
    """Graph-safe (torch.Generator) states of megatron's and TE's RNG trackers, deduplicated."""
    gens: list = []
    seen: set = set()

    def add(g: Any) -> None:
        if isinstance(g, torch.Generator) and g.device.type == "cuda" and id(g) not in seen:
            seen.add(id(g))
            gens.append(g)

    tracker = megatron_rng_tracker()
    if tracker is not None:
        for g in (getattr(tracker, "states_", None) or {}).values():
            add(g)
    reg = _te_rng_registry()
    if reg:
        for g in reg.values():
            add(g)
    return gens


def _tracker_snapshot() -> list:
    out: list = []
    tracker = megatron_rng_tracker()
    if tracker is None:
        return out
    states = getattr(tracker, "states_", None) or {}
    tensors = {k: v.clone() for k, v in states.items() if isinstance(v, torch.Tensor)}
    if tensors:
        out.append(("tracker_tensors", tracker, tensors))
    for g in states.values():
        if isinstance(g, torch.Generator):
            out.append(("gen", g, g.get_state()))
    reg = _te_rng_registry()
    if reg:
        for g in reg.values():
            if isinstance(g, torch.Generator) and all(g is not item[1] for item in out if item[0] == "gen"):
                out.append(("gen", g, g.get_state()))
    return out


# -------------------------------------------------------------------------------------------
# CPU: rerun


class _RerunReplayable(Replayable):
    def __init__(self, fn: Fn, outputs: list):
        self.fn = fn
        self.outputs = outputs
        self._live = outputs

    def replay(self) -> None:
        fresh = self.fn()
        if len(fresh) != len(self.outputs):
            raise RuntimeError("rerun produced a different number of results than the capture")
        with torch.no_grad():
            for static, new in zip(self.outputs, fresh):
                if static is None or new is None:
                    if static is not new:
                        raise RuntimeError("rerun produced None where the capture had a tensor (or back)")
                    continue
                static.copy_(new)
        self._live = fresh

    def grad_roots(self) -> list:
        return self._live

    def reset(self) -> None:
        self._live = None


class RerunBackend(CaptureBackend):
    """CPU stand-in for CUDA graphs: capture = run once, replay = run again + copy results."""

    name = "rerun"
    capture_runs = True  # capture executes fn (CUDA capture only records it)

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Fn, pool: Any) -> Replayable:
        self.captures += 1
        backend = self

        class _Counted(_RerunReplayable):
            def replay(self_inner) -> None:
                backend.replays += 1
                _RerunReplayable.replay(self_inner)

        return _Counted(fn, fn())


# -------------------------------------------------------------------------------------------
# CUDA


class _CudaReplayable(Replayable):
    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: list):
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()


class CudaBackend(CaptureBackend):
    """torch.cuda.CUDAGraph capture on one side stream, into the pool the caller passes."""

    name = "cuda"
    counts_graphs = True

    def __init__(self, device: Optional[torch.device] = None, capture_error_mode: str = "thread_local"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaBackend needs CUDA; use RerunBackend on CPU")
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        # thread_local: a pin-memory or logging thread touching CUDA does not break the capture
        self.capture_error_mode = capture_error_mode
        self._stream: Optional[torch.cuda.Stream] = None

    @property
    def stream(self) -> "torch.cuda.Stream":
        """Where warm-up and capture run.

        The current stream when training runs on a side stream (the supported setup, see
        `use_side_stream`): autograd then never has to synchronise with another stream
        inside the captured backward. On the legacy default stream, which cannot be
        captured, a private side stream.
        """
        cur = torch.cuda.current_stream(self.device)
        if cur != torch.cuda.default_stream(self.device):
            return cur
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def on_default_stream(self) -> bool:
        return torch.cuda.current_stream(self.device) == torch.cuda.default_stream(self.device)

    def make_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        s = self.stream
        cur = torch.cuda.current_stream(self.device)
        if s == cur:
            yield
            return
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            yield
        cur.wait_stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Fn, pool: Any) -> Replayable:
        graph = torch.cuda.CUDAGraph()
        for gen in graph_safe_generators():
            graph.register_generator_state(gen)
        # A garbage collection during capture can destroy another graph mid-capture
        # (pytorch/pytorch#161037; TE disables gc around capture for the same reason).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            # torch.cuda.graph() synchronizes and empties the cache itself; doing it first
            # makes the reserved-memory delta below the memory the capture added to the pool
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
            s = self.stream
            cur = torch.cuda.current_stream(self.device)
            if s != cur:
                s.wait_stream(cur)
            try:
                with torch.cuda.graph(graph, pool=pool, stream=s, capture_error_mode=self.capture_error_mode):
                    outputs = fn()
            except Exception as e:
                if "legacy stream" in str(e) or "legacy stream" in str(e.__context__ or ""):
                    raise RuntimeError(LEGACY_STREAM_HELP) from e
                raise
            if s != cur:
                cur.wait_stream(s)
            added = max(0, int(torch.cuda.memory_reserved(self.device)) - int(before))
        finally:
            if gc_was_enabled:
                gc.enable()
        rep = _CudaReplayable(graph, outputs)
        rep.pool_bytes = added
        return rep

    def memory_reserved(self) -> Optional[int]:
        return int(torch.cuda.memory_reserved(self.device))

    def rng_snapshot(self) -> list:
        snap = super().rng_snapshot()
        gen = torch.cuda.default_generators[self.device.index or 0]
        snap.append(("gen", gen, gen.get_state()))
        return snap


LEGACY_STREAM_HELP = (
    "graphs: the captured backward had to synchronise with the legacy default CUDA stream. "
    "Autograd nodes of the parameters (AccumulateGrad) were created on the default stream and are "
    "still alive -- megatron DDP keeps them for its gradient hooks, a kept loss or output keeps "
    "its whole graph -- and CUDA forbids that dependency during capture. Run training on a side "
    "stream: call vitgraph.graphs.use_side_stream() before building the model and wrapping it in "
    "DDP (megatron's own CUDA graphs do the same).")


def use_side_stream(device: Optional[torch.device] = None) -> Optional["torch.cuda.Stream"]:
    """Make a fresh side stream the current CUDA stream (for the rest of the program).

    Call once, before the model and its DDP wrapper are built. Graph capture cannot run on
    the legacy default stream, and autograd nodes created there (megatron DDP keeps one
    per parameter) would have to be synchronised with the capture. With everything on one
    side stream the graphs are captured and replayed on the training stream itself.
    No-op (returns None) without CUDA.
    """
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    torch.cuda.set_stream(s)
    return s


def default_backend() -> CaptureBackend:
    return CudaBackend() if torch.cuda.is_available() else RerunBackend()
