"""Which cuDNN TE loaded, and which attention backend TE used inside a graph.

Transformer Engine chooses its attention backend per call (flash, fused = cuDNN, unfused).
Under CUDA-graph capture it drops the fused cuDNN backend when the cuDNN *it* loaded is
9.15 or older -- and TE looks for cuDNN in $CUDNN_HOME, then /usr/local/cuda, before the
pip wheel (nvidia-cudnn) that torch uses. An old system cuDNN there made graphed training
1.5x slower than eager on an H200. `warn_if_fallback(log)` says so loudly at start-up.

Recording the backend TE actually used: TE keeps its last selection in the module global
`transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention.
_attention_backends` (TE 2.13 ... 2.20), updated whenever the attention parameters change
-- and `cuda_graph=True` during capture is such a change. Reading that dict right after a
capture is free and exact for the captured call; the manager does it after every capture
and reports it in `stats()["attention_backend"]`. (For a full trace of TE's reasoning run
with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2.)
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch

FUSED_ATTN_GRAPH_MIN = (9, 15, 0)  # TE drops fused attention under capture at <= this


def decode_cudnn_version(v: Optional[int]) -> Optional[tuple]:
    """cuDNN's integer version (91900, or 8907 for 8.9.7) -> (major, minor, patch)."""
    if v is None:
        return None
    v = int(v)
    major_mag = 1000 if v < 90000 else 10000
    major, rest = divmod(v, major_mag)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)


def _fmt(v: Optional[tuple]) -> Optional[str]:
    return ".".join(str(x) for x in v) if v is not None else None


def torch_cudnn_version() -> Optional[tuple]:
    try:
        if not torch.backends.cudnn.is_available():
            return None
        return decode_cudnn_version(torch.backends.cudnn.version())
    except Exception:  # pragma: no cover - defensive
        return None


def te_cudnn_version() -> Optional[tuple]:
    """The cuDNN TE's extension loaded (best effort; None without TE or without a GPU)."""
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        v = get_cudnn_version()
        return tuple(int(x) for x in v)
    except Exception:
        pass
    try:
        import transformer_engine_torch as tex  # type: ignore[import-not-found]

        return decode_cudnn_version(tex.get_cudnn_version())
    except Exception:
        return None


def torch_cudnn_dir() -> Optional[str]:
    """Directory of the pip cuDNN torch uses (the `nvidia.cudnn` package), if installed."""
    try:
        import nvidia.cudnn  # type: ignore[import-not-found]
    except Exception:
        return None
    paths = list(getattr(nvidia.cudnn, "__path__", []) or [])
    if paths:
        return paths[0]
    f = getattr(nvidia.cudnn, "__file__", None)
    return os.path.dirname(f) if f else None


def te_attention_backend() -> Optional[dict]:
    """TE's last attention-backend selection, or None when TE is not loaded / unknown."""
    mod = sys.modules.get("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    sel = getattr(mod, "_attention_backends", None) if mod is not None else None
    if not isinstance(sel, dict) or sel.get("attention_params") is None:
        return None
    if sel.get("use_flash_attention"):
        name = f"FlashAttention ({sel.get('flash_attention_backend')})"
    elif sel.get("use_fused_attention"):
        sub = sel.get("fused_attention_backend")
        name = f"FusedAttention (sub-backend {int(sub) if sub is not None else '?'})"
    elif sel.get("use_unfused_attention"):
        name = "UnfusedDotProductAttention"
    else:
        name = "none"
    params = sel.get("attention_params")
    return {"backend": name, "cuda_graph": bool(getattr(params, "cuda_graph", False))}


def attention_report() -> dict:
    torch_v = torch_cudnn_version()
    te_v = te_cudnn_version()
    return {
        "torch_cudnn": _fmt(torch_v),
        "te_cudnn": _fmt(te_v),
        # None: unknown (no TE); False: TE will not use fused attention inside graphs
        "te_fused_attention_in_graphs": None if te_v is None else te_v > FUSED_ATTN_GRAPH_MIN,
        "torch_cudnn_dir": torch_cudnn_dir(),
        "cudnn_home": os.environ.get("CUDNN_HOME"),
        "te_attention_backend": te_attention_backend(),
    }


def warn_if_fallback(log: logging.Logger | None = None) -> bool:
    """Log both cuDNN versions; warn loudly when TE's cuDNN loses fused attention in graphs.

    Returns True when the warning was issued.
    """
    log = log or logging.getLogger("vitgraph.graphs")
    r = attention_report()
    log.info("cuDNN: torch %s, Transformer Engine %s", r["torch_cudnn"], r["te_cudnn"] or "n/a")
    if r["te_fused_attention_in_graphs"] is not False:
        return False
    fix = r["torch_cudnn_dir"] or "<site-packages>/nvidia/cudnn"
    bar = "!" * 78
    log.warning(
        "\n%s\n"
        "!! Transformer Engine loaded cuDNN %s (torch uses %s).\n"
        "!! TE drops its fused (cuDNN) attention inside CUDA graphs with cuDNN <= %s:\n"
        "!! graphed layers fall back to a slower attention (seen: graphs 1.5x SLOWER than eager).\n"
        "!! TE searches $CUDNN_HOME%s, then /usr/local/cuda, before torch's pip cuDNN.\n"
        "!! Fix: export CUDNN_HOME=%s\n"
        "%s",
        bar, r["te_cudnn"], r["torch_cudnn"], _fmt(FUSED_ATTN_GRAPH_MIN),
        f" (now {r['cudnn_home']})" if r["cudnn_home"] else " (unset)", fix, bar,
    )
    return True
