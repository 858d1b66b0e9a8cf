"""Process groups, model construction and ``parallelize``: the one place where precision, data
parallelism and CUDA graphs are applied to the model, in this order:

1. build the stage's ``ViT`` (tensor- and pipeline-parallel layers come from megatron-core);
2. precision: bf16 through megatron-core's ``Float16Module`` (GPU);
3. data parallelism: megatron-core ``DistributedDataParallel`` (GPU; on CPU gradients are
   all-reduced by ``CpuOptimizer``);
4. CUDA graphs over the encoder layers (vitgraph.graphs), last, so they capture the modules
   exactly as they run.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from vitgraph.config import Config
from vitgraph.models.registry import resolve_arch
from vitgraph.models.specs import get_layer_spec, resolve_spec
from vitgraph.models.vit import ViT
from vitgraph.parallel import cpu_shims


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: Config) -> Dist:
    """torchrun's environment, or a single process when launched without torchrun."""
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_shims.install()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if "RANK" not in os.environ:  # plain `vitgraph train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10),
                                device_id=device if cuda else None)
    p = cfg.parallel
    if ps.model_parallel_is_initialized():  # a second Trainer in one process (benchmarks)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tp,
                                 pipeline_model_parallel_size=p.pp)
    d = Dist(rank, world, local_rank, device, p.tp, p.pp, ps.get_data_parallel_world_size(),
             ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
             ps.get_data_parallel_rank())
    if cuda and cfg.graphs.enabled:
        # graphs capture on the training stream, which must not be the legacy default stream
        # (megatron DDP's grad-accumulation nodes remember the stream they were made on)
        from vitgraph.graphs import use_side_stream
        use_side_stream(device)
    seed_everything(cfg.train.seed, d, graphs=cfg.graphs.enabled,
                    te=resolve_spec(cfg.model.spec) == "te")
    return d


def seed_everything(seed: int, d: Dist, graphs: bool = False, te: bool = False) -> None:
    # distinct per pipeline stage (different layers), same across data-parallel replicas so
    # that initial weights agree; megatron offsets the tensor-parallel streams itself
    torch.manual_seed(seed + 100 * d.pp_rank)
    if d.cuda:
        # under graphs, TE's attention dropout needs TE's (graph-safe) RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed + 100 * d.pp_rank, te_rng_tracker=graphs and te, use_cudagraphable_rng=graphs,
            force_reset_rng=True)


def shutdown() -> None:
    if dist.is_initialized():
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def use_bf16(cfg: Config, d: Dist) -> bool:
    if cfg.train.precision == "auto":
        return d.cuda
    return cfg.train.precision == "bf16"


def transformer_config(cfg: Config, d: Dist) -> TransformerConfig:
    arch = resolve_arch(cfg.model)
    fuse_wgrad = (cfg.model.gradient_accumulation_fusion and d.cuda
                  and resolve_spec(cfg.model.spec) == "te")
    bf16 = use_bf16(cfg, d)
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads, ffn_hidden_size=arch.ffn_hidden_size,
        hidden_dropout=cfg.model.hidden_dropout, attention_dropout=cfg.model.attention_dropout,
        layernorm_epsilon=cfg.model.layernorm_epsilon, add_bias_linear=True,
        activation_func=torch.nn.functional.gelu, gated_linear_unit=False,
        normalization="LayerNorm", init_method_std=cfg.model.init_std,
        tensor_model_parallel_size=d.tp, pipeline_model_parallel_size=d.pp,
        sequence_parallel=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not d.cuda, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=fuse_wgrad, persist_layer_norm=False,
        # p2p between pipeline stages: on CPU avoid the CUDA-stream sync
        batch_p2p_comm=d.cuda, batch_p2p_sync=d.cuda,
    )


def build_model(cfg: Config, d: Dist, num_classes: int) -> ViT:
    spec = resolve_spec(cfg.model.spec)
    if spec == "te" and not d.cuda:
        raise RuntimeError("model.spec=te needs CUDA and Transformer Engine; use model.spec=torch on CPU")
    arch = resolve_arch(cfg.model)
    model = ViT(transformer_config(cfg, d), get_layer_spec(spec), arch,
                cfg.model.num_classes or num_classes, num_registers=cfg.model.num_registers,
                class_token=cfg.model.class_token, pool=cfg.model.pool,
                pre_process=d.is_first_stage, post_process=d.is_last_stage)
    return model


def parallelize(model: ViT, cfg: Config, d: Dist):
    """Apply precision, data parallelism and graphs (in that order). Returns (wrapped, graphs)."""
    wrapped = model
    if d.cuda:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module
        if model.config.bf16:
            wrapped = Float16Module(model.config, wrapped)
        # no distributed optimizer yet: its sharded state needs megatron's dist checkpointing
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
        wrapped = DistributedDataParallel(model.config, ddp_cfg, wrapped)
        wrapped.broadcast_params()  # replicas start from rank 0's weights
    graphs = None
    if cfg.graphs.enabled:
        from vitgraph.graphs import GraphManager
        graphs = GraphManager.for_model([wrapped], cfg.graphs)
    return wrapped, graphs
