#!/usr/bin/env python
"""scikit-learn's handwritten digits (1,797 8x8 scans, 10 classes) as a small real ImageFolder.

    pip download scikit-learn --no-deps -d /tmp/skl        # the wheel holds the data
    python scripts/digits_folder.py OUT [--wheel PATH] [--size 32] [--seed 0]

OUT gets ``train/<digit>/<index>.png`` (1,437 images) and ``val/<digit>/<index>.png`` (360): a
seeded 80/20 split of a permutation (``--seed``), each scan's 0..16 levels scaled to 0..255 and
upscaled bicubic to ``--size`` (32: the tiny config's image size), written as RGB PNG.
``data.kind=imagefolder data.path=OUT`` trains on it; docs/data.md's augmentation table was
measured on it. The data is read from the wheel's ``sklearn/datasets/data/digits.csv.gz``
(a wheel is a zip: nothing is installed); an installed scikit-learn is used when no wheel is
given or found under /tmp/skl.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import zipfile

import numpy as np
from PIL import Image

MEMBER = "sklearn/datasets/data/digits.csv.gz"


def load_digits(wheel: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 8, 8] in 0..255, labels int [n])."""
    if wheel is None:
        found = sorted(glob.glob("/tmp/skl/scikit_learn-*.whl"))
        wheel = found[-1] if found else None
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            raw = gzip.decompress(z.read(MEMBER))
    else:
        try:
            import sklearn
        except ImportError:
            raise SystemExit("no scikit-learn wheel: pip download scikit-learn --no-deps -d "
                             "/tmp/skl, or pass --wheel PATH") from None
        with open(os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data",
                               "digits.csv.gz"), "rb") as f:
            raw = gzip.decompress(f.read())
    table = np.loadtxt(io.BytesIO(raw), delimiter=",")
    pixels = np.round(table[:, :64] * 255 / 16).clip(0, 255).astype(np.uint8)
    return pixels.reshape(-1, 8, 8), table[:, 64].astype(int)


def write_digits_folder(out: str, wheel: str | None = None, size: int = 32, seed: int = 0,
                        train_fraction: float = 0.8) -> dict[str, int]:
    images, labels = load_digits(wheel)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(len(labels) * train_fraction)
    counts = {}
    for split, idx in (("train", order[:cut]), ("val", order[cut:])):
        for i in idx:
            d = os.path.join(out, split, str(labels[i]))
            os.makedirs(d, exist_ok=True)
            img = Image.fromarray(images[i], "L").resize((size, size), Image.BICUBIC)
            img.convert("RGB").save(os.path.join(d, f"{i:04d}.png"))
        counts[split] = len(idx)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--wheel", default=None, help="a scikit-learn wheel (default: /tmp/skl/*.whl)")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    counts = write_digits_folder(a.out, a.wheel, a.size, a.seed)
    print(f"{a.out}: {counts['train']} train / {counts['val']} val images, 10 classes, "
          f"{a.size}x{a.size}")


if __name__ == "__main__":
    main()
