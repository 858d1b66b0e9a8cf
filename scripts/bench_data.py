#!/usr/bin/env python
"""The input pipeline alone, in images per second: shards -> decoded, (augmented) model inputs
on the device, no model.

    python scripts/bench_data.py --shards DIR [--decode cpu|cuda] [--workers 16] [--augment]
    python scripts/bench_data.py --synthetic 4000 ...     # makes ImageNet-like JPEG shards first

Each timed step reads one batch of ``--batch`` images through ``MicrobatchLoader`` (shard-window
shuffle, as training does), decodes them (PIL in ``--workers`` threads, or nvJPEG on the GPU),
turns them into normalized ``--image-size`` inputs on the device (with ``--augment``, the DeiT
recipe of ``data.augment``) and synchronizes. The loader prefetches nothing beyond what a step
asks for, so the figure is what one process's input pipeline sustains by itself. ViT-B/16 on
one H200 trains at ~3,300 img/s: the pipeline must beat that with room to spare.
Writes ``--out`` JSON ({"provenance", "rows"}) when given.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402


def make_synthetic_shards(out: str, n: int, width: int, height: int, shard_size: int) -> str:
    """``n`` random-content JPEGs of width x height (ImageNet's mean is ~400x350), as shards."""
    import subprocess
    folder = os.path.join(out, "folder")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    for split, count in (("train", n), ("val", max(1, n // 50))):
        for i in range(count):
            d = os.path.join(folder, split, f"c{i % 10}")
            os.makedirs(d, exist_ok=True)
            # smooth image + noise: compresses like a photo (~100 KB at 500x375 q90)
            img = Image.fromarray(np.roll(base, i, axis=1)).resize((width, height), Image.BILINEAR)
            arr = np.asarray(img).astype(np.int16) + rng.integers(-20, 20, (height, width, 3))
            Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(
                os.path.join(d, f"{i:06d}.jpg"), "JPEG", quality=90)
    shards = os.path.join(out, "shards")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "make_shards.py"),
                    folder, shards, "--shard-size", str(shard_size)], check=True)
    return shards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shards", help="folder of train-*.tar shards (scripts/make_shards.py)")
    src.add_argument("--synthetic", type=int, metavar="N", help="make N JPEG shards first")
    ap.add_argument("--synthetic-size", default="500x375", help="WxH of the synthetic JPEGs")
    ap.add_argument("--decode", default="auto", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--render-size", type=int, default=None, help="decode size (default image size)")
    ap.add_argument("--augment", action="store_true", help="the DeiT recipe on the device")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)

    from vitgraph.data import MicrobatchLoader, build_datasets, to_model_input
    from vitgraph.data.augment import AugmentConfig, BatchAugment
    from vitgraph.data.shards import resolve_decode

    tmp = None
    root = args.shards
    if args.synthetic:
        tmp = tempfile.mkdtemp(prefix="vitgraph-bench-data-")
        w, h = (int(v) for v in args.synthetic_size.split("x"))
        root = make_synthetic_shards(tmp, args.synthetic, w, h, shard_size=500)
    decode = resolve_decode(args.decode)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = types.SimpleNamespace(kind="webdataset", path=root, render_size=args.render_size or
                                args.image_size, workers=args.workers, decode=decode,
                                shuffle_shards=4, num_train=0, num_val=0, num_classes=0,
                                cache_dir=None)
    train, _ = build_datasets(cfg, seed=0)
    loader = MicrobatchLoader(train, args.batch, 1, 0, 1, seed=0)
    augment = BatchAugment(AugmentConfig(enabled=True), args.image_size, len(train.classes),
                           0.1, seed=0) if args.augment else None

    def step(i):
        (images, labels), = loader.next_step()
        if augment is not None:
            x = augment.images(images, (i, 0), device)
            augment.targets(labels, (i, 0))
        else:
            x = to_model_input(images, args.image_size, device, torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return x

    for i in range(args.warmup):
        step(i)
    t0 = time.perf_counter()
    for i in range(args.steps):
        x = step(args.warmup + i)
    dt = time.perf_counter() - t0
    ips = args.steps * args.batch / dt
    row = {"system": "vitgraph-data", "decode": decode, "workers": args.workers,
           "augment": args.augment, "batch": args.batch, "image_size": args.image_size,
           "render_size": cfg.render_size, "images_per_s": ips, "steps": args.steps,
           "shape": list(x.shape)}
    print(f"input pipeline: {ips:,.0f} img/s ({decode} decode, {args.workers} workers, "
          f"batch {args.batch}, {args.image_size}px{', augment' if args.augment else ''})")
    if args.out:
        prov = {"host": platform.node(), "python": platform.python_version(),
                "torch": torch.__version__, "cpus": os.cpu_count(),
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "shards": root if not args.synthetic else f"synthetic {args.synthetic} x "
                f"{args.synthetic_size} JPEG q90", "command": " ".join(sys.argv)}
        with open(args.out, "w") as f:
            json.dump({"provenance": prov, "rows": [row]}, f, indent=2)
    if tmp:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
