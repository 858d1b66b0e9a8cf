#!/usr/bin/env python
"""ImageFolder -> WebDataset shards for ``data.kind=webdataset``.

    python scripts/make_shards.py SRC OUT [--shard-size 1000] [--seed 0]

SRC holds ``train/<class>/*`` and ``val/<class>/*`` (as ``data.kind=imagefolder`` reads);
OUT gets ``train-000000.tar ...``, ``val-000000.tar ...`` and ``index.json`` (class names and
every sample's member offsets, so that training reads no tar headers at start-up). Each sample
is ``<key>.jpg`` (JPEGs copied byte for byte, other formats re-encoded as JPEG quality 95, so
that the GPU's nvJPEG can decode every image) and ``<key>.cls`` (the class index); with
``--captions`` a ``<key>.txt`` holding the class name too. The train split is shuffled (seeded)
before it is cut into shards, so every shard holds a mix of classes.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tarfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from PIL import Image  # noqa: E402

from vitgraph.data.imagefolder import list_classes, list_files  # noqa: E402


def jpeg_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if data[:3] == b"\xff\xd8\xff":  # already a JPEG
        return data
    with Image.open(io.BytesIO(data)) as im:
        out = io.BytesIO()
        im.convert("RGB").save(out, "JPEG", quality=95)
        return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    header = len(info.tobuf(tar.format, tar.encoding, tar.errors))
    start = tar.offset
    tar.addfile(info, io.BytesIO(data))
    return start + header  # where the member's data begins


def write_split(src: str, out: str, split: str, classes: list[str], shard_size: int,
                seed: int, captions: bool) -> list[dict]:
    paths, labels = list_files(os.path.join(src, split), classes)
    items = list(zip(paths, labels))
    if split == "train":
        random.Random(seed).shuffle(items)
    shards = []
    for n, start in enumerate(range(0, len(items), shard_size)):
        name = f"{split}-{n:06d}.tar"
        samples = []
        with tarfile.open(os.path.join(out, name + ".partial"), "w", format=tarfile.USTAR_FORMAT) as tar:
            for i, (path, label) in enumerate(items[start:start + shard_size]):
                key = f"{split}_{start + i:08d}"
                data = jpeg_bytes(path)
                offset = _add(tar, f"{key}.jpg", data)
                _add(tar, f"{key}.cls", str(label).encode())
                sample = {"key": key, "offset": offset, "size": len(data), "ext": "jpg",
                          "cls": label}
                if captions:
                    sample["txt"] = classes[label]
                    _add(tar, f"{key}.txt", classes[label].encode())
                samples.append(sample)
        os.replace(os.path.join(out, name + ".partial"), os.path.join(out, name))
        shards.append({"file": name, "samples": samples})
    return shards


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="ImageFolder root with train/ and val/")
    ap.add_argument("out", help="output folder for the shards")
    ap.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    ap.add_argument("--seed", type=int, default=0, help="train-split shuffle seed")
    ap.add_argument("--captions", action="store_true", help="also write <key>.txt (class name)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    classes = list_classes(os.path.join(args.src, "train"))
    index = {"classes": classes, "splits": {}}
    for split in ("train", "val"):
        index["splits"][split] = write_split(args.src, args.out, split, classes,
                                             args.shard_size, args.seed, args.captions)
    tmp = os.path.join(args.out, "index.json.partial")
    with open(tmp, "w") as f:
        json.dump(index, f)
    os.replace(tmp, os.path.join(args.out, "index.json"))
    counts = {s: sum(len(x["samples"]) for x in v) for s, v in index["splits"].items()}
    print(f"wrote {counts} samples in {sum(len(v) for v in index['splits'].values())} shards "
          f"to {args.out} ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
