#!/usr/bin/env python
"""The input pipeline alone, in images per second: JPEG shards -> decoded, resized (and, with
``--augment``, augmented) model inputs on the device, no model.

    python scripts/bench_data.py --out bench_data.json          # shards made here (~30 s on
                                                                # 16 cores + an H200)
    python scripts/bench_data.py --shards DIR [--decode cuda,cpu] [--workers 16] [--augment]

Without ``--shards`` it first makes its own: ``--images`` (4096) images of the embedded
shapes data (``scripts/shapes_imagefolder.py``), resized to ``--jpeg-size`` (500x375,
ImageNet's typical size) with +-40 pixel noise so that they compress like photos (~100 KB at
quality 90; ImageNet's mean is ~110 KB), written as JPEG shards by ``scripts/make_shards.py``
into a temporary folder under ``--tmp`` (removed at the end). No download, no dataset.

Then, for each ``--decode`` mode (default: ``cuda`` (nvJPEG through
``torchvision.io.decode_jpeg(device="cuda")``) when CUDA and torchvision are there, and
``cpu`` (PIL in ``--workers`` threads) always), each timed step reads one batch of ``--batch``
images through ``MicrobatchLoader`` (shard-window shuffle, as training does), decodes them,
resizes their shorter side to ``--image-size`` and center-crops (as ``data.kind=webdataset``
does), turns them into normalized fp32 inputs on the device and synchronizes. Nothing is
prefetched beyond what a step asks for, so each figure is what one process's input pipeline
sustains by itself. ViT-B/16 on one H200 trains at ~3,300 img/s: the pipeline must beat that.

Prints one line per mode and writes ``--out`` ({"provenance", "rows"}: git commit, GPU,
torch / torchvision / Pillow versions, CPU count, the shards, the command). A mode that fails
(no nvJPEG, say) is reported with its error and the others still run; the exit code is 1 then.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from vitgraph import set_hardware_queues  # noqa: E402

set_hardware_queues()  # as `vitgraph train` does, before anything initialises CUDA
import torch  # noqa: E402


def make_shards(tmp: str, n: int, size: tuple[int, int], workers: int) -> tuple[str, dict]:
    """``n`` shapes images as photo-like JPEGs, as shards under ``tmp``: (shards dir, info)."""
    import make_shards as ms
    from shapes_imagefolder import write_shapes_imagefolder
    folder, shards = os.path.join(tmp, "folder"), os.path.join(tmp, "shards")
    t0 = time.perf_counter()
    write_shapes_imagefolder(folder, num_train=n, num_val=max(10, n // 50), fmt="jpg",
                             size=size, noise=40, quality=90, workers=workers, cache_dir=None)
    ms.main([folder, shards, "--shard-size", "512"])
    jpegs = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(folder, "train")) for f in fs]
    mean_kb = sum(os.path.getsize(p) for p in jpegs) / len(jpegs) / 1024
    info = {"made": f"{n} shapes images as JPEG {size[0]}x{size[1]} quality 90, +-40 noise",
            "mean_jpeg_kb": round(mean_kb, 1), "make_s": round(time.perf_counter() - t0, 1)}
    return shards, info


def measure(root: str, decode: str, args, device: torch.device) -> dict:
    from vitgraph.data import DataConfig, MicrobatchLoader, build_datasets, to_model_input
    from vitgraph.data.augment import AugmentConfig, BatchAugment
    cfg = DataConfig(kind="webdataset", path=root, render_size=args.image_size,
                     workers=args.workers, decode=decode, shuffle_shards=4,
                     cpu_decode_share=args.cpu_decode_share if decode == "cuda" else 0.0,
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
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        x = step(args.warmup + i)
        times.append(time.perf_counter() - t0)
    ips = args.steps * args.batch / sum(times)
    times.sort()
    return {"system": "vitgraph-data", "decode": decode, "device": str(device),
            "cpu_decode_share": cfg.cpu_decode_share,
            "workers": args.workers, "augment": args.augment, "batch": args.batch,
            "image_size": args.image_size, "images_per_s": round(ips, 1), "steps": args.steps,
            "step_ms_median": round(1e3 * times[len(times) // 2], 2),
            "step_ms_max": round(1e3 * times[-1], 2), "shape": list(x.shape)}


def provenance(args, shards_info: dict, device: torch.device) -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except Exception:
            return None

    try:
        import torchvision
        tv = torchvision.__version__
    except Exception as e:
        tv = f"not importable ({type(e).__name__})"
    import PIL
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(status),
            "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "torchvision": tv, "pillow": PIL.__version__,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "shards": shards_info, "command": " ".join([sys.executable, *sys.argv]),
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", help="folder of train-*.tar shards (default: make them)")
    ap.add_argument("--images", type=int, default=4096, help="images to make without --shards")
    ap.add_argument("--jpeg-size", default="500x375", help="WxH of the JPEGs made")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where to make them")
    ap.add_argument("--decode", default=None,
                    help="comma-separated modes: cuda (nvJPEG), cpu (PIL threads); default "
                         "cuda,cpu with CUDA and torchvision, else cpu")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--augment", action="store_true", help="the DeiT recipe on the device")
    ap.add_argument("--cpu-decode-share", type=float, default=0.0,
                    help="cuda decode: this share of each batch decoded in the threads (simplejpeg, else PIL)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)

    from vitgraph.data.decode import resolve_decode
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = (args.decode.split(",") if args.decode else
             (["cuda", "cpu"] if resolve_decode("auto") == "cuda" else ["cpu"]))
    t_start = time.perf_counter()
    tmp = None
    if args.shards:
        root, info = args.shards, {"path": os.path.abspath(args.shards)}
    else:
        tmp = tempfile.mkdtemp(prefix="vitgraph-bench-data-", dir=args.tmp)
        w, h = (int(v) for v in args.jpeg_size.split("x"))
        root, info = make_shards(tmp, args.images, (w, h), args.workers)
        print(f"made {args.images} JPEGs ({info['mean_jpeg_kb']:.0f} KB mean) as shards in "
              f"{root} ({info['make_s']:.1f}s)", flush=True)
    rows, failed = [], False
    try:
        for mode in modes:
            try:
                row = measure(root, mode, args, device)
            except Exception as e:  # report it, go on with the other modes
                failed = True
                row = {"system": "vitgraph-data", "decode": mode, "error": f"{type(e).__name__}: {e}"}
                print(f"{mode} decode: FAILED: {row['error']}", flush=True)
            else:
                print(f"input pipeline: {row['images_per_s']:,.0f} img/s ({mode} decode, "
                      f"{args.workers} workers, batch {args.batch}, {args.image_size}px"
                      f"{', augment' if args.augment else ''}; step median "
                      f"{row['step_ms_median']:.1f} ms, max {row['step_ms_max']:.1f} ms)",
                      flush=True)
            rows.append(row)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        result = {"provenance": provenance(args, info, device), "rows": rows}
        result["provenance"]["total_s"] = round(time.perf_counter() - t_start, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
