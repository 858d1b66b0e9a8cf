"""Checkpoints lose nothing. Save then load gives back every tensor of the training state bit
for bit (weights, the optimizer's fp32 weights, Adam moments and step counts, the EMA, the LR
schedule, the data position, the RNG) at fixed and native resolution, and FSDP's pieces in a
process whose earlier Trainer's groups are gone. megatron's distributed
optimizer (GPU only in training) cuts each parameter's own state out of its gathered buffers
for a checkpoint, where buckets end padded too (vitgraph.train.optim.
checkpoint_state_at_parameter_offsets): megatron's own code over megatron's buffers on CPU, in
this process and at dp=2 (a call job of the session's launch of two). The GPU variant, through
the Trainer with and without the distributed optimizer: tests/gpu/test_checkpoint_gpu.py."""
import os

import pytest
import torch

from conftest import (ROOT, assert_results, assert_same_state, save_then_load, tiny_overrides,
                      write_result, zero_filled_warnings)
from vitgraph.config import load_config
from vitgraph.models.build import build_model
from vitgraph.parallel import cpu_shims
from vitgraph.parallel.setup import init_distributed, shutdown
from vitgraph.plan import resolve
from vitgraph.train.optim import checkpoint_state_at_parameter_offsets

TINY = ROOT / "configs" / "vit-tiny-shapes.yaml"
CONFIGS = {
    "fixed": (TINY, []),
    # 2 packs a step of 512 tokens, images of at most 48 patches
    "native": (ROOT / "configs" / "vit-tiny-shapes-native.yaml",
               ["train.global_batch_size=2", "data.packing.tokens_per_microbatch=512",
                "data.packing.max_patches=48", "data.packing.max_images=16"]),
    "fsdp": (TINY, ["parallel.fsdp=true", "parallel.distributed_optimizer=false",
                    "train.ema.decay=null"]),
}


def trainer(config: str, run_dir, *extra):
    from vitgraph.train.loop import Trainer
    path, over = CONFIGS[config]
    # stochastic depth: the steps draw from torch's generator, so the RNG state moves
    return Trainer(load_config(path, [*tiny_overrides(run_dir, 6, **{
        "train.ema.decay": 0.9, "model.drop_path_rate": 0.1, "data.num_train": 256,
        "data.num_val": 64}), *over, *extra]))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_save_then_load_gives_back_every_tensor_bit_for_bit(tmp_path, config):
    # fsdp: the second Trainer's parameters came out carrying the first's (destroyed) mesh
    saved, loaded = save_then_load(lambda: trainer(config, tmp_path / "run"), steps=3,
                                   shutdown_dist=config != "fsdp")
    assert loaded["step"] == 3 and float(loaded.get("ema.count", 3)) == 3
    assert any(k.endswith(".exp_avg_sq") for k in saved)
    assert_same_state(loaded, saved)


# ------------------------------------------------- megatron's distributed optimizer's cuts

STATE = ("param", "exp_avg", "exp_avg_sq")


def _known(i: int, p: torch.Tensor) -> dict:
    """Parameter ``i``'s fp32 weights and moments, as the test makes them up: all distinct."""
    return {k: torch.arange(p.numel(), dtype=torch.float32) + 1000 * i + 0.25 * j
            for j, k in enumerate(STATE)}


def _owned(opt, p) -> slice:
    """The range of parameter ``p`` (flattened) that this dp rank's optimizer shard holds."""
    for ranges in opt.gbuf_ranges[0].values():
        for bucket in ranges:
            if p in bucket["param_map"]:
                r = bucket["param_map"][p]["param"]
                return slice(r.start, r.end)
    return slice(0, 0)


def _cuts() -> None:
    """A tiny ViT in megatron's DDP with the distributed optimizer's buffers, buckets of 20,000
    elements (some end padded: 64-wide parameters, a 10-element head bias), and a
    ``DistributedOptimizer`` holding only what its checkpoint code reads (megatron's optimizer
    itself asks for CUDA tensors): the state its fully_reshardable checkpoint cuts is every
    parameter's own, without megatron's zero-fill warning, and a load hands each rank its
    shard of it."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    cfg = load_config(TINY, ["model.spec=torch", "train.micro_batch_size=8"])
    plan = resolve(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    d = init_distributed(plan)
    torch_name = param_and_grad_buffer.torch
    param_and_grad_buffer.torch = cpu_shims._CpuTorch()  # its buffers on the CPU
    try:
        chunk = build_model(plan, cfg.model, d, 10, 0)[0]
        ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
            bucket_size=20000), chunk)
        (buffer,) = ddp.buffers
        assert any(b.grad_data.numel() > b.numel_unpadded for b in buffer.buckets[:-1])
        opt = object.__new__(DistributedOptimizer)
        opt.buffers, opt.optimizer = ddp.buffers, None
        opt.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in ddp.buffers]
        opt.data_parallel_group = ps.get_data_parallel_group()
        opt.data_parallel_group_gloo = ps.get_data_parallel_group_gloo()
        params = list(buffer.param_index_map)  # megatron's order of the checkpoint's entries
        known = {p: _known(i, p) for i, p in enumerate(params)}
        opt._get_main_param_and_optimizer_states = lambda p: {
            k: v[_owned(opt, p)] for k, v in known[p].items()}
        checkpoint_state_at_parameter_offsets(opt)
        with zero_filled_warnings() as zero_filled:
            # megatron's memory-efficient mode: gathered over gloo (its other mode over CUDA)
            cut = opt.sharded_param_state_fully_reshardable(
                chunk.sharded_state_dict(),
                metadata={"distrib_optim_fully_reshardable_mem_efficient": True})
        assert not zero_filled, zero_filled[0]
        if d.dp_rank == 0:
            names = {p: n for n, p in chunk.named_parameters()}
            wrong = [(names[p], k) for i, p in enumerate(params) for k in STATE
                     if not torch.equal(cut[i][k].data.reshape(-1), known[p][k])]
            assert not wrong, f"{len(wrong)} of {3 * len(params)} cut wrong: {wrong[:4]}"
        loaded = {}
        opt._set_main_param_and_optimizer_states = lambda p, t: loaded.__setitem__(p, t)
        opt.load_parameter_state_from_fully_reshardable(
            {i: {k: v.view(p.shape) for k, v in known[p].items()} for i, p in enumerate(params)})
        mine = [p for p in params if _owned(opt, p).stop > _owned(opt, p).start]
        assert set(loaded) == set(mine)
        for p in mine:
            assert all(torch.equal(loaded[p][k], known[p][k][_owned(opt, p)]) for k in STATE)
    finally:
        param_and_grad_buffer.torch = torch_name
        shutdown()


def test_the_distributed_optimizer_checkpoints_each_parameters_own_state():
    _cuts()


def cuts_check(out: str) -> None:
    """A call job of the session's launch of two (conftest.launched): _cuts at dp=2."""
    import torch.distributed as dist
    write_result(out, f"rank{dist.get_rank()}", _cuts)


def launch_jobs(root) -> dict[int, list]:
    return {2: [("cuts", {"call": "test_checkpoint_state:cuts_check",
                          "kwargs": {"out": str(root / "cuts")}})]}


@pytest.mark.multiproc
def test_the_distributed_optimizer_checkpoints_each_parameters_own_state_at_dp2(launched):
    assert_results(*launched[__name__]["cuts"], ["rank0", "rank1"])
