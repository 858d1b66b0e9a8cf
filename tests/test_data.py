"""Data: the shapes generator, ImageFolder, the microbatch loader and the batch transform."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vitgraph.data import (DataConfig, DataError, ImageDataset, MicrobatchLoader,
                           build_datasets, iterate_eval, to_model_input)
from vitgraph.data import shapes
from conftest import ROOT


def shapes_cfg(**kw):
    base = dict(kind="shapes", path=None, num_train=256, num_val=128, render_size=32,
                num_classes=10, cache_dir=None, workers=1, seed=None)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def small():
    return build_datasets(shapes_cfg(num_train=1200, num_val=300), seed=0)


# ---------------------------------------------------------------- shapes


def test_shapes_basic(small):
    train, val = small
    assert len(shapes.CLASSES) >= 10
    for ds, n in ((train, 1200), (val, 300)):
        assert isinstance(ds, ImageDataset)
        assert ds.images.dtype == torch.uint8 and ds.images.shape == (n, 32, 32, 3)
        assert ds.labels.dtype == torch.int64 and ds.labels.shape == (n,)
        assert ds.classes == shapes.CLASSES[:10]
        assert int(ds.labels.min()) == 0 and int(ds.labels.max()) == 9
        assert torch.bincount(ds.labels, minlength=10).min() >= n // 10  # balanced
        assert len(ds.captions) == n
        for cap, label in zip(ds.captions, ds.labels.tolist()):
            assert f" {ds.classes[label]} on a " in cap
    # images are not trivially constant
    assert train.images.float().std() > 30


def test_short_captions_keep_size_colour_and_shape(small):
    train, _ = small
    short, _ = build_datasets(shapes_cfg(num_train=1200, num_val=300, captions="short"), seed=0)
    assert torch.equal(short.images, train.images)
    for full, cap, label in zip(train.captions, short.captions, train.labels.tolist()):
        assert full.startswith(cap + " on a ") and cap.endswith(" " + train.classes[label])
        assert len(cap.split()) >= 4  # a <size> <colour...> <shape>


def test_shape_first_captions_name_the_shape_then_size_and_colour(small):
    train, val = small
    first, first_val = build_datasets(shapes_cfg(num_train=1200, num_val=300,
                                                 captions="shape_first"), seed=0)
    assert torch.equal(first.images, train.images)
    for plain, ds in ((train, first), (val, first_val)):
        for full, cap, label in zip(plain.captions, ds.captions, plain.labels.tolist()):
            size_colour = " ".join(full.split(" on a ")[0].split()[1:-1])
            assert cap == f"{plain.classes[label]}, {size_colour}", (full, cap)
    assert shapes.shape_first_caption(
        "a large dark blue L-shape on a white background, upright") == "L-shape, large dark blue"


def test_caption_dropout_variants_only_for_training(small):
    """data.caption_dropout: each training caption carries its variants without size and/or
    colour (bitmask order); the held-out split has none and keeps its captions as written."""
    _, val_plain = build_datasets(shapes_cfg(num_train=1200, num_val=300, captions="short"),
                                  seed=0)
    train, val = build_datasets(shapes_cfg(num_train=1200, num_val=300, captions="short",
                                           caption_dropout=0.5), seed=0)
    assert val.caption_variants is None and val.captions == val_plain.captions
    assert len(train.caption_variants) == len(train)
    for cap, var, label in zip(train.captions, train.caption_variants, train.labels.tolist()):
        name = train.classes[label]
        size, colour = cap.split()[1], " ".join(cap.split()[2:-1])
        assert var == (cap, f"a {colour} {name}", f"a {size} {name}", f"a {name}"), var
    assert shapes.caption_variants("a large dark blue L-shape on a white background, upright") == (
        "a large dark blue L-shape on a white background, upright",
        "a dark blue L-shape on a white background, upright",
        "a large L-shape on a white background, upright",
        "a L-shape on a white background, upright")
    with pytest.raises(ValueError, match="not a shapes caption"):
        shapes.caption_variants("a photo of a star")


def test_shapes_deterministic_and_worker_independent():
    # CHUNK-sized pieces are seeded separately; 1200 images = 3 chunks across 2 workers
    a = shapes.generate(1200, split_seed=7, workers=1)
    b = shapes.generate(1200, split_seed=7, workers=2)
    assert a[0].tobytes() == b[0].tobytes()
    assert np.array_equal(a[1], b[1]) and a[2] == b[2]
    c = shapes.generate(1200, split_seed=8, workers=1)
    assert a[0].tobytes() != c[0].tobytes()


def test_shapes_splits_differ_and_seed_matters(small):
    train, val = small
    assert shapes.split_seed(0, "train") != shapes.split_seed(0, "val")
    # no held-out image equals a training image
    train_set = {bytes(x) for x in train.images.numpy().reshape(len(train), -1)}
    assert not any(bytes(x) in train_set for x in val.images.numpy().reshape(len(val), -1))
    again, _ = build_datasets(shapes_cfg(num_train=1200, num_val=300), seed=0)
    assert torch.equal(again.images, train.images) and again.captions == train.captions
    other, _ = build_datasets(shapes_cfg(num_train=1200, num_val=300), seed=1)
    assert not torch.equal(other.images, train.images)


def test_num_classes_subset_and_limit():
    tr, _ = build_datasets(shapes_cfg(num_classes=4, num_train=64, num_val=16), seed=0)
    assert tr.classes == shapes.CLASSES[:4] and int(tr.labels.max()) == 3
    with pytest.raises(DataError):
        build_datasets(shapes_cfg(num_classes=len(shapes.CLASSES) + 1), seed=0)


def _nearest_centroid_acc(x_tr, y_tr, x_te, y_te, k):
    cent = torch.stack([x_tr[y_tr == c].mean(0) for c in range(k)])
    return (torch.cdist(x_te, cent).argmin(1) == y_te).float().mean().item()


def test_colour_does_not_decide_the_class(small):
    """Colour statistics alone stay near chance, while a colour-free shape statistic does not.

    A nearest-centroid classifier on a 4x4x4 colour histogram plus the mean colour must stay
    near 10% held-out. Control: the same classifier on a radial profile of the foreground
    (pixels far from the corner colour; distances from its centroid, divided by sqrt(area):
    blind to colour, position, size and rotation) must do far better, so the images do
    carry the class, in the shape.
    """
    train, val = small

    def colour_feats(ds):
        q = (ds.images.long() // 64).view(len(ds), -1, 3)
        idx = q[..., 0] * 16 + q[..., 1] * 4 + q[..., 2]
        hist = torch.zeros(len(ds), 64).scatter_add_(1, idx, torch.ones(idx.shape))
        mean = ds.images.float().mean((1, 2)) / 255
        return torch.cat([hist / idx.shape[1], mean], 1)

    def radial_feats(ds):
        x = ds.images.float()
        corners = torch.stack([x[:, 0, 0], x[:, 0, -1], x[:, -1, 0], x[:, -1, -1]], 1)
        dist = (x - corners.median(1).values[:, None, None]).norm(dim=-1)
        fg = (dist > 0.5 * dist.flatten(1).amax(1)[:, None, None]).float()
        yy, xx = torch.meshgrid(*[torch.arange(x.shape[1], dtype=torch.float)] * 2, indexing="ij")
        area = fg.sum((1, 2)).clamp_min(1)
        cy = (fg * yy).sum((1, 2)) / area
        cx = (fg * xx).sum((1, 2)) / area
        r = ((yy - cy[:, None, None]) ** 2 + (xx - cx[:, None, None]) ** 2).sqrt()
        bins = (r / area.sqrt()[:, None, None] * 6).long().clamp(max=7)
        hist = torch.zeros(len(ds), 8).scatter_add_(1, bins.flatten(1), fg.flatten(1))
        return hist / area[:, None]

    colour = _nearest_centroid_acc(colour_feats(train), train.labels, colour_feats(val),
                                   val.labels, 10)
    shape = _nearest_centroid_acc(radial_feats(train), train.labels, radial_feats(val),
                                  val.labels, 10)
    assert colour < 0.22, f"colour features predict the class: {colour:.0%}"
    assert shape > 0.6, f"a colour-free shape profile gets only {shape:.0%}"


def test_cache_round_trip(tmp_path):
    cfg = shapes_cfg(num_train=96, num_val=32, cache_dir=str(tmp_path / "cache"))
    tr1, va1 = build_datasets(cfg, seed=3)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 2 and all(f.endswith(".npz") for f in files)
    mtimes = [os.path.getmtime(tmp_path / "cache" / f) for f in files]
    tr2, va2 = build_datasets(cfg, seed=3)
    # read back, not rewritten
    assert [os.path.getmtime(tmp_path / "cache" / f) for f in files] == mtimes
    for a, b in ((tr1, tr2), (va1, va2)):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
        assert a.captions == b.captions and a.classes == b.classes
    uncached, _ = build_datasets(shapes_cfg(num_train=96, num_val=32), seed=3)
    assert torch.equal(uncached.images, tr1.images)
    # a truncated cache file is regenerated, not trusted
    for f in files:
        (tmp_path / "cache" / f).write_bytes(b"PK\x03\x04 truncated")
    tr3, _ = build_datasets(cfg, seed=3)
    assert torch.equal(tr3.images, tr1.images) and tr3.captions == tr1.captions
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".tmp")]
    # another parameter set gets another file
    build_datasets(shapes_cfg(num_train=64, num_val=32, cache_dir=str(tmp_path / "cache")), 3)
    assert len(os.listdir(tmp_path / "cache")) == 3


# ---------------------------------------------------------------- ImageFolder


def _write(path, size, colour, fmt):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, fmt)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "imgs"
    _write(root / "train" / "dog" / "a.png", (40, 20), (255, 0, 0), "PNG")
    _write(root / "train" / "dog" / "b.JPG", (20, 50), (0, 255, 0), "JPEG")
    _write(root / "train" / "cat" / "c.jpeg", (16, 16), (0, 0, 255), "JPEG")
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    _write(root / "val" / "cat" / "d.png", (64, 64), (10, 20, 30), "PNG")
    _write(root / "val" / "dog" / "e.png", (30, 30), (200, 200, 200), "PNG")
    return root


def folder_cfg(root, **kw):
    base = dict(kind="imagefolder", path=str(root), render_size=8, num_classes=2,
                cache_dir=None, workers=1, decode="cpu")
    base.update(kw)
    return DataConfig(**base)


def test_imagefolder(folder):
    train, val = build_datasets(folder_cfg(folder), seed=0)
    assert train.classes == ["cat", "dog"] and val.classes == ["cat", "dog"]
    assert train.images.shape == (3, 8, 8, 3) and train.images.dtype == torch.uint8
    assert train.labels.tolist() == [0, 1, 1]  # cat/c.jpeg, dog/a.png, dog/b.JPG
    assert train.captions is None
    assert train.images[1].view(-1, 3).float().mean(0).tolist() == pytest.approx([255, 0, 0], abs=1)
    assert val.labels.tolist() == [0, 1]
    assert val.images[0].view(-1, 3).float().mean(0).tolist() == pytest.approx([10, 20, 30], abs=1)


def test_imagefolder_center_crop(tmp_path):
    # 30x10: left third red, middle green, right blue -> shorter side 10 -> crop the middle
    img = np.zeros((10, 30, 3), np.uint8)
    img[:, :10, 0] = 255
    img[:, 10:20, 1] = 255
    img[:, 20:, 2] = 255
    for split in ("train", "val"):
        (tmp_path / split / "x").mkdir(parents=True)
        Image.fromarray(img).save(tmp_path / split / "x" / "i.png")
    train, _ = build_datasets(folder_cfg(tmp_path, render_size=10, num_classes=1), seed=0)
    assert train.images.shape == (1, 10, 10, 3)
    assert (train.images[0, :, :, 1] == 255).all() and (train.images[0, :, :, 0] == 0).all()


def test_imagefolder_workers_match(folder):
    for split in ("train", "val"):
        for i in range(300):  # more than one decode chunk
            _write(folder / split / "dog" / f"x{i:03d}.png", (12, 9), (i % 256, 7, 9), "PNG")
    a, _ = build_datasets(folder_cfg(folder, workers=1), seed=0)
    b, _ = build_datasets(folder_cfg(folder, workers=2), seed=0)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_imagefolder_without_preload_decodes_the_same_batches(folder):
    eager, eager_val = build_datasets(folder_cfg(folder), seed=0)
    lazy, lazy_val = build_datasets(folder_cfg(folder, preload=False, workers=2), seed=0)
    assert lazy.images.shape == eager.images.shape and len(lazy) == len(eager)
    assert torch.equal(lazy.labels, eager.labels)
    for index in (torch.tensor([2, 0]), slice(0, 3), slice(1, 1)):
        assert torch.equal(lazy.images[index], eager.images[index])
    a = MicrobatchLoader(eager, 1, 2, 0, 1, seed=3).next_step()
    b = MicrobatchLoader(lazy, 1, 2, 0, 1, seed=3).next_step()
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert [torch.equal(x, y) for (x, _), (y, _) in
            zip(iterate_eval(eager_val, 1), iterate_eval(lazy_val, 1))] == [True, True]


def test_imagefolder_without_preload_skips_a_corrupt_file_when_drawn(folder, caplog):
    """A corrupt file found when drawn is replaced by the next readable image of its class
    (the label stays right, batches keep their shape), counted and named in the log."""
    (folder / "train" / "cat" / "bad.png").write_bytes(b"not a png")
    (folder / "train" / "cat" / "d.png").write_bytes(b"")  # empty file
    train, _ = build_datasets(folder_cfg(folder, preload=False), seed=0)  # no decoding yet
    assert train.labels.tolist() == [0, 0, 0, 1, 1]  # cat: bad.png c.jpeg d.png; dog: a, b
    with caplog.at_level("WARNING", logger="vitgraph"):
        images = train.images[torch.arange(len(train))]
    assert images.shape == (5, 8, 8, 3)
    cat = train.images[torch.tensor([1])][0]
    assert torch.equal(images[0], cat) and torch.equal(images[2], cat)  # both replaced by c.jpeg
    assert sorted(os.path.basename(train.images.paths[i]) for i in train.images.unreadable) == [
        "bad.png", "d.png"]
    assert "bad.png" in caplog.text and "d.png" in caplog.text
    for f in ("c.jpeg",):  # a class with nothing readable left is an error naming a file
        (folder / "train" / "cat" / f).write_bytes(b"junk")
    train, _ = build_datasets(folder_cfg(folder, preload=False), seed=0)
    with pytest.raises(DataError, match="no readable image"):
        train.images[torch.tensor([0])]


def test_imagefolder_skips_corrupt_images_and_ignores_other_files(folder, caplog):
    for name, data in (("bad.png", b"\x89PNG\r\n\x1a\n this is not a png"), ("empty.jpg", b""),
                       ("cut.png", None)):
        path = folder / "train" / "dog" / name
        if data is None:  # a real PNG cut in half
            _write(path, (30, 30), (1, 2, 3), "PNG")
            data = path.read_bytes()[:40]
        path.write_bytes(data)
    (folder / "train" / "dog" / "README.md").write_text("not an image")
    (folder / "train" / "dog" / ".hidden.png").write_bytes(b"junk")  # hidden: ignored
    with caplog.at_level("WARNING", logger="vitgraph"):
        train, val = build_datasets(folder_cfg(folder), seed=0)
    assert train.images.shape == (3, 8, 8, 3) and train.labels.tolist() == [0, 1, 1]
    assert "skipped 3 unreadable image(s) of 6" in caplog.text
    for name in ("bad.png", "empty.jpg", "cut.png"):
        assert name in caplog.text
    assert "README" not in caplog.text and ".hidden" not in caplog.text
    # a split where nothing decodes is an error naming a file
    for f in (folder / "val").rglob("*.png"):
        f.write_bytes(b"junk")
    with pytest.raises(DataError, match=r"no readable images in .*val.*\.png"):
        build_datasets(folder_cfg(folder), seed=0)


def test_imagefolder_names_the_first_five_unreadable_images_and_counts_the_rest(folder, caplog):
    bad = [f"bad{i}.png" for i in range(7)]
    for name in bad:
        (folder / "train" / "dog" / name).write_bytes(b"junk")
    with caplog.at_level("WARNING", logger="vitgraph"):
        build_datasets(folder_cfg(folder), seed=0)
    assert "skipped 7 unreadable image(s) of 10" in caplog.text
    assert [n for n in bad if n in caplog.text] == bad[:5] and caplog.text.rstrip().endswith("...")


def _pil_decoder(data):
    """nvJPEG's stand-in on the CPU: list of JPEG byte tensors -> list of uint8 [3, H, W]."""
    import io
    return [torch.from_numpy(np.array(Image.open(io.BytesIO(bytes(d.numpy()))).convert("RGB"))
                             ).permute(2, 0, 1) for d in data]


def _cuda_decode_folder(root, **kw):
    """The folder read as data.decode=cuda reads it, on a machine without CUDA."""
    from vitgraph.data.imagefolder import read_split
    from vitgraph.data.imagefolder import list_classes
    classes = list_classes(os.path.join(root, "train"))
    return read_split(str(root), "train", classes, 8, workers=2, preload=False, decode="cuda",
                      **kw)


def test_imagefolder_cuda_decode_hands_jpegs_over_encoded_and_decodes_the_rest_here(folder):
    """decode=cuda: JPEG files go to the device as bytes (nvJPEG), a PNG is decoded in the
    loader's threads at full size; finished on the device, they are the CPU path's pixels up
    to resampling, with the same labels and order."""
    from vitgraph.data.decode import EncodedImages, finish_on_device
    cpu, _ = build_datasets(folder_cfg(folder), seed=0)
    enc = _cuda_decode_folder(folder)
    batch = enc.images[torch.arange(3)]  # cat/c.jpeg, dog/a.png, dog/b.JPG
    assert isinstance(batch, EncodedImages) and batch.size == 8
    assert [t.dim() for t in batch.data] == [1, 3, 1]
    assert [os.path.basename(n) for n in batch.names] == ["c.jpeg", "a.png", "b.JPG"]
    got = finish_on_device(batch, "cpu", decoder=_pil_decoder)
    assert got.shape == cpu.images.shape and got.dtype == torch.uint8
    assert (got.float() - cpu.images.float()).abs().max() <= 2
    assert torch.equal(enc.labels, cpu.labels)
    # data.cpu_decode_share: the batch's last share decoded in the threads, the same pixels
    shared = _cuda_decode_folder(folder, cpu_share=0.34).images[torch.arange(3)]
    assert [t.dim() for t in shared.data] == [1, 3, 3] and shared.names == batch.names
    assert torch.equal(finish_on_device(shared, "cpu", decoder=_pil_decoder), got)


def test_a_steps_microbatches_are_finished_in_one_batch(folder):
    """finish_step_on_device (the prefetcher's staging): every microbatch's EncodedImages of a
    step decoded and resized in one call, each microbatch's images the ones finish_on_device
    gives it alone; the other fields untouched."""
    from vitgraph.data.decode import finish_on_device, finish_step_on_device
    for i in range(5):
        _write(folder / "train" / "dog" / f"x{i:02d}.jpg", (10, 12), (i * 40, 7, 9), "JPEG")
    enc = _cuda_decode_folder(folder)
    calls = []

    def decoder(data):
        calls.append(len(data))
        return _pil_decoder(data)
    step = [(enc.images[torch.tensor(idx)], enc.labels[torch.tensor(idx)])
            for idx in ([0, 1, 2], [3, 4, 5, 6], [7])]
    got = finish_step_on_device(step, "cpu", decoder)
    assert calls == [7]  # the step's JPEGs (a.png is decoded by the reader) in one batch
    for (images, labels), (out, same) in zip(step, got):
        assert same is labels
        assert torch.equal(out, finish_on_device(images, "cpu", decoder=_pil_decoder))


def test_imagefolder_cuda_decode_skips_unreadable_files_and_survives_a_damaged_jpeg(folder, caplog):
    """A file whose header is no image is found in the loader's threads and replaced by the
    next readable image of its class, as on the CPU path; a JPEG whose header reads but whose
    body nvJPEG and PIL cannot decode is named in the log and trained as a grey image."""
    from vitgraph.data.decode import finish_on_device
    (folder / "train" / "cat" / "bad.jpg").write_bytes(b"not a jpeg")
    noise = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    Image.fromarray(noise).save(folder / "train" / "dog" / "cut.jpg", "JPEG")
    whole = (folder / "train" / "dog" / "cut.jpg").read_bytes()
    cut = whole[:len(whole) * 2 // 3]  # the header reads; the entropy-coded body is cut
    (folder / "train" / "dog" / "cut.jpg").write_bytes(cut)
    enc = _cuda_decode_folder(folder)
    with caplog.at_level("WARNING", logger="vitgraph"):
        batch = enc.images[torch.arange(len(enc))]  # cat: bad, c; dog: a, b, cut
    assert [os.path.basename(n) for n in batch.names] == ["c.jpeg", "c.jpeg", "a.png", "b.JPG",
                                                           "cut.jpg"]
    assert "bad.jpg" in caplog.text

    def nvjpeg_like(data):  # fails on a damaged body, as nvJPEG does
        out = []
        for d in data:
            if len(d) == len(cut):
                raise RuntimeError("nvjpeg: bitstream error")
            out.append(_pil_decoder([d])[0])
        return out

    with caplog.at_level("WARNING", logger="vitgraph"):
        got = finish_on_device(batch, "cpu", decoder=nvjpeg_like)
    assert got.shape == (5, 8, 8, 3)
    assert (got[4] == 128).all() and "cut.jpg" in caplog.text
    cpu, _ = build_datasets(folder_cfg(folder, preload=False), seed=0)
    assert (got[:4].float() - cpu.images[torch.arange(4)].float()).abs().max() <= 2


def test_imagefolder_cuda_decode_resumes_at_the_same_files(folder):
    """The loader's position, saved and loaded, gives the same files next (decode=cuda)."""
    for i in range(12):
        _write(folder / "train" / "dog" / f"x{i:02d}.jpg", (10, 12), (i * 20, 7, 9), "JPEG")
    enc = _cuda_decode_folder(folder)

    def names(loader):
        return [os.path.basename(n) for mb in loader.next_step() for n in mb[0].names]

    a = MicrobatchLoader(enc, 2, 2, 0, 1, seed=5)
    names(a)
    state = a.state_dict()
    want = [names(a), names(a)]
    b = MicrobatchLoader(enc, 2, 2, 0, 1, seed=5)
    b.load_state_dict(state)
    assert [names(b), names(b)] == want


def test_imagefolder_decode_setting_is_resolved_and_checked(folder):
    from vitgraph.data.imagefolder import imagefolder_decode
    assert imagefolder_decode("auto", preload=True) == "cpu"  # preloaded
    assert imagefolder_decode("auto", preload=False) == (
        "cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DataError, match="needs data.preload=false"):
        build_datasets(folder_cfg(folder, decode="cuda"), seed=0)
    if not torch.cuda.is_available():
        with pytest.raises(DataError, match="needs a CUDA device"):
            build_datasets(folder_cfg(folder, decode="cuda", preload=False), seed=0)


PRELOAD_AFTER_HANDLERS = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from vitgraph.data import DataConfig, build_datasets
# what preemption installs before start-up: SIGTERM only sets a flag
signal.signal(signal.SIGTERM, lambda *a: None)
signal.signal(signal.SIGUSR1, lambda *a: None)
def no_fork(*a, **k):
    raise AssertionError("the ImageFolder reader forked a process")
os.fork = no_fork
cfg = DataConfig(kind="imagefolder", path={path!r}, render_size=8, workers=4,
                 preload=True, decode="auto", num_classes=2, cache_dir=None)
for _ in range(20):
    train, val = build_datasets(cfg, seed=0)
print("ok", len(train), len(val))
"""


def test_a_preloaded_imagefolder_with_workers_never_forks_and_never_hangs(tmp_path):
    """Forked pool workers inherited preemption's flag-only SIGTERM handler, so the pool's
    terminate() could not end them and start-up hung in Pool.__exit__ (a race). The reader
    forks nothing: 20 builds of a 600-image folder with 4 workers, under a time limit."""
    root = tmp_path / "imgs"
    for split, n in (("train", 300), ("val", 300)):
        for i in range(n):
            _write(root / split / ("a" if i % 2 else "b") / f"{i:03d}.png", (10, 10),
                   (i % 256, 0, 0), "PNG")
    script = PRELOAD_AFTER_HANDLERS.format(root=str(ROOT), path=str(root))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "300", "300"]


def test_imagefolder_errors(folder, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        build_datasets(folder_cfg(missing), seed=0)
    (folder / "train" / "bird").mkdir()
    with pytest.raises(DataError, match=re.escape(str(folder / "train" / "bird"))):
        build_datasets(folder_cfg(folder), seed=0)
    (folder / "train" / "bird").rmdir()

    (folder / "val" / "fish").mkdir()  # a class the train split does not have
    with pytest.raises(DataError, match=re.escape(str(folder / "val"))):
        build_datasets(folder_cfg(folder), seed=0)
    (folder / "val" / "fish").rmdir()

    (folder / "val" / "cat" / "d.png").unlink()  # an empty class folder
    with pytest.raises(DataError, match=re.escape(str(folder / "val" / "cat"))):
        build_datasets(folder_cfg(folder), seed=0)
    _write(folder / "val" / "cat" / "d.png", (64, 64), (10, 20, 30), "PNG")

    os.rename(folder / "val", folder / "valx")
    (folder / "val").mkdir()  # an empty split: no class folders
    with pytest.raises(DataError, match="no class folders in " + re.escape(str(folder / "val"))):
        build_datasets(folder_cfg(folder), seed=0)
    (folder / "val").rmdir()
    with pytest.raises(DataError, match=re.escape(str(folder / "val"))):
        build_datasets(folder_cfg(folder), seed=0)
    os.rename(folder / "train", folder / "trainx")
    with pytest.raises(DataError, match=re.escape(str(folder / "train"))):
        build_datasets(folder_cfg(folder), seed=0)
    with pytest.raises(DataError, match="data.path"):
        build_datasets(folder_cfg(folder, path=None), seed=0)
    with pytest.raises(DataError, match="lmdb"):
        build_datasets(shapes_cfg(kind="lmdb"), seed=0)


# ---------------------------------------------------------------- loader


def toy(n=100, hw=2):
    images = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    images = images.view(n, 1, 1, 1).expand(n, hw, hw, 3).contiguous()
    return ImageDataset(images, torch.arange(n), ["x"], None)


def ids(step):
    return torch.cat([labels for _, labels in step]).tolist()


def test_loader_shapes_and_epoch():
    ds = toy(100)
    ld = MicrobatchLoader(ds, micro_batch_size=4, num_microbatches=3, dp_rank=0, dp_size=2,
                          seed=0)
    assert ld.steps_per_epoch == 100 // 24
    step = ld.next_step()
    assert len(step) == 3
    for images, labels in step:
        assert images.shape == (4, 2, 2, 3) and images.dtype == torch.uint8
        assert labels.shape == (4,) and labels.dtype == torch.int64
        assert torch.equal(images[:, 0, 0, 0].long(), labels)  # images and labels stay paired


def test_loader_dp_union_matches_single_rank():
    ds = toy(200)
    single = MicrobatchLoader(ds, 4, 4, 0, 1, seed=5)   # global batch 16
    ranks = [MicrobatchLoader(ds, 4, 2, r, 2, seed=5) for r in range(2)]  # 4 x 2 x 2
    quad = [MicrobatchLoader(ds, 2, 2, r, 4, seed=5) for r in range(4)]  # 2 x 2 x 4
    for _ in range(single.steps_per_epoch + 3):  # across an epoch boundary
        ref = ids(single.next_step())
        assert sum((ids(ld.next_step()) for ld in ranks), []) == ref
        assert sum((ids(ld.next_step()) for ld in quad), []) == ref
        assert len(set(ref)) == 16


def test_loader_epoch_covers_and_reshuffles():
    ds = toy(64)
    ld = MicrobatchLoader(ds, 8, 2, 0, 1, seed=1)
    e0 = sum((ids(ld.next_step()) for _ in range(ld.steps_per_epoch)), [])
    assert ld.epoch == 0 and sorted(e0) == list(range(64))
    e1 = sum((ids(ld.next_step()) for _ in range(ld.steps_per_epoch)), [])
    assert ld.epoch == 1 and sorted(e1) == list(range(64)) and e1 != e0
    other = MicrobatchLoader(ds, 8, 2, 0, 1, seed=2)
    assert ids(other.next_step()) != e0[:16]
    plain = MicrobatchLoader(ds, 8, 2, 0, 1, seed=1, shuffle=False)
    assert ids(plain.next_step()) == list(range(16))


def test_loader_drop_last():
    ds = toy(50)
    dropped = MicrobatchLoader(ds, 4, 2, 0, 2, seed=0)  # G = 16
    assert dropped.steps_per_epoch == 3
    kept = [MicrobatchLoader(ds, 4, 2, r, 2, seed=0, drop_last=False) for r in range(2)]
    assert kept[0].steps_per_epoch == 4
    seen = []
    for _ in range(4):
        for ld in kept:
            step = ld.next_step()
            assert all(len(labels) == 4 for _, labels in step)  # shapes stay fixed
            seen += ids(step)
    assert set(seen) == set(range(50)) and kept[0].epoch == 0
    with pytest.raises(DataError):
        MicrobatchLoader(toy(10), 4, 2, 0, 2, seed=0)


def test_loader_resume():
    ds = toy(90)
    ld = MicrobatchLoader(ds, 4, 2, 1, 2, seed=9)  # 5 steps per epoch
    for _ in range(7):
        ld.next_step()
    sd = ld.state_dict()
    assert sd == {"epoch": 1, "step_in_epoch": 2, "seed": 9}
    expect = [ids(ld.next_step()) for _ in range(6)]
    fresh = MicrobatchLoader(ds, 4, 2, 1, 2, seed=9)
    fresh.load_state_dict(sd)
    assert [ids(fresh.next_step()) for _ in range(6)] == expect
    # at an epoch boundary too
    at_end = MicrobatchLoader(ds, 4, 2, 1, 2, seed=9)
    for _ in range(5):
        at_end.next_step()
    resumed = MicrobatchLoader(ds, 4, 2, 1, 2, seed=9)
    resumed.load_state_dict(at_end.state_dict())
    assert ids(resumed.next_step()) == ids(at_end.next_step())
    with pytest.raises(ValueError):
        MicrobatchLoader(ds, 4, 2, 1, 2, seed=10).load_state_dict(sd)


def test_prefetcher_hands_out_the_loaders_steps_and_checkpoints_what_it_handed_out():
    """Made ahead (one step staged, the next in a thread): the same steps in the same order,
    and the saved position is after the last step handed out: a resume repeats and skips
    nothing, across epochs too."""
    from vitgraph.data.prefetch import Prefetcher
    ds = toy(90)
    plain = MicrobatchLoader(ds, 4, 2, 1, 2, seed=9)  # 5 steps per epoch
    pre = Prefetcher(MicrobatchLoader(ds, 4, 2, 1, 2, seed=9), "cpu")
    try:
        for _ in range(7):
            want = plain.next_step()
            got = pre.next_step()
            pre.stage_next()  # as the trainer does while the step runs
            assert ids(got) == ids(want)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
        pre._next.result()
        assert pre.loader.state_dict()["step_in_epoch"] == 4  # two steps made ahead
        sd = pre.state_dict()
        assert sd == plain.state_dict() == {"epoch": 1, "step_in_epoch": 2, "seed": 9}
        assert pre.epoch == 1 and pre.steps_per_epoch == 5
        expect = [ids(plain.next_step()) for _ in range(6)]
        resumed = Prefetcher(MicrobatchLoader(ds, 4, 2, 1, 2, seed=9), "cpu")
        resumed.load_state_dict(sd)
        assert [ids(resumed.next_step()) for _ in range(6)] == expect
        resumed.close()
        # loading into a prefetcher that already ran ahead drops what it made
        pre.load_state_dict(sd)
        assert [ids(pre.next_step()) for _ in range(6)] == expect
    finally:
        pre.close()


def test_prefetcher_raises_a_data_error_at_the_step_that_meets_it_before_training_it():
    from vitgraph.data.prefetch import Prefetcher

    class Broken(MicrobatchLoader):
        def next_step(self):
            if self.step_in_epoch == 2:
                raise DataError("shard-000001.tar: truncated member at offset 512")
            return super().next_step()

    pre = Prefetcher(Broken(toy(90), 4, 2, 0, 1, seed=0), "cpu")
    try:
        pre.next_step()
        pre.next_step()
        pre.stage_next()  # as the trainer does during a step: the error waits
        with pytest.raises(DataError, match="truncated member"):
            pre.next_step()  # the step that met it is not handed out
        assert pre.state_dict()["step_in_epoch"] == 2  # a resume starts at the broken step
    finally:
        pre.close()


@pytest.mark.parametrize("n,batch,dp", [(100, 8, 1), (100, 8, 3), (7, 4, 4), (2, 5, 3)])
def test_iterate_eval_covers_once(n, batch, dp):
    ds = toy(n)
    seen = []
    for r in range(dp):
        batches = list(iterate_eval(ds, batch, r, dp))
        assert all(0 < len(labels) <= batch for _, labels in batches)
        assert all(len(labels) == batch for _, labels in batches[:-1])
        seen += [i for _, labels in batches for i in labels.tolist()]
    assert sorted(seen) == list(range(n))
    assert list(iterate_eval(ds, batch)) and ids(iterate_eval(ds, batch)) == list(range(n))


# ---------------------------------------------------------------- transform


def test_to_model_input():
    x = torch.randint(0, 256, (5, 32, 32, 3), dtype=torch.uint8)
    x[0] = 0
    x[1] = 255
    same = to_model_input(x, 32, "cpu", torch.float32)
    assert same.shape == (5, 3, 32, 32) and same.dtype == torch.float32
    assert same.min() >= -1 and same.max() <= 1
    assert (same[0] == -1).all() and (same[1] == 1).all()
    assert torch.allclose(same[2], x[2].permute(2, 0, 1).float() / 127.5 - 1)
    up = to_model_input(x, 64, "cpu", torch.bfloat16)
    assert up.shape == (5, 3, 64, 64) and up.dtype == torch.bfloat16
    assert (up[1] == 1).all() and (up[0] == -1).all()
    down = to_model_input(x, 16, "cpu", torch.float32)
    assert down.shape == (5, 3, 16, 16) and down.min() >= -1 - 1e-5 and down.max() <= 1 + 1e-5


# ---------------------------------------------------------------- WebDataset shards


def _shapes_folder(root, n_train=60, n_val=20, classes=3, size=24, fmt="JPEG"):
    train, val = build_datasets(shapes_cfg(num_train=n_train, num_val=n_val, num_classes=classes,
                                           render_size=size), seed=0)
    for split, ds in (("train", train), ("val", val)):
        for i, (img, lb) in enumerate(zip(ds.images.numpy(), ds.labels.tolist())):
            d = root / split / ds.classes[lb]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(d / f"{i:04d}.{'jpg' if fmt == 'JPEG' else 'png'}", fmt,
                                      **({"quality": 95} if fmt == "JPEG" else {}))
    return root


def _make_shards(src, out, *extra):
    import subprocess
    import sys
    from conftest import ROOT
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), str(src), str(out),
                    *extra], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wds")
    src = _shapes_folder(tmp / "folder")
    return src, _make_shards(src, tmp / "shards", "--shard-size", "16", "--captions")


def wds_cfg(root, **kw):
    return folder_cfg(root, kind="webdataset", render_size=24, **kw)


def test_webdataset_matches_the_imagefolder_and_the_webdataset_package(shards):
    src, out = shards
    assert sorted(p.name for p in out.glob("train-*.tar")) == [f"train-{i:06d}.tar" for i in range(4)]
    train, val = build_datasets(wds_cfg(out), seed=0)
    ref_train, ref_val = build_datasets(folder_cfg(src, render_size=24), seed=0)
    assert train.classes == ref_train.classes and len(train) == 60 and len(val) == 20
    # the same images (same bytes decoded the same way), in the shard order
    assert train.captions == [train.classes[i] for i in train.labels.tolist()]
    assert torch.equal(val.images[torch.arange(20)], ref_val.images)
    assert torch.equal(val.labels, ref_val.labels)
    assert sorted(map(bytes, train.images[:].numpy())) == sorted(map(bytes, ref_train.images.numpy()))
    # without index.json the tar headers give the same samples
    (out / "index.json").rename(out / "index.off")
    try:
        scanned, _ = build_datasets(wds_cfg(out), seed=0)
    finally:
        (out / "index.off").rename(out / "index.json")
    assert torch.equal(scanned.labels, train.labels) and scanned.captions == train.captions
    assert torch.equal(scanned.images[:], train.images[:])
    wds = pytest.importorskip("webdataset")  # the shards are plain WebDataset
    samples = list(wds.WebDataset(str(out / "train-000000.tar"), shardshuffle=False))
    assert [int(s["cls"]) for s in samples] == train.labels[:16].tolist()
    assert samples[0]["txt"].decode() == train.captions[0]


def test_webdataset_loader_splits_ranks_and_resumes_exactly(shards):
    _, out = shards
    train, _ = build_datasets(wds_cfg(out, workers=2), seed=0)
    assert train.images.shuffle_shards == 4
    train.images.shuffle_shards = 2  # windows of 2 of the 4 shards
    train.labels = torch.arange(len(train))  # sample ids, to follow every sample
    single = MicrobatchLoader(train, 4, 2, 0, 1, seed=1)  # global batch 8
    ranks = [MicrobatchLoader(train, 2, 2, r, 2, seed=1) for r in range(2)]
    epoch = []
    for _ in range(single.steps_per_epoch):
        ref = ids(single.next_step())
        assert sum((ids(ld.next_step()) for ld in ranks), []) == ref
        epoch += ref
    assert len(set(epoch)) == len(epoch) == 56  # 60 // 8 steps, nothing repeated
    # the first window's samples all come first: two shards, all of their samples
    shard_of = train.images.shard_ids
    perm = single._permutation()
    first = set(shard_of[perm[:12]].tolist())
    k = int(sum((shard_of == s).sum() for s in first))
    assert len(first) == 2 and set(shard_of[perm[:k]].tolist()) == first
    # resume mid-epoch and across the epoch boundary: the same samples, none repeated or skipped
    ld = MicrobatchLoader(train, 2, 2, 1, 2, seed=1)
    for _ in range(5):
        ld.next_step()
    sd = ld.state_dict()
    want = [(ids(s), s[0][0]) for s in (ld.next_step() for _ in range(6))]
    fresh = MicrobatchLoader(train, 2, 2, 1, 2, seed=1)
    fresh.load_state_dict(sd)
    got = [(ids(s), s[0][0]) for s in (fresh.next_step() for _ in range(6))]
    assert [w[0] for w in want] == [g[0] for g in got]
    assert all(torch.equal(w[1], g[1]) for w, g in zip(want, got))  # decoded pixels too


def test_webdataset_png_input_and_errors(tmp_path, monkeypatch):
    from vitgraph.data import class_count, native_size_sample
    src = _shapes_folder(tmp_path / "f", n_train=8, n_val=4, fmt="PNG")
    out = _make_shards(src, tmp_path / "s", "--shard-size", "5")
    train, val = build_datasets(wds_cfg(out), seed=0)
    assert train.images[torch.arange(8)].shape == (8, 24, 24, 3) and len(val) == 4
    with open(out / "train-000000.tar", "rb") as f:
        assert b"JFIF" in f.read(4096)  # re-encoded as JPEG for nvJPEG
    # data.path under ~, which the config's check expands: every reader expands it too
    # (and an ImageFolder reads the formats torchvision's does)
    first = sorted((src / "train").iterdir())[0]
    Image.new("RGB", (30, 20), (200, 10, 10)).save(first / "extra.webp")
    Image.new("RGB", (20, 30), (10, 200, 10)).save(first / "extra.bmp")
    monkeypatch.setenv("HOME", str(tmp_path))
    for cfg, n in ((wds_cfg("~/s"), 8), (folder_cfg("~/f", render_size=24), 10)):
        assert class_count(cfg) == len(train.classes)
        assert len(build_datasets(cfg, seed=0)[0]) == n
        assert len(native_size_sample(cfg, 0, 4)) == 4
    with pytest.raises(DataError, match="no such directory"):
        build_datasets(wds_cfg(tmp_path / "nope"), seed=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="train-"):
        build_datasets(wds_cfg(empty), seed=0)


def test_device_decode_path_with_a_stand_in_decoder(shards):
    """``data.decode=cuda`` hands microbatches over encoded; the device path (decode, resize,
    crop, stack) gives the CPU path's pixels up to resampling (nvJPEG itself is GPU-only)."""
    from vitgraph.data.decode import finish_on_device
    _, out = shards
    cpu, _ = build_datasets(wds_cfg(out), seed=0)
    enc, _ = build_datasets(wds_cfg(out, decode="cpu"), seed=0)
    enc.images.decode = "cuda"
    batch = enc.images[torch.tensor([3, 1, 7])]
    assert len(batch) == 3 and batch.size == 24

    def pil_decode(data):
        import io
        return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(d.numpy()))).convert("RGB"))
                                 ).permute(2, 0, 1) for d in data]

    got = finish_on_device(batch, "cpu", decoder=pil_decode)
    want = cpu.images[torch.tensor([3, 1, 7])]
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert (got.float() - want.float()).abs().mean() < 2  # same size: no resize, same pixels


def test_device_decode_resizes_each_size_as_one_batch_with_the_per_image_result():
    """Mixed sizes: images are resized (shorter side, bicubic, antialiased) and center-cropped
    in one batch per size, each as torch's antialiased interpolate would alone (the device
    path multiplies by per-axis weight matrices instead: a rare pixel rounds one level off)."""
    import torch.nn.functional as F
    from vitgraph.data.decode import EncodedImages, finish_on_device
    g = torch.Generator().manual_seed(0)
    sizes = [(40, 30), (30, 40), (40, 30), (16, 16), (30, 40), (12, 50), (375, 500), (375, 500)]
    raw = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    for s in (16, 224):  # down- and upscaling
        batch = EncodedImages([torch.zeros(1, dtype=torch.uint8)] * len(raw), s)
        got = finish_on_device(batch, "cpu", decoder=lambda data: raw)
        assert got.shape == (len(raw), s, s, 3) and got.dtype == torch.uint8
        for im, out in zip(raw, got):
            h, w = im.shape[-2:]
            nh, nw = max(s, round(h * s / min(h, w))), max(s, round(w * s / min(h, w)))
            if (nh, nw) != (h, w):
                im = F.interpolate(im[None].float(), size=(nh, nw), mode="bicubic",
                                   align_corners=False, antialias=True)[0].round().clamp(0, 255)
            top, left = (nh - s) // 2, (nw - s) // 2
            diff = (out.float() - im[:, top:top + s, left:left + s].permute(1, 2, 0).float()).abs()
            assert diff.max() <= 1 and (diff > 0).sum() <= max(2, 1e-3 * diff.numel()), (h, w, s)


def test_resize_matrix_rows_are_normalised_bicubic_weights():
    from vitgraph.data.decode import resize_matrix
    m = resize_matrix(500, 298, 37, 224)
    assert m.shape == (224, 500) and np.allclose(m.sum(1), 1, atol=1e-6)
    # a downscale by 500/298 spreads each output over about 4 x 1.68 inputs
    assert 6 <= (m != 0).sum(1).max() <= 8
    assert np.allclose(resize_matrix(64, 64, 0, 64), np.eye(64), atol=1e-6)  # same size: identity


def test_an_encoded_eval_batch_is_padded_and_cut_into_microbatches():
    """``data.decode=cuda`` eval batches stay encoded until the device: they are filled up and
    cut into microbatches like tensors (a run from shards failed here after its last step)."""
    from vitgraph.data.decode import EncodedImages
    from vitgraph.train.evaluate import split_padded
    enc = EncodedImages([torch.tensor([i], dtype=torch.uint8) for i in range(5)], 16)
    mbs = split_padded((enc, torch.arange(5)), 2, fill_label=-1)
    assert [len(im) for im, _ in mbs] == [3, 3]
    assert [int(d) for im, _ in mbs for d in im.data] == [0, 1, 2, 3, 4, 0]
    assert mbs[1][1].tolist() == [3, 4, -1] and mbs[0][0].size == 16


def test_cache_one_entry_per_dataset_whatever_the_run_seed_and_bounded(tmp_path):
    cache = tmp_path / "cache"
    cfg = shapes_cfg(num_train=64, num_val=32, cache_dir=str(cache), seed=0)
    a, _ = build_datasets(cfg, seed=1)
    b, _ = build_datasets(cfg, seed=2)  # another run seed, the same data and cache entries
    assert torch.equal(a.images, b.images) and len(os.listdir(cache)) == 2
    seed0 = set(os.listdir(cache))
    c, _ = build_datasets(shapes_cfg(num_train=64, num_val=32, cache_dir=str(cache), seed=5), 1)
    assert not torch.equal(a.images, c.images) and len(os.listdir(cache)) == 4
    seed5 = set(os.listdir(cache)) - seed0
    size = sum(os.path.getsize(cache / f) for f in seed0)  # one dataset: train + val
    for f in os.listdir(cache):
        os.utime(cache / f, (1, 1))  # long unused
    build_datasets(cfg, seed=3)  # a read makes seed 0's entries the most recently used
    # a cap of 2.5 datasets: writing a third evicts the least recently used (seed 5's)
    capped = shapes_cfg(num_train=64, num_val=32, cache_dir=str(cache), seed=6,
                        cache_max_mb=2.5 * size / 2**20)
    build_datasets(capped, seed=1)
    files = set(os.listdir(cache))
    assert seed0 <= files and not seed5 & files and len(files) == 4
    assert sum(os.path.getsize(cache / f) for f in files) <= 2.5 * size
    d, _ = build_datasets(shapes_cfg(num_train=64, num_val=32, cache_dir=str(cache), seed=0,
                                     cache_max_mb=1e-6), seed=1)  # read: kept, others go
    assert torch.equal(d.images, a.images)
    from vitgraph.data.shapes import prune_cache
    assert prune_cache(str(cache), 0) and os.listdir(cache) == []


def test_bench_data_runs_on_cpu(tmp_path, env):
    """With no shards given it makes its own (shapes JPEGs) under --tmp, and removes them."""
    import json
    import subprocess
    import sys
    from conftest import ROOT
    out = tmp_path / "bench.json"
    made = tmp_path / "made"
    made.mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_data.py"), "--images", "40",
                        "--jpeg-size", "64x48", "--tmp", str(made), "--batch", "8", "--steps", "2",
                        "--warmup", "1", "--image-size", "32", "--workers", "1", "--augment",
                        "--decode", "cpu", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "img/s (cpu decode" in p.stdout
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert row["images_per_s"] > 0 and row["shape"] == [8, 3, 32, 32] and row["decode"] == "cpu"
    prov = result["provenance"]
    assert prov["torch"] == torch.__version__ and "torchvision" in prov and "gpu" in prov
    assert len(prov["git_commit"]) == 40 and prov["shards"]["mean_jpeg_kb"] > 0
    assert os.listdir(made) == []  # the shards it made are gone


def test_shapes_imagefolder_holds_the_shapes_pixels(tmp_path):
    """scripts/shapes_imagefolder.py: the shapes data as PNG files, pixel for pixel, in class
    folders whose sorted order is the shapes label order."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "scripts"))
    from shapes_imagefolder import write_shapes_imagefolder
    counts = write_shapes_imagefolder(str(tmp_path / "f"), num_train=40, num_val=12, seed=3,
                                      workers=2, cache_dir=None)
    assert counts == {"train": 40, "val": 12}
    _, val = build_datasets(shapes_cfg(num_train=40, num_val=12, seed=3, cache_dir=None), seed=0)
    folder = build_datasets(DataConfig(kind="imagefolder", path=str(tmp_path / "f"),
                                       render_size=32, workers=1, decode="cpu"), seed=0)[1]
    assert sorted(folder.labels.tolist()) == sorted(val.labels.tolist())
    for path in (tmp_path / "f" / "val").rglob("*.png"):
        i = int(path.stem)
        assert path.parent.name.endswith(val.classes[int(val.labels[i])])
        assert np.array_equal(np.asarray(Image.open(path)), val.images[i].numpy())


def test_a_share_of_the_device_decode_done_by_the_loader_threads(shards):
    """data.cpu_decode_share: the last share of each microbatch is decoded in the loader's
    threads at full size, the rest left as JPEG bytes; the device resizes and crops all of them
    alike (here the CPU stands in for the device, and PIL for nvJPEG)."""
    import io
    from vitgraph.data.decode import finish_on_device
    from vitgraph.data.shards import read_shard_split

    def pil_decode(data):
        return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(d.numpy()))).convert("RGB"))
                                 ).permute(2, 0, 1) for d in data]

    _, out = shards
    idx = torch.tensor([3, 1, 7, 0])
    half = read_shard_split(str(out), "train", 24, 2, "cuda", cpu_share=0.5).images[idx]
    none = read_shard_split(str(out), "train", 24, 2, "cuda").images[idx]
    assert [t.dim() for t in half.data] == [1, 1, 3, 3] and [t.dim() for t in none.data] == [1] * 4
    assert all(t.dtype == torch.uint8 and t.shape[-1] == 3 and min(t.shape[:2]) >= 24
               for t in half.data[2:])
    got = finish_on_device(half, "cpu", decoder=pil_decode)
    assert torch.equal(got, finish_on_device(none, "cpu", decoder=pil_decode))
    cpu, _ = build_datasets(wds_cfg(out), seed=0)
    assert (got.float() - cpu.images[idx].float()).abs().mean() < 2
    parts = half.padded(1).split(3)  # an eval batch's fill and cut keep each image's form
    assert [[t.dim() for t in p.data] for p in parts] == [[1, 1, 3], [3, 1]]


@pytest.mark.parametrize("size_wh, mode, fmt", [((500, 375), "RGB", "JPEG"),  # full size
                                                ((1000, 800), "RGB", "JPEG"),  # reduced by 2
                                                ((500, 375), "L", "JPEG"),     # gray
                                                ((300, 260), "CMYK", "JPEG"),  # PIL's
                                                ((300, 260), "RGB", "PNG")])   # PIL's
def test_decode_full_gives_pil_draft_pixels_with_or_without_simplejpeg(size_wh, mode, fmt,
                                                                       monkeypatch):
    """The loader threads' decode (data.cpu_decode_share) goes through simplejpeg when it is
    installed (no GIL held); the pixels and the reduced DCT scale are PIL's either way."""
    import io
    from vitgraph.data import decode as shards
    rng = np.random.default_rng(0)
    w, h = size_wh
    pixels = (rng.integers(0, 6, (h, w, 3)) * 40 + rng.integers(0, 20, (h, w, 3))).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    data = buf.getvalue()
    fast = shards.decode_full(data, 224)
    monkeypatch.setattr(shards, "simplejpeg", None)
    pil = shards.decode_full(data, 224)
    assert fast.dtype == np.uint8 and fast.flags.writeable and fast.shape == pil.shape
    assert pil.shape[:2] == ((400, 500) if w == 1000 else (h, w))
    assert np.array_equal(fast, pil)


def test_cpu_decode_share_is_checked():
    from conftest import ROOT
    from vitgraph.config import ConfigError, load_config
    for over in (["data.cpu_decode_share=1.5"], ["data.cpu_decode_share=0.5"],
                 ["data.kind=webdataset", "data.path=/x", "data.decode=cpu",
                  "data.cpu_decode_share=0.5"],
                 ["data.kind=imagefolder", "data.path=/x", "data.preload=true",
                  "data.cpu_decode_share=0.5"]):
        with pytest.raises(ConfigError, match="data.cpu_decode_share"):
            load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", over)


def test_training_from_shards_with_augmentation(shards, tmp_path, capsys):
    import json
    from conftest import ROOT, tiny_overrides
    from vitgraph.cli import main
    _, out = shards
    over = tiny_overrides(tmp_path / "run", steps=6, **{
        "data.kind": "webdataset", "data.path": str(out), "data.render_size": 24,
        "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.eval_batch_size": 10,
        "data.augment.enabled": "true"})
    code = main(["train", str(ROOT / "configs" / "vit-tiny-shapes.yaml"), *over])
    assert code == 0, capsys.readouterr().err[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["step"] == 6 and metrics["eval_images"] == 20
    assert 0 < metrics["loss"] < 10
