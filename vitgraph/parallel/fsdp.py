"""parallel.fsdp: megatron-core's ``TorchFullyShardedDataParallel`` (PyTorch FSDP2) around a
model chunk, and what its checkpoints need to stay in vitgraph's one format.

FSDP2 turns every parameter (and so its gradient and optimizer state) into a DTensor split
along dim 0 over the data-parallel ranks. megatron-core 0.16.1's checkpoint helpers see a
DTensor and describe its local shard, but a full tensor (where some rank holds nothing) they
describe as a shard, and uneven splits they cannot describe at all; its wrapper's
``load_state_dict`` is a no-op. So the state is built here as if nothing were sharded
(``unsharded_view``: megatron's DTensor paths off), then ``to_shards`` rewrites each
DTensor-backed ShardedTensor into this rank's piece of the same global tensor. The checkpoint
is then the one a DDP run writes: either layout resumes the other (``restore`` turns loaded
pieces back into DTensors).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
from megatron.core.distributed.torch_fully_sharded_data_parallel import \
    TorchFullyShardedDataParallel


class FullySharded(TorchFullyShardedDataParallel):
    """megatron's wrapper, taking the arguments megatron's own ``finalize_model_grads`` passes
    (0.16.1's base class refuses ``force_all_reduce``). FSDP2 reduce-scatters each layer's
    gradients in the backward pass: nothing is left to finish."""

    def finish_grad_sync(self, *args, **kwargs):
        pass


def wrap(chunk, ddp_config=None):
    """``chunk`` fully sharded over the data-parallel group: each encoder layer a group of
    its own (gathered as it runs), the rest of the chunk one group. Only the layers: the
    wrapper's default set adds megatron's ColumnParallelLinear, which the torch spec's layers
    hold, and FSDP2 refuses to shard a layer's parameters twice."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    return FullySharded(chunk.config, ddp_config or DistributedDataParallelConfig(), chunk,
                        sub_modules_to_wrap={TransformerLayer})


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (``t`` itself unless a DTensor), sharing its storage."""
    return t._local_tensor if is_dtensor(t) else t


@contextlib.contextmanager
def unsharded_view():
    """megatron's sharded_state_dict helpers treat DTensors as plain (global-shape) tensors."""
    from megatron.core import utils
    saved = utils.HAVE_DTENSOR
    utils.HAVE_DTENSOR = False
    try:
        yield
    finally:
        utils.HAVE_DTENSOR = saved


def _rows(n: int, parts: int, rank: int) -> tuple[int, int]:
    """The rows of dim 0 (of ``n``) FSDP2 gives ``rank``: torch.chunk's split."""
    c = math.ceil(n / parts)
    return min(rank * c, n), min(rank * c + c, n)


def _placement(t) -> tuple[int, int] | None:
    """(dp size, dp rank) of a DTensor split along dim 0 on a 1-D mesh; None otherwise."""
    from torch.distributed.tensor import Shard
    if not is_dtensor(t) or t.device_mesh.ndim != 1 or t.placements != (Shard(0),):
        return None
    return t.device_mesh.size(), t.device_mesh.get_local_rank()


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map(v, fn) for v in tree)
    return fn(tree)


def _shard(sh):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    if not isinstance(sh, ShardedTensor) or not is_dtensor(sh.data):
        return sh
    place = _placement(sh.data)
    if place is None:
        raise NotImplementedError(f"{sh.key}: a DTensor with placements {sh.data.placements}")
    dp, r = place
    a = sh.prepend_axis_num  # the tensor's dim 0 in the global tensor (local_shape: 0)
    n = sh.data.shape[0]
    if n % dp:  # uneven (or empty) pieces: the whole tensor, written once (dp replica 0)
        return replace(sh, data=sh.data.full_tensor())
    c = n // dp
    offset, frags, shape = list(sh.global_offset), list(sh.axis_fragmentations), list(sh.local_shape)
    offset[a] += r * c
    frags[a] *= dp
    shape[0] = c
    rid = sh.replica_id
    rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0  # each dp rank writes its own piece
    return replace(sh, data=local(sh.data).detach(), global_offset=tuple(offset),
                   axis_fragmentations=tuple(frags), local_shape=tuple(shape), replica_id=rid)


def to_shards(state: dict) -> dict:
    """``state`` (built under ``unsharded_view``) with every DTensor-backed ShardedTensor as
    this rank's piece: evenly split tensors as their local shard (dp replica 0 each), the
    others as the whole tensor (gathered: collective, every rank walks the same state)."""
    return _map(state, _shard)


def restore(template: dict, loaded: dict) -> dict:
    """``loaded`` (dist_checkpointing's answer for ``to_shards(template)``) with every piece
    that ``template`` held as a DTensor made that DTensor's shape and placement again, so the
    model's and the optimizer's ``load_state_dict`` take it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.tensor import DTensor

    def back(t, value):
        if not (isinstance(t, ShardedTensor) and is_dtensor(t.data)):
            return value
        dt = t.data
        dp, r = _placement(dt)
        if value.shape[0] == dt.shape[0] and dt.shape[0] % dp:  # the whole tensor
            lo, hi = _rows(dt.shape[0], dp, r)
            value = value[lo:hi]
        return DTensor.from_local(value.to(dt.dtype).contiguous(), dt.device_mesh,
                                  dt.placements, run_check=False, shape=dt.shape,
                                  stride=dt.stride())

    def walk(t, v):
        if isinstance(t, dict) and isinstance(v, dict):
            return {k: walk(t[k], x) if k in t else x for k, x in v.items()}
        if isinstance(t, (list, tuple)) and isinstance(v, (list, tuple)) and len(t) == len(v):
            return type(v)(walk(a, b) for a, b in zip(t, v))
        return back(t, v)

    return walk(template, loaded)
