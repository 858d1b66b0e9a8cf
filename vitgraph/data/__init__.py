"""Datasets and loaders: the embedded shapes task, ImageFolder, and the microbatch iterators.

``build_datasets(data_cfg, seed)`` is the entry point; it returns (train, held-out)
``ImageDataset``s, which ``MicrobatchLoader`` and ``iterate_eval`` slice into batches and
``to_model_input`` turns into model inputs. At data.resolution=native (``native=True``) it
gives ``NativeDataset``s, which ``PackedLoader`` and ``iterate_eval_packs`` pack along the
sequence and ``pack_inputs`` turns into model inputs (vitgraph/data/native.py).
"""

from vitgraph.data.config import DataConfig, PackingConfig
from vitgraph.data.dataset import DataError, ImageDataset, data_root
from vitgraph.data.decode import EncodedImages, resolve_decode
from vitgraph.data.loader import MicrobatchLoader, iterate_eval, to_model_input
from vitgraph.data.imagefolder import build_imagefolder, build_imagefolder_native, root_and_classes
from vitgraph.data.imagefolder import native_size_sample as _folder_sizes
from vitgraph.data.native import (NativeDataset, PackedLoader, images_per_pack,
                                  iterate_eval_packs, pack_fill, pack_inputs, pack_spec,
                                  size_tokens)
from vitgraph.data.shapes import CLASSES as SHAPES_CLASSES
from vitgraph.data.shapes import build_shapes
from vitgraph.data.shapes import native_size_sample as _shapes_sizes
from vitgraph.data.shards import _split_samples, build_webdataset, build_webdataset_native
from vitgraph.data.shards import native_size_sample as _shards_sizes

SIZE_SAMPLE = 512  # images whose sizes estimate a native dataset's mean image


def build_datasets(data_cfg: DataConfig, seed: int, native: bool = False) -> tuple:
    """(train, held-out) for ``data_cfg.kind`` ("shapes" | "imagefolder" | "webdataset") and
    run seed ``seed``: ``ImageDataset``s, or with ``native`` (data.resolution=native)
    ``NativeDataset``s: shapes drawn at varied sizes and aspect ratios, an ImageFolder or
    WebDataset shards read at their images' own sizes (decoded per step: data.preload does not
    apply).
    """
    if data_cfg.kind == "shapes":
        return build_shapes(data_cfg, seed, native=native)
    if data_cfg.kind == "imagefolder":
        return (build_imagefolder_native if native else build_imagefolder)(data_cfg, seed)
    if data_cfg.kind == "webdataset":
        train, val = (build_webdataset_native if native else build_webdataset)(data_cfg, seed)
        train.images.shuffle_shards = data_cfg.shuffle_shards
        return train, val
    raise DataError(f"unknown data.kind {data_cfg.kind!r} (expected 'shapes', 'imagefolder' "
                    "or 'webdataset')")


def class_count(data_cfg: DataConfig) -> int:
    """The classes a run on ``data_cfg`` finds, without decoding an image: the shapes'
    data.num_classes, an ImageFolder's train/ class folders, the shards' index.json (else
    their tar headers). DataError where data.path cannot tell."""
    if data_cfg.kind == "shapes":
        return data_cfg.num_classes
    if data_cfg.kind == "imagefolder":
        return len(root_and_classes(data_cfg)[1])
    return len(_split_samples(data_root(data_cfg), "train", None)[5])


def decode_line(data_cfg: DataConfig, native: bool = False, cuda: bool = False) -> str:
    """How the run's image files are decoded, and why (the start-up log's data line); "" for
    the shapes, drawn rather than decoded. ``cuda``: whether the run has a GPU."""
    if data_cfg.kind == "shapes":
        return ""
    asked = data_cfg.decode
    if data_cfg.kind == "imagefolder" and data_cfg.preload and not native:
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
    share = data_cfg.cpu_decode_share
    return (f"decoded by nvJPEG on the GPU ({why})"
            + (f", {share:.0%} on the CPU (data.cpu_decode_share)" if share else ""))


def native_size_sample(data_cfg: DataConfig, seed: int, n: int = SIZE_SAMPLE):
    """(h, w) int64 [<= n, 2] of training images spread over ``data_cfg``'s native dataset,
    without decoding a pixel (shapes: drawn from its seed; imagefolder: the files' headers;
    webdataset: index.json, headers at its offsets or the sizes cache). DataError where that
    is not cheap or nothing was read; the message says why."""
    if data_cfg.kind == "shapes":
        sizes = _shapes_sizes(data_cfg, seed, n)
    elif data_cfg.kind == "imagefolder":
        sizes = _folder_sizes(data_cfg, n)
    elif data_cfg.kind == "webdataset":
        sizes = _shards_sizes(data_cfg, n)
    else:
        raise DataError(f"unknown data.kind {data_cfg.kind!r}")
    if len(sizes) == 0:
        raise DataError(f"data.kind={data_cfg.kind}: no image size could be read")
    return sizes


__all__ = ["DataConfig", "DataError", "EncodedImages", "ImageDataset", "MicrobatchLoader",
           "NativeDataset", "PackedLoader", "PackingConfig", "SHAPES_CLASSES", "build_datasets",
           "class_count", "decode_line", "images_per_pack",
           "iterate_eval", "iterate_eval_packs", "native_size_sample", "pack_fill", "pack_inputs",
           "pack_spec", "size_tokens", "to_model_input"]
