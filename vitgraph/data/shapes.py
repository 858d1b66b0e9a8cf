"""The embedded procedural dataset: coloured shapes, classed by shape only.

Each image is one filled shape on a background. The class is the shape; everything else is
drawn at random per image and independently of the class: foreground and background colour
(from a named palette, jittered, with a minimum colour and brightness contrast, either one
the brighter), a mild background gradient, size (bounding radius 30-45% of the side),
position, rotation (+-30 degrees) and Gaussian pixel noise. Shapes are drawn as a mask with
PIL at 4x the render size and box-downsampled, which antialiases the edges. Each image has
an English caption (for CLIP-style training), e.g. "a large white star on a dark blue
background, in the top left, rotated 12 degrees clockwise".

How hard it is: ``scripts/shapes_baseline.py`` (a 200k-parameter plain-PyTorch ViT on
2 CPU cores) must reach >= 85% held-out top-1 on 10 classes within ~2500-3000 steps of
batch 32. The knobs below were tuned for that; full-turn rotations or hue-only contrast made
it several times slower.

Determinism: images are generated in fixed chunks of ``CHUNK`` images, chunk ``i`` seeded
from ``SeedSequence(split_seed, spawn_key=(i,))``, so the bytes depend only on the generation
parameters, never on the number of worker processes. Labels are balanced (``arange(n) %
num_classes``, permuted).

Bump ``VERSION`` whenever the drawing changes: it is part of the cache key.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os

import numpy as np
import torch
from PIL import Image, ImageDraw

from vitgraph.data.config import DataConfig
from vitgraph.data.dataset import DataError, ImageDataset
from vitgraph.data.native import ArrayImages, NativeDataset, spread
from vitgraph.output import written_whole

VERSION = 1
CHUNK = 500
SUPERSAMPLE = 4

# Order matters: a config with num_classes=k uses the first k. The first ten were chosen to
# stay distinguishable at 32x32 (no pentagon / hexagon next to the circle).
CLASSES = ["circle", "square", "triangle", "plus", "star", "ring", "crescent", "L-shape",
           "arrow", "heart", "hourglass", "semicircle"]

# Rotational symmetry order of each shape, used only to report a canonical angle in captions
# (0 = rotation does not show).
_SYMMETRY = {"circle": 0, "square": 4, "triangle": 3, "plus": 4, "star": 5, "ring": 0,
             "crescent": 1, "L-shape": 1, "arrow": 1, "heart": 1, "hourglass": 2,
             "semicircle": 1}

_PALETTE = [
    ("red", (215, 40, 40)), ("orange", (240, 140, 30)), ("yellow", (240, 220, 50)),
    ("green", (50, 170, 60)), ("dark green", (25, 90, 40)), ("cyan", (50, 200, 215)),
    ("blue", (45, 95, 225)), ("dark blue", (20, 30, 110)), ("purple", (130, 50, 180)),
    ("pink", (240, 130, 185)), ("brown", (125, 75, 35)), ("white", (240, 240, 240)),
    ("gray", (128, 128, 128)), ("black", (20, 20, 20)),
]
_PALETTE_RGB = np.array([c for _, c in _PALETTE], dtype=np.float32)
# fg and bg palette entries differ by at least this much in RGB (Euclidean) and in luma:
# with hue-only contrast (red on green at equal brightness) the small baseline ViT learned
# far slower, so every shape is visible in grayscale too; which of the two is brighter is
# random.
_MIN_CONTRAST = 130.0
_MIN_LUMA_DIFF = 80.0
_COLOUR_JITTER = 20.0

# Size = radius of the shape's bounding circle, as a fraction of the image side.
_RADIUS = (0.30, 0.45)
_NOISE_SIGMA = (0.0, 10.0)  # pixel noise std, in 0..255 units
_GRADIENT = 30.0  # max change of the background colour across the image
# Degrees, counter-clockwise from the upright shape. Full turns made the 2-core baseline
# need several times more steps (see scripts/shapes_baseline.py); +-30 keeps rotation real.
_ROTATION = (-30.0, 30.0)


def _circle(n=48, r=1.0, cx=0.0, cy=0.0):
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1)


def _star(points=5, outer=1.0, inner=0.42):
    t = np.arange(2 * points) * np.pi / points + np.pi / 2
    r = np.where(np.arange(2 * points) % 2 == 0, outer, inner)
    return np.stack([r * np.cos(t), r * np.sin(t)], 1)


def _heart(n=64):
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = 13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t)
    return np.stack([x, y + 2.5], 1) / 16.5


def _semicircle(n=32):
    t = np.linspace(0, np.pi, n)
    return np.stack([np.cos(t), np.sin(t) - 0.4], 1) * 0.95


# Each shape: list of (polygon in unit coordinates with y up, fill 255 = shape / 0 = hole),
# drawn in order. Everything fits inside the unit circle.
_GEOMETRY = {
    "circle": [(_circle(r=0.85), 255)],
    "square": [(np.array([[-0.68, -0.68], [0.68, -0.68], [0.68, 0.68], [-0.68, 0.68]]), 255)],
    "triangle": [(_circle(n=3, r=1.0) @ np.array([[0, 1], [-1, 0]]), 255)],
    "plus": [(np.array([[-0.2, 0.92], [0.2, 0.92], [0.2, 0.2], [0.92, 0.2], [0.92, -0.2],
                        [0.2, -0.2], [0.2, -0.92], [-0.2, -0.92], [-0.2, -0.2], [-0.92, -0.2],
                        [-0.92, 0.2], [-0.2, 0.2]]), 255)],
    "star": [(_star(), 255)],
    "ring": [(_circle(r=0.9), 255), (_circle(r=0.5), 0)],
    "crescent": [(_circle(r=0.9), 255), (_circle(r=0.75, cx=0.45), 0)],
    "L-shape": [(np.array([[-0.55, 0.85], [-0.1, 0.85], [-0.1, -0.35], [0.6, -0.35],
                           [0.6, -0.8], [-0.55, -0.8]]), 255)],
    "arrow": [(np.array([[-0.9, -0.17], [0.15, -0.17], [0.15, -0.6], [0.95, 0.0],
                         [0.15, 0.6], [0.15, 0.17], [-0.9, 0.17]]), 255)],
    "heart": [(_heart(), 255)],
    "hourglass": [(np.array([[-0.65, 0.85], [0.65, 0.85], [0.0, 0.0], [0.65, -0.85],
                             [-0.65, -0.85], [0.0, 0.0]]), 255)],
    "semicircle": [(_semicircle(), 255)],
}
assert list(_GEOMETRY) == CLASSES


def _size_word(frac):
    lo, hi = _RADIUS
    t = (frac - lo) / (hi - lo)
    return "small" if t < 1 / 3 else ("medium" if t < 2 / 3 else "large")


def _position_word(cx, cy, size, height=None):
    # cx, cy in pixels, y down; "center" unless the shape sits clearly off-centre. ``size``:
    # the width (and the height, unless ``height`` is given)
    dx, dy = cx / size - 0.5, cy / (size if height is None else height) - 0.5
    col = "left" if dx < -0.08 else ("right" if dx > 0.08 else "")
    row = "top" if dy < -0.08 else ("bottom" if dy > 0.08 else "")
    if row and col:
        return f"in the {row} {col}"
    if col:
        return f"on the {col}"
    return f"at the {row}" if row else "in the center"


def _luma(rgb):
    return rgb @ np.array([0.299, 0.587, 0.114], np.float32)


def _rotation_words(angle, symmetry):
    if not symmetry:  # circle, ring: rotation does not show
        return ""
    period = 360 / symmetry
    a = round((angle + period / 2) % period - period / 2)  # the smallest equivalent turn
    if abs(a) < 3:
        return ", upright"
    return f", rotated {abs(a)} degrees {'counter-clockwise' if a > 0 else 'clockwise'}"


def _pick_colours(rng):
    while True:
        f, b = rng.integers(len(_PALETTE), size=2)
        if (np.linalg.norm(_PALETTE_RGB[f] - _PALETTE_RGB[b]) >= _MIN_CONTRAST
                and abs(_luma(_PALETTE_RGB[f]) - _luma(_PALETTE_RGB[b])) >= _MIN_LUMA_DIFF):
            return int(f), int(b)


def _draw_shape(draw, name, cx, cy, r, angle, y0=0, x0=0):
    """Draw one shape into a 0/255 mask canvas at SUPERSAMPLE x, its tile starting at row y0
    (and column x0)."""
    a = math.radians(angle)
    rot = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
    for poly, fill in _GEOMETRY[name]:
        p = poly @ rot.T * r
        xs = (cx + p[:, 0]) * SUPERSAMPLE
        if x0:
            xs = xs + x0
        ys = (cy - p[:, 1]) * SUPERSAMPLE + y0  # image y points down
        draw.polygon(list(zip(xs.tolist(), ys.tolist())), fill=fill)


_SHARED_OUT = None  # in each worker: the shared buffer the images are written into


def _attach_shared(buf, shape) -> None:
    """Pool initializer: view the parent's shared buffer as the image array."""
    global _SHARED_OUT
    _SHARED_OUT = np.frombuffer(buf, np.uint8, count=int(np.prod(shape))).reshape(shape)


def _render_into_shared(args):
    start, job = args
    images, captions = _render_chunk(job)
    _SHARED_OUT[start:start + len(images)] = images
    return captions


def _render_chunk(args):
    """Images (uint8 [n, size, size, 3]) and captions for ``labels``, from the chunk seed."""
    split_seed, chunk_idx, labels, size = args
    rng = np.random.default_rng(np.random.SeedSequence(split_seed, spawn_key=(chunk_idx,)))
    n = len(labels)
    big = size * SUPERSAMPLE
    # Masks go into tall canvases of `per_canvas` tiles (one PIL image and one resize for
    # many shapes: per-image PIL calls cost more than the drawing); at most 16M pixels each.
    per_canvas = max(1, min(n, 2**24 // big**2))
    alpha = np.empty((n, size, size, 1), np.float32)
    fg = np.empty((n, 1, 1, 3), np.float32)
    bg = np.empty((n, 1, 1, 3), np.float32)
    grad = np.empty((n, 2), np.float32)
    grad_col = np.empty((n, 1, 1, 3), np.float32)
    sigma = np.empty((n, 1, 1, 1), np.float32)
    captions = []
    for i, label in enumerate(labels):
        name = CLASSES[int(label)]
        frac = rng.uniform(*_RADIUS)
        r = frac * size
        cx, cy = rng.uniform(r, size - r, size=2)
        angle = rng.uniform(*_ROTATION) % 360.0
        f, b = _pick_colours(rng)
        fg[i] = _PALETTE_RGB[f] + rng.uniform(-_COLOUR_JITTER, _COLOUR_JITTER, 3)
        bg[i] = _PALETTE_RGB[b] + rng.uniform(-_COLOUR_JITTER, _COLOUR_JITTER, 3)
        theta = rng.uniform(0, 2 * np.pi)
        grad[i] = (math.cos(theta), math.sin(theta))
        grad_col[i] = rng.uniform(-_GRADIENT, _GRADIENT, 3)
        sigma[i] = rng.uniform(*_NOISE_SIGMA)
        if i % per_canvas == 0:
            canvas = Image.new("L", (big, big * min(per_canvas, n - i)), 0)
            draw = ImageDraw.Draw(canvas)
        _draw_shape(draw, name, cx, cy, r, angle, (i % per_canvas) * big)
        if i % per_canvas == per_canvas - 1 or i == n - 1:
            # box-filter down: antialiased coverage in [0, 1]
            tiles = canvas.height // big
            small = np.asarray(canvas.resize((size, size * tiles), Image.BOX), np.float32)
            alpha[i + 1 - tiles:i + 1] = small.reshape(tiles, size, size, 1) / 255

        caption = f"a {_size_word(frac)} {_PALETTE[f][0]} {name} on a {_PALETTE[b][0]} background"
        caption += f", {_position_word(cx, cy, size)}"
        caption += _rotation_words(angle, _SYMMETRY[name])
        captions.append(caption)

    # composite (background gradient, shape, noise) in cache-sized blocks of images
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    out = np.empty((n, size, size, 3), np.uint8)
    for s in range(0, n, 64):
        e = min(n, s + 64)
        ramp = (grad[s:e, 0, None, None] * coords[None, None, :]
                + grad[s:e, 1, None, None] * coords[None, :, None])[..., None]
        img = bg[s:e] + ramp * grad_col[s:e]
        img += (fg[s:e] - img) * alpha[s:e]
        img += rng.standard_normal(img.shape, dtype=np.float32) * sigma[s:e]
        np.rint(img, out=img)
        np.clip(img, 0, 255, out=img)
        out[s:e] = img
    return out, captions


def generate(num: int, split_seed: int, num_classes: int = 10, render_size: int = 32,
             workers: int = 1) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images uint8 [num, S, S, 3], labels int64 [num], captions); independent of workers."""
    if not 1 <= num_classes <= len(CLASSES):
        raise ValueError(f"num_classes must be in [1, {len(CLASSES)}] for the shapes data, "
                         f"got {num_classes}")
    label_rng = np.random.default_rng(np.random.SeedSequence(split_seed, spawn_key=(2**31,)))
    labels = label_rng.permutation(np.arange(num, dtype=np.int64) % num_classes)
    jobs = [(split_seed, i, labels[s:s + CHUNK], render_size)
            for i, s in enumerate(range(0, num, CHUNK))]
    shape = (num, render_size, render_size, 3)
    if workers > 1 and len(jobs) > 1:
        # Workers write into one shared buffer; sending 150 MB back through pipes cost more
        # than drawing. They come from a fork server, never forked from this process: by now
        # it runs gloo's and torch's threads, and a child forked while one of them held a lock
        # hung (seen: the README's default run stuck after the training split).
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([__name__])  # import numpy / PIL once, in the server
        buf = ctx.RawArray("B", max(1, int(np.prod(shape))))
        with ctx.Pool(min(workers, len(jobs)), initializer=_attach_shared,
                      initargs=(buf, shape)) as pool:
            caps = pool.map(_render_into_shared, [(i * CHUNK, j) for i, j in enumerate(jobs)],
                            chunksize=1)
        images = np.frombuffer(buf, np.uint8, count=int(np.prod(shape))).reshape(shape).copy()
        captions = [c for part in caps for c in part]
    else:
        parts = [_render_chunk(j) for j in jobs]
        images = np.concatenate([p[0] for p in parts]) if parts else np.empty(shape, np.uint8)
        captions = [c for p in parts for c in p[1]]
    return images, labels, captions


# ---------------------------------------------------------------- native resolution
# data.resolution=native: each image at its own size and aspect ratio. The shorter side is
# log-uniform in NATIVE_SHORT x render_size, the ratio of the sides log-uniform in 1..2 (either
# way up, so height / width spans 0.5-2); the shape's size and place are relative to the
# canvas as above (its radius a fraction of the shorter side). Stored flat: every image's
# pixels back to back (uint8 [sum h*w*3]) with their (h, w).

NATIVE_SHORT = (0.5, 2.0)
NATIVE_STRETCH = 2.0  # longer side / shorter side at most
_CANVAS = 512  # mask canvases this many pixels wide (SUPERSAMPLE x that when drawn)


def _colour_pairs() -> np.ndarray:
    """Every (fg, bg) palette pair _pick_colours accepts, so a draw is one integer."""
    pairs = [(f, b) for f in range(len(_PALETTE)) for b in range(len(_PALETTE))
             if np.linalg.norm(_PALETTE_RGB[f] - _PALETTE_RGB[b]) >= _MIN_CONTRAST
             and abs(_luma(_PALETTE_RGB[f]) - _luma(_PALETTE_RGB[b])) >= _MIN_LUMA_DIFF]
    return np.array(pairs, dtype=np.int64)


def native_sizes(num: int, split_seed: int, render_size: int) -> np.ndarray:
    """The (h, w) of each image of a native-resolution split: int64 [num, 2], drawn from the
    split seed alone (known before any image is drawn)."""
    rng = np.random.default_rng(np.random.SeedSequence(split_seed, spawn_key=(2**31 + 1,)))
    lo = max(4, round(render_size * NATIVE_SHORT[0]))
    hi = max(lo, round(render_size * NATIVE_SHORT[1]))
    short = np.rint(np.exp(rng.uniform(math.log(lo), math.log(hi), num))).astype(np.int64)
    stretch = np.exp(rng.uniform(0.0, math.log(NATIVE_STRETCH), num))
    long = np.minimum(np.rint(short * stretch).astype(np.int64),
                      np.floor(short * NATIVE_STRETCH).astype(np.int64))
    tall = rng.uniform(0, 1, num) < 0.5
    return np.stack([np.where(tall, long, short), np.where(tall, short, long)], 1)


def _shelves(sizes: np.ndarray, width: int, max_pixels: int):
    """Tiles of ``sizes`` (h, w) placed left to right in rows of canvases ``width`` wide, at
    most ``max_pixels`` each: [(canvas height, [(tile, y, x), ...]), ...]."""
    canvases, tiles, x, y, row_h = [], [], 0, 0, 0
    for i, (h, w) in enumerate(sizes.tolist()):
        if x + w > width:
            x, y, row_h = 0, y + row_h, 0
        if (y + max(row_h, h)) * width > max_pixels and tiles:
            canvases.append((y + row_h, tiles))
            tiles, x, y, row_h = [], 0, 0, 0
        tiles.append((i, y, x))
        x, row_h = x + w, max(row_h, h)
    if tiles:
        canvases.append((y + row_h, tiles))
    return canvases


def _render_chunk_native(args):
    """Pixels (uint8, the images of ``sizes`` back to back, each [h, w, 3]) and captions for
    ``labels``, from the chunk seed. The per-image draws are made as arrays; only the drawing
    is a per-image call."""
    split_seed, chunk_idx, labels, sizes = args
    rng = np.random.default_rng(np.random.SeedSequence(split_seed, spawn_key=(chunk_idx, 1)))
    n = len(labels)
    h, w = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
    frac = rng.uniform(*_RADIUS, n)
    r = frac * np.minimum(h, w)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    angle = rng.uniform(*_ROTATION, n) % 360.0
    table = _colour_pairs()
    pairs = table[rng.integers(0, len(table), n)]
    fg = (_PALETTE_RGB[pairs[:, 0]] + rng.uniform(-_COLOUR_JITTER, _COLOUR_JITTER, (n, 3))
          ).astype(np.float32)
    bg = (_PALETTE_RGB[pairs[:, 1]] + rng.uniform(-_COLOUR_JITTER, _COLOUR_JITTER, (n, 3))
          ).astype(np.float32)
    theta = rng.uniform(0, 2 * np.pi, n)
    grad = np.stack([np.cos(theta), np.sin(theta)], 1).astype(np.float32)
    grad_col = rng.uniform(-_GRADIENT, _GRADIENT, (n, 3)).astype(np.float32)
    sigma = rng.uniform(*_NOISE_SIGMA, n).astype(np.float32)

    hw = (sizes[:, 0] * sizes[:, 1]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(hw)[:-1]])
    total = int(hw.sum())
    alpha = np.empty(total, np.float32)
    width = max(_CANVAS, int(sizes[:, 1].max()) if n else 1)
    for height, tiles in _shelves(sizes, width, 2**24 // SUPERSAMPLE**2):
        canvas = Image.new("L", (width * SUPERSAMPLE, height * SUPERSAMPLE), 0)
        draw = ImageDraw.Draw(canvas)
        for i, y, x in tiles:
            _draw_shape(draw, CLASSES[int(labels[i])], cx[i], cy[i], r[i], angle[i],
                        y * SUPERSAMPLE, x * SUPERSAMPLE)
        small = np.asarray(canvas.resize((width, height), Image.BOX))
        for i, y, x in tiles:
            th, tw = sizes[i]
            alpha[starts[i]:starts[i] + hw[i]] = small[y:y + th, x:x + tw].reshape(-1)
    alpha *= 1 / 255

    # composite (background gradient, shape, noise) image by image, into the flat output
    noise = rng.standard_normal(total * 3, dtype=np.float32)
    out = np.empty(total * 3, np.uint8)
    for i, (th, tw) in enumerate(sizes.tolist()):
        ys = ((np.arange(th, dtype=np.float32) + 0.5) / th - 0.5)[:, None, None]
        xs = ((np.arange(tw, dtype=np.float32) + 0.5) / tw - 0.5)[None, :, None]
        img = bg[i] + (grad[i, 0] * xs + grad[i, 1] * ys) * grad_col[i]
        a = alpha[starts[i]:starts[i] + hw[i]].reshape(th, tw, 1)
        img += (fg[i] - img) * a
        s0 = 3 * starts[i]
        img += noise[s0:s0 + 3 * hw[i]].reshape(th, tw, 3) * sigma[i]
        np.rint(img, out=img)
        np.clip(img, 0, 255, out=img)
        out[s0:s0 + 3 * hw[i]] = img.reshape(-1)

    captions = []
    for i in range(n):
        name = CLASSES[int(labels[i])]
        f, b = pairs[i]
        caption = (f"a {_size_word(frac[i])} {_PALETTE[f][0]} {name} on a {_PALETTE[b][0]} "
                   f"background, {_position_word(cx[i], cy[i], w[i], h[i])}")
        captions.append(caption + _rotation_words(angle[i], _SYMMETRY[name]))
    return out, captions


def _render_native_into_shared(args):
    start, job = args
    pixels, captions = _render_chunk_native(job)
    _SHARED_OUT[start:start + len(pixels)] = pixels
    return captions


def generate_native(num: int, split_seed: int, num_classes: int = 10, render_size: int = 32,
                    workers: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(pixels uint8 [sum h*w*3], sizes int64 [num, 2] (h, w), labels int64 [num], captions)
    of a native-resolution split; independent of workers."""
    if not 1 <= num_classes <= len(CLASSES):
        raise ValueError(f"num_classes must be in [1, {len(CLASSES)}] for the shapes data, "
                         f"got {num_classes}")
    label_rng = np.random.default_rng(np.random.SeedSequence(split_seed, spawn_key=(2**31,)))
    labels = label_rng.permutation(np.arange(num, dtype=np.int64) % num_classes)
    sizes = native_sizes(num, split_seed, render_size)
    nbytes = sizes[:, 0] * sizes[:, 1] * 3
    offsets = np.concatenate([[0], np.cumsum(nbytes)]).astype(np.int64)
    jobs = [(split_seed, i, labels[s:s + CHUNK], sizes[s:s + CHUNK])
            for i, s in enumerate(range(0, num, CHUNK))]
    total = int(offsets[-1])
    if workers > 1 and len(jobs) > 1:  # as generate: a fork server, one shared buffer
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([__name__])
        buf = ctx.RawArray("B", max(1, total))
        with ctx.Pool(min(workers, len(jobs)), initializer=_attach_shared,
                      initargs=(buf, (max(1, total),))) as pool:
            caps = pool.map(_render_native_into_shared,
                            [(int(offsets[i * CHUNK]), j) for i, j in enumerate(jobs)],
                            chunksize=1)
        pixels = np.frombuffer(buf, np.uint8, count=total).copy()
        captions = [c for part in caps for c in part]
    else:
        parts = [_render_chunk_native(j) for j in jobs]
        pixels = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.uint8)
        captions = [c for p in parts for c in p[1]]
    return pixels, sizes, labels, captions


def split_seed(seed: int, split: str) -> int:
    """The seed of a split, derived from the data seed (train and val never collide)."""
    h = hashlib.sha256(f"vitgraph-shapes/{split}/{int(seed)}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def _drawing_params():
    # the knobs above, so that editing one cannot serve a stale cache even without a VERSION bump
    return repr((CLASSES, _PALETTE, _MIN_CONTRAST, _MIN_LUMA_DIFF, _COLOUR_JITTER, _RADIUS,
                 _NOISE_SIGMA, _GRADIENT, _ROTATION))


def _cache_path(cache_dir, params):
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"shapes_v{VERSION}_{params['split']}_{key}.npz")


def _through_cache(cache_dir: str | None, params: dict, names: tuple, make, cache_max_mb: float):
    """The arrays ``names`` (the last: the captions, a list) from the .npz cache entry of
    ``params``, or ``make()``'s, written there (kept under ``cache_max_mb`` by
    least-recently-used eviction)."""
    path = _cache_path(cache_dir, params) if cache_dir else None
    if path and os.path.exists(path):
        try:
            with np.load(path, allow_pickle=False) as z:
                out = *(z[n] for n in names[:-1]), z[names[-1]].tolist()
            # last use, in the access time (the modification time stays the write's), for the
            # size cap's least-recently-used eviction
            import time
            os.utime(path, (time.time(), os.stat(path).st_mtime))
            return out
        except Exception:  # truncated or foreign file: regenerate and overwrite it
            pass
    out = make()
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with written_whole(path) as tmp, open(tmp, "wb") as fh:  # ranks write it at once
            np.savez(fh, **dict(zip(names[:-1], out[:-1])),
                     **{names[-1]: np.array(out[-1], dtype=str)})
        prune_cache(cache_dir, cache_max_mb * 2**20, keep=path)
    return out


def _cache_params(split: str, num: int, seed: int, num_classes: int, render_size: int) -> dict:
    return {"version": VERSION, "split": split, "num": num, "seed": int(seed),
            "num_classes": num_classes, "render_size": render_size, "chunk": CHUNK,
            "supersample": SUPERSAMPLE, "drawing": _drawing_params()}


def load_or_generate(split: str, num: int, seed: int, num_classes: int, render_size: int,
                     workers: int, cache_dir: str | None, cache_max_mb: float = 1024):
    """Like ``generate`` for one split of data seed ``seed``, through the .npz cache."""
    return _through_cache(
        cache_dir, _cache_params(split, num, seed, num_classes, render_size),
        ("images", "labels", "captions"),
        lambda: generate(num, split_seed(seed, split), num_classes, render_size, workers),
        cache_max_mb)


def cache_files(cache_dir: str) -> list[str]:
    if not cache_dir or not os.path.isdir(cache_dir):
        return []
    return [os.path.join(cache_dir, f) for f in os.listdir(cache_dir)
            if f.startswith("shapes_v") and f.endswith(".npz")]


def prune_cache(cache_dir: str, max_bytes: int, keep: str | None = None) -> list[str]:
    """Delete the least recently used cached datasets until the cache is <= ``max_bytes``
    (``keep``, the file just written or read, stays). Returns the deleted paths."""
    files = []
    for f in cache_files(cache_dir):
        try:
            st = os.stat(f)
        except FileNotFoundError:  # another rank pruned it
            continue
        files.append((max(st.st_atime, st.st_mtime), st.st_size, f))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, f in sorted(files):  # oldest use first
        if total <= max_bytes:
            break
        if keep and os.path.abspath(f) == os.path.abspath(keep):
            continue
        try:
            os.remove(f)
        except FileNotFoundError:
            pass
        total -= size
        removed.append(f)
    return removed


def short_caption(caption: str) -> str:
    """A caption's first clause, size, colour and shape ("a large white star"): without the
    background, place and rotation, the shape is a larger share of what tells captions apart
    (data.captions=short)."""
    return caption.split(" on a ", 1)[0]


_SIZE_WORDS = ("small", "medium", "large")
# longest first: "dark blue" before "blue"
_COLOUR_NAMES = sorted((name for name, _ in _PALETTE), key=len, reverse=True)


def _size_colour_rest(caption: str) -> tuple[str, str, str]:
    """"a large dark blue star on a ..." -> ("large", "dark blue", "star on a ...")."""
    if not caption.startswith("a "):
        raise ValueError(f"not a shapes caption: {caption!r}")
    size, _, rest = caption[2:].partition(" ")
    colour = next((c for c in _COLOUR_NAMES if rest.startswith(c + " ")), None)
    if size not in _SIZE_WORDS or colour is None:
        raise ValueError(f"not a shapes caption: {caption!r}")
    return size, colour, rest[len(colour) + 1:]


def shape_first_caption(caption: str) -> str:
    """The shape, then size and colour ("star, large white"; data.captions=shape_first): a
    captioning model names the class with its first word, before the words it learns
    sooner."""
    size, colour, shape = _size_colour_rest(short_caption(caption))
    return f"{shape}, {size} {colour}"


CAPTION_FORMS = {"short": short_caption, "shape_first": shape_first_caption}


def caption_variants(caption: str) -> tuple[str, str, str, str]:
    """A caption with its size word and/or its shape's colour left out, indexed by a bitmask
    (1: no size, 2: no colour): ("a large white star ...", "a white star ...",
    "a large star ...", "a star ..."). The rest (background, place, rotation) stays. The
    article stays "a" ("a orange star"), as the captions and the zero-shot prompts write it."""
    size, colour, shape = _size_colour_rest(caption)
    return (caption, f"a {colour} {shape}", f"a {size} {shape}", f"a {shape}")


def load_or_generate_native(split: str, num: int, seed: int, num_classes: int,
                            render_size: int, workers: int, cache_dir: str | None,
                            cache_max_mb: float = 1024):
    """``generate_native`` for one split of data seed ``seed``, through the .npz cache (its
    key holds the mode: a native split never serves a fixed one)."""
    params = {**_cache_params(split, num, seed, num_classes, render_size), "resolution": "native",
              "sizes": repr((NATIVE_SHORT, NATIVE_STRETCH, _CANVAS))}
    return _through_cache(
        cache_dir, params, ("pixels", "sizes", "labels", "captions"),
        lambda: generate_native(num, split_seed(seed, split), num_classes, render_size, workers),
        cache_max_mb)


def native_size_sample(data_cfg: DataConfig, seed: int, n: int) -> np.ndarray:
    """(h, w) of ``n`` training images of the native shapes data (spread over the split), from
    its seed alone: ``native_sizes`` draws them before any pixel (the seed as ``build_shapes``
    takes it)."""
    data_seed = data_cfg.seed
    seed = seed if data_seed is None else data_seed
    sizes = native_sizes(data_cfg.num_train, split_seed(seed, "train"), data_cfg.render_size)
    return sizes[spread(len(sizes), n)]


def build_shapes(data_cfg: DataConfig, seed: int, native: bool = False):
    """(train, held-out) datasets of the shapes task: ``data_cfg.seed``'s data, or run seed
    ``seed``'s when that is None. ImageDatasets of render_size squares, or with ``native``
    NativeDatasets (each image its own size and aspect ratio, ``native_sizes``)."""
    if not 1 <= data_cfg.num_classes <= len(CLASSES):
        raise DataError(f"data.num_classes={data_cfg.num_classes}: the shapes data has "
                        f"{len(CLASSES)} classes ({', '.join(CLASSES)})")
    # data.seed fixes the dataset whatever the run seed, so runs that differ only in
    # train.seed share one cached dataset; null derives the data from the run seed
    data_seed = data_cfg.seed
    seed = seed if data_seed is None else data_seed
    load = load_or_generate_native if native else load_or_generate
    out = []
    for split, num in (("train", data_cfg.num_train), ("val", data_cfg.num_val)):
        *arrays, labels, captions = load(
            split, num, seed, data_cfg.num_classes, data_cfg.render_size,
            data_cfg.workers, data_cfg.cache_dir and os.path.expanduser(data_cfg.cache_dir),
            data_cfg.cache_max_mb)
        form = CAPTION_FORMS.get(data_cfg.captions)
        if form is not None:
            captions = [form(c) for c in captions]
        variants = None
        if split == "train" and data_cfg.caption_dropout > 0:
            variants = [caption_variants(c) for c in captions]  # the task draws among them
        labels = torch.from_numpy(labels.astype(np.int64))
        pixels = torch.from_numpy(np.ascontiguousarray(arrays[0]))
        if native:
            images = ArrayImages(pixels, arrays[1], data_cfg.workers, keep_rows=True)
            out.append(NativeDataset(images, labels, CLASSES[:data_cfg.num_classes], captions,
                                     caption_variants=variants))
        else:
            out.append(ImageDataset(pixels, labels, CLASSES[:data_cfg.num_classes], captions,
                                    caption_variants=variants))
    return out[0], out[1]
