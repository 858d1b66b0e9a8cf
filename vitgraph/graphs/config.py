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
from typing import Union

from vitgraph.config_keys import ConfigError, check_section, key


# every graphs key may change when a run resumes: graphs change how a step runs, not what it
# computes
@dataclass
class GraphsConfig:
    enabled: Union[bool, str] = key("auto", choices=(True, False, "auto"), resume_ok=True)  # resolved: auto.py
    impl: str = key("local", choices=("local", "te"), resume_ok=True)
    scope: str = key("layer", choices=("layer", "step"), resume_ok=True)
    warmup_steps: int = key(3, min=0, resume_ok=True)
    on_new_shape: str = key("capture", choices=("capture", "eager"), resume_ok=True)
    max_slots: int = key(8, min=1, resume_ok=True)
    capture_warmup_iters: int = key(2, min=0, resume_ok=True)
    pool: str = key("auto", choices=("auto", "shared", "slot"), resume_ok=True)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "GraphsConfig":
        """ConfigError (a ValueError) naming the first key whose value is not allowed."""
        check_section(self, "graphs.")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> "GraphsConfig":
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"graphs.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        return cls(**d)
