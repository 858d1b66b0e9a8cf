"""The `graphs:` section of a vitgraph experiment.

    graphs:
      enabled: true        # capture each encoder layer's forward + backward as CUDA graphs
      impl: local          # local: vitgraph's own capture on torch.cuda.CUDAGraph
                           # te:    Transformer Engine's make_graphed_callables (needed for FP8)
      scope: layer         # layer: one graph pair per TransformerLayer (impl applies)
                           # step:  the whole optimizer step as one graph per input shape
                           #        (forward, backward, gradient reduction, clipping, update;
                           #        no host sync in a step; see step.py)
      warmup_steps: 3      # eager training steps before the first capture (also after a reset)
      on_new_shape: capture  # an input shape first seen after the capture step:
                             #   capture -> capture it too;  eager -> run that shape eagerly
      max_slots: 8         # graph copies per layer and shape: microbatches in flight at once
      capture_warmup_iters: 2  # eager fwd+bwd iterations on a side stream before each capture
      pool: auto           # layer graphs' memory: shared -> the layers' graphs, captured in the
                           #   order the step runs them, share one pool (no pipeline only);
                           #   slot -> one pool per graph copy (any replay order);
                           #   auto -> shared without a pipeline (parallel.pp=1) under
                           #   megatron DDP (the trainer's setup), else slot
"""

from __future__ import annotations

from dataclasses import dataclass

IMPLS = ("local", "te")
SCOPES = ("layer", "step")
ON_NEW_SHAPE = ("capture", "eager")
POOLS = ("auto", "shared", "slot")


@dataclass(frozen=True)
class GraphPath:
    """The graphs a run trains with, as resolved at start-up (vitgraph.plan.choose_graphs):
    ``scope`` layer or step, None when ``enabled`` is false; ``reason``: why, for the log."""
    enabled: bool
    scope: str | None
    reason: str

    def __str__(self) -> str:
        return f"{self.scope if self.enabled else 'off'} ({self.reason})"


@dataclass
class GraphsConfig:
    enabled: bool = False
    impl: str = "local"
    scope: str = "layer"
    warmup_steps: int = 3
    on_new_shape: str = "capture"
    max_slots: int = 8
    capture_warmup_iters: int = 2
    pool: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "GraphsConfig":
        def bad(key: str, value: object, why: str) -> ValueError:
            return ValueError(f"graphs.{key}={value!r}: {why}")

        if not isinstance(self.enabled, bool):
            raise bad("enabled", self.enabled, "must be true or false")
        if self.impl not in IMPLS:
            raise bad("impl", self.impl, f"must be one of {', '.join(IMPLS)}")
        if self.scope not in SCOPES:
            raise bad("scope", self.scope, f"must be one of {', '.join(SCOPES)}")
        if self.on_new_shape not in ON_NEW_SHAPE:
            raise bad("on_new_shape", self.on_new_shape, f"must be one of {', '.join(ON_NEW_SHAPE)}")
        if self.pool not in POOLS:
            raise bad("pool", self.pool, f"must be one of {', '.join(POOLS)}")
        for key, lo in (("warmup_steps", 0), ("max_slots", 1), ("capture_warmup_iters", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise bad(key, value, f"must be an integer >= {lo}")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> "GraphsConfig":
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"graphs.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        return cls(**d)
