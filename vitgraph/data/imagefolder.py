"""ImageFolder reader: ``root/<split>/<class_name>/*.{jpg,jpeg,png}`` into memory.

Classes are the sub-folders of ``root/train`` sorted by name; label = index in that list.
Files without an image extension and hidden files are ignored. Unreadable or corrupt images
are skipped, counted and the first few named in the log; a split left with no images, or a val
class that train lacks, is a DataError.
Every image is decoded with PIL to RGB, its shorter side resized to ``render_size`` and
center-cropped to a square, and the whole split is decoded up front (with ``workers``
processes) into one uint8 array. That is fine for small and medium folders (50k images at
64x64 are 600 MB); large datasets need a streaming reader, which this module is not.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading

import numpy as np
import torch
from PIL import Image

from vitgraph.data.loader import DataError, ImageDataset

EXTENSIONS = (".jpg", ".jpeg", ".png")
NAMED = 5  # unreadable files named in the log; the rest are counted

log = logging.getLogger("vitgraph")


def list_classes(split_dir: str) -> list[str]:
    if not os.path.isdir(split_dir):
        raise DataError(f"image folder split not found: {split_dir}")
    classes = sorted(d for d in os.listdir(split_dir)
                     if os.path.isdir(os.path.join(split_dir, d)) and not d.startswith("."))
    if not classes:
        raise DataError(f"no class folders in {split_dir}")
    return classes


def list_files(split_dir: str, classes: list[str]) -> tuple[list[str], list[int]]:
    """Image paths and labels of one split, in (class, file name) order."""
    class_dirs = list_classes(split_dir)
    unknown = sorted(set(class_dirs) - set(classes))
    if unknown:
        raise DataError(f"class folders in {split_dir} not present in the train split: "
                        f"{', '.join(unknown)}")
    paths, labels = [], []
    for name in class_dirs:
        d = os.path.join(split_dir, name)
        files = sorted(f for f in os.listdir(d)
                       if f.lower().endswith(EXTENSIONS) and not f.startswith(".")
                       and os.path.isfile(os.path.join(d, f)))
        if not files:
            raise DataError(f"no .jpg/.jpeg/.png images in class folder {d}")
        paths += [os.path.join(d, f) for f in files]
        labels += [classes.index(name)] * len(files)
    return paths, labels


def resize_crop(im: Image.Image, size: int) -> np.ndarray:
    """An RGB image with its shorter side resized to ``size`` (bicubic), center-cropped:
    uint8 [size, size, 3]."""
    w, h = im.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        im = im.resize((nw, nh), Image.BICUBIC, reducing_gap=3.0)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)


def load_image(path: str, size: int) -> np.ndarray:
    """Decode to RGB, resize the shorter side to ``size``, center-crop: uint8 [size, size, 3]."""
    try:
        with Image.open(path) as im:
            return resize_crop(im.convert("RGB"), size)
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, bomb errors...
        raise DataError(f"cannot read image {path}: {e}") from None


def _load_many(args):
    """(decoded images, the errors of the unreadable ones: (index in ``paths``, message))."""
    paths, size = args
    images, errors = [], []
    for i, p in enumerate(paths):
        try:
            images.append(load_image(p, size))
        except DataError as e:
            errors.append((i, str(e)))
    empty = np.empty((0, size, size, 3), np.uint8)
    return (np.stack(images) if images else empty), errors


def _report_unreadable(split_dir: str, errors: list[str], total: int) -> None:
    if not errors:
        return
    if len(errors) == total:
        raise DataError(f"no readable images in {split_dir}: all {total} failed to decode, e.g. "
                        f"{errors[0]}")
    log.warning("data: skipped %d unreadable image(s) of %d in %s: %s%s", len(errors), total,
                split_dir, "; ".join(errors[:NAMED]), " ..." if len(errors) > NAMED else "")


class LazyImages:
    """Decodes on demand what ``dataset.images[index]`` asks for, in ``workers`` threads.

    Stands in for the uint8 [N, H, W, 3] tensor of a preloaded split, for folders too large
    to hold decoded in memory (ImageNet at 224 is ~190 GB as uint8). Unreadable files are
    found when first drawn, as a DataError naming the file.
    """

    dtype = torch.uint8
    ndim = 4

    def __init__(self, paths: list[str], size: int, workers: int = 1,
                 labels: list[int] | None = None):
        from concurrent.futures import ThreadPoolExecutor
        self.paths, self.size = paths, size
        self.labels = labels if labels is not None else [0] * len(paths)
        self.shape = (len(paths), size, size, 3)
        self.unreadable: dict[int, str] = {}  # index -> error, as found
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-decode")

    def _load(self, i: int) -> np.ndarray:
        """Image ``i``, or when it cannot be decoded the next readable image of the same class
        (deterministic, so a resumed run draws the same batches; the label stays right)."""
        n = len(self.paths)
        for k in range(n):
            j = (i + k) % n
            if self.labels[j] != self.labels[i] or j in self.unreadable:
                continue
            try:
                return load_image(self.paths[j], self.size)
            except DataError as e:
                with self._lock:
                    if j not in self.unreadable:
                        self.unreadable[j] = str(e)
                        if len(self.unreadable) <= NAMED:
                            log.warning("data: skipping unreadable image (%d so far): %s",
                                        len(self.unreadable), e)
        raise DataError(f"no readable image of class index {self.labels[i]} (every file of it "
                        f"failed to decode, e.g. {self.unreadable.get(i, self.paths[i])})")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice):
            idx = range(*index.indices(len(self.paths)))
        else:
            idx = torch.as_tensor(index).reshape(-1).tolist()
        images = list(self._pool.map(self._load, idx))
        if not images:
            return torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        return torch.from_numpy(np.stack(images))


def read_split(root: str, split: str, classes: list[str], render_size: int,
               workers: int = 1, preload: bool = True) -> ImageDataset:
    split_dir = os.path.join(root, split)
    paths, labels = list_files(split_dir, classes)
    if not preload:
        return ImageDataset(LazyImages(paths, render_size, workers, labels),  # type: ignore[arg-type]
                            torch.tensor(labels, dtype=torch.int64), list(classes), None)
    chunk = 256
    jobs = [(paths[i:i + chunk], render_size) for i in range(0, len(paths), chunk)]
    if workers > 1 and len(jobs) > 1:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(min(workers, len(jobs))) as pool:
            parts = pool.map(_load_many, jobs, chunksize=1)
    else:
        parts = [_load_many(j) for j in jobs]
    bad = {start + i: msg for start, (_, errors) in zip(range(0, len(paths), chunk), parts)
           for i, msg in errors}
    _report_unreadable(split_dir, [bad[i] for i in sorted(bad)], len(paths))
    keep = [label for i, label in enumerate(labels) if i not in bad]
    return ImageDataset(torch.from_numpy(np.concatenate([images for images, _ in parts])),
                        torch.tensor(keep, dtype=torch.int64), list(classes), None)


def build_imagefolder(data_cfg, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, val) from ``data_cfg.path``. The folder decides the classes and sizes:
    num_classes, num_train and num_val are not used, nor is ``seed`` (decoding is
    deterministic)."""
    root = data_cfg.path
    if not root:
        raise DataError("data.path must name the image folder root for kind=imagefolder")
    if not os.path.isdir(root):
        raise DataError(f"image folder root not found: {root}")
    classes = list_classes(os.path.join(root, "train"))
    preload = getattr(data_cfg, "preload", True)
    train = read_split(root, "train", classes, data_cfg.render_size, data_cfg.workers, preload)
    val = read_split(root, "val", classes, data_cfg.render_size, data_cfg.workers, preload)
    return train, val
