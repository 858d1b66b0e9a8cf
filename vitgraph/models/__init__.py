from vitgraph.models.registry import ALIASES, MODELS, ViTArch, get_arch, resolve_arch

__all__ = ["ALIASES", "MODELS", "ViTArch", "get_arch", "resolve_arch"]
