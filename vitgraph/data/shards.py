"""WebDataset shards: ``.tar`` files whose members ``<key>.<ext>`` group into samples by key.

Classification samples hold an image (``jpg`` / ``jpeg`` / ``png`` / ``webp``) and ``cls`` (the
class index as text); image-text samples hold an image and ``txt`` (a caption); a sample may
have both. ``data.path`` holds ``train-*.tar`` and ``val-*.tar`` (``scripts/make_shards.py``
writes them from an ImageFolder, with ``index.json``: the class names and every sample's
member offsets, so start-up reads no tar headers).

Reading: the tar members are indexed once (``index.json``, else the tar headers) and images are
read by offset and decoded per batch, in ``data.workers`` threads, into the same uint8
``[b, H, W, 3]`` microbatches as ImageFolder (or, with ``data.decode=cuda``, handed over still
encoded and decoded on the GPU by nvJPEG). Order, rank split and resume come from
``MicrobatchLoader``, which for sharded data shuffles shards, and samples only within windows
of ``data.shuffle_shards`` shards: a step reads from a few shards, not from all of them.
"""
from __future__ import annotations

import glob
import json
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from vitgraph.data.config import DataConfig
from vitgraph.data.dataset import DataError, ImageDataset, data_root
from vitgraph.data.decode import (EncodedImages, cpu_decoded, decode_full, decode_image,
                                  for_device, read_size, resolve_decode)
from vitgraph.data.native import NativeDataset, ShardMembers, read_sizes, spread
from vitgraph.output import written_whole

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
INDEX = "index.json"


def sample_key(member_name: str) -> tuple[str, str]:
    """("dir/abc", "jpg") from "dir/abc.jpg"; the key ends at the first dot of the base name."""
    d, base = os.path.split(member_name)
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


def scan_shard(path: str) -> list[dict]:
    """The samples of one tar, in order: {"key", "offset", "size", "ext", "cls", "txt"}."""
    samples: dict[str, dict] = {}
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            key, ext = sample_key(m.name)
            s = samples.setdefault(key, {"key": key})
            if ext in IMAGE_EXTS:
                s.update(offset=m.offset_data, size=m.size, ext=ext)
            elif ext == "cls":
                s["cls"] = int(tar.extractfile(m).read().decode().strip())
            elif ext == "txt":
                s["txt"] = tar.extractfile(m).read().decode("utf-8")
    out = [s for s in samples.values() if "offset" in s]
    if not out:
        raise DataError(f"{path}: no image members (.jpg/.png/.webp) in the shard")
    return out


def split_shards(root: str, split: str) -> list[str]:
    paths = sorted(glob.glob(os.path.join(root, f"{split}-*.tar")))
    if not paths:
        raise DataError(f"no {split}-*.tar shards in {root}")
    return paths


def read_index(root: str, split: str) -> tuple[list[str], list[list[dict]], list[str] | None]:
    """(shard paths, samples per shard, class names or None) from index.json or the tars."""
    index_path = os.path.join(root, INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        if split not in index.get("splits", {}):
            raise DataError(f"{index_path}: no split {split!r}")
        shards = index["splits"][split]
        return ([os.path.join(root, s["file"]) for s in shards], [s["samples"] for s in shards],
                index.get("classes"))
    paths = split_shards(root, split)
    return paths, [scan_shard(p) for p in paths], None



class ShardImages:
    """Stands in for the uint8 [N, H, W, 3] images of a split stored in shards: indexing reads
    the members by offset and decodes them (``decode="cpu"``, in ``workers`` threads) or returns
    them encoded (``decode="cuda"``)."""

    dtype = torch.uint8
    ndim = 4

    def __init__(self, paths: list[str], entries: list[tuple[int, int, int]], size: int,
                 workers: int = 1, decode: str = "cpu", cpu_share: float = 0.0):
        self.paths, self.size, self.decode, self.cpu_share = paths, size, decode, cpu_share
        self.entries = np.asarray(entries, dtype=np.int64).reshape(-1, 3)  # shard, offset, size
        self.shard_ids = torch.from_numpy(self.entries[:, 0].copy())
        self.shape = (len(self.entries), size, size, 3)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-shards")

    def __len__(self) -> int:
        return len(self.entries)

    def read(self, i: int) -> bytes:
        shard, offset, size = (int(v) for v in self.entries[i])
        with open(self.paths[shard], "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise DataError(f"{self.paths[shard]}: truncated member at offset {offset}")
        return data

    def _where(self, i: int) -> str:
        return f"{self.paths[int(self.entries[i, 0])]} @{int(self.entries[i, 1])}"

    def _load_raw(self, i: int) -> torch.Tensor:
        return torch.from_numpy(decode_full(self.read(i), self.size, self._where(i)))

    def _load_encoded(self, i: int) -> torch.Tensor:
        return for_device(self.read(i), self.size, self._where(i))

    def _load(self, i: int) -> np.ndarray:
        return decode_image(self.read(i), self.size, self._where(i))

    def __getitem__(self, index):
        if isinstance(index, slice):
            idx = list(range(*index.indices(len(self))))
        else:
            idx = torch.as_tensor(index).reshape(-1).tolist()
        if self.decode == "cuda":
            # the last share of the batch decoded here, the rest left to nvJPEG
            n_cpu = cpu_decoded(self.cpu_share, len(idx))
            first = len(idx) - n_cpu
            data = list(self._pool.map(self._load_raw, idx[first:])) if n_cpu else []
            jpegs = list(self._pool.map(self._load_encoded, idx[:first]))
            return EncodedImages(jpegs + data, self.size, [self._where(i) for i in idx])
        images = list(self._pool.map(self._load, idx))
        if not images:
            return torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        return torch.from_numpy(np.stack(images))


def read_shard_split(root: str, split: str, size: int, workers: int, decode: str,
                     classes: list[str] | None = None, cpu_share: float = 0.0) -> ImageDataset:
    paths, entries, labels, captions, _, classes = _split_samples(root, split, classes)
    images = ShardImages(paths, entries, size, workers, decode, cpu_share)
    return ImageDataset(images, torch.tensor(labels, dtype=torch.int64), classes,  # type: ignore[arg-type]
                        captions)


def _split_samples(root: str, split: str, classes: list[str] | None):
    """A split's shards as index.json lists them: (paths, entries (shard, offset, size),
    labels, captions (None unless every sample has one), sizes (h, w) or None each, class
    names: ``classes``, else the index's, else "0".."n-1")."""
    paths, per_shard, index_classes = read_index(root, split)
    entries, labels, captions, hws = [], [], [], []
    for s, samples in enumerate(per_shard):
        for smp in samples:
            entries.append((s, smp["offset"], smp["size"]))
            labels.append(int(smp.get("cls", -1)))
            captions.append(smp.get("txt"))
            hws.append(smp.get("hw"))
    has_txt = all(c is not None for c in captions)
    if any(lb < 0 for lb in labels) and not has_txt:
        raise DataError(f"{root}: {split} samples need a .cls (class) or .txt (caption) member")
    classes = classes or index_classes
    if classes is None:
        n = max(labels) + 1 if labels else 0
        classes = [str(i) for i in range(max(n, 1))]
    return paths, entries, labels, captions if has_txt else None, hws, list(classes)


def _shards_root(data_cfg: DataConfig) -> tuple[str, str]:
    """data.path and the decode device of a webdataset run, checked."""
    root = data_root(data_cfg)
    decode = resolve_decode(data_cfg.decode)
    if decode == "cuda" and not torch.cuda.is_available():
        raise DataError("data.decode=cuda needs a CUDA device; use data.decode=cpu or auto")
    return root, decode


def build_webdataset(data_cfg: DataConfig, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, val) from ``data_cfg.path``'s ``train-*.tar`` / ``val-*.tar`` shards."""
    root, decode = _shards_root(data_cfg)
    share = data_cfg.cpu_decode_share
    train = read_shard_split(root, "train", data_cfg.render_size, data_cfg.workers, decode,
                             cpu_share=share)
    val = read_shard_split(root, "val", data_cfg.render_size, data_cfg.workers, decode,
                           train.classes, cpu_share=share)
    return train, val


# ---------------------------------------------------------------- native resolution

def _member_size(path: str, offset: int, size: int) -> tuple[int, int]:
    where = f"{path} @{offset}"
    try:
        with open(path, "rb") as f:
            def head(k):
                f.seek(offset)
                return f.read(k)
            return read_size(head, size, where)
    except OSError as e:
        raise DataError(f"cannot read image {where}: {e}") from None


def _sizes_cache(cache_dir: str | None, paths: list[str], split: str) -> str | None:
    """Where the sizes of a split's members are cached: keyed by the shards' paths, lengths and
    modification times (a rewritten shard reads its headers again)."""
    if not cache_dir:
        return None
    import hashlib
    ident = [(os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    key = hashlib.sha256(json.dumps([split, ident]).encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(cache_dir), f"shard_sizes_{split}_{key}.npy")


def member_sizes(paths: list[str], entries: list[tuple[int, int, int]], hws: list,
                 workers: int, cache: str | None) -> np.ndarray:
    """int64 [N, 2] (h, w) of every sample's image: from index.json's ``hw`` where each sample
    has one, else from the cache file, else from the members' headers (in ``workers``
    threads; written to the cache). A sample whose header does not read is (0, 0)."""
    if hws and all(hw is not None for hw in hws):
        return np.asarray(hws, dtype=np.int64).reshape(-1, 2)
    if cache and os.path.isfile(cache):
        try:
            sizes = np.load(cache, allow_pickle=False)
            if sizes.shape == (len(entries), 2):
                return sizes
        except Exception:  # truncated or foreign: read the headers again
            pass
    sizes, _ = read_sizes(len(entries), lambda i: _member_size(paths[entries[i][0]],
                                                               *entries[i][1:]), workers)
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with written_whole(cache) as tmp, open(tmp, "wb") as fh:
            np.save(fh, sizes)
    return sizes


def read_shard_split_native(root: str, split: str, workers: int, decode: str,
                            classes: list[str] | None = None, cache_dir: str | None = None):
    """One split of shards at native resolution: each sample's size from index.json, the
    cache or its image header; samples whose header does not read are left out (counted in
    the log)."""

    paths, entries, labels, captions, hws, classes = _split_samples(root, split, classes)
    sizes = member_sizes(paths, entries, hws, workers, _sizes_cache(cache_dir, paths, split))
    keep = np.nonzero((sizes > 0).all(1))[0].tolist()
    if len(keep) < len(entries):
        if not keep:
            raise DataError(f"{root}: no readable images in the {split} shards")
        import logging
        logging.getLogger("vitgraph").warning(
            "data: skipped %d %s sample(s) of %d whose image header does not read",
            len(entries) - len(keep), split, len(entries))
    images = ShardMembers(paths, [entries[i] for i in keep], sizes[keep], workers, decode)
    return NativeDataset(images, torch.tensor([labels[i] for i in keep], dtype=torch.int64),
                         classes, [captions[i] for i in keep] if captions else None)


def native_size_sample(data_cfg: DataConfig, n: int) -> np.ndarray:
    """(h, w) of at most ``n`` training samples spread over the shards, where that is cheap:
    index.json's ``hw``, else the members' headers at its offsets, else the sizes cache of
    an earlier run (``member_sizes``). DataError when none of these is there: the sizes would
    take every tar header of the split."""
    root = data_root(data_cfg)
    if os.path.isfile(os.path.join(root, INDEX)):
        paths, entries, _, _, hws, _ = _split_samples(root, "train", None)
        pick = spread(len(entries), n)
        if hws and all(hws[i] is not None for i in pick):
            sizes = np.asarray([hws[i] for i in pick], dtype=np.int64).reshape(-1, 2)
        else:
            sizes, _ = read_sizes(len(pick), lambda j: _member_size(
                paths[entries[pick[j]][0]], *entries[pick[j]][1:]), data_cfg.workers)
        return sizes[(sizes > 0).all(1)]
    cache = _sizes_cache(data_cfg.cache_dir, split_shards(root, "train"),
                         "train")
    if cache and os.path.isfile(cache):
        try:
            sizes = np.load(cache, allow_pickle=False).reshape(-1, 2)
        except Exception:  # truncated or foreign: as if it were not there
            sizes = None
        if sizes is not None:
            sizes = sizes[spread(len(sizes), n)]
            return sizes[(sizes > 0).all(1)]
    raise DataError(f"{root}: no {INDEX} and no cached sizes: the image sizes would take "
                    "every tar header of the train split")


def build_webdataset_native(data_cfg: DataConfig, seed: int):
    """(train, val) ``NativeDataset``s from ``data_cfg.path``'s shards, each image at its own
    size (decoded in the loader's threads, or by nvJPEG with data.decode=cuda)."""
    root, decode = _shards_root(data_cfg)
    cache = data_cfg.cache_dir
    train = read_shard_split_native(root, "train", data_cfg.workers, decode, cache_dir=cache)
    val = read_shard_split_native(root, "val", data_cfg.workers, decode, train.classes,
                                  cache_dir=cache)
    return train, val
