"""The `graphs:` section of a vitgraph experiment.

    graphs:
      enabled: auto        # auto: the fastest path the config allows on this machine (step
                           #   graphs on a GPU; see auto.py); true: graphs as scope/impl say;
                           #   false: eager
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


@dataclass
class GraphsConfig:
    enabled: bool | str = "auto"  # true | false | auto (resolved at start-up: auto.py)
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

        if not isinstance(self.enabled, bool) and self.enabled != "auto":
            raise bad("enabled", self.enabled, "must be true, false or auto")
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
