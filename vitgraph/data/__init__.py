"""Datasets and loaders: the embedded shapes task, ImageFolder, and the microbatch iterators.

``build_datasets(data_cfg, seed)`` is the entry point; it returns (train, held-out)
``ImageDataset``s, which ``MicrobatchLoader`` and ``iterate_eval`` slice into batches and
``to_model_input`` turns into model inputs. At data.resolution=native (``native=True``) it
gives ``NativeDataset``s, which ``PackedLoader`` and ``iterate_eval_packs`` pack along the
sequence and ``pack_inputs`` turns into model inputs (vitgraph/data/native.py).
"""

from vitgraph.data.dataset import DataError, ImageDataset
from vitgraph.data.decode import EncodedImages, resolve_decode
from vitgraph.data.loader import MicrobatchLoader, iterate_eval, to_model_input
from vitgraph.data.imagefolder import build_imagefolder, build_imagefolder_native
from vitgraph.data.native import (NativeDataset, PackedLoader, iterate_eval_packs, pack_inputs,
                                  pack_spec)
from vitgraph.data.shapes import CLASSES as SHAPES_CLASSES
from vitgraph.data.shapes import build_shapes
from vitgraph.data.shards import build_webdataset, build_webdataset_native


def build_datasets(data_cfg, seed: int, native: bool = False) -> tuple:
    """(train, held-out) for ``data_cfg.kind`` ("shapes" | "imagefolder" | "webdataset") and
    run seed ``seed``: ``ImageDataset``s, or with ``native`` (data.resolution=native)
    ``NativeDataset``s: shapes drawn at varied sizes and aspect ratios, an ImageFolder or
    WebDataset shards read at their images' own sizes (decoded per step: data.preload does not
    apply).

    ``data_cfg`` is duck-typed: kind, path, num_train, num_val, render_size, num_classes,
    cache_dir, workers.
    """
    if data_cfg.kind == "shapes":
        return build_shapes(data_cfg, seed, native=native)
    if data_cfg.kind == "imagefolder":
        return (build_imagefolder_native if native else build_imagefolder)(data_cfg, seed)
    if data_cfg.kind == "webdataset":
        train, val = (build_webdataset_native if native else build_webdataset)(data_cfg, seed)
        train.images.shuffle_shards = getattr(data_cfg, "shuffle_shards", 4)
        return train, val
    raise DataError(f"unknown data.kind {data_cfg.kind!r} (expected 'shapes', 'imagefolder' "
                    "or 'webdataset')")


def decode_line(data_cfg, native: bool = False, cuda: bool = False) -> str:
    """How the run's image files are decoded, and why (the start-up log's data line); "" for
    the shapes, drawn rather than decoded. ``cuda``: whether the run has a GPU."""
    if data_cfg.kind == "shapes":
        return ""
    asked = getattr(data_cfg, "decode", "cpu")
    if data_cfg.kind == "imagefolder" and getattr(data_cfg, "preload", True) and not native:
        return "decoded up front on the CPU (data.preload=true)"
    got = resolve_decode(asked)
    if asked != "auto":
        why = f"data.decode={asked}"
    elif got == "cuda":
        why = "data.decode=auto: a GPU and torchvision's nvJPEG"
    else:
        why = "data.decode=auto: " + ("torchvision's nvJPEG missing" if cuda else "no GPU")
    if got == "cpu":
        return f"decoded on the CPU in {data_cfg.workers} threads ({why})"
    share = getattr(data_cfg, "cpu_decode_share", 0.0)
    return (f"decoded by nvJPEG on the GPU ({why})"
            + (f", {share:.0%} on the CPU (data.cpu_decode_share)" if share else ""))


__all__ = ["DataError", "EncodedImages", "ImageDataset", "MicrobatchLoader", "NativeDataset",
           "PackedLoader", "SHAPES_CLASSES", "build_datasets", "decode_line",
           "iterate_eval", "iterate_eval_packs", "pack_inputs", "pack_spec", "to_model_input"]
