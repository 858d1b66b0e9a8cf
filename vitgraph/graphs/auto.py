"""``graphs.enabled: auto`` (the default): the graph path a run takes, chosen once at start-up.

The fastest path the config allows on this machine, in this order:

1. ``scope: step`` -- the whole optimizer step as one graph. Fastest at every micro-batch of
   the bundled GPU configs on an H200 (bf16, one bench run, benchmarks/BENCHMARKS.md):
   ViT-B/16 mb 128: step 3,797 img/s, layer 3,440, eager 1,375; ViT-L/16 mb 64: 1,133, 928,
   433.
2. ``scope: layer`` -- where step graphs are not valid: FP8 with delayed scaling keeps an amax
   history that TE updates from the host between steps (layer graphs with ``impl: te``); or
   not checked: tensor parallelism (layer graphs matched eager at tp=2 on two H200s; step
   graphs were checked at dp=2 and pp=2 only).
3. eager -- without CUDA (the CPU path; graphs need a CUDA device), and where neither scope
   holds the run: activation recompute with random masks in the layers (graph-safe RNG states
   are not rewound for the recompute), and selective recompute.
Activation recompute: ``full`` runs under both scopes, ``selective`` eagerly only.

An explicit ``graphs.enabled: true | false`` always wins, with ``scope`` and ``impl`` as
written. Under auto the chooser sets ``scope`` and ``impl``; the section's other keys
(``warmup_steps``, ``on_new_shape`` ...) apply as written.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import GraphsConfig


@dataclass(frozen=True)
class GraphPath:
    """The resolved ``graphs`` section (``enabled`` a bool) and why it was chosen."""
    config: GraphsConfig
    reason: str

    @property
    def enabled(self) -> bool:
        return self.config.enabled is True

    @property
    def scope(self) -> str | None:
        """layer | step; None when the run is eager."""
        return self.config.scope if self.enabled else None

    @property
    def name(self) -> str:
        """eager | layer | step: what the logs and benchmark rows call the path."""
        return self.scope or "eager"

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_graphs(graphs: GraphsConfig, cuda: bool, precision: str = "bf16",
                  fp8_recipe: str = "current", tp: int = 1, *, recompute: str = "none",
                  random_layers: bool = False, host_optimizer: bool = False,
                  fsdp: bool = False) -> GraphPath:
    """The path for a run with ``graphs`` on a machine with (``cuda``) or without a GPU.
    ``recompute``: train.recompute; ``random_layers``: the layers draw random masks (drop path,
    dropout); ``host_optimizer``: part of the optimizer steps on the CPU
    (optim.offload_fraction); ``fsdp``: parallel.fsdp (weights gathered as the step runs)."""
    if graphs.enabled is True or graphs.enabled is False:
        return GraphPath(graphs, f"graphs.enabled={str(graphs.enabled).lower()} in the config")

    def path(**changes) -> GraphsConfig:
        return dataclasses.replace(graphs, **changes)

    if not cuda:
        return GraphPath(path(enabled=False), "graphs.enabled=auto: no CUDA device (graphs "
                                              "need one), eager")
    if fsdp:
        return GraphPath(path(enabled=False), "graphs.enabled=auto: eager: parallel.fsdp "
                                              "gathers each layer's weights into memory it "
                                              "allocates as the step runs")
    if recompute != "none" and random_layers:
        return GraphPath(path(enabled=False), f"graphs.enabled=auto: eager: train.recompute="
                                              f"{recompute} with random masks in the layers (drop "
                                              f"path, dropout) cannot replay them under graphs")
    if recompute == "selective":
        return GraphPath(path(enabled=False), "graphs.enabled=auto: eager: megatron's module "
                                              "checkpoint (train.recompute=selective) cannot be "
                                              "captured")
    if precision == "fp8" and fp8_recipe != "current":
        return GraphPath(path(enabled=True, scope="layer", impl="te"),
                         f"graphs.enabled=auto: per-layer graphs (impl te): FP8 with "
                         f"{fp8_recipe} scaling updates its amax history from the host between "
                         f"steps, which a whole-step graph cannot hold")
    if host_optimizer:
        return GraphPath(path(enabled=True, scope="layer"),
                         "graphs.enabled=auto: per-layer graphs: the optimizer steps partly on "
                         "the CPU (optim.offload_fraction), which a whole-step graph cannot hold")
    if tp > 1:
        return GraphPath(path(enabled=True, scope="layer"),
                         f"graphs.enabled=auto: per-layer graphs: whole-step graphs are not "
                         f"checked with tensor parallelism (parallel.tp={tp}) yet")
    return GraphPath(path(enabled=True, scope="step"),
                     "graphs.enabled=auto: the whole step as one CUDA graph, the fastest path "
                     "measured at every bundled config's micro-batch")
