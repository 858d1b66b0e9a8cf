# Measured in session 8, call 4 as vitgraph/data/nvjpeg.py (with a data.gpu_decoder key choosing it
# in finish_on_device), then removed: slower than torchvision's hardware path beside a step.
"""Batched JPEG decoding with nvJPEG's GPU-assisted Huffman backend, through ctypes.

Why not ``torchvision.io.decode_jpeg(device="cuda")`` alone: on an A100/H100/H200 it takes
nvJPEG's hardware-decoder path, which moves each image through its own host round trips (a
pageable copy, a small colour-conversion kernel, an event the host waits on). Beside a
training step those 256 small operations each wait for the step's kernels and each delays
the persistent GEMM that has to make room for it: measured on an H200 (benchmarks/
h200-2026-12-01-s8), a ViT-B/16 step-graph step went from 66.6 to 74.8 ms with a 256-image
decode beside it, most of it GPU idle after the step while the decode finished.

``NVJPEG_BACKEND_GPU_HYBRID`` decodes a whole batch with a few large kernels instead
(``nvjpegDecodeBatched``; Huffman decoding on the GPU for batches over ~50 images). The
library is the one torchvision already loads; nothing is built.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch

# nvjpeg.h
_BACKEND_GPU_HYBRID = 2
_OUTPUT_RGB = 3  # planar: one plane per channel, as torchvision returns (C, H, W)
_CSS_UNKNOWN = -1
_MAX_COMPONENT = 4


class _Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * _MAX_COMPONENT),
                ("pitch", ctypes.c_size_t * _MAX_COMPONENT)]


class NvjpegError(RuntimeError):
    pass


def _find_library() -> str | None:
    """libnvjpeg as torchvision loaded it (its soname differs by CUDA major), else the
    system's."""
    try:
        import torchvision.io.image  # noqa: F401  (loads torchvision's image.so and nvjpeg)
    except Exception:
        pass
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnvjpeg" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("nvjpeg")


class BatchDecoder:
    """``decode(list of 1-D uint8 CPU tensors) -> list of uint8 [3, H, W]`` on ``device``, the
    work queued on the current CUDA stream. One per device; calls are serialised (nvJPEG's
    state is not thread-safe)."""

    def __init__(self, device, max_threads: int = 8):
        path = _find_library()
        if path is None:
            raise NvjpegError("libnvjpeg not found")
        self.lib = lib = ctypes.CDLL(path)
        self.device = torch.device(device)
        self.max_threads = max_threads
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.nvjpegCreateEx.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint, ctypes.POINTER(vp)]
        lib.nvjpegJpegStateCreate.argtypes = [vp, ctypes.POINTER(vp)]
        lib.nvjpegDecodeBatchedInitialize.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int,
                                                      ctypes.c_int]
        lib.nvjpegDecodeBatched.argtypes = [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz),
                                            ctypes.POINTER(_Image), vp]
        lib.nvjpegGetImageInfo.argtypes = [vp, vp, sz, ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int)]
        self.handle, self.state = vp(), vp()
        with torch.cuda.device(self.device):
            self._check(lib.nvjpegCreateEx(_BACKEND_GPU_HYBRID, None, None, 0,
                                           ctypes.byref(self.handle)), "nvjpegCreateEx")
            self._check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)),
                        "nvjpegJpegStateCreate")
        self._batch = 0  # the batch size nvjpegDecodeBatchedInitialize was last called with
        self._lock = threading.Lock()

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise NvjpegError(f"{what} failed: nvjpegStatus {status}")

    def size(self, data: torch.Tensor) -> tuple[int, int]:
        """(height, width) from the JPEG header."""
        n, css = ctypes.c_int(), ctypes.c_int()
        w, h = (ctypes.c_int * _MAX_COMPONENT)(), (ctypes.c_int * _MAX_COMPONENT)()
        self._check(self.lib.nvjpegGetImageInfo(self.handle, data.data_ptr(), data.numel(),
                                                ctypes.byref(n), ctypes.byref(css), w, h),
                    "nvjpegGetImageInfo")
        if css.value == _CSS_UNKNOWN:
            raise NvjpegError("unknown chroma subsampling")
        return h[0], w[0]

    def __call__(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        if not data:
            return []
        data = [d.contiguous() for d in data]
        with self._lock, torch.cuda.device(self.device):
            out = [torch.empty((3, *self.size(d)), dtype=torch.uint8, device=self.device)
                   for d in data]
            n = len(data)
            if n != self._batch:
                self._check(self.lib.nvjpegDecodeBatchedInitialize(
                    self.handle, self.state, n, self.max_threads, _OUTPUT_RGB),
                    "nvjpegDecodeBatchedInitialize")
                self._batch = n
            ptrs = (ctypes.c_void_p * n)(*[d.data_ptr() for d in data])
            lengths = (ctypes.c_size_t * n)(*[d.numel() for d in data])
            images = (_Image * n)()
            for img, o in zip(images, out):
                plane = o.shape[1] * o.shape[2]
                for c in range(3):
                    img.channel[c] = o.data_ptr() + c * plane
                    img.pitch[c] = o.shape[2]
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self._check(self.lib.nvjpegDecodeBatched(self.handle, self.state, ptrs, lengths,
                                                     images, stream), "nvjpegDecodeBatched")
        return out


_decoders: dict = {}


def batch_decoder(device) -> BatchDecoder:
    device = torch.device(device)
    if device not in _decoders:
        _decoders[device] = BatchDecoder(device)
    return _decoders[device]
