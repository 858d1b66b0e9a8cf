"""ImageFolder reader: ``root/<split>/<class_name>/*.{jpg,jpeg,png}`` into memory.

Classes are the sub-folders of ``root/train`` sorted by name; label = index in that list.
Files without an image extension and hidden files are ignored. Unreadable or corrupt images
are skipped, counted and the first few named in the log; a split left with no images, or a val
class that train lacks, is a DataError.

``preload=True``: every image is decoded with PIL to RGB, its shorter side resized to
``render_size`` and center-cropped to a square, the whole split up front (in ``workers``
threads) into one uint8 array: fine for small and medium folders (50k images at 64x64 are
600 MB). ``preload=False``: each batch is read when drawn (``LazyImages``), decoded in
``workers`` threads (``decode="cpu"``) or read there and decoded by nvJPEG on the GPU
(``decode="cuda"``: ``EncodedImages``, finished by the prefetcher one step ahead).

No process is forked: a forked worker inherits the flag-only SIGTERM handler that preemption
installs, so a pool's terminate() could not end it and start-up hung in Pool.__exit__.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from vitgraph.data.config import DataConfig
from vitgraph.data.dataset import DataError, ImageDataset, data_root
from vitgraph.data.decode import (EncodedImages, cpu_decoded, decode_full, for_device,
                                  load_image, read_size, resolve_decode)
from vitgraph.data.native import FileImages, NativeDataset, read_sizes, spread

# torchvision's ImageFolder list; all but JPEG are decoded by PIL on the CPU
EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".pgm", ".tif", ".tiff")
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
            raise DataError(f"no images ({'/'.join(EXTENSIONS)}) in class folder {d}")
        paths += [os.path.join(d, f) for f in files]
        labels += [classes.index(name)] * len(files)
    return paths, labels


def _report_unreadable(split_dir: str, errors: list[str], total: int) -> None:
    if not errors:
        return
    if len(errors) == total:
        raise DataError(f"no readable images in {split_dir}: all {total} failed to decode, e.g. "
                        f"{errors[0]}")
    log.warning("data: skipped %d unreadable image(s) of %d in %s: %s%s", len(errors), total,
                split_dir, "; ".join(errors[:NAMED]), " ..." if len(errors) > NAMED else "")


class LazyImages:
    """Reads on demand what ``dataset.images[index]`` asks for, in ``workers`` threads.

    Stands in for the uint8 [N, H, W, 3] tensor of a preloaded split, for folders too large
    to hold decoded in memory (ImageNet at 224 is ~190 GB as uint8). ``decode="cpu"``: the
    threads decode and resize (PIL); ``"cuda"``: they read the files and check each header,
    and the batch goes to the device still encoded (``EncodedImages``; other formats than
    JPEG are decoded here at full size), but for the last ``cpu_share`` of each batch, which
    the threads decode at full size (``data.cpu_decode_share``). An unreadable file is found
    when first drawn, named in the log and replaced by the next readable image of its class.
    """

    dtype = torch.uint8
    ndim = 4

    def __init__(self, paths: list[str], size: int, workers: int = 1,
                 labels: list[int] | None = None, decode: str = "cpu", cpu_share: float = 0.0):
        self.paths, self.size, self.decode, self.cpu_share = paths, size, decode, cpu_share
        self.labels = labels if labels is not None else [0] * len(paths)
        self.shape = (len(paths), size, size, 3)
        self.unreadable: dict[int, str] = {}  # index -> error, as found
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-decode")

    def _read(self, j: int, full: bool):
        if self.decode == "cuda":
            try:
                with open(self.paths[j], "rb") as f:
                    data = f.read()
            except OSError as e:
                raise DataError(f"cannot read image {self.paths[j]}: {e}") from None
            if full:
                return torch.from_numpy(decode_full(data, self.size, self.paths[j]))
            return for_device(data, self.size, self.paths[j])
        return load_image(self.paths[j], self.size)

    def _load(self, i: int, full: bool = False) -> tuple:
        """(image ``i``, its path), or when it cannot be read the next readable image of the
        same class (deterministic, so a resumed run draws the same batches; the label stays
        right)."""
        n = len(self.paths)
        for k in range(n):
            j = (i + k) % n
            if self.labels[j] != self.labels[i] or j in self.unreadable:
                continue
            try:
                return self._read(j, full), self.paths[j]
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

    def __getitem__(self, index):
        if isinstance(index, slice):
            idx = range(*index.indices(len(self.paths)))
        else:
            idx = torch.as_tensor(index).reshape(-1).tolist()
        if self.decode == "cuda":
            # the last share of the batch decoded here, the rest left to nvJPEG
            n_cpu = cpu_decoded(self.cpu_share, len(idx))
            full = [False] * (len(idx) - n_cpu) + [True] * n_cpu
            loaded = list(self._pool.map(self._load, idx, full))
            return EncodedImages([im for im, _ in loaded], self.size, [p for _, p in loaded])
        loaded = list(self._pool.map(self._load, idx))
        if not loaded:
            return torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        return torch.from_numpy(np.stack([im for im, _ in loaded]))


def _load_all(paths: list[str], size: int, workers: int) -> tuple[list, dict[int, str]]:
    """Every image of ``paths`` decoded (in ``workers`` threads: PIL's decode and resize leave
    the GIL), and the errors of the unreadable ones by index."""
    def one(p):
        try:
            return load_image(p, size), None
        except DataError as e:
            return None, str(e)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-preload") as pool:
        results = list(pool.map(one, paths, chunksize=64))
    errors = {i: err for i, (_, err) in enumerate(results) if err is not None}
    return [im for im, _ in results if im is not None], errors


def read_split(root: str, split: str, classes: list[str], render_size: int,
               workers: int = 1, preload: bool = True, decode: str = "cpu",
               cpu_share: float = 0.0) -> ImageDataset:
    split_dir = os.path.join(root, split)
    paths, labels = list_files(split_dir, classes)
    if not preload:
        images = LazyImages(paths, render_size, workers, labels, decode, cpu_share)
        return ImageDataset(images, torch.tensor(labels, dtype=torch.int64),  # type: ignore[arg-type]
                            list(classes), None)
    images, bad = _load_all(paths, render_size, workers)
    _report_unreadable(split_dir, [bad[i] for i in sorted(bad)], len(paths))
    keep = [label for i, label in enumerate(labels) if i not in bad]
    return ImageDataset(torch.from_numpy(np.stack(images)),
                        torch.tensor(keep, dtype=torch.int64), list(classes), None)


def build_imagefolder(data_cfg: DataConfig, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, val) from ``data_cfg.path``. The folder decides the classes and sizes:
    num_classes, num_train and num_val are not used, nor is ``seed`` (decoding is
    deterministic)."""
    root, classes = root_and_classes(data_cfg)
    args = (classes, data_cfg.render_size, data_cfg.workers, data_cfg.preload,
            imagefolder_decode(data_cfg.decode, data_cfg.preload), data_cfg.cpu_decode_share)
    return read_split(root, "train", *args), read_split(root, "val", *args)


def root_and_classes(data_cfg: DataConfig) -> tuple[str, list]:
    """The folder of an ImageFolder run (``data_root``) and the classes its train/ holds."""
    root = data_root(data_cfg)
    return root, list_classes(os.path.join(root, "train"))


def imagefolder_decode(decode: str, preload: bool) -> str:
    """Where an ImageFolder run decodes: ``data.decode`` with auto resolved (nvJPEG when a GPU
    and torchvision are there); a preloaded folder is decoded up front on the CPU."""
    if decode == "cuda" and preload:
        raise DataError("data.decode=cuda decodes each batch on the GPU as it is drawn: it "
                        "needs data.preload=false (a preloaded folder is decoded up front)")
    if preload:
        return "cpu"
    decode = resolve_decode(decode)
    if decode == "cuda" and not torch.cuda.is_available():
        raise DataError("data.decode=cuda needs a CUDA device; use data.decode=cpu or auto")
    return decode


# ---------------------------------------------------------------- native resolution

def file_size(path: str) -> tuple[int, int]:
    """(h, w) of an image file from its header (vitgraph.data.decode.read_size)."""
    try:
        with open(path, "rb") as f:
            total = os.fstat(f.fileno()).st_size

            def head(k):
                f.seek(0)
                return f.read(k)
            return read_size(head, total, path)
    except OSError as e:
        raise DataError(f"cannot read image {path}: {e}") from None


def read_split_native(root: str, split: str, classes: list[str], workers: int = 1,
                      decode: str = "cpu"):
    """One split at native resolution: every file's size from its header (in ``workers``
    threads; a file whose header does not read is skipped, counted and named as
    ``read_split`` does), the pixels read and decoded when a pack draws them."""
    split_dir = os.path.join(root, split)
    paths, labels = list_files(split_dir, classes)
    sizes, bad = read_sizes(len(paths), lambda i: file_size(paths[i]), workers)
    _report_unreadable(split_dir, [bad[i] for i in sorted(bad)], len(paths))
    keep = [i for i in range(len(paths)) if i not in bad]
    images = FileImages([paths[i] for i in keep], sizes[keep], workers, decode)
    return NativeDataset(images, torch.tensor([labels[i] for i in keep], dtype=torch.int64),
                         list(classes), None)


def native_size_sample(data_cfg: DataConfig, n: int) -> np.ndarray:
    """(h, w) of at most ``n`` training images spread over the folder (in class order), from
    their headers; files whose header does not read are left out."""
    split_dir = os.path.join(data_root(data_cfg), "train")
    paths, _ = list_files(split_dir, list_classes(split_dir))
    paths = [paths[i] for i in spread(len(paths), n)]
    sizes, bad = read_sizes(len(paths), lambda i: file_size(paths[i]), data_cfg.workers)
    return np.delete(sizes, sorted(bad), axis=0)


def build_imagefolder_native(data_cfg: DataConfig, seed: int):
    """(train, val) ``NativeDataset``s from ``data_cfg.path``, each image at its own size.
    Decoded per step whatever data.preload says (a folder held decoded at every image's own
    size would not be the small one preloading is for); data.decode resolved as for a folder
    that is not preloaded."""
    root, classes = root_and_classes(data_cfg)
    args = (classes, data_cfg.workers, imagefolder_decode(data_cfg.decode, preload=False))
    return read_split_native(root, "train", *args), read_split_native(root, "val", *args)
