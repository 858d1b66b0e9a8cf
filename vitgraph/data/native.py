"""Native-resolution data (data.resolution=native): datasets whose images keep their own sizes,
the packed training loader, the eval packs and the packs' device-side transform.

* ``NativeDataset``: labels, classes, captions / tokens as ``ImageDataset`` has them, and
  ``images``, a ``NativeImages`` source whose ``sizes`` (h, w) are known before any pixel is
  decoded (the shapes data draws them first; files and shards read their headers), so the
  packer plans a step from sizes alone. ``vitgraph.data.build_datasets(data_cfg, seed,
  native=True)`` makes the (train, held-out) pair for data.kind shapes | imagefolder |
  webdataset.
* ``PackedLoader``: each step's ``num_microbatches x dp`` packs (vitgraph.data.packing), the
  same global packing on every rank, each rank taking its slice; deterministic from the seed
  and resumed exactly (the images waiting for a pack are part of its state).
* ``iterate_eval_packs``: the held-out images in fixed order, next-fit into packs, each pack
  on one rank.
* ``PackAugment``: per-image augmentation of a pack on the device (flip, colour ops, colour
  jitter, erasing) from fixed-shape draws (``PackParams``), so that a step graph holds it (the
  classifier applies it in its forward); the random-resized crop is drawn here too
  (``crop_boxes``) and made by the resize.
* ``pack_inputs``: one pack as the model takes it on the device, normalised as the fixed path,
  augmented there when training (``PackAugment``, eagerly).

Each image's pixels are its planned grid (``packing.native_grid``) times the patch: decoded
and resized in the loader's threads (data.decode=cpu) or, for data.decode=cuda, handed over
still encoded (``decode.EncodedPack``) and decoded by nvJPEG, resized and patchified on the
device (``Prefetcher`` finishes it on its side stream, ``pack_inputs`` when nothing did).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np
import torch

from vitgraph.data.augment import (_constant, _hash32, _normal_polar, _rng, draw_ops, fused,
                                   slot_ops)
from vitgraph.data.dataset import DataError
from vitgraph.data.decode import (EncodedPack, decode_native, finish_pack_on_device,
                                  native_for_device, resize_native)
from vitgraph.data.loader import MEAN, STD, _epoch_seed, _shard_window_permutation
from vitgraph.data.packing import PackSpec, assemble, fill_packs, layout, native_grid

log = logging.getLogger("vitgraph")
NAMED = 5  # undecodable images named in the log; the rest are counted


# ---------------------------------------------------------------- image sources

def patch_rows(image: np.ndarray, patch: int) -> torch.Tensor:
    """``packing.patchify`` of uint8 [gh * p, gw * p, 3], in numpy (a few times cheaper per
    small image than the torch view ops): [gh * gw, 3 * p * p]."""
    h, w, c = image.shape
    gh, gw = h // patch, w // patch
    x = image[:gh * patch, :gw * patch].reshape(gh, patch, gw, patch, c).transpose(0, 2, 4, 1, 3)
    return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, c * patch * patch))


class NativeImages:
    """The images of one split at their own sizes. ``sizes``: int64 [N, 2] (h, w) as stored;
    ``rows`` gives one image's patch rows (cropped, resized to its grid, patchified) on the
    CPU, ``encoded`` what an ``EncodedPack`` holds for it (``decode="cuda"``).
    ``shuffle_shards`` > 0 with ``shard_ids`` permutes shard-wise (WebDataset)."""

    decode = "cpu"
    shard_ids: torch.Tensor | None = None
    shuffle_shards = 0

    def __init__(self, sizes, workers: int = 1):
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-native")

    def __len__(self) -> int:
        return len(self.sizes)

    def name(self, i: int) -> str:
        return f"image {i}"

    def rows(self, i: int, grid, patch: int, crop=None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def encoded(self, i: int, grid, patch: int, crop=None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def map(self, fn, *args) -> list:
        return list(self._pool.map(fn, *args))


class ArrayImages(NativeImages):
    """Images in memory, back to back: ``pixels`` uint8 [sum h*w*3] (the shapes data).
    ``keep_rows``: each image's uncropped patch rows are made once and kept (the pixels must
    not change after; the resize is most of a pack's host time on the CPU demo, and its
    50,000 images' rows are ~120 MB)."""

    def __init__(self, pixels, sizes, workers: int = 1, keep_rows: bool = False):
        super().__init__(sizes, workers)
        self.keep_rows = keep_rows
        self.pixels = torch.as_tensor(pixels).reshape(-1)
        self._flat = self.pixels.numpy()  # the same memory; numpy slices cost less per image
        nbytes = self.sizes[:, 0] * self.sizes[:, 1] * 3
        self.offsets = np.concatenate([[0], np.cumsum(nbytes)]).astype(np.int64)
        if self.offsets[-1] != self.pixels.numel():
            raise ValueError(f"{self.pixels.numel()} pixel bytes for images of "
                             f"{int(self.offsets[-1])}")
        self._rows: dict[tuple, torch.Tensor] = {}  # (image, grid, patch) -> its patch rows

    def image(self, i: int) -> np.ndarray:
        """Image ``i`` as uint8 [h, w, 3] (a view)."""
        h, w = (int(v) for v in self.sizes[i])
        return self._flat[int(self.offsets[i]):int(self.offsets[i + 1])].reshape(h, w, 3)

    def rows(self, i, grid, patch, crop=None):
        # without a crop an image's rows are the same every epoch (keep_rows: made once)
        key = None if crop is not None or not self.keep_rows else (
            int(i), int(grid[0]), int(grid[1]), int(patch))
        if key is not None and key in self._rows:
            return self._rows[key]
        target = (grid[0] * patch, grid[1] * patch)
        out = patch_rows(resize_native(self.image(i), target, crop), patch)
        if key is not None:
            self._rows[key] = out
        return out

    def encoded(self, i, grid, patch, crop=None):
        return torch.from_numpy(self.image(i).copy())  # decoded already: the device resizes


class EncodedSource(NativeImages):
    """Images stored encoded (files, shard members): ``read(i)`` gives image ``i``'s bytes.
    One that its header read but that does not decode is named in the log and trained as a
    grey image of its planned size (its slot in the pack stays; a resumed run draws the same)."""

    def __init__(self, sizes, workers: int = 1, decode: str = "cpu"):
        super().__init__(sizes, workers)
        self.decode = decode
        self.unreadable: dict[int, str] = {}
        self._lock = threading.Lock()

    def read(self, i: int) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def _bad(self, i: int, e: Exception) -> None:
        with self._lock:
            if i not in self.unreadable:
                self.unreadable[i] = str(e)
                if len(self.unreadable) <= NAMED:
                    log.warning("data: %s; trained as a grey image (%d so far)", e,
                                len(self.unreadable))

    def rows(self, i, grid, patch, crop=None):
        target = (grid[0] * patch, grid[1] * patch)
        try:
            image = decode_native(self.read(i), target, crop, self.name(i))
        except DataError as e:
            self._bad(i, e)
            image = np.full((*target, 3), 128, dtype=np.uint8)
        return patch_rows(image, patch)

    def encoded(self, i, grid, patch, crop=None):
        target = (grid[0] * patch, grid[1] * patch)
        try:
            return native_for_device(self.read(i), target, crop, self.name(i))
        except DataError as e:
            self._bad(i, e)
            return torch.full((*target, 3), 128, dtype=torch.uint8)


class FileImages(EncodedSource):
    """Image files (an ImageFolder), read when a pack draws them."""

    def __init__(self, paths: list[str], sizes, workers: int = 1, decode: str = "cpu"):
        super().__init__(sizes, workers, decode)
        self.paths = list(paths)
        if len(self.paths) != len(self.sizes):
            raise ValueError(f"{len(self.paths)} paths for {len(self.sizes)} sizes")

    def name(self, i: int) -> str:
        return self.paths[i]

    def read(self, i: int) -> bytes:
        try:
            with open(self.paths[i], "rb") as f:
                return f.read()
        except OSError as e:
            raise DataError(f"cannot read image {self.paths[i]}: {e}") from None


class ShardMembers(EncodedSource):
    """WebDataset shard members (``entries``: shard, offset, size), read by offset when a
    pack draws them."""

    def __init__(self, paths: list[str], entries, sizes, workers: int = 1, decode: str = "cpu"):
        super().__init__(sizes, workers, decode)
        self.paths = list(paths)
        self.entries = np.asarray(entries, dtype=np.int64).reshape(-1, 3)
        self.shard_ids = torch.from_numpy(self.entries[:, 0].copy())

    def name(self, i: int) -> str:
        return f"{self.paths[int(self.entries[i, 0])]} @{int(self.entries[i, 1])}"

    def read(self, i: int) -> bytes:
        shard, offset, size = (int(v) for v in self.entries[i])
        try:
            with open(self.paths[shard], "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as e:
            raise DataError(f"cannot read image {self.name(i)}: {e}") from None
        if len(data) != size:
            raise DataError(f"{self.paths[shard]}: truncated member at offset {offset}")
        return data

def read_sizes(source_len: int, head_of, workers: int) -> tuple[np.ndarray, dict]:
    """Every image's (h, w) from its header (``head_of(i)`` -> (h, w), raising DataError), in
    ``workers`` threads; the errors by index."""
    def one(i):
        try:
            return head_of(i), None
        except DataError as e:
            return None, str(e)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="vitgraph-headers") as pool:
        got = list(pool.map(one, range(source_len), chunksize=256))
    errors = {i: e for i, (_, e) in enumerate(got) if e is not None}
    sizes = np.array([s if s is not None else (0, 0) for s, _ in got],
                     dtype=np.int64).reshape(-1, 2)
    return sizes, errors


# ---------------------------------------------------------------- sizes and grids

def native_grids(sizes, spec: PackSpec) -> np.ndarray:
    """int64 [N, 2]: the patch grid under ``spec`` (``packing.native_grid``) of each (h, w) of
    ``sizes`` [N, 2], computed once per distinct size."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    if len(sizes) == 0:
        return np.zeros((0, 2), np.int64)
    uniq, inv = np.unique(sizes, axis=0, return_inverse=True)
    g = np.array([native_grid(int(h), int(w), spec.patch_size, spec.max_patches,
                              spec.min_patches) for h, w in uniq.tolist()],
                 dtype=np.int64).reshape(-1, 2)
    return g[inv.reshape(-1)]


def size_tokens(sizes, spec: PackSpec) -> np.ndarray:
    """int64 [N]: the tokens of each image of ``sizes`` [N, 2] (h, w) in a pack of ``spec``:
    its prefix and its patches after the resize to its native grid."""
    g = native_grids(sizes, spec)
    return spec.num_prefix + g[:, 0] * g[:, 1]


def pack_fill(tokens, spec: PackSpec, num_packs: int, window: int = 0, steps: int = 16,
              seed: int = 0) -> float:
    """The share of the packs' tokens that images fill when ``PackedLoader`` packs images of
    ``tokens`` (each image's tokens with its prefix: a sample of a dataset's, drawn in shuffled
    rounds) ``num_packs`` a step from a window of ``window`` images (0: the loader's default),
    over ``steps`` steps: ``packing.fill_packs`` itself. Four packs a step at most, the window
    scaled with them: the fill follows the images a window offers per pack."""
    t = np.asarray(tokens, dtype=np.int64)
    k = min(num_packs, 4)
    window = max(k, round((window or num_packs * spec.max_images) * k / num_packs))
    rng = np.random.default_rng(seed)
    rounds = steps * window // len(t) + 1
    order = np.concatenate([rng.permutation(len(t)) for _ in range(rounds)]).tolist()
    carry, at, used = [], 0, 0
    for _ in range(steps):
        items = carry + order[at:at + window - len(carry)]
        at += window - len(carry)
        packs, left = fill_packs(list(range(len(items))), lambda j: int(t[items[j]]), spec, k)
        carry = [items[j] for j in left]
        used += sum(int(t[items[j]]) for pack in packs for j in pack)
    return used / (steps * k * spec.tokens)


def images_per_pack(tokens, spec: PackSpec, num_packs: int, window: int = 0,
                    slack: float = 0.002) -> int:
    """data.packing.max_images=0: the fewest images a pack may hold (a multiple of 8) for
    which ``pack_fill`` fills packs of ``spec.tokens`` within ``slack`` of what four times the
    mean's count gives, over images of ``tokens`` (a sample, prefix included): tokens, not the
    image count, end a pack. A count too low leaves every pack short by the same images (16,384
    tokens at most 64 images of ~231 tokens: 90% full); a higher one costs little (a
    per-image row, and slots of max_len where the attention runs in slots)."""
    t = np.asarray(tokens, dtype=np.int64)
    lo = 8 * -(-math.ceil(spec.tokens / t.mean()) // 8)
    hi = max(lo, min(spec.tokens // int(t.min()), 4 * lo))

    def fill(m: int) -> float:
        return pack_fill(t, dataclasses.replace(spec, max_images=m), num_packs, window)
    best, m = fill(hi), lo
    while m < hi and fill(m) < best - slack:
        m += 8
    return m


def spread(total: int, n: int) -> np.ndarray:
    """At most ``n`` indices spread evenly over ``range(total)`` (first and last included):
    a sample that sees every part of a dataset stored in class or shard order."""
    return np.unique(np.linspace(0, total - 1, min(n, total)).round().astype(np.int64))


# ---------------------------------------------------------------- the dataset

@dataclass
class NativeDataset:
    images: NativeImages
    labels: torch.Tensor  # int64 [N]; -1 where image-text data has no class
    classes: list[str]
    captions: list[str] | None = None
    # caption token ids (set by the contrastive task), [N, context] or [N, variants, context]
    tokens: torch.Tensor | None = None
    caption_variants: list[tuple[str, ...]] | None = None

    def __post_init__(self):
        n = len(self.images)
        if self.labels.dtype != torch.int64 or self.labels.shape != (n,):
            raise ValueError(f"labels must be int64 [{n}], got {self.labels.dtype} "
                             f"{tuple(self.labels.shape)}")
        if self.captions is not None and len(self.captions) != n:
            raise ValueError(f"{len(self.captions)} captions for {n} images")
        self._grids: dict[tuple, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.images)

    @property
    def sizes(self) -> np.ndarray:
        """int64 [N, 2]: each image's (h, w) as stored."""
        return self.images.sizes

    def grids(self, spec: PackSpec) -> np.ndarray:
        """int64 [N, 2]: each image's patch grid under ``spec`` (``native_grids``)."""
        key = (spec.patch_size, spec.max_patches, spec.min_patches)
        if key not in self._grids:
            self._grids[key] = native_grids(self.sizes, spec)
        return self._grids[key]

    def image_tokens(self, spec: PackSpec) -> np.ndarray:
        """int64 [N]: each image's tokens in a pack (prefix tokens and patches)."""
        g = self.grids(spec)
        return spec.num_prefix + g[:, 0] * g[:, 1]


def pack_fields(dataset: NativeDataset, spec: PackSpec, idx: list[int], crops=None) -> tuple:
    """The pack of images ``idx`` (in slot order; ``crops``: a box of fractions per image, or
    None): (patches, coords, seg, cu_seqlens, labels[, tokens]) as ``packing.assemble`` makes
    them; patches an ``EncodedPack`` when the images decode on the device. tokens:
    [max_images, ...] of the dataset's tokens, zero for empty slots."""
    idx = [int(i) for i in idx]
    grids = dataset.grids(spec)
    g = [(int(grids[i, 0]), int(grids[i, 1])) for i in idx]
    crops = list(crops) if crops is not None else [None] * len(idx)
    labels = dataset.labels[idx].tolist() if idx else []
    src, p = dataset.images, spec.patch_size
    if src.decode == "cuda":
        coords, seg, cu, offsets = layout(g, spec)
        data = src.map(lambda i, gr, c: src.encoded(i, gr, p, c), idx, g, crops)
        patches = EncodedPack(data, g, offsets, crops, spec.tokens, p, [src.name(i) for i in idx])
        lab = torch.full((spec.max_images,), -1, dtype=torch.int64)
        lab[:len(labels)] = torch.as_tensor(labels, dtype=torch.int64)
        out = (patches, coords, seg, cu, lab)
    else:
        rows = src.map(lambda i, gr, c: src.rows(i, gr, p, c), idx, g, crops)
        out = assemble(rows, g, labels, spec)
    if dataset.tokens is not None:
        t = dataset.tokens
        tok = torch.zeros((spec.max_images, *t.shape[1:]), dtype=t.dtype)
        if idx:
            tok[:len(idx)] = t[torch.as_tensor(idx)]
        out = (*out, tok)
    return out


# ---------------------------------------------------------------- random-resized crops

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniforms(seed: int, epochs, idx, k: int) -> np.ndarray:
    """float64 [n, k] in [0, 1): a counter-based draw per (seed, epoch, image), so an image's
    numbers do not depend on which step, pack or rank it lands in."""
    e = np.asarray(epochs, dtype=np.int64).astype(np.uint64)
    i = np.asarray(idx, dtype=np.int64).astype(np.uint64)
    key = _mix64(_mix64(np.full(len(i), int(seed) & 0xFFFFFFFFFFFFFFFF, np.uint64) ^ e) ^ i)
    with np.errstate(over="ignore"):
        j = np.arange(k, dtype=np.uint64) * _GOLDEN
        bits = _mix64(key[:, None] + j[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def crop_boxes(cfg, seed: int, epochs, idx) -> list[tuple[float, float, float, float]]:
    """A random-resized crop per image (data.augment's crop_scale / crop_ratio keys, as
    ``BatchAugment``: area a fraction of the image's, the crop's aspect that fraction's ratio
    times the image's; 10 tries, else the whole image), as fractions (y0, x0, y1, x1), drawn
    from (seed, epoch, image index). The crop is resized to the image's planned grid, so the
    packing never depends on it."""
    n = len(idx)
    if n == 0:
        return []
    u = _uniforms(seed, epochs, idx, 22)
    area = cfg.crop_scale_min + u[:, :10] * (cfg.crop_scale_max - cfg.crop_scale_min)
    lo, hi = math.log(cfg.crop_ratio_min), math.log(cfg.crop_ratio_max)
    ratio = np.exp(lo + u[:, 10:20] * (hi - lo))
    w, h = np.sqrt(area * ratio), np.sqrt(area / ratio)
    ok = (w <= 1) & (h <= 1)
    rows, first = np.arange(n), ok.argmax(1)
    w = np.where(ok.any(1), w[rows, first], 1.0)
    h = np.where(ok.any(1), h[rows, first], 1.0)
    cx = w / 2 + u[:, 20] * (1 - w)
    cy = h / 2 + u[:, 21] * (1 - h)
    return [tuple(float(v) for v in b) for b in
            np.stack([cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2], 1)]


# ---------------------------------------------------------------- the training loader

class PackedLoader:
    """Deterministic, resumable, data-parallel packs: ``MicrobatchLoader``'s interface with one
    pack per microbatch (``micro_batch_size`` 1).

    Each epoch draws a permutation as ``MicrobatchLoader`` does (seeded by (seed, epoch);
    shard-wise for WebDataset). A step fills ``num_microbatches x dp_size`` packs first-fit
    (``packing.fill_packs``) from a window of ``window`` images (0: ``max_images`` per pack;
    at most the dataset): the images left over from the last step first, then the next ones of the permutation.
    Every rank computes the same packs and takes its ``num_microbatches`` in order
    (rank r: packs r*m .. r*m+m-1), so the step's union does not depend on dp.

    The stream runs across epochs: at an epoch's end the window goes on into the next epoch's
    permutation, and images left over roll into the next steps. Every image of every epoch is
    trained exactly once; a step near an epoch's end may hold images of two epochs, and
    ``epoch`` is the epoch of the next image to be drawn. ``steps_per_epoch`` is an estimate
    from the epoch's tokens (and images, where max_images binds) against the step's packs.

    With ``augment_cfg`` (data.augment, enabled) each image is a random-resized crop, the box
    drawn from (seed, epoch, image index): resumed runs crop the same.
    """

    micro_batch_size = 1

    def __init__(self, dataset: NativeDataset, spec: PackSpec, num_microbatches: int,
                 dp_rank: int, dp_size: int, seed: int, window: int = 0, shuffle: bool = True,
                 augment_cfg=None):
        if num_microbatches < 1 or dp_size < 1:
            raise ValueError("num_microbatches and dp_size must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        if window < 0:
            raise DataError(f"data.packing.window={window}: must be >= 0")
        self.dataset, self.spec = dataset, spec
        self.num_microbatches, self.dp_rank, self.dp_size = num_microbatches, dp_rank, dp_size
        self.seed, self.shuffle = int(seed), shuffle
        self.num_packs = num_microbatches * dp_size
        n = len(dataset)
        if n < self.num_packs:
            raise DataError(f"the training split has {n} images, fewer than one step's "
                            f"{self.num_packs} packs (train.global_batch_size={self.num_packs})")
        self.window = min(window or self.num_packs * spec.max_images, n)
        if self.window < self.num_packs:
            raise DataError(f"data.packing.window={window}: a window of fewer images than the "
                            f"step's {self.num_packs} packs (train.global_batch_size) leaves "
                            "packs empty")
        self.tokens = dataset.image_tokens(spec)
        big = int(np.argmax(self.tokens))
        if self.tokens[big] > spec.tokens:
            raise DataError(f"data.packing.tokens_per_microbatch={spec.tokens}: image "
                            f"{dataset.images.name(big)} needs {int(self.tokens[big])} tokens")
        per_step = self.num_packs
        self.steps_per_epoch = max(1, math.ceil(max(self.tokens.sum() / (per_step * spec.tokens),
                                                    n / (per_step * spec.max_images))))
        self.crop = augment_cfg if augment_cfg is not None and augment_cfg.enabled else None
        self.epoch = 0
        self.step = 0  # steps handed out
        self._pos = 0  # the next image's place in the epoch's permutation
        self._carry: list[tuple[int, int]] = []  # (image, epoch) left over, in order
        self._perms: dict[int, torch.Tensor] = {}
        # the step handed out last, over every rank's packs: images, tokens (prefix included),
        # real patches and the sum of squared image token counts (attention's pairs)
        self.last_counts: dict | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            n = len(self.dataset)
            src = self.dataset.images
            window = getattr(src, "shuffle_shards", 0)
            if self.shuffle and window and src.shard_ids is not None:
                perm = _shard_window_permutation(src.shard_ids, window,
                                                 _epoch_seed(self.seed, epoch))
            elif self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                perm = torch.randperm(n, generator=gen)
            else:
                perm = torch.arange(n)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return self._perms[epoch]

    def _draw(self, k: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        n = len(self.dataset)
        while len(out) < k:
            if self._pos >= n:
                self.epoch, self._pos = self.epoch + 1, 0
            take = self._permutation(self.epoch)[self._pos:self._pos + k - len(out)].tolist()
            out += [(i, self.epoch) for i in take]
            self._pos += len(take)
        return out

    def next_packs(self) -> list[list[tuple[int, int]]]:
        """The next step's packs on every rank, as (image, epoch) lists; advances the loader."""
        items = self._carry + self._draw(max(0, self.window - len(self._carry)))
        tokens = self.tokens
        packs, left = fill_packs(list(range(len(items))), lambda j: int(tokens[items[j][0]]),
                                 self.spec, self.num_packs)
        self._carry = [items[j] for j in left]
        self.step += 1
        packs = [[items[j] for j in p] for p in packs]
        placed = np.array([i for p in packs for i, _ in p], dtype=np.int64)
        n = self.tokens[placed]
        self.last_counts = {"images": len(placed), "tokens": int(n.sum()),
                            "patches": int((n - self.spec.num_prefix).sum()),
                            "token_pairs": int((n * n).sum())}
        return packs

    def _fields(self, pack: list[tuple[int, int]]) -> tuple:
        idx = [i for i, _ in pack]
        crops = None
        if self.crop is not None:
            crops = crop_boxes(self.crop, self.seed, [e for _, e in pack], idx)
        return pack_fields(self.dataset, self.spec, idx, crops)

    def next_step(self) -> list[tuple]:
        """This rank's ``num_microbatches`` packs of the next step (``pack_fields``)."""
        packs = self.next_packs()
        n = np.array([int(self.tokens[i]) for p in packs for i, _ in p], dtype=np.int64)
        # the whole step's (every rank's) counts, for img/s, real tokens/s and FLOPs
        self.last_counts = {"images": len(n), "tokens": int(n.sum()),
                            "patches": int(n.sum()) - len(n) * self.spec.num_prefix,
                            "token_pairs": int((n * n).sum())}
        m = self.num_microbatches
        return [self._fields(p) for p in packs[self.dp_rank * m:(self.dp_rank + 1) * m]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self._pos, "step": self.step, "seed": self.seed,
                "carry": [i for i, _ in self._carry], "carry_epochs": [e for _, e in self._carry]}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["seed"]) != self.seed:
            raise ValueError(f"loader state was saved with seed {sd['seed']}, this loader has "
                             f"seed {self.seed}; resuming would not continue the same sequence")
        n = len(self.dataset)
        pos, carry = int(sd["pos"]), [int(i) for i in sd["carry"]]
        if not 0 <= pos <= n or any(not 0 <= i < n for i in carry):
            raise ValueError(f"loader state (position {pos}, {len(carry)} waiting images) does "
                             f"not fit a dataset of {n} images (did the dataset change?)")
        self.epoch, self._pos, self.step = int(sd["epoch"]), pos, int(sd["step"])
        self._carry = list(zip(carry, (int(e) for e in sd["carry_epochs"])))


# ---------------------------------------------------------------- eval

def eval_packs(dataset: NativeDataset, spec: PackSpec) -> list[list[int]]:
    """The held-out images in index order, next-fit into packs (a pack is closed when the next
    image does not fit its tokens or max_images)."""
    packs, cur, used = [], [], 0
    for i, n in enumerate(dataset.image_tokens(spec).tolist()):
        if n > spec.tokens:
            raise DataError(f"data.packing.tokens_per_microbatch={spec.tokens}: image "
                            f"{dataset.images.name(i)} needs {n} tokens")
        if cur and (used + n > spec.tokens or len(cur) == spec.max_images):
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


def iterate_eval_packs(dataset: NativeDataset, spec: PackSpec, dp_rank: int = 0,
                       dp_size: int = 1) -> Iterator[tuple]:
    """Fixed-order packs (``pack_fields``) of the held-out images; rank r takes the contiguous
    block ``[P*r//dp, P*(r+1)//dp)`` of the P packs, so each image is in one pack on one rank.
    Ranks may see different numbers of packs (one may see none): reduce counts after the loop.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    packs = eval_packs(dataset, spec)
    lo, hi = len(packs) * dp_rank // dp_size, len(packs) * (dp_rank + 1) // dp_size
    for p in packs[lo:hi]:
        yield pack_fields(dataset, spec, p)


# ---------------------------------------------------------------- on the device

# the colour ops that make sense per image of a pack (RandAugment's geometric ops and
# sharpness would need the image's neighbouring patches: the crop is the geometric part)
OPS = ("identity", "autocontrast", "equalize", "brightness", "color", "contrast", "posterize",
       "solarize")
ERASE_TRIES = 10  # timm's RandomErasing: the first of 10 tried rectangles that fits


def _segment_sum(v: torch.Tensor, cu: torch.Tensor, m: int) -> torch.Tensor:
    """Per image slot the sum of ``v`` [T] over its tokens (a cumulative sum cut at the slots'
    offsets: no atomics, the same bits on every run), [m + 1] with 0 for the padding slot;
    ``v`` zero outside images."""
    cs = torch.cat([v.new_zeros(1, dtype=torch.float64), v.double().cumsum(0)])
    cu = cu.long()
    out = cs[cu[1:m + 1]] - cs[cu[:m]]
    return torch.cat([out, out.new_zeros(1)]).to(v.dtype)


def _gray(x: torch.Tensor) -> torch.Tensor:
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def _blend(a, b, f):
    return (b + (a - b) * f).clamp_(0, 1)


def pack_colour(name: str, x: torch.Tensor, m: torch.Tensor, sign: torch.Tensor,
                seg: torch.Tensor, real: torch.Tensor, cu: torch.Tensor, slots: int
                ) -> torch.Tensor:
    """One colour op on pack pixels x [T, 3, p*p] in [0, 1], per image as
    ``augment._colour`` does it on a whole image: ``m`` magnitude and ``sign`` [T, 1, 1],
    ``real`` [T] the patch tokens (statistics are over them), ``slots`` max_images."""
    factor = 1 + 0.9 * m * sign
    if name == "brightness":
        return _blend(x, torch.zeros_like(x), factor)
    if name == "color":
        return _blend(x, _gray(x).expand_as(x), factor)
    if name == "contrast":
        g = _gray(x)[:, 0].sum(1) * real
        count = _segment_sum(real.to(x.dtype), cu, slots) * x.shape[-1]
        mean = _segment_sum(g, cu, slots) / count.clamp_min(1)
        return _blend(x, mean[seg].view(-1, 1, 1).expand_as(x), factor)
    if name == "posterize":
        bits = 8 - (4 * m).floor()
        step = 2 ** (8 - bits)
        return torch.floor(x * 255 / step) * step / 255
    if name == "solarize":
        return torch.where(x >= 1 - m, 1 - x, x)
    if name == "autocontrast":
        idx = seg.view(-1, 1).expand(-1, 3)
        inf = torch.full((slots + 1, 3), float("inf"), device=x.device, dtype=x.dtype)
        keep = real.view(-1, 1)
        lo = inf.scatter_reduce(0, idx, torch.where(keep, x.amin(-1), inf[0, 0]), "amin")
        hi = (-inf).scatter_reduce(0, idx, torch.where(keep, x.amax(-1), -inf[0, 0]), "amax")
        lo, hi = lo[seg].unsqueeze(-1), hi[seg].unsqueeze(-1)
        return torch.where(hi > lo, (x - lo) / (hi - lo).clamp_min(1e-6), x)
    if name == "equalize":
        q = (x * 255).round().long().clamp_(0, 255)
        chan = seg.view(-1, 1, 1) * 3 + torch.arange(3, device=x.device).view(1, 3, 1)
        bins = chan * 256 + q
        weight = real.to(torch.float32).view(-1, 1, 1).expand_as(q)
        hist = torch.zeros((slots + 1) * 3 * 256, device=x.device).index_add_(
            0, bins.reshape(-1), weight.reshape(-1)).view(-1, 256)
        cdf = hist.cumsum(1)
        cdf_min = torch.where(hist > 0, cdf, torch.full_like(cdf, float("inf"))).amin(1, True)
        lut = ((cdf - cdf_min) / (cdf[:, -1:] - cdf_min).clamp_min(1)).clamp_(0, 1)
        return lut.view(-1)[bins].to(x.dtype)
    raise ValueError(name)


class PackParams(NamedTuple):
    """One pack's augmentation as drawn on the host (``PackAugment.draw``): tensors whose
    shapes follow the config and the pack's image slots alone, whatever was drawn, so that a
    step graph takes them as inputs refilled before each replay (``PackAugment.apply``)."""
    flip: torch.Tensor  # [M] bool
    ops: torch.Tensor  # [M, slots] int64: each op slot's op, an ``OPS`` index (-1: none)
    mag: torch.Tensor  # [M, slots] float32: its signed magnitude in [-1, 1]
    # [M, 2 x ERASE_TRIES + 2] float64: random erasing's draws, the rectangle made on the
    # device from the image's size (known there from the pack's coords): the tried areas as
    # fractions of the image (all 0: no erasing), their log aspects, then top and left in [0, 1)
    erase: torch.Tensor
    noise: torch.Tensor  # [M] int64: each image's erasing-noise seed (32 bits)

    def to(self, device) -> "PackParams":
        return PackParams(*(t.to(device, non_blocking=True) for t in self))


def _slot_values(values: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """A value per image slot ([M, ...]) at every token of its slot (padding: 0)."""
    return torch.cat([values, values.new_zeros((1, *values.shape[1:]))])[seg]


def _real(coords: torch.Tensor, seg: torch.Tensor, slots: int) -> torch.Tensor:
    """[T] bool: the patch tokens of images (not prefix, not padding)."""
    return (coords[:, 0] >= 0) & (seg < slots)


def _normalise(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Pack pixels x [T, 3, p^2] in [0, 1] -> the fixed path's normalisation, zero outside
    ``real`` (the constants made by fills: a host copy would not be capturable)."""
    x = (x - _constant(MEAN, x).view(1, 3, 1)) / _constant(STD, x).view(1, 3, 1)
    return torch.where(real.view(-1, 1, 1), x, torch.zeros((), dtype=x.dtype, device=x.device))


class PackAugment:
    """Per-image augmentation of native-resolution packs: host-side draws (``draw``: numpy,
    keyed by (seed, data-parallel rank, step, microbatch)) and the device function
    (``apply``: fixed shapes, no host sync, no branch on a drawn value), so that a step graph
    holds it. The random-resized crop is not here: it is part of the resize that makes each
    image's pixels (``crop_boxes``; docs/native.md says why)."""

    def __init__(self, cfg, seed: int = 0, rank: int = 0):
        self.cfg, self.seed, self.rank = cfg, int(seed), int(rank)
        self.slot_ops = slot_ops(cfg, OPS)
        self._fused = fused(self._apply)

    def draw(self, slots: int, key: tuple) -> PackParams:
        """Pack ``key``'s draws for ``slots`` image slots (max_images), on the CPU: flip, then
        ``augment.draw_ops`` from one generator (the draws of the prepare-time code this
        replaced), erasing from another."""
        rng = _rng(self.seed, (self.rank, *key), 5)
        flip = rng.uniform(0, 1, slots) < self.cfg.flip
        ops, mag = draw_ops(self.cfg, rng, slots, OPS)
        erase = np.zeros((slots, 2 * ERASE_TRIES + 2))
        noise = np.zeros(slots, np.int64)
        if self.cfg.erase_prob > 0:
            er = _rng(self.seed, (self.rank, *key), 6)
            area = er.uniform(0.02, 1 / 3, (slots, ERASE_TRIES))
            logr = er.uniform(math.log(0.3), math.log(1 / 0.3), (slots, ERASE_TRIES))
            do = er.uniform(0, 1, slots) < self.cfg.erase_prob
            corner = er.uniform(0, 1, (slots, 2))
            erase = np.concatenate([np.where(do[:, None], area, 0.0), logr, corner], 1)
            noise = er.integers(0, 2**32, slots)
        return PackParams(torch.as_tensor(flip), torch.as_tensor(ops, dtype=torch.int64),
                          torch.as_tensor(mag, dtype=torch.float32),
                          torch.as_tensor(erase, dtype=torch.float64),
                          torch.as_tensor(noise, dtype=torch.int64))

    def apply(self, patches: torch.Tensor, coords: torch.Tensor, seg: torch.Tensor,
              cu: torch.Tensor, p: PackParams) -> torch.Tensor:
        """The device function: a pack's uint8 rows [T, 3 q^2] and ``p`` (on their device) ->
        float32 [T, 3 q^2], normalised, zero on prefix and padding tokens. A flip is a gather
        of the image's patch columns in reverse and a mirror of each patch (the patches of the
        flipped image); each colour op runs on every token and ``torch.where`` keeps it for
        the images that drew it; erasing is a mask made from each image's size in coords.
        On a GPU it runs compiled (``augment.fused``)."""
        return self._fused(patches, coords, seg, cu, p)

    def _apply(self, patches, coords, seg, cu, p: PackParams) -> torch.Tensor:
        t, slots = patches.shape[0], p.flip.shape[0]
        q = math.isqrt(patches.shape[1] // 3)
        real = _real(coords, seg, slots)
        f = _slot_values(p.flip, seg) & real
        col, gw = coords[:, 1], coords[:, 3]
        src = torch.arange(t, device=patches.device) + torch.where(f, gw - 1 - 2 * col, 0)
        x = patches[src]
        x = torch.where(f.view(-1, 1), x.view(t, 3, q, q).flip(-1).reshape(t, -1), x)
        x = x.float().div_(255).view(t, 3, q * q)
        for slot, names in enumerate(self.slot_ops):
            mag = _slot_values(p.mag[:, slot], seg).view(-1, 1, 1)
            m, sign = mag.abs(), mag.sign()
            for name in names:
                sel = _slot_values(p.ops[:, slot] == OPS.index(name), seg) & real
                x = torch.where(sel.view(-1, 1, 1),
                                pack_colour(name, x, m, sign, seg, real, cu, slots), x)
        x = _normalise(x, real)
        if self.cfg.erase_prob > 0:
            x = self._erase(x, coords, seg, real, p, q)
        return x.reshape(t, -1)

    @staticmethod
    def _erase(x, coords, seg, real, p: PackParams, q: int) -> torch.Tensor:
        """timm's RandomErasing (``mode="pixel"``) on each image at its own size: the
        rectangle drawn as ``BatchAugment`` draws it (the first of the tries that fits), its
        pixels replaced by normal noise hashed from the image's seed and the pixel's place."""
        n, e = x.shape[0], _slot_values(p.erase, seg)
        h, w = coords[:, 2:3] * q, coords[:, 3:4] * q  # the token's image's size in pixels
        hgt, wid = h.double(), w.double()
        area = e[:, :ERASE_TRIES] * hgt * wid
        ratio = e[:, ERASE_TRIES:2 * ERASE_TRIES].exp()
        eh, ew = (area * ratio).sqrt().round(), (area / ratio).sqrt().round()
        ok = (eh < hgt) & (ew < wid) & (eh > 0) & (ew > 0)
        first = ok.int().argmax(1, keepdim=True)
        eh, ew = eh.gather(1, first), ew.gather(1, first)
        top = (e[:, -2:-1] * (hgt - eh + 1)).floor()
        left = (e[:, -1:] * (wid - ew + 1)).floor()
        do = ok.any(1, keepdim=True) & real.view(-1, 1)
        at = torch.arange(q, device=x.device)
        yy = (coords[:, 0:1] * q + at).view(n, 1, q, 1)  # the token's pixels in its image
        xx = (coords[:, 1:2] * q + at).view(n, 1, 1, q)
        v = lambda a: a.view(n, 1, 1, 1)  # noqa: E731
        inside = (v(do) & (yy >= v(top)) & (yy < v(top + eh)) & (xx >= v(left))
                  & (xx < v(left + ew)))
        # each value's index in its image's [3, h, w], hashed with the image's seed
        chan = torch.arange(3, device=x.device).view(1, 3, 1, 1)
        pixel = (chan * v(h) + yy) * v(w) + xx
        r, angle = _normal_polar(_hash32(_hash32(pixel) ^ v(_slot_values(p.noise, seg))),
                                 x.dtype)
        z = (r * torch.cos(angle)).view_as(x)
        return torch.where(inside.view(n, 1, q * q), z, x)


def pack_to_device(fields: tuple, device) -> tuple:
    """A raw pack's (patches uint8 [T, 3 p^2], coords int64, seg int64, cu_seqlens int32,
    labels int64) on ``device``; an ``EncodedPack`` is decoded there first."""
    patches, coords, seg, cu, labels = fields[:5]
    device = torch.device(device)
    if isinstance(patches, EncodedPack):
        patches = finish_pack_on_device(patches, device)
    else:
        patches = patches.to(device, non_blocking=True)
    return (patches, coords.to(device, non_blocking=True).long(),
            seg.to(device, non_blocking=True).long(), cu.to(device, non_blocking=True).int(),
            labels.to(device, non_blocking=True).long())


def pack_inputs(fields: tuple, device, augment_cfg=None, key=None, seed: int = 0,
                dp_rank: int = 0) -> tuple:
    """One pack as the model takes it, on ``device``: (x float32 [T, 3 p^2], coords int64
    [T, 4], seg int64 [T], cu_seqlens int32 [S + 1], labels int64 [M][, tokens]). x is the
    fixed path's normalisation ((v / 255 - MEAN) / STD per channel) on patch tokens, zero on
    prefix and padding tokens. With ``augment_cfg`` enabled and a training ``key`` (step,
    microbatch), each image is augmented there, eagerly (``PackAugment``: drawn from (seed,
    dp_rank, step, microbatch)); the classifier runs the same two functions inside its step
    instead (vitgraph.tasks.classification.prepare_pack)."""
    patches, coords, seg, cu, labels = pack_to_device(fields, device)
    if augment_cfg is not None and getattr(augment_cfg, "enabled", False) and key is not None:
        a = PackAugment(augment_cfg, seed, dp_rank)
        x = a.apply(patches, coords, seg, cu, a.draw(labels.shape[0], key).to(patches.device))
    else:
        t = patches.shape[0]
        x = patches.float().div_(255).view(t, 3, -1)
        x = _normalise(x, _real(coords, seg, labels.shape[0])).view(t, -1)
    out = (x.contiguous(), coords, seg, cu, labels)
    if len(fields) > 5:
        out = (*out, fields[5].to(device, non_blocking=True))
    return out


# ---------------------------------------------------------------- building

def pack_spec(packing_cfg, patch_size: int, num_prefix: int, padded: bool = False,
              multiple: int = 1, split: int = 1) -> PackSpec:
    """The ``PackSpec`` of data.packing for a model of ``patch_size`` with ``num_prefix`` class
    and register tokens. ``padded`` (data.packing.layout=padded): each image in a slot of
    max_len tokens of its own, as many slots as tokens_per_microbatch holds (max_images at
    most, unless 0), rounded down so that their tokens are a multiple of ``multiple`` (16 for FP8
    GEMMs); ValueError, saying why, where no slot is left or a slot's tokens do not split
    over ``split`` ranks (sequence parallel's tp)."""
    k = packing_cfg
    spec = PackSpec(tokens=k.tokens_per_microbatch, max_images=k.max_images,
                    max_patches=k.max_patches, num_prefix=num_prefix, patch_size=patch_size,
                    min_patches=k.min_patches)
    if not padded:
        return spec
    L = spec.max_len
    if L % split:
        raise ValueError(f"slots of {L} tokens ({num_prefix} prefix + data.packing.max_patches="
                         f"{k.max_patches}) do not split over parallel.tp={split} ranks "
                         "(sequence parallel)")
    fits = k.tokens_per_microbatch // L
    fits = min(k.max_images, fits) if k.max_images else fits
    step = multiple // math.gcd(multiple, L)
    slots = fits - fits % step
    if slots < 1:
        raise ValueError(f"FP8 GEMMs need a multiple of {multiple} tokens: slots of {L} tokens "
                         f"come {step} at a time, and data.packing.tokens_per_microbatch="
                         f"{k.tokens_per_microbatch} (data.packing.max_images={k.max_images}) "
                         f"holds {fits}")
    return dataclasses.replace(spec, tokens=slots * L, max_images=slots, padded=True)
