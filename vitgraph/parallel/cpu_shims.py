"""The shims that let megatron-core 0.16.1 run on CPU (gloo, fp32). Active only without CUDA.

megatron-core assumes CUDA in a few places that a ViT training step touches:
- the schedules create ``torch.zeros(..., device="cuda")`` (token counters);
- p2p communication allocates on ``torch.cuda.current_device()`` and calls
  ``torch.cuda.synchronize()``;
- ``model_parallel_cuda_manual_seed`` seeds CUDA generators and forks CUDA RNG states;
  activation recompute saves and restores the CUDA generator's state;
- grad-norm clipping builds its all-reduce buffer with ``device='cuda'`` (we use our own
  ``clip_grad_norm`` instead, see below) and the megatron optimizers hold CUDA tensors;
- sequence parallel's all-gather buffer (``GlobalMemoryBuffer``) is made on
  ``torch.cuda.current_device()``;
- dist_checkpointing's save path synchronizes CUDA and builds its consistency-check tensors
  on ``torch.cuda.current_device()``;
- its FSDP wrapper (``TorchFullyShardedDataParallel``) builds its device mesh for "cuda";
- attention allocates the inference KV cache on ``torch.cuda.current_device()``.
Each shim swaps the module-level ``torch`` name of one megatron module for a proxy that maps
those calls to the CPU, so the real ``torch`` is untouched for everyone else.
"""
from __future__ import annotations

import contextlib
import types

import torch

from vitgraph.parallel.fsdp import is_dtensor, local

_installed = False


class _CpuCuda:
    """Stands in for ``torch.cuda`` inside a shimmed megatron module."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs):
        return None


class _CpuTorch(types.ModuleType):
    """Stands in for ``torch`` inside a shimmed megatron module: CUDA devices become the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            return _on_cpu(attr)
        return attr


def _on_cpu(fn):
    def wrapped(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return wrapped


class _NoForkTracker:
    """A tracker whose forks are no-ops: on CPU there is one generator, seeded per rank."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def reset(self):
        pass

    def is_initialized(self):
        return True


class _CpuDeviceMesh:
    """Stands in for ``DeviceMesh`` in megatron's FSDP wrapper: its mesh on the CPU (gloo)."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh
        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _cpu_manual_seed(seed, *args, **kwargs):
    torch.manual_seed(seed)


def install() -> bool:
    """Install the shims if CUDA is absent; returns whether they are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import (async_utils, filesystem_async,
                                                             state_dict_saver)
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as tp_random

    proxy = _CpuTorch()
    from megatron.core import utils as core_utils  # GlobalMemoryBuffer (sequence parallel)
    # sequence parallel: scatter / gather, and the linears' backward all-gather buffers
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer import attention  # the KV cache of greedy captions
    for module in (schedules, p2p_communication, async_utils, filesystem_async, state_dict_saver,
                   core_utils, mappings, layers, attention):
        module.torch = proxy
    tracker = _NoForkTracker()
    tp_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker
    tp_random.model_parallel_cuda_manual_seed = _cpu_manual_seed
    # activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA generator
    # beside the CPU one; on CPU the CPU generator is the only one
    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    tensor_parallel.model_parallel_cuda_manual_seed = _cpu_manual_seed
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp
    fsdp.DeviceMesh = _CpuDeviceMesh
    _installed = True
    return True


def clip_grad_norm(params, max_norm: float, model_parallel_group) -> float:
    """Global L2 grad norm over the model-parallel group, clipped to ``max_norm`` (0: no clip).

    The CPU stand-in for megatron's ``clip_grad_norm_fp32``: tensor-parallel duplicates
    (replicated params) are counted once, as megatron does; FSDP's gradient pieces
    (DTensors) are summed over their data-parallel mesh.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    grads = [local(p.grad) for p in params if p.grad is not None]
    counted = [p.grad for p in params
               if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.zeros(1, dtype=torch.float64)
    for g in counted:
        if not is_dtensor(g):
            sq += g.double().pow(2).sum()
    sharded = [g for g in counted if is_dtensor(g)]  # parallel.fsdp: pieces over dp
    if sharded:
        part = torch.zeros(1, dtype=torch.float64)
        for g in sharded:
            part += local(g).double().pow(2).sum()
        torch.distributed.all_reduce(part, group=sharded[0].device_mesh.get_group())
        sq += part
    if model_parallel_group is not None and torch.distributed.get_world_size(model_parallel_group) > 1:
        torch.distributed.all_reduce(sq, group=model_parallel_group)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
