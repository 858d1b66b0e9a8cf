"""Datasets and loaders: the embedded shapes task, ImageFolder, and the microbatch iterators.

``build_datasets(data_cfg, seed)`` is the entry point; it returns (train, held-out)
``ImageDataset``s, which ``MicrobatchLoader`` and ``iterate_eval`` slice into batches and
``to_model_input`` turns into model inputs.
"""

from vitgraph.data.dataset import DataError, ImageDataset
from vitgraph.data.decode import EncodedImages
from vitgraph.data.loader import MicrobatchLoader, iterate_eval, to_model_input
from vitgraph.data.shapes import CLASSES as SHAPES_CLASSES


def build_datasets(data_cfg, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, held-out) for ``data_cfg.kind`` ("shapes" | "imagefolder" | "webdataset") and
    run seed ``seed``.

    ``data_cfg`` is duck-typed: kind, path, num_train, num_val, render_size, num_classes,
    cache_dir, workers.
    """
    if data_cfg.kind == "shapes":
        from vitgraph.data.shapes import build_shapes
        return build_shapes(data_cfg, seed)
    if data_cfg.kind == "imagefolder":
        from vitgraph.data.imagefolder import build_imagefolder
        return build_imagefolder(data_cfg, seed)
    if data_cfg.kind == "webdataset":
        from vitgraph.data.shards import build_webdataset
        train, val = build_webdataset(data_cfg, seed)
        train.images.shuffle_shards = getattr(data_cfg, "shuffle_shards", 4)
        return train, val
    raise DataError(f"unknown data.kind {data_cfg.kind!r} (expected 'shapes', 'imagefolder' "
                    "or 'webdataset')")


__all__ = ["DataError", "EncodedImages", "ImageDataset", "MicrobatchLoader", "SHAPES_CLASSES", "build_datasets",
           "iterate_eval", "to_model_input"]
