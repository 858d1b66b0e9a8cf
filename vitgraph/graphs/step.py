"""graphs.scope: step -- the whole optimizer step as one CUDA graph per input shape.

What one graph holds (the trainer's step body, see vitgraph.train.loop):
zeroing the gradient buffers, every microbatch's forward and backward through megatron's
schedule (pipeline p2p included), the loss, the gradient reduction across data-parallel ranks
(megatron DDP / finalize_model_grads), the gradient norm and clipping, the optimizer update
(vitgraph.train.optim.SyncFreeStep: no host sync, a non-finite norm skips the update on
the device) and the copy back to the bf16 weights. The LR is a device tensor the host
refills before each replay.

Around it, eagerly: the loader's batches are prepared and copied into the static input
buffers of the graph (a classifier's augmentation, fixed resolution or native packs, is drawn
there, as fixed-shape tensors, and applied inside the step by the task's forward); the LR
schedule runs on the host. Results (loss stats, grad norm, step applied) come back as device
tensors, read only at log steps.

The life of a shape (a key: the shapes and dtypes of every microbatch's inputs):
* the first `warmup_steps` steps of the process run eagerly (DDP buckets, optimizer state
  and library workspaces are made there, outside any graph);
* then a key seen for the first time is captured (`on_new_shape: capture`) or, after the
  first capture, run eagerly (`on_new_shape: eager`);
* `reset()` (a checkpoint load replaced optimizer state tensors) drops every graph; the
  next step warms up and captures again.
megatron-core 0.16.1's FullCudaGraphWrapper is the model for the static-input handling; it
captures the forward-backward only and leaves the optimizer eager with its host syncs.

Capture executes nothing on CUDA: the step runs by the replay right after it. The CPU rerun
backend executes the body at capture, so there the first replay is skipped.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from vitgraph.output import plural

from .backend import CaptureBackend, default_backend
from .config import GraphsConfig

log = logging.getLogger("vitgraph.graphs")

Inputs = list  # one tuple of tensors (or None: an input this pipeline stage does not take) per microbatch
Body = Callable[[Inputs], list]  # inputs -> list of output tensors


def _key(inputs: Inputs) -> tuple:
    return tuple(tuple(None if t is None else (tuple(t.shape), t.dtype) for t in mb)
                 for mb in inputs)


class _Captured:
    def __init__(self, inputs: Inputs, rep: Any, seconds: float):
        self.inputs, self.rep, self.seconds = inputs, rep, seconds
        self.replays = 0


class StepGraphs:
    """One captured training step per input key; same life-cycle methods as GraphManager
    (step_begin / reset / restore / stats), so the trainer drives either."""

    def __init__(self, cfg: GraphsConfig, backend: Optional[CaptureBackend] = None,
                 barrier: Optional[Callable[[], None]] = None):
        self.cfg = cfg
        self._backend = backend
        self._barrier = barrier  # all ranks capture together (their NCCL calls are recorded)
        self._graphs: dict = {}
        self._nsteps = 0  # steps since the start or the last reset
        self._steps_total = 0
        self._step: Optional[int] = None
        self._captures = 0
        self._capture_time = 0.0
        self._eager = 0
        self._resets = 0
        self._unseen: set = set()

    @property
    def backend(self) -> CaptureBackend:
        if self._backend is None:
            self._backend = default_backend()
            if self._backend.name == "rerun":
                log.warning("graphs: no CUDA; the step runs through the CPU rerun backend "
                            "(correct, not faster)")
        return self._backend

    # the trainer's hooks -------------------------------------------------------------------
    def step_begin(self, step: Optional[int] = None) -> None:
        self._step = step
        self._nsteps += 1
        self._steps_total += 1

    def run(self, inputs: Inputs, body: Body) -> list:
        """This step's outputs: ``body(inputs)`` run eagerly, or by a graph whose static
        inputs receive a copy of ``inputs`` first."""
        key = _key(inputs)
        cap = self._graphs.get(key)
        if cap is None:
            warming = self._nsteps <= self.cfg.warmup_steps
            if warming or (self._graphs and self.cfg.on_new_shape == "eager"):
                if not warming:
                    self._unseen.add(key)
                self._eager += 1
                return body(inputs)
            return self._capture(key, inputs, body)
        with torch.no_grad():
            for static_mb, mb in zip(cap.inputs, inputs):
                for s, t in zip(static_mb, mb):
                    if t is not None:
                        s.copy_(t, non_blocking=True)
        cap.rep.replay()
        cap.replays += 1
        return cap.rep.outputs

    def _capture(self, key: tuple, inputs: Inputs, body: Body) -> list:
        backend = self.backend
        static = [tuple(None if t is None else t.detach().clone() for t in mb) for mb in inputs]
        if self._barrier is not None:
            self._barrier()
        t0 = time.time()
        rep = backend.capture(lambda: list(body(static)), backend.make_pool())
        cap = self._graphs[key] = _Captured(static, rep, time.time() - t0)
        self._captures += 1
        self._capture_time += cap.seconds
        log.info("graphs: captured the whole step for %s of %s in %.2fs%s",
                 plural(len(inputs), "microbatch"), [t if t is None else tuple(t.shape) for t in inputs[0]], cap.seconds,
                 f" ({rep.pool_bytes / 2**20:.0f} MiB pool)" if rep.pool_bytes else "")
        if not getattr(backend, "capture_runs", False):
            rep.replay()  # the capture only recorded the step: run it now
        cap.replays += 1
        return rep.outputs

    def reset(self) -> None:
        """Drop every graph (optimizer state or parameters were replaced); warm up again."""
        for cap in self._graphs.values():
            cap.rep.reset()
        if self._graphs:
            self._resets += 1
        self._graphs.clear()
        self._nsteps = 0

    def restore(self, drop_graphs: bool = True) -> None:
        if drop_graphs:
            self.reset()

    @property
    def active(self) -> bool:
        return bool(self._graphs)

    def stats(self) -> dict:
        b = self._backend
        return {
            "enabled": True, "scope": "step",
            "backend": b.name if b is not None else None,
            "active": self.active,
            "steps": self._steps_total,
            "step": self._step,
            "graphs": len(self._graphs),
            "captures": self._captures,
            "capture_time_s": round(self._capture_time, 6),
            "pool_bytes": sum(c.rep.pool_bytes for c in self._graphs.values()),
            "replays": sum(c.replays for c in self._graphs.values()),
            "eager_fallbacks": {"eager_steps": self._eager},
            "unseen_shapes": len(self._unseen),
            "recaptures": {"reset": self._resets},
        }
