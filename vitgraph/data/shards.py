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

import functools
import glob
import io
import json
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

try:  # libjpeg-turbo without the GIL (see _turbo_decode)
    import simplejpeg
except ImportError:  # PIL decodes everything then
    simplejpeg = None

from vitgraph.data.imagefolder import resize_crop
from vitgraph.data.loader import DataError, ImageDataset

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


def _turbo_decode(data: bytes, size: int) -> np.ndarray | None:
    """A JPEG as RGB uint8 [H, W, 3] at the largest power-of-two DCT reduction whose shorter
    side still covers ``size`` (PIL's draft mode), through simplejpeg; None where PIL should
    decode (no simplejpeg, not a JPEG, CMYK, damaged). Used by ``decode_full`` only: in
    ``decode_image`` PIL's resize dominates, and swapping the decode measured no faster there
    (on a 2-core machine).

    simplejpeg wraps libjpeg-turbo, as PIL's decoder does (the same pixels), but holds no GIL
    while decoding into the array. PIL holds it while making an array of a decoded image, so
    the loader's threads barely scale: on the H200 host, 500x375 photos at full size, PIL gave
    222 img/s on one thread and 948 on 16; simplejpeg 474 and 4,964
    (benchmarks/BENCHMARKS.md, input pipeline)."""
    if simplejpeg is None or data[:2] != b"\xff\xd8":
        return None
    try:
        h, w, space, _ = simplejpeg.decode_jpeg_header(data)
        if space not in ("YCbCr", "Gray"):  # PIL's own conversion for the rare others (CMYK)
            return None
        f = 1
        while f < 8 and min(h, w) // (2 * f) >= size:
            f *= 2
        return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // f), min_width=-(-w // f))
    except ValueError:
        return None  # PIL decides, and names the error


def _open(data: bytes, size: int) -> Image.Image:
    """The image as RGB; JPEGs decoded at a reduced DCT scale when that still covers ``size``
    on the shorter side (PIL's draft mode: several times faster for large photos)."""
    with Image.open(io.BytesIO(data)) as im:
        if im.format == "JPEG":
            w, h = im.size
            im.draft("RGB", (max(size, round(size * w / min(w, h))),
                             max(size, round(size * h / min(w, h)))))
        return im.convert("RGB")


def decode_image(data: bytes, size: int, where: str = "") -> np.ndarray:
    """Encoded image -> RGB, shorter side resized to ``size``, center-cropped: uint8 [s, s, 3]."""
    try:
        return resize_crop(_open(data, size), size)
    except Exception as e:
        raise DataError(f"cannot decode image {where}: {e}") from None


def decode_full(data: bytes, size: int, where: str = "") -> np.ndarray:
    """Encoded image -> RGB uint8 [H, W, 3], not resized (``data.cpu_decode_share``: the device
    resizes); JPEGs at PIL's draft scale, through simplejpeg where it can (``_turbo_decode``)."""
    fast = _turbo_decode(data, size)
    if fast is not None:
        return fast
    try:
        return np.array(_open(data, size), dtype=np.uint8)  # writable, as torch wants it
    except Exception as e:
        raise DataError(f"cannot decode image {where}: {e}") from None


@dataclass
class EncodedImages:
    """A microbatch the device finishes (``data.decode=cuda``): decoded there by nvJPEG, then
    resized to ``size`` and center-cropped (``finish_on_device``). ``data``: CPU uint8
    tensors, each 1-D (JPEG bytes) or, for the share decoded in the loader's threads
    (``data.cpu_decode_share``), [H, W, 3] at full size."""
    data: list
    size: int

    def __len__(self) -> int:
        return len(self.data)

    # the two tensor methods an eval batch is cut into microbatches with
    def split(self, m: int) -> list["EncodedImages"]:
        return [EncodedImages(self.data[i:i + m], self.size) for i in range(0, len(self.data), m)]

    def padded(self, n: int) -> "EncodedImages":
        """``n`` copies of the first image appended (the fill of a last, short batch)."""
        return EncodedImages(self.data + self.data[:1] * n, self.size)


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
        # not pinned: pinning is a CUDA call, which from this thread could break a graph capture
        # on the training thread (global capture mode); finish_on_device copies it as it is
        return torch.from_numpy(decode_full(self.read(i), self.size, self._where(i)))

    def _load(self, i: int) -> np.ndarray:
        return decode_image(self.read(i), self.size, self._where(i))

    def __getitem__(self, index):
        if isinstance(index, slice):
            idx = list(range(*index.indices(len(self))))
        else:
            idx = torch.as_tensor(index).reshape(-1).tolist()
        if self.decode == "cuda":
            # the last share of the batch decoded here, the rest left to nvJPEG
            n_cpu = round(self.cpu_share * len(idx))
            first = len(idx) - n_cpu
            data = list(self._pool.map(self._load_raw, idx[first:])) if n_cpu else []
            jpegs = [torch.frombuffer(bytearray(d), dtype=torch.uint8)
                     for d in self._pool.map(self.read, idx[:first])]
            return EncodedImages(jpegs + data, self.size)
        images = list(self._pool.map(self._load, idx))
        if not images:
            return torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        return torch.from_numpy(np.stack(images))


def read_shard_split(root: str, split: str, size: int, workers: int, decode: str,
                     classes: list[str] | None = None, cpu_share: float = 0.0) -> ImageDataset:
    paths, per_shard, index_classes = read_index(root, split)
    entries, labels, captions = [], [], []
    for s, samples in enumerate(per_shard):
        for smp in samples:
            entries.append((s, smp["offset"], smp["size"]))
            labels.append(int(smp.get("cls", -1)))
            captions.append(smp.get("txt"))
    has_txt = all(c is not None for c in captions)
    if any(lb < 0 for lb in labels) and not has_txt:
        raise DataError(f"{root}: {split} samples need a .cls (class) or .txt (caption) member")
    classes = classes or index_classes
    if classes is None:
        n = max(labels) + 1 if labels else 0
        classes = [str(i) for i in range(max(n, 1))]
    images = ShardImages(paths, entries, size, workers, decode, cpu_share)
    return ImageDataset(images, torch.tensor(labels, dtype=torch.int64), list(classes),  # type: ignore[arg-type]
                        captions if has_txt else None)


def build_webdataset(data_cfg, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, val) from ``data_cfg.path``'s ``train-*.tar`` / ``val-*.tar`` shards."""
    root = data_cfg.path
    if not root or not os.path.isdir(root):
        raise DataError(f"data.kind=webdataset: data.path must name a folder of train-*.tar / "
                        f"val-*.tar shards, got {root!r}")
    decode = resolve_decode(getattr(data_cfg, "decode", "cpu"))
    if decode == "cuda" and not torch.cuda.is_available():
        raise DataError("data.decode=cuda needs a CUDA device; use data.decode=cpu or auto")
    share = getattr(data_cfg, "cpu_decode_share", 0.0)
    train = read_shard_split(root, "train", data_cfg.render_size, data_cfg.workers, decode,
                             cpu_share=share)
    val = read_shard_split(root, "val", data_cfg.render_size, data_cfg.workers, decode,
                           train.classes, cpu_share=share)
    return train, val


def resolve_decode(decode: str) -> str:
    if decode == "auto":
        return "cuda" if torch.cuda.is_available() and _nvjpeg_available() else "cpu"
    return decode


def _nvjpeg_available() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:
        return False
    return True


def _bicubic(x: np.ndarray) -> np.ndarray:
    """PIL's (and torch's antialiased) bicubic kernel, a = -0.5."""
    a, x = -0.5, np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resize_matrix(n_in: int, n_out: int, start: int, length: int) -> np.ndarray:
    """Rows ``start:start + length`` of the [n_out, n_in] matrix of an antialiased bicubic
    resize along one axis, as PIL and ``F.interpolate(antialias=True)`` compute it: a
    downscale widens the kernel by the scale, and each output's weights sum to one."""
    scale = n_in / n_out
    support = 2.0 * max(scale, 1.0)
    m = np.zeros((length, n_in), dtype=np.float64)
    for r, i in enumerate(range(start, start + length)):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        w = _bicubic((np.arange(lo, hi) - center + 0.5) / max(scale, 1.0))
        m[r, lo:hi] = w / w.sum()
    return m.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _device_matrix(n_in: int, n_out: int, start: int, length: int, device, dtype) -> torch.Tensor:
    """``resize_matrix`` on the device, computed and copied there once per image size."""
    return torch.from_numpy(resize_matrix(n_in, n_out, start, length)).to(device, dtype)


def finish_on_device(batch: EncodedImages, device, decoder=None) -> torch.Tensor:
    """A microbatch -> uint8 [b, s, s, 3] on ``device``: its JPEGs decoded there in one nvJPEG
    batch (``torchvision.io.decode_jpeg(device=...)``; ``decoder``, list of byte tensors ->
    list of uint8 [3, H, W], replaces it in tests), the images decoded in the loader's threads
    copied there; then each image's shorter side resized to ``s`` and the center cropped.

    The resize is separable, so each size's images go through two batched matmuls with the
    weights of the rows and columns the crop keeps (``resize_matrix``): on an H200 torch's
    antialiased bicubic kernel took 2.5 ms of GPU time per 256 photos of 500x375, the two
    matmuls 0.7 ms. On CUDA they run in fp16 (pixels 0..255 are exact; the intermediate is
    rounded to fp16): at most one level from torch's fp32 result, on 4% of values there."""
    jpegs = [i for i, t in enumerate(batch.data) if t.dim() == 1]
    # from pageable memory: the driver stages each copy (host-synchronous, a memcpy). Pinning
    # each image first cost the training thread 57 ms per 77 photos on the H200 host
    imgs = [t.to(device, non_blocking=True).permute(2, 0, 1) if t.dim() == 3 else None
            for t in batch.data]
    if jpegs:
        data = [batch.data[i] for i in jpegs]
        if decoder is None:
            from torchvision.io import ImageReadMode, decode_jpeg
            decoded = decode_jpeg(data, device=device, mode=ImageReadMode.RGB)
        else:
            decoded = decoder(data)
        for i, im in zip(jpegs, decoded):
            imgs[i] = im
    s = batch.size
    out = torch.empty((len(imgs), s, s, 3), dtype=torch.uint8, device=device)
    # images of one size (most of a photo dataset) are resized and cropped as one batch
    by_size: dict[tuple, list[int]] = {}
    for i, im in enumerate(imgs):
        by_size.setdefault(tuple(im.shape[-2:]), []).append(i)
    for (h, w), idx in by_size.items():
        ims = torch.stack([imgs[i].to(device) for i in idx])
        scale = s / min(h, w)
        nh, nw = max(s, round(h * scale)), max(s, round(w * scale))
        top, left = (nh - s) // 2, (nw - s) // 2
        if (nh, nw) != (h, w):
            dt = torch.float16 if ims.is_cuda else torch.float32
            rows = _device_matrix(h, nh, top, s, ims.device, dt)
            cols = _device_matrix(w, nw, left, s, ims.device, dt).t()
            x = ims.to(dt)
            # the cheaper order of the two products
            if s * h * w + s * w * s <= h * w * s + s * h * s:
                x = torch.matmul(torch.matmul(rows, x), cols)
            else:
                x = torch.matmul(rows, torch.matmul(x, cols))
            # fp16 holds every integer to 2048: rounding and clamping there gives fp32's bytes
            crop = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        else:
            crop = ims[:, :, top:top + s, left:left + s].permute(0, 2, 3, 1)
        if len(idx) == len(imgs):
            out.copy_(crop)
        else:
            out[torch.tensor(idx, device=out.device)] = crop
    return out
