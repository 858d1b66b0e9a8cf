#!/usr/bin/env python
"""The embedded shapes data written out as an ImageFolder (``data.kind=imagefolder`` reads it).

    python scripts/shapes_imagefolder.py OUT                  # the default config's data, PNG
    python scripts/shapes_imagefolder.py OUT --format jpg --size 500x375 --noise 20

OUT gets ``train/<NN>_<shape>/<index>.<ext>`` and ``val/...`` (class folders numbered so that
their sorted order is the shapes data's label order). With the defaults the pixels are exactly
those ``data.kind=shapes`` trains on (``data.seed`` 0, 50,000 / 2,000 images at 32x32, PNG is
lossless), read through the dataset cache like a training run. ``--size WxH`` resizes (bicubic)
and ``--noise N`` adds uniform +-N pixel noise before encoding: larger, photo-like JPEGs for
decoding benchmarks (``scripts/bench_data.py`` makes its shards this way). Images are encoded
in ``--workers`` threads (PIL releases the GIL while it resizes and encodes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


def write_shapes_imagefolder(out: str, num_train: int = 50000, num_val: int = 2000,
                             seed: int = 0, num_classes: int = 10, render_size: int = 32,
                             fmt: str = "png", size: tuple[int, int] | None = None,
                             noise: int = 0, quality: int = 90, workers: int = 1,
                             cache_dir: str | None = "~/.cache/vitgraph") -> dict[str, int]:
    """Write both splits under ``out``; returns {"train": n, "val": n}. ``cache_dir`` None
    draws the data without touching the dataset cache."""
    from vitgraph.data import DataConfig
    from vitgraph.data.shapes import build_shapes
    if fmt not in ("png", "jpg"):
        raise ValueError(f"format {fmt!r}: png | jpg")
    cfg = DataConfig(num_train=num_train, num_val=num_val, num_classes=num_classes,
                     render_size=render_size, seed=seed, workers=max(1, workers),
                     cache_dir=cache_dir)
    train, val = build_shapes(cfg, seed)
    # a few fixed noise fields, reused: drawing fresh noise per image would hold the GIL
    noise_fields = []
    if noise:
        h, w = (size[1], size[0]) if size else (render_size, render_size)
        rng = np.random.default_rng(seed)
        noise_fields = [rng.integers(-noise, noise + 1, (h, w, 3), dtype=np.int16)
                        for _ in range(8)]
    folders = [f"{i:02d}_{name}" for i, name in enumerate(train.classes)]
    counts = {}
    for split, ds in (("train", train), ("val", val)):
        for name in folders:
            os.makedirs(os.path.join(out, split, name), exist_ok=True)
        images = ds.images.numpy()
        labels = ds.labels.numpy()

        def write(i: int, split=split, images=images, labels=labels) -> None:
            im = Image.fromarray(images[i])
            if size and im.size != tuple(size):
                im = im.resize(tuple(size), Image.BICUBIC)
            if noise_fields:
                arr = np.asarray(im, dtype=np.int16) + noise_fields[i % len(noise_fields)]
                im = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
            path = os.path.join(out, split, folders[labels[i]], f"{i:06d}.{fmt}")
            if fmt == "jpg":
                im.save(path, "JPEG", quality=quality)
            else:
                im.save(path, "PNG", compress_level=1)

        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(write, range(len(labels)), chunksize=64))
        counts[split] = len(labels)
    return counts


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.partition("x")
    return int(w), int(h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output folder (gets train/ and val/)")
    ap.add_argument("--num-train", type=int, default=50000)
    ap.add_argument("--num-val", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="data.seed of the shapes data")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--render-size", type=int, default=32, help="size the shapes are drawn at")
    ap.add_argument("--format", default="png", choices=("png", "jpg"))
    ap.add_argument("--size", type=_size, default=None, help="WxH to resize to (default: as drawn)")
    ap.add_argument("--noise", type=int, default=0, help="uniform +-N pixel noise (0: none)")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-cache", action="store_true", help="do not use the dataset cache")
    args = ap.parse_args(argv)
    t0 = time.time()
    counts = write_shapes_imagefolder(
        args.out, args.num_train, args.num_val, args.seed, args.num_classes, args.render_size,
        args.format, args.size, args.noise, args.quality, args.workers,
        None if args.no_cache else "~/.cache/vitgraph")
    print(f"wrote {counts} {args.format} images to {args.out} ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
