"""vitgraph: train vision encoders the Megatron way."""
__version__ = "0.1.0"
