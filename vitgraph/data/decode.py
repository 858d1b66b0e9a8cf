"""Image decoding, on the CPU and on the device.

CPU: ``load_image`` / ``decode_image`` give uint8 [s, s, 3] (shorter side resized to ``s``,
center-cropped), ``decode_full`` the image at full size (JPEGs through simplejpeg, without the
GIL, where it is installed). Device (``data.decode=cuda``): a reader hands over an
``EncodedImages`` microbatch (JPEG bytes, plus any image it had to decode itself at full size)
and ``finish_on_device`` decodes the JPEGs in one nvJPEG batch and resizes every image there
(the prefetcher hands it a whole step's microbatches at once: ``finish_step_on_device``).
At native resolution (vitgraph.data.native) the same pieces decode each image at its own
planned size: ``decode_native`` on the CPU, ``EncodedPack`` / ``finish_pack_on_device`` on the
device; ``read_size`` gives an image's size from its header before anything is decoded.
"""
from __future__ import annotations

import functools
import io
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

try:  # libjpeg-turbo without the GIL (see _turbo_decode)
    import simplejpeg
except ImportError:  # PIL decodes everything then
    simplejpeg = None

from vitgraph.data.dataset import DataError

log = logging.getLogger("vitgraph")


def resize_crop(im: Image.Image, size: int) -> np.ndarray:
    """An RGB image with its shorter side resized to ``size`` (bicubic), center-cropped:
    uint8 [size, size, 3]."""
    w, h = im.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    if (nw, nh) != (w, h):
        im = im.resize((nw, nh), Image.BICUBIC, reducing_gap=3.0)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)


def load_image(path: str, size: int) -> np.ndarray:
    """Decode to RGB, resize the shorter side to ``size``, center-crop: uint8 [size, size, 3]."""
    try:
        with Image.open(path) as im:
            return resize_crop(im.convert("RGB"), size)
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, bomb errors...
        raise DataError(f"cannot read image {path}: {e}") from None


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
    tensors, each 1-D (JPEG bytes) or [H, W, 3] at full size (an image the reader decoded
    itself: another format, a CMYK JPEG, or the ``data.cpu_decode_share`` of shards).
    ``names``: where each image came from, for the message when one cannot be decoded."""
    data: list
    size: int
    names: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.data)

    def _name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"image {i} of the batch"

    # the two tensor methods an eval batch is cut into microbatches with
    def split(self, m: int) -> list["EncodedImages"]:
        return [EncodedImages(self.data[i:i + m], self.size, self.names[i:i + m])
                for i in range(0, len(self.data), m)]

    def padded(self, n: int) -> "EncodedImages":
        """``n`` copies of the first image appended (the fill of a last, short batch)."""
        return EncodedImages(self.data + self.data[:1] * n, self.size,
                             self.names + self.names[:1] * n)


def cpu_decoded(share: float, n: int) -> int:
    """How many of a batch's ``n`` images the loader's threads decode themselves (the last
    ones) under ``data.cpu_decode_share`` = ``share``; nvJPEG takes the rest."""
    return round(share * n)


def for_device(data: bytes, size: int, where: str = "") -> torch.Tensor:
    """One image as ``EncodedImages`` holds it: a JPEG's bytes (nvJPEG decodes it on the
    device), anything else decoded here at full size (a file that is no image at all is a
    DataError naming it). Only the magic bytes are looked at: parsing the header with PIL is
    Python under the GIL, and at ~3,800 img/s (ViT-B/16 step graphs on an H200) the loader's
    threads then starved the training thread (0.58x the synthetic-input rate). A JPEG nvJPEG
    cannot take (CMYK, damaged) is decoded again by ``_decode_jpegs``."""
    if data[:3] == b"\xff\xd8\xff":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    # not pinned: pinning is a CUDA call, which from a loader thread could break a graph
    # capture on the training thread (global capture mode); finish_on_device copies it
    return torch.from_numpy(decode_full(data, size, where))


def _nvjpeg(data: list, device) -> list:
    from torchvision.io import ImageReadMode, decode_jpeg
    return decode_jpeg(data, device=device, mode=ImageReadMode.RGB)


def _decode_jpegs(batch: "EncodedImages", jpegs: list[int], device, decoder) -> list:
    """The JPEGs of ``batch`` (indices ``jpegs``) as uint8 [3, H, W] on ``device``: one nvJPEG
    batch; if that fails (a damaged file), one by one, and a file nvJPEG cannot decode goes
    to PIL; one PIL cannot decode either is logged by name and trained as a grey image (the
    reader saw JPEG magic bytes: a damaged file). A batch holding such a file pays the one-by-one
    decode each time it is drawn."""
    decode = decoder or (lambda d: _nvjpeg(d, device))
    data = [batch.data[i] for i in jpegs]
    try:
        return list(decode(data))
    except RuntimeError:
        pass
    out = []
    for i, d in zip(jpegs, data):
        try:
            out.append(decode([d])[0])
            continue
        except RuntimeError:
            pass
        try:
            full = decode_full(bytes(d.numpy()), batch.size, batch._name(i))
            out.append(torch.from_numpy(full).permute(2, 0, 1))
        except DataError as e:
            log.warning("data: %s; trained as a grey image", e)
            out.append(torch.full((3, batch.size, batch.size), 128, dtype=torch.uint8))
    return out


def resolve_decode(decode: str) -> str:
    if decode == "auto":
        return "cuda" if torch.cuda.is_available() and _nvjpeg_available() else "cpu"
    return decode


def _nvjpeg_available() -> bool:
    try:
        import torchvision.io  # noqa: F401  (nvJPEG decode)
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
        for i, im in zip(jpegs, _decode_jpegs(batch, jpegs, device, decoder)):
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


def finish_step_on_device(batches: list[tuple], device, decoder=None) -> list[tuple]:
    """A step's microbatches with every ``EncodedImages`` field finished on ``device`` in one
    ``finish_on_device`` call (one nvJPEG batch for the step, the resize batched over it), the
    other fields as they are. torchvision waits for nvJPEG after each batch, and that wait is
    where the training thread spends most of an ImageFolder step (benchmarks/BENCHMARKS.md,
    "The DeiT augmentation inside the step"): a step's images in one batch wait once (on an
    H100 no faster than a batch a microbatch: the decoder's throughput is the bound)."""
    encoded = [f for mb in batches for f in mb if isinstance(f, EncodedImages)]
    if not encoded:
        return batches
    assert len({e.size for e in encoded}) == 1, "one loader makes a step: one render size"
    whole = EncodedImages([d for e in encoded for d in e.data], encoded[0].size,
                          [e._name(i) for e in encoded for i in range(len(e))])
    parts = iter(finish_on_device(whole, device, decoder).split([len(e) for e in encoded]))
    return [tuple(next(parts) if isinstance(f, EncodedImages) else f for f in mb)
            for mb in batches]


# ---------------------------------------------------------------- native resolution
# data.resolution=native: each image decoded at its own planned size (its patch grid times the
# patch, vitgraph.data.packing.native_grid), optionally from a crop box given as fractions of
# its sides (y0, x0, y1, x1), and patchified into a pack.

_PNG = b"\x89PNG\r\n\x1a\n"
# SOF markers (C0-CF but DHT C4, JPG C8 and DAC CC) carry the frame's height and width
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def header_size(head: bytes) -> tuple[int, int] | None:
    """An image's (height, width) from the first bytes of its file (JPEG: the SOF segment;
    PNG: IHDR), without decoding it; None when ``head`` does not reach it or the format is
    another (the caller asks PIL then). EXIF orientation is not applied, as the decoders here
    do not apply it either."""
    if head[:8] == _PNG and head[12:16] == b"IHDR" and len(head) >= 24:
        return int.from_bytes(head[20:24], "big"), int.from_bytes(head[16:20], "big")
    if head[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(head)
    while i + 4 <= n:
        if head[i] != 0xFF:
            return None  # not a marker where one should be: PIL decides
        m = head[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
            continue
        if m == 0x01 or 0xD0 <= m <= 0xD8:  # markers without a length
            i += 2
            continue
        if m in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None
        if m in _SOF:
            if i + 9 > n:
                return None
            h = int.from_bytes(head[i + 5:i + 7], "big")
            w = int.from_bytes(head[i + 7:i + 9], "big")
            return (h, w) if h and w else None
        i += 2 + int.from_bytes(head[i + 2:i + 4], "big")
    return None


def read_size(read, total: int, where: str = "") -> tuple[int, int]:
    """(height, width) of an encoded image; ``read(k)`` gives its first k bytes, ``total``
    its length. The header parse first on a few KB (more if an EXIF block comes first), PIL's
    lazy open on the whole file last. DataError naming ``where`` if neither can tell."""
    k = 4096
    while True:
        head = read(min(k, total))
        size = header_size(head)
        if size is not None:
            return size
        if k >= total:
            break
        k *= 16
    try:
        with Image.open(io.BytesIO(head)) as im:
            w, h = im.size
    except Exception as e:
        raise DataError(f"cannot read image {where}: {e}") from None
    if h < 1 or w < 1:
        raise DataError(f"cannot read image {where}: size {w}x{h}")
    return h, w


def crop_box(crop, h: int, w: int) -> tuple[int, int, int, int]:
    """A crop box of fractions (y0, x0, y1, x1) (None: the whole image) in whole pixels of an
    ``h`` x ``w`` image, at least one pixel each way."""
    if crop is None:
        return 0, 0, h, w
    y0, x0, y1, x1 = crop
    top, left = min(round(y0 * h), h - 1), min(round(x0 * w), w - 1)
    return top, left, max(min(round(y1 * h), h), top + 1), max(min(round(x1 * w), w), left + 1)


def draft_size(target: tuple[int, int], crop) -> tuple[int, int]:
    """(height, width) a decode must keep at least so that ``crop`` of it still covers
    ``target`` pixels (PIL's draft mode decodes JPEGs at a reduced scale down to that)."""
    ch, cw = (1.0, 1.0) if crop is None else (crop[2] - crop[0], crop[3] - crop[1])
    return math.ceil(target[0] / max(ch, 1e-6)), math.ceil(target[1] / max(cw, 1e-6))


def resize_native(image: np.ndarray, target: tuple[int, int], crop=None) -> np.ndarray:
    """uint8 [h, w, 3] -> ``crop`` of it resized to ``target`` (height, width), bicubic and
    antialiased (PIL): uint8 [H, W, 3]."""
    h, w = image.shape[:2]
    top, left, bottom, right = crop_box(crop, h, w)
    part = image[top:bottom, left:right]
    if part.shape[:2] == tuple(target):
        return np.ascontiguousarray(part)
    im = Image.fromarray(np.ascontiguousarray(part))
    return np.array(im.resize((target[1], target[0]), Image.BICUBIC), dtype=np.uint8)


def decode_native(data: bytes, target: tuple[int, int], crop=None, where: str = "") -> np.ndarray:
    """Encoded image -> ``crop`` of it resized to ``target`` (height, width): uint8 [H, W, 3].
    JPEGs decode at PIL's draft scale where that still covers the target."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format == "JPEG":
                dh, dw = draft_size(target, crop)
                im.draft("RGB", (dw, dh))
            rgb = np.array(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:
        raise DataError(f"cannot decode image {where}: {e}") from None
    return resize_native(rgb, target, crop)


def native_for_device(data: bytes, target: tuple[int, int], crop=None, where: str = ""
                      ) -> torch.Tensor:
    """One image of an ``EncodedPack``: a JPEG's bytes (nvJPEG decodes it on the device),
    anything else decoded here (at full size, or PIL's draft scale for a JPEG the magic bytes
    hid), as ``for_device``."""
    if data[:3] == b"\xff\xd8\xff":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dh, dw = draft_size(target, crop)
    return torch.from_numpy(decode_full(data, max(dh, dw), where))


@dataclass
class EncodedPack:
    """A pack's patches the device finishes (``data.decode=cuda``): per image, ``data`` (CPU
    uint8, 1-D JPEG bytes or [H, W, 3] decoded), its patch ``grids``, the token ``offsets``
    where its patches go, its crop box (fractions, or None); the pack's ``tokens`` and
    ``patch``. ``finish_pack_on_device`` makes the uint8 [tokens, 3 patch^2] patch rows."""
    data: list
    grids: list
    offsets: list
    crops: list
    tokens: int
    patch: int
    names: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.data)


def patchify_chw(x: torch.Tensor, patch: int) -> torch.Tensor:
    """uint8 [b, 3, gh * p, gw * p] -> [b, gh * gw, 3 * p * p] (vitgraph.data.packing.patchify's
    order: patches row-major, each in (channel, row, column) order)."""
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    x = x.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, gh * gw, c * patch * patch)


def finish_pack_on_device(pack: EncodedPack, device, decoder=None) -> torch.Tensor:
    """A pack's patch rows, uint8 [tokens, 3 p^2] on ``device``: its JPEGs decoded there in one
    nvJPEG batch (with ``_decode_jpegs``' fallbacks; ``decoder`` replaces nvJPEG in tests), each
    image cropped and resized to its grid (two matmuls with ``resize_matrix``'s weights, as
    ``finish_on_device``; images of one size, box and grid as one batch) and patchified into
    its place; prefix and padding rows zero."""
    jpegs = [i for i, t in enumerate(pack.data) if t.dim() == 1]
    imgs = [t.to(device, non_blocking=True).permute(2, 0, 1) if t.dim() == 3 else None
            for t in pack.data]
    if jpegs:
        p = pack.patch
        hint = max([max(g) * p for g in pack.grids] or [p])
        batch = EncodedImages(pack.data, hint, pack.names)
        for i, im in zip(jpegs, _decode_jpegs(batch, jpegs, device, decoder)):
            imgs[i] = im
    p = pack.patch
    out = torch.zeros((pack.tokens, 3 * p * p), dtype=torch.uint8, device=device)
    groups: dict[tuple, list[int]] = {}
    for i, im in enumerate(imgs):
        h, w = im.shape[-2:]
        box = crop_box(pack.crops[i] if pack.crops else None, h, w)
        groups.setdefault((box, tuple(pack.grids[i])), []).append(i)
    for ((top, left, bottom, right), (gh, gw)), idx in groups.items():
        ims = torch.stack([imgs[i].to(device) for i in idx])[:, :, top:bottom, left:right]
        h, w, nh, nw = bottom - top, right - left, gh * p, gw * p
        if (h, w) != (nh, nw):
            dt = torch.float16 if ims.is_cuda else torch.float32
            rows = _device_matrix(h, nh, 0, nh, ims.device, dt)
            cols = _device_matrix(w, nw, 0, nw, ims.device, dt).t()
            x = ims.to(dt)
            if nh * h * w + nh * w * nw <= h * w * nw + nh * h * nw:
                x = torch.matmul(torch.matmul(rows, x), cols)
            else:
                x = torch.matmul(rows, torch.matmul(x, cols))
            ims = x.round_().clamp_(0, 255).to(torch.uint8)
        patches = patchify_chw(ims, p)
        for k, i in enumerate(idx):
            start = pack.offsets[i]
            out[start:start + gh * gw] = patches[k]
    return out
