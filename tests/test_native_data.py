"""Native-resolution data (vitgraph/data/native.py): sizes, packs, the packed loader, eval
packs, the readers and the device-side transform; CPU, small data."""
import copy
import dataclasses
import io
import os
import types

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph.data import (DataConfig, DataError, build_datasets, iterate_eval_packs,
                           native_size_sample, pack_inputs)
from vitgraph.data import shapes
from vitgraph.data.augment import AugmentConfig, _colour
from vitgraph.data.decode import (EncodedPack, crop_box, finish_pack_on_device, header_size,
                                  read_size)
from vitgraph.data.native import (OPS, ArrayImages, NativeDataset, PackAugment, PackedLoader,
                                  crop_boxes, eval_packs, pack_colour, pack_fields, pack_fill,
                                  pack_spec, size_tokens)
from vitgraph.data.packing import PackSpec, native_grid, patchify

P = 4  # patch size of the toy specs


def spec(tokens=256, max_images=8, max_patches=64, num_prefix=1, min_patches=1):
    return PackSpec(tokens=tokens, max_images=max_images, max_patches=max_patches,
                    num_prefix=num_prefix, patch_size=P, min_patches=min_patches)


def toy(n=60, seed=0, lo=4, hi=48, tokens=None):
    """n random images of random sizes in memory; label = image index (to follow images)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lo, hi + 1, (n, 2))
    pixels = rng.integers(0, 256, int((sizes[:, 0] * sizes[:, 1] * 3).sum()), dtype=np.uint8)
    ds = NativeDataset(ArrayImages(torch.from_numpy(pixels), sizes), torch.arange(n),
                       [str(i) for i in range(n)])
    if tokens:
        ds.tokens = torch.arange(n * tokens).view(n, tokens) + 1
    return ds


def ids(fields) -> list[int]:
    lab = fields[4]
    return lab[lab >= 0].tolist()


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b))


def aug(**kw):
    """data.augment as native packs take it (no mixing); erasing only where a test asks."""
    base = dict(enabled=True, mixup_alpha=0.0, cutmix_alpha=0.0, erase_prob=0.0)
    base.update(kw)
    return AugmentConfig(**base)


# ---------------------------------------------------------------- sizes and packs

def test_size_rule_edge_cases():
    assert native_grid(16, 32, 4, 64) == (4, 8)  # fits: its own size
    assert native_grid(17, 33, 4, 64) == (4, 8)  # rounded to whole patches
    assert native_grid(2, 3, 4, 64) == (1, 1)  # smaller than a patch: one
    for h, w in ((400, 100), (100, 400), (1000, 1000), (5, 4000), (333, 777)):
        gh, gw = native_grid(h, w, 4, 64)
        assert gh * gw <= 64 and gh >= 1 and gw >= 1, (h, w)
        if min(h, w) >= 64:  # shrunk, the aspect ratio kept to about a patch
            assert abs(gh / gw - h / w) <= max(h / w / gw, 1 / gw) + 0.05
            assert (gh + 1) * gw > 64 or gh * (gw + 1) > 64  # the largest that fits
    # the loader's numpy patchify is packing.patchify
    from vitgraph.data.native import patch_rows
    img = np.random.default_rng(0).integers(0, 256, (13, 22, 3), dtype=np.uint8)
    assert torch.equal(patch_rows(img, P), patchify(img, P))
    # the dataset computes each distinct size's grid once, and as native_grid does
    ds = toy(80, hi=90)
    s = spec()
    grids = ds.grids(s)
    assert grids.tolist() == [list(native_grid(h, w, P, 64)) for h, w in ds.sizes.tolist()]
    assert (ds.image_tokens(s) == 1 + grids[:, 0] * grids[:, 1]).all()


def test_min_patches_enlarges_small_images():
    assert native_grid(8, 8, 4, 64, min_patches=16) == (4, 4)
    assert native_grid(4, 4, 4, 64, min_patches=9) == (3, 3)
    assert native_grid(4, 8, 4, 64, min_patches=8) == (2, 4)


def test_packs_keep_their_budget_shapes_and_layout():
    ds, s = toy(200, hi=60), spec(tokens=200, max_images=6, max_patches=40)
    ld = PackedLoader(ds, s, 3, 0, 1, seed=0)
    grids = ds.grids(s)
    for _ in range(12):
        for patches, coords, seg, cu, labels in ld.next_step():
            assert patches.shape == (200, 3 * P * P) and patches.dtype == torch.uint8
            assert coords.shape == (200, 4) and seg.shape == (200,)
            assert cu.shape == (s.num_segments + 1,) and cu.dtype == torch.int32
            assert labels.shape == (6,)
            got = labels[labels >= 0].tolist()
            assert 1 <= len(got) <= 6 and (labels[len(got):] == -1).all()
            need = sum(1 + int(grids[i, 0] * grids[i, 1]) for i in got)
            assert need <= 200 and int(cu[len(got)]) == need
            assert (torch.diff(cu) >= 0).all() and int(cu[-1]) == 200
            assert (torch.diff(cu) <= s.max_len).all()
            assert (seg[need:] == 6).all() and (patches[need:] == 0).all()
            for k, i in enumerate(got):  # each image's patches in place, its grid in coords
                a, b = int(cu[k]), int(cu[k + 1])
                gh, gw = grids[i]
                assert (coords[a, 2:] == torch.tensor([gh, gw])).all() and coords[a, 0] == -1
                assert torch.equal(patches[a + 1:b], ds.images.rows(i, (gh, gw), P))


def test_padded_slots_hold_what_packs_of_as_many_images_would():
    """data.packing.layout=padded: the loader fills each pack's slots with the images a pack
    of as many images (and room for them) takes; image i at the start of slot i."""
    ds = toy(200, hi=60)
    slots = pack_spec(types.SimpleNamespace(tokens_per_microbatch=200, max_images=8,
                                            max_patches=40, min_patches=1), P, 1, padded=True)
    assert (slots.max_images, slots.tokens, slots.num_segments) == (4, 4 * 41, 4)
    room = spec(tokens=4 * 41, max_images=4, max_patches=40)
    a, b = (PackedLoader(ds, s, 2, 0, 1, seed=0) for s in (slots, room))
    for _ in range(3):
        assert a.next_packs() == b.next_packs()
    grids = ds.grids(slots)
    for fields in a.next_step():
        patches, coords, seg, cu, labels = fields
        assert cu.tolist() == [0, 41, 82, 123, 164] and ids(fields)
        for k, i in enumerate(ids(fields)):
            n = 1 + int(grids[i, 0] * grids[i, 1])
            assert (seg[41 * k:41 * k + n] == k).all() and (seg[41 * k + n:41 * (k + 1)] == 4).all()
            assert torch.equal(patches[41 * k + 1:41 * k + n], ds.images.rows(i, tuple(grids[i]), P))
    # the model runs M * max_len tokens as slots of max_len: the budget must be exactly that
    with pytest.raises(ValueError, match="padded slots"):
        dataclasses.replace(slots, tokens=200)


def test_pack_fill_is_the_loaders():
    """data.packing.layout=auto's fill: the packer on a sample of the images' tokens fills
    packs as the loader does; max_images bounds it."""
    ds, s = toy(400, hi=60), spec(tokens=200, max_images=8, max_patches=40)
    ld = PackedLoader(ds, s, 2, 0, 1, seed=0)
    used = 0
    for _ in range(40):
        ld.next_packs()
        used += ld.last_counts["tokens"]
    got = pack_fill(ds.image_tokens(s), s, 2)
    assert got == pytest.approx(used / (40 * 2 * 200), abs=0.015) and got > 0.93
    few = dataclasses.replace(s, max_images=3)
    assert pack_fill(ds.image_tokens(s), few, 2) <= 3 * 41 / 200


def test_determinism_and_seeds():
    ds, s = toy(), spec()
    a = [PackedLoader(ds, s, 2, 0, 1, seed=5).next_step() for _ in range(2)]
    assert same(a[0], a[1])
    b = PackedLoader(ds, s, 2, 0, 1, seed=6).next_step()
    assert [ids(f) for f in a[0]] != [ids(f) for f in b]


@pytest.mark.parametrize("crop", [False, True])
def test_resume_is_exact(crop):
    ds, s = toy(50), spec(tokens=160, max_images=5)
    cfg = aug(crop_scale_min=0.3) if crop else None

    def loader():
        return PackedLoader(ds, s, 2, 1, 2, seed=3, augment_cfg=cfg)

    ref = loader()
    want = [ref.next_step() for _ in range(7)]  # 7 steps cross an epoch end (50 images)
    assert ref.epoch >= 1
    first = loader()
    got = [first.next_step() for _ in range(3)]
    state = copy.deepcopy(first.state_dict())
    assert state["carry"]  # images waited for a pack: part of the state
    fresh = loader()
    fresh.load_state_dict(state)
    got += [fresh.next_step() for _ in range(4)]
    assert all(same(w, g) for w, g in zip(want, got))
    assert fresh.state_dict() == ref.state_dict()
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(ds, s, 2, 1, 2, seed=4).load_state_dict(state)


def test_last_counts_are_the_steps_over_every_rank():
    ds, s = toy(200), spec()
    ranks = [PackedLoader(ds, s, 2, r, 2, seed=0) for r in range(2)]
    steps = [ld.next_step() for ld in ranks]
    assert ranks[0].last_counts == ranks[1].last_counts
    seg_lens = [torch.diff(f[3])[:int((f[4] >= 0).sum())] for st in steps for f in st]
    n = torch.cat(seg_lens).long()
    assert ranks[0].last_counts == {"images": len(n), "tokens": int(n.sum()),
                                    "patches": int((n - 1).sum()),
                                    "token_pairs": int((n * n).sum())}


def test_every_image_once_per_epoch_carry_included():
    n = 97
    ds, s = toy(n, hi=40), spec(tokens=150, max_images=5)
    ld = PackedLoader(ds, s, 2, 0, 1, seed=1)
    trained = []
    while ld.epoch < 3:
        packs = ld.next_packs()
        assert all(p for p in packs)  # no empty pack
        trained += [item for p in packs for item in p]
    waiting = [(i, e) for i, e in zip(ld.state_dict()["carry"], ld.state_dict()["carry_epochs"])]
    for epoch in (0, 1):
        seen = [i for i, e in trained if e == epoch]
        assert sorted(seen) == list(range(n)), epoch  # each exactly once
    assert len(set(trained)) == len(trained)
    assert not set(trained) & set(waiting)


def test_steps_per_epoch_estimate_is_close():
    ds, s = toy(300, hi=40), spec(tokens=200, max_images=8)
    ld = PackedLoader(ds, s, 2, 0, 1, seed=0)
    steps = 0
    while ld.epoch == 0:  # until a step draws from the next epoch
        ld.next_packs()
        steps += 1
    assert ld.steps_per_epoch <= steps <= 1.3 * ld.steps_per_epoch + 1


def test_data_parallel_ranks_split_one_global_packing():
    ds, s = toy(400), spec()
    single = PackedLoader(ds, s, 4, 0, 1, seed=2)
    ranks = [PackedLoader(ds, s, 2, r, 2, seed=2) for r in range(2)]
    for _ in range(5):
        ref = single.next_step()
        parts = [ld.next_step() for ld in ranks]
        assert same(parts[0] + parts[1], ref)
        a, b = ({i for f in part for i in ids(f)} for part in parts)
        assert not a & b


def test_bad_settings_are_data_errors():
    ds, s = toy(6), spec()
    with pytest.raises(DataError, match="train.global_batch_size"):
        PackedLoader(ds, s, 4, 0, 2, seed=0)
    with pytest.raises(DataError, match="data.packing.window"):
        PackedLoader(toy(40), s, 4, 0, 1, seed=0, window=3)
    big = toy(20)
    big.image_tokens = lambda spec: np.full(20, 10_000)
    with pytest.raises(DataError, match="data.packing.tokens_per_microbatch"):
        PackedLoader(big, s, 2, 0, 1, seed=0)


def test_caption_tokens_ride_along_zero_for_empty_slots():
    ds, s = toy(30, tokens=5), spec(max_images=6)
    for fields in PackedLoader(ds, s, 2, 0, 1, seed=0).next_step():
        assert len(fields) == 6 and fields[5].shape == (6, 5)
        got = ids(fields)
        assert torch.equal(fields[5][:len(got)], ds.tokens[got])
        assert (fields[5][len(got):] == 0).all()
    x = pack_inputs(fields, "cpu")
    assert len(x) == 6 and torch.equal(x[5], fields[5])


def test_eval_packs_cover_each_image_once_in_order():
    ds, s = toy(73, hi=60), spec(tokens=180, max_images=5)
    packs = eval_packs(ds, s)
    assert sum(packs, []) == list(range(73))  # in order, each once
    tokens = ds.image_tokens(s)
    for a, b in zip(packs, packs[1:]):  # next-fit: a pack closes when the next does not fit
        assert len(a) == 5 or sum(tokens[a]) + tokens[b[0]] > 180
    for dp in (1, 2, 3):
        seen = [i for r in range(dp) for f in iterate_eval_packs(ds, s, r, dp) for i in ids(f)]
        assert seen == list(range(73))


# ---------------------------------------------------------------- the shapes data

def shapes_cfg(**kw):
    base = dict(kind="shapes", num_train=300, num_val=60, render_size=32, num_classes=10,
                cache_dir=None, workers=1, seed=0)
    base.update(kw)
    return DataConfig(**base)


def test_shapes_native_sizes_vary_and_are_deterministic():
    train, val = build_datasets(shapes_cfg(), seed=0, native=True)
    again, _ = build_datasets(shapes_cfg(), seed=0, native=True)
    assert torch.equal(train.images.pixels, again.images.pixels)
    assert (train.sizes == again.sizes).all() and torch.equal(train.labels, again.labels)
    h, w = train.sizes[:, 0], train.sizes[:, 1]
    assert np.minimum(h, w).min() >= 16 and np.minimum(h, w).max() <= 64
    assert (h / w).min() >= 0.5 and (h / w).max() <= 2.0
    assert (h > w).sum() > 50 and (w > h).sum() > 50 and len({*map(tuple, train.sizes)}) > 150
    assert len(val) == 60 and not (val.sizes[:20] == train.sizes[:20]).all()
    # the class is the shape, named in the caption; labels balanced
    assert all(f" {train.classes[lb]} on a " in c for lb, c in zip(train.labels, train.captions))
    assert np.bincount(train.labels.numpy()).tolist() == [30] * 10
    other, _ = build_datasets(shapes_cfg(seed=1), seed=0, native=True)
    assert not (other.sizes[:50] == train.sizes[:50]).all()
    # data.packing.layout=auto's sample: the same sizes, drawn without a pixel
    assert (native_size_sample(shapes_cfg(), 0, n=300) == train.sizes).all()
    assert (native_size_sample(shapes_cfg(), 0, n=3) == train.sizes[[0, 150, 299]]).all()
    s = spec(max_patches=16)
    assert (size_tokens(train.sizes, s) == train.image_tokens(s)).all()


def test_shapes_native_does_not_depend_on_workers():
    a = shapes.generate_native(1100, 7, 10, 16, workers=1)
    b = shapes.generate_native(1100, 7, 10, 16, workers=2)  # three chunks over two workers
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[3] == b[3]


def test_shapes_native_cache_is_its_own_entry(tmp_path):
    cfg = shapes_cfg(num_train=40, num_val=10, cache_dir=str(tmp_path))
    train, _ = build_datasets(cfg, seed=0, native=True)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2
    cached, _ = build_datasets(cfg, seed=0, native=True)  # read back
    assert torch.equal(cached.images.pixels, train.images.pixels)
    assert cached.captions == train.captions and (cached.sizes == train.sizes).all()
    build_datasets(cfg, seed=0)  # the fixed split: entries of its own
    assert len(os.listdir(tmp_path)) == 4


# ---------------------------------------------------------------- files and shards

def _write(path, size_wh, fmt, seed, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size_wh
    # smooth content: JPEG keeps it close, resizes are well-behaved
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)),
                    np.full_like(xx, int(rng.integers(0, 256)))], -1).astype(np.uint8)
    Image.fromarray(img).save(path, fmt, **kw)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "imgs"
    sizes = [(40, 30), (30, 40), (64, 20), (12, 12), (50, 50), (21, 37)]
    for i, wh in enumerate(sizes):
        fmt = "JPEG" if i % 2 else "PNG"
        ext = "jpg" if fmt == "JPEG" else "png"
        _write(root / "train" / ("a" if i < 3 else "b") / f"{i}.{ext}", wh, fmt, i,
               **({"quality": 95} if fmt == "JPEG" else {}))
    _write(root / "val" / "a" / "v.png", (33, 17), "PNG", 9)
    _write(root / "val" / "b" / "w.jpg", (18, 44), "JPEG", 10, quality=95)
    return root


def folder_cfg(root, **kw):
    base = dict(kind="imagefolder", path=str(root), render_size=8, num_classes=2,
                cache_dir=None, workers=2, decode="cpu")
    base.update(kw)
    return DataConfig(**base)


def test_header_sizes_match_pil(tmp_path):
    cases = [("a.jpg", "JPEG", {}), ("b.jpg", "JPEG", {"progressive": True}),
             ("c.png", "PNG", {}), ("d.jpg", "JPEG", {"exif": b"Exif\x00\x00" + b"x" * 9000}),
             ("e.webp", "WEBP", {})]
    for name, fmt, kw in cases:
        p = tmp_path / name
        _write(p, (37, 23), fmt, 0, **kw)
        data = p.read_bytes()
        with Image.open(p) as im:
            want = im.size[::-1]
        assert read_size(lambda k: data[:k], len(data), name) == want, name
        if fmt != "WEBP":
            assert header_size(data) == want, name
    assert header_size(b"not an image") is None
    with pytest.raises(DataError, match="junk.bin"):
        read_size(lambda k: b"junk"[:k], 4, "junk.bin")


def test_imagefolder_native_pixels_are_a_resize_and_patchify(folder):
    train, val = build_datasets(folder_cfg(folder), seed=0, native=True)
    # data.packing.layout=auto's sample: the headers of files spread over the folder
    assert (native_size_sample(folder_cfg(folder), 0) == train.sizes).all()
    assert (native_size_sample(folder_cfg(folder), 0, n=2) == train.sizes[[0, 5]]).all()
    assert train.classes == ["a", "b"] and train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    paths = train.images.paths
    for p, (h, w) in zip(paths, train.sizes.tolist()):
        with Image.open(p) as im:
            assert im.size == (w, h)
    s = spec(tokens=600, max_images=8, max_patches=48)
    fields = pack_fields(train, s, list(range(6)))
    grids = train.grids(s)
    cu = fields[3]
    for k, p in enumerate(paths):
        gh, gw = (int(v) for v in grids[k])
        with Image.open(p) as im:
            want = patchify(np.array(im.convert("RGB").resize((gw * P, gh * P), Image.BICUBIC)), P)
        assert torch.equal(fields[0][int(cu[k]) + 1:int(cu[k + 1])], want), p
    assert len(val) == 2 and val.sizes.tolist() == [[17, 33], [44, 18]]


def test_imagefolder_native_skips_unreadable_headers_and_greys_a_broken_body(folder, caplog):
    (folder / "train" / "a" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (folder / "train" / "a" / "empty.jpg").write_bytes(b"")
    whole = (folder / "train" / "b" / "3.jpg").read_bytes()
    (folder / "train" / "b" / "3.jpg").write_bytes(whole[:len(whole) // 3])  # header reads
    with caplog.at_level("WARNING", logger="vitgraph"):
        train, _ = build_datasets(folder_cfg(folder), seed=0, native=True)
        assert len(train) == 6 and "bad.png" in caplog.text and "empty.jpg" in caplog.text
        cut = [os.path.basename(p) for p in train.images.paths].index("3.jpg")
        rows = train.images.rows(cut, (3, 3), P)
    assert (rows == 128).all() and "3.jpg" in caplog.text


def _pil_decoder(data):
    """nvJPEG's stand-in on the CPU: JPEG byte tensors -> uint8 [3, H, W]."""
    return [torch.from_numpy(np.array(Image.open(io.BytesIO(bytes(d.numpy()))).convert("RGB"))
                             ).permute(2, 0, 1) for d in data]


def test_nvjpeg_path_with_a_stand_in_decoder_equals_the_cpu_path(folder, monkeypatch):
    from vitgraph.data.imagefolder import list_classes, read_split_native
    cpu, _ = build_datasets(folder_cfg(folder), seed=0, native=True)
    classes = list_classes(str(folder / "train"))
    enc = read_split_native(str(folder), "train", classes, workers=2, decode="cuda")
    s = spec(tokens=600, max_images=8, max_patches=48)
    crops = crop_boxes(aug(crop_scale_min=0.4), 1, [0] * 6, range(6))
    for boxes in (None, crops):
        want = pack_fields(cpu, s, list(range(6)), boxes)
        got = pack_fields(enc, s, list(range(6)), boxes)
        pack = got[0]
        assert isinstance(pack, EncodedPack) and len(pack) == 6
        assert [t.dim() for t in pack.data] == [3, 1, 3, 1, 3, 1]  # PNGs decoded here
        assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
        rows = finish_pack_on_device(pack, "cpu", decoder=_pil_decoder)
        assert rows.shape == want[0].shape and rows.dtype == torch.uint8
        diff = (rows.float() - want[0].float()).abs()
        assert diff.max() <= 3 and diff.mean() < 0.2
    # pack_inputs finishes an encoded pack itself (nvJPEG stood in for)
    from vitgraph.data import decode
    monkeypatch.setattr(decode, "_nvjpeg", lambda data, device: _pil_decoder(data))
    x = pack_inputs(got, "cpu")
    ref = pack_inputs(want, "cpu")
    assert (x[0] - ref[0]).abs().max() <= 3 / 127.5 + 1e-6


def test_webdataset_native_sizes_and_pixels_match_the_folder(folder, tmp_path):
    import importlib.util
    from conftest import ROOT
    spec_ = importlib.util.spec_from_file_location("make_shards",
                                                   ROOT / "scripts" / "make_shards.py")
    make_shards = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(make_shards)  # in this process: no interpreter start-up
    out = tmp_path / "shards"
    make_shards.main([str(folder), str(out), "--shard-size", "3"])
    cache = tmp_path / "cache"
    cfg = folder_cfg(out, kind="webdataset", cache_dir=str(cache))
    train, val = build_datasets(cfg, seed=0, native=True)
    assert train.images.shuffle_shards == 4
    assert train.images.shard_ids.tolist() == [0, 0, 0, 1, 1, 1]
    ref_train, ref_val = build_datasets(folder_cfg(folder), seed=0, native=True)
    assert (val.sizes == ref_val.sizes).all() and torch.equal(val.labels, ref_val.labels)
    # PNGs are re-encoded as JPEG in the shards: the same sizes, pixels close
    assert sorted(map(tuple, train.sizes.tolist())) == sorted(map(tuple, ref_train.sizes.tolist()))
    s = spec(tokens=600, max_images=8, max_patches=48)
    a, b = pack_fields(val, s, [0, 1]), pack_fields(ref_val, s, [0, 1])
    assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
    cu = a[3]
    jpeg = slice(int(cu[1]) + 1, int(cu[2]))  # the val JPEG: the same bytes, the same pixels
    assert torch.equal(a[0][jpeg], b[0][jpeg])
    assert (a[0].float() - b[0].float()).abs().mean() < 2
    assert len(list(cache.glob("shard_sizes_*.npy"))) == 2
    again, _ = build_datasets(cfg, seed=0, native=True)  # from the cache
    assert (again.sizes == train.sizes).all()
    ld = PackedLoader(train, s, 2, 0, 1, seed=0)
    assert sorted(i for f in ld.next_step() for i in ids(f)) != []
    # data.packing.layout=auto's sample: index.json's offsets (headers read there), else the
    # sizes cache, else none (it would take every tar header)
    got = native_size_sample(cfg, 0)
    assert (got == train.sizes).all()
    (out / "index.json").unlink()
    assert (native_size_sample(cfg, 0) == got).all()
    with pytest.raises(DataError, match="no index.json and no cached sizes"):
        native_size_sample(folder_cfg(out, kind="webdataset", cache_dir=None), 0)


# ---------------------------------------------------------------- on the device

def exact_pack(seed=0, grids=((3, 5), (4, 4), (2, 6)), s=None):
    """Images whose sizes are their grids' (no resize), and their pack."""
    s = s or spec(tokens=128, max_images=4)
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (gh * P, gw * P, 3), dtype=np.uint8) for gh, gw in grids]
    sizes = [im.shape[:2] for im in images]
    pixels = torch.from_numpy(np.concatenate([im.reshape(-1) for im in images]))
    ds = NativeDataset(ArrayImages(pixels, sizes), torch.arange(len(images)), ["x"] * len(images))
    return ds, images, s, pack_fields(ds, s, list(range(len(images))))


def test_pack_inputs_normalise_as_the_fixed_path():
    ds, images, s, fields = exact_pack()
    x, coords, seg, cu, labels = pack_inputs(fields, "cpu")
    assert x.dtype == torch.float32 and x.shape == (128, 3 * P * P)
    assert coords.dtype == seg.dtype == labels.dtype == torch.int64 and cu.dtype == torch.int32
    real = (coords[:, 0] >= 0) & (seg < s.max_images)
    assert torch.allclose(x[real], (fields[0][real].float() / 255 - 0.5) / 0.5)
    assert (x[~real] == 0).all()


def test_flip_is_the_pack_of_the_flipped_image():
    ds, images, s, fields = exact_pack()
    flipped, _, _, ref = exact_pack()
    flipped.images.pixels.copy_(torch.from_numpy(np.concatenate(
        [np.ascontiguousarray(im[:, ::-1]).reshape(-1) for im in images])))
    ref = pack_fields(flipped, s, [0, 1, 2])
    cfg = aug(flip=1.0, auto="none")
    got = pack_inputs(fields, "cpu", cfg, key=(0, 0))[0]
    assert torch.equal(got, pack_inputs(ref, "cpu")[0])
    none = pack_inputs(fields, "cpu", dataclasses.replace(cfg, flip=0.0), key=(0, 0))[0]
    assert torch.equal(none, pack_inputs(fields, "cpu")[0])


def _unpatchify(rows, gh, gw):
    return rows.view(gh, gw, 3, P, P).permute(2, 0, 3, 1, 4).reshape(1, 3, gh * P, gw * P)


@pytest.mark.parametrize("name", [o for o in OPS if o != "identity"])
def test_colour_ops_act_per_image_as_on_the_whole_image(name):
    ds, images, s, fields = exact_pack(seed=3)
    patches, coords, seg, cu, _ = fields
    x = (patches.float() / 255).view(128, 3, P * P)
    real = (coords[:, 0] >= 0) & (seg < s.max_images)
    mag = torch.tensor([0.9, 0.3, 0.6, 0.0, 0.0])[seg].view(-1, 1, 1)
    sign = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0])[seg].view(-1, 1, 1)
    y = pack_colour(name, x, mag, sign, seg, real, cu, s.max_images).reshape(128, -1)
    for k, (gh, gw) in enumerate(((3, 5), (4, 4), (2, 6))):
        a = int(cu[k]) + 1
        rows = y[a:a + gh * gw]
        img = torch.from_numpy(images[k]).permute(2, 0, 1)[None].float() / 255
        want = _colour(name, img, mag[a].view(1, 1, 1, 1), sign[a].view(1, 1, 1, 1))
        assert torch.allclose(_unpatchify(rows, gh, gw), want, atol=1e-5), (name, k)


def test_augmentation_is_deterministic_for_a_key_and_per_image():
    ds, s = toy(40), spec()
    fields = PackedLoader(ds, s, 1, 0, 1, seed=0).next_step()[0]
    cfg = aug(op_prob=1.0)
    x1 = pack_inputs(fields, "cpu", cfg, key=(3, 0), seed=7)[0]
    assert torch.equal(x1, pack_inputs(fields, "cpu", cfg, key=(3, 0), seed=7)[0])
    for other in (dict(key=(4, 0), seed=7), dict(key=(3, 1), seed=7), dict(key=(3, 0), seed=8),
                  dict(key=(3, 0), seed=7, dp_rank=1)):
        assert not torch.equal(x1, pack_inputs(fields, "cpu", cfg, **other)[0]), other
    plain = pack_inputs(fields, "cpu")[0]
    assert torch.equal(pack_inputs(fields, "cpu", cfg, key=None)[0], plain)  # eval
    assert torch.equal(pack_inputs(fields, "cpu", aug(enabled=False), key=(3, 0))[0], plain)
    seg, n = fields[2], len(ids(fields))
    changed = {int(seg[t]) for t in torch.nonzero((x1 - plain).abs().amax(1) > 1e-6)[:, 0]}
    assert 0 < len(changed) <= n  # some images changed, padding never
    assert torch.isfinite(x1).all() and x1.abs().max() <= 1 + 1e-6


def test_crop_boxes_are_per_image_and_resumable():
    cfg = aug(crop_scale_min=0.25, crop_scale_max=0.5)
    a = crop_boxes(cfg, 1, [0, 0, 1], [5, 6, 5])
    assert a == crop_boxes(cfg, 1, [0, 0, 1], [5, 6, 5])
    assert a[0] == crop_boxes(cfg, 1, [0], [5])[0]  # its own, wherever it is drawn
    assert len({*a}) == 3 and a[0] != crop_boxes(cfg, 2, [0], [5])[0]
    for y0, x0, y1, x1 in a:
        assert 0 <= y0 < y1 <= 1 and 0 <= x0 < x1 <= 1
        assert 0.25 - 1e-9 <= (y1 - y0) * (x1 - x0) <= 0.5 + 1e-9
    assert crop_box(None, 10, 20) == (0, 0, 10, 20)
    assert crop_box((0.0, 0.5, 0.01, 0.51), 10, 20) == (0, 10, 1, 11)


def test_packs_through_the_prefetcher_on_cpu_with_the_tasks_host_fields():
    """The loader's packs, and after each the fields the task makes from its CPU fields
    (the caption task's language-model layout), made in the prefetcher's thread."""
    import threading
    from vitgraph.data.prefetch import Prefetcher
    ds, s = toy(40), spec()
    want = PackedLoader(ds, s, 2, 0, 1, seed=0)
    threads = set()

    def host_fields(mb):
        threads.add(threading.current_thread().name)
        return (mb[2] * 2, mb[4].sum())

    pre = Prefetcher(PackedLoader(ds, s, 2, 0, 1, seed=0), "cpu", host_fields)
    try:
        for _ in range(3):
            got, packs = pre.next_step(), want.next_step()
            assert same([mb[:-2] for mb in got], packs)
            for mb, pack in zip(got, packs):
                assert torch.equal(mb[-2], pack[2] * 2) and torch.equal(mb[-1], pack[4].sum())
            assert pre.state_dict() == want.state_dict()
    finally:
        pre.close()
    assert threads == {"vitgraph-prefetch_0"}


def test_pack_spec_from_the_packing_keys():
    keys = types.SimpleNamespace(tokens_per_microbatch=4096, max_images=64, max_patches=256,
                                 min_patches=2)
    s = pack_spec(keys, patch_size=16, num_prefix=2)
    assert (s.tokens, s.max_images, s.max_patches, s.min_patches) == (4096, 64, 256, 2)
    assert (s.patch_size, s.num_prefix, s.max_len) == (16, 2, 258) and not s.padded
    # padded: the slots of max_len the budget holds (max_images at most), for FP8 rounded
    # down to a multiple of 16 tokens
    s = pack_spec(keys, 16, 2, padded=True)
    assert (s.tokens, s.max_images, s.padded) == (15 * 258, 15, True)
    assert pack_spec(keys, 16, 2, padded=True, multiple=16).max_images == 8
    few = types.SimpleNamespace(**{**vars(keys), "max_images": 4})
    assert pack_spec(few, 16, 2, padded=True).max_images == 4
    with pytest.raises(ValueError, match="FP8"):
        pack_spec(few, 16, 2, padded=True, multiple=16)
    with pytest.raises(ValueError, match="parallel.tp=4"):
        pack_spec(keys, 16, 2, padded=True, split=4)


def test_augmentation_leaves_prefix_and_padding_alone():
    ds, images, s, fields = exact_pack()
    patches, coords, seg, cu, labels = fields
    a = PackAugment(aug(flip=1.0, op_prob=1.0, num_ops=3, erase_prob=1.0))
    y = a.apply(patches, coords.long(), seg.long(), cu, a.draw(s.max_images, (0, 0)))
    real = (coords[:, 0] >= 0) & (seg < s.max_images)
    assert (y[~real] == 0).all() and torch.isfinite(y).all()


# ---------------------------------------------------------------- inside the step

def old_pack_augment(x, coords, seg, cu, slots, cfg, rng):
    """The prepare-time code ``PackAugment`` replaced (host draws, host branches: an op no
    image drew was skipped, erasing was not applied at native resolution): the reference of
    the same images. x [T, 3 p^2] in [0, 1] -> normalised rows."""
    from vitgraph.data.augment import draw_ops
    from vitgraph.data.loader import MEAN, STD
    t, p = x.shape[0], int(round((x.shape[1] // 3) ** 0.5))
    flip = rng.uniform(0, 1, slots) < cfg.flip
    ops, mag = draw_ops(cfg, rng, slots, OPS)
    per = lambda v, dt: torch.as_tensor(np.append(v, 0), dtype=dt)[seg]  # noqa: E731
    real = (coords[:, 0] >= 0) & (seg < slots)
    if flip.any():
        f = per(flip, torch.bool) & real
        col, gw = coords[:, 1], coords[:, 3]
        x = x[torch.arange(t) + torch.where(f, gw - 1 - 2 * col, torch.zeros_like(col))]
        x = torch.where(f.view(-1, 1), x.view(t, 3, p, p).flip(-1).reshape(t, -1), x)
    x = x.view(t, 3, p * p)
    for slot in range(ops.shape[1]):
        for k, name in enumerate(OPS):
            chosen = ops[:, slot] == k
            if name == "identity" or not chosen.any():
                continue
            sel = per(chosen, torch.bool) & real
            m = per(np.abs(mag[:, slot]), x.dtype).view(-1, 1, 1)
            sg = per(np.sign(mag[:, slot]), x.dtype).view(-1, 1, 1)
            x = torch.where(sel.view(-1, 1, 1),
                            pack_colour(name, x, m, sg, seg, real, cu, slots), x)
    x = (x - torch.tensor(MEAN).view(1, 3, 1)) / torch.tensor(STD).view(1, 3, 1)
    return torch.where(real.view(-1, 1, 1), x, torch.zeros(())).view(t, -1)


PACK_CASES = {
    "light": dict(preset="light"),
    "flip+randaugment": dict(flip=0.5, op_prob=0.7, num_ops=3),
    "trivialaugment+jitter": dict(flip=0.5, auto="trivialaugment", color_jitter=0.4),
    "randaugment-every-op": dict(op_prob=1.0, num_ops=2, magnitude_std=0.0),
}


@pytest.mark.parametrize("case", list(PACK_CASES))
def test_in_step_augmentation_gives_the_prepare_time_images(case):
    """The classifier's in-step path (``prepare_pack`` hands over uint8 rows and the drawn
    ``PackParams``, ``PackAugment.apply`` runs in the task's forward) gives bit for bit
    (torch.equal) the images of the prepare-time code it replaced, for the same seed and key:
    flip, RandAugment / TrivialAugment's colour ops and colour jitter are the same draws from
    the same generator through the same per-op functions. Two things differ from that code:
    random erasing, which it did not apply at native resolution (so it is compared with
    data.augment.erase_prob=0, and on its own below), and nothing else; the random-resized
    crop is not in this path (the resize makes it, ``crop_boxes``, as before)."""
    from vitgraph.data.augment import _rng
    from vitgraph.data.native import PackParams
    from vitgraph.tasks.classification import prepare_pack
    ds, s = toy(60), spec()
    loader = PackedLoader(ds, s, 2, 0, 1, seed=0)
    packs = loader.next_step() + loader.next_step()
    cfg = aug(**PACK_CASES[case])
    a = PackAugment(cfg, seed=7, rank=1)
    for j, fields in enumerate(packs):
        for key in ((j // 2, j % 2), (5, 1)):
            staged = prepare_pack(fields, key, "cpu", True, None, None, a)
            assert staged[0].dtype == torch.uint8 and len(staged) == 10
            got = a.apply(*staged[:4], PackParams(*staged[5:]))
            assert torch.equal(got, pack_inputs(fields, "cpu", cfg, key, seed=7, dp_rank=1)[0])
            old = old_pack_augment(fields[0].float() / 255, fields[1], fields[2], fields[3],
                                   s.max_images, cfg, _rng(7, (1, *key), 5))
            assert torch.equal(got, old), (case, j, key)


def test_pack_erasing_is_a_rectangle_of_noise_in_each_image():
    """data.augment.erase_prob at native resolution: per image timm's rectangle (2-33% of its
    area) at the image's own size, wherever its patches lie in the pack, filled with normal
    noise; every other pixel is the unerased image's."""
    grids = ((3, 5), (4, 4), (2, 6))
    ds, images, s, fields = exact_pack(seed=2, grids=grids)
    erased = PackAugment(aug(erase_prob=1.0, auto="none"), seed=1)
    plain = PackAugment(aug(auto="none"), seed=1)
    rows = [t.long() if t.dtype != torch.int32 else t for t in fields[:4]]
    for key in ((0, 0), (1, 0), (2, 1)):
        y = erased.apply(*rows, erased.draw(s.max_images, key))
        ref = plain.apply(*rows, plain.draw(s.max_images, key))
        assert torch.isfinite(y).all() and y.abs().max() < 4.8
        for k, (gh, gw) in enumerate(grids):
            a = int(fields[3][k]) + 1
            diff = (_unpatchify(y[a:a + gh * gw], gh, gw)
                    != _unpatchify(ref[a:a + gh * gw], gh, gw))[0].any(0)
            ys, xs = torch.nonzero(diff, as_tuple=True)
            assert len(ys), (key, k)  # erase_prob 1: every image (a rectangle always fits)
            box = diff[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
            assert box.all(), (key, k)  # one filled rectangle
            # 2-33% of the area, its sides rounded to whole pixels
            assert 0.01 <= box.numel() / diff.numel() <= 0.4, (key, k, box.shape)


def test_pack_augmentations_shapes_and_kernels_do_not_depend_on_the_draws():
    """The drawn tensors' shapes follow the config and max_images only, and so do the
    kernels: a flip, an op or an erasing nobody drew runs the same kernels on the same shapes
    (a step graph replays one recording for any draw)."""
    ds, images, s, fields = exact_pack()
    rows = [t.long() if t.dtype != torch.int32 else t for t in fields[:4]]
    a = PackAugment(aug(flip=0.5, op_prob=0.5, num_ops=2, color_jitter=0.3, erase_prob=0.5))
    shapes = {tuple((tuple(t.shape), t.dtype) for t in a.draw(4, (k, 0))) for k in range(20)}
    assert len(shapes) == 1
    p = a.draw(4, (0, 0))
    none = p._replace(flip=torch.zeros_like(p.flip), ops=torch.full_like(p.ops, -1),
                      erase=torch.zeros_like(p.erase))
    kernels = []
    for params in (p, none):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            a.apply(*rows, params)
        kernels.append([(e.name, str(e.input_shapes)) for e in prof.events()
                        if e.name.startswith("aten::")])
    assert kernels[0] == kernels[1]
    assert torch.equal(a.apply(*rows, none), pack_inputs(fields, "cpu")[0])
