"""CUDA graphs for megatron-core models: per TransformerLayer (manager.py, graphs.scope=layer)
or the whole training step (step.py, graphs.scope=step).

    from vitgraph.graphs import GraphManager, GraphsConfig
    manager = GraphManager.for_model(model_chunks, GraphsConfig(enabled=True))
"""

from .auto import GraphPath, choose_graphs
from .backend import CaptureBackend, CudaBackend, RerunBackend, default_backend, use_side_stream
from .callable import GraphedCallable
from .config import GraphsConfig
from .cudnn import attention_report, te_attention_backend, warn_if_fallback
from .manager import GraphManager, find_transformer_layers
from .step import StepGraphs
from .te_impl import TEGraphedCallable

__all__ = [
    "CaptureBackend",
    "CudaBackend",
    "RerunBackend",
    "default_backend",
    "use_side_stream",
    "GraphedCallable",
    "TEGraphedCallable",
    "GraphsConfig",
    "GraphPath",
    "choose_graphs",
    "GraphManager",
    "StepGraphs",
    "find_transformer_layers",
    "attention_report",
    "te_attention_backend",
    "warn_if_fallback",
]
