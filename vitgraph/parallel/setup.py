"""Process groups and ``parallelize``: the one place where frozen parameters, precision, data
parallelism and CUDA graphs are applied to this rank's model chunks (built by
vitgraph.models.build), in this order:

0. frozen parameters (model.freeze, task.lock_image) lose requires_grad, before anything
   allocates gradients or optimizer state for them;
1. precision: bf16 through megatron-core's ``Float16Module`` (GPU); FP8 is TE's, inside the
   layers (TransformerConfig.fp8);
2. data parallelism: megatron-core ``DistributedDataParallel`` per chunk, with gradient
   reduction overlapped with the backward pass and, by default, the distributed optimizer's
   padded buffers (GPU; on CPU gradients are all-reduced by ``CpuOptimizer``); or, with
   parallel.fsdp, megatron-core's FSDP2 wrapper (vitgraph.parallel.fsdp), GPU and CPU;
3. CUDA graphs over the encoder layers of every chunk (vitgraph.graphs), last, so they
   capture the modules exactly as they run.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module

from vitgraph.config import ConfigError, ParallelConfig
from vitgraph.graphs import GraphManager, StepGraphs, use_side_stream
from vitgraph.graphs.callable import te_rng_tracker_class
from vitgraph.graphs.off import NoGraphs
from vitgraph.models.freeze import freeze as freeze_params
from vitgraph.parallel import cpu_shims, fsdp
from vitgraph.parallel.dist import Dist
from vitgraph.plan import Plan

log = logging.getLogger("vitgraph")


def _init_world_of_one(backend: str, device: torch.device | None,
                       timeout: datetime.timedelta | None = None) -> None:
    """The default process group of a process that is the whole world, over an in-process
    store: no TCP port to pick (a port picked free and bound later was a race between two
    runs started at once) and nothing written to the environment (RANK, MASTER_PORT ...
    inherited by a child process made it join this world, not one of its own)."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device, timeout=timeout)


def launched_world_size() -> int:
    """torchrun's WORLD_SIZE; 1 for a plain ``vitgraph train``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(plan: Plan) -> Dist:
    """The process groups of the plan's layout: torchrun's environment, or a single process
    when launched without torchrun."""
    cuda = plan.cuda
    if not cuda:
        cpu_shims.install()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torchrun = "RANK" in os.environ  # else a plain `vitgraph train`: a world of one
    rank, world = (int(os.environ["RANK"]), launched_world_size()) if torchrun else (0, 1)
    if world != plan.world:
        raise ConfigError(f"the run was planned for a world of {plan.world} processes; "
                          f"WORLD_SIZE is {world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    p = plan.parallel
    graphs = plan.graphs.config
    if cuda:
        check_precision(plan.fp8_recipe, local_rank)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if graphs.enabled and not p.nccl_graph_register:
            # read by NCCL when a communicator is made: no user-buffer registration of
            # buffers used inside CUDA graphs (it has hung tp runs with graphs)
            os.environ["NCCL_GRAPH_REGISTER"] = "0"
    else:
        device = torch.device("cpu")
    timeout = collective_timeout(p)
    backend, device_id = ("nccl", device) if cuda else ("gloo", None)
    if not dist.is_initialized():  # else a caller's (tests, benchmarks), kept
        if torchrun:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device_id)
        else:
            _init_world_of_one(backend, device_id, timeout)
    if ps.model_parallel_is_initialized():  # a second Trainer in one process (benchmarks)
        destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tp,
                                 pipeline_model_parallel_size=p.pp,
                                 virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
                                 distributed_timeout_minutes=p.timeout_minutes)
    d = Dist(rank, world, local_rank, device, p.tp, p.pp, ps.get_data_parallel_world_size(),
             ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
             ps.get_data_parallel_rank(), vpp=p.vpp)
    if cuda and graphs.enabled:
        # graphs capture on the training stream, which must not be the legacy default stream
        # (megatron DDP's grad-accumulation nodes remember the stream they were made on)
        use_side_stream(device)
    seed_everything(plan.train.seed, d, graphs=graphs.enabled, te=plan.spec == "te")
    return d


def init_for_module(cuda: bool, *, seed: int = 0, graphs: bool = False, te: bool = False) -> None:
    """megatron-core's state for a model used outside vitgraph's trainer (vitgraph.tower): on
    CPU the shims; tensor- and pipeline-parallel size 1 over the caller's default process
    group (under torchrun every rank builds the model: making megatron's groups is a
    collective), or over a world of one made here when there is none; with graphs on a GPU,
    megatron's graph-safe RNG tracker (TE's for the te spec: TE asserts it under capture),
    seeded by ``seed`` (which seeds the CUDA generator too). What a caller set up already is
    kept, except a tracker that graphs cannot capture when graphs are asked for (one left by
    an eager Trainer or tower of the same process): that one is replaced."""
    if not cuda:
        cpu_shims.install()
    if not dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        _init_world_of_one("nccl" if cuda else "gloo", device)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                     pipeline_model_parallel_size=1)
    tracker = tensor_parallel.get_cuda_rng_tracker() if cuda and graphs else None
    if tracker is not None and not (tracker.is_initialized() and _graph_safe(tracker, te)):
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te,
                                                        use_cudagraphable_rng=True,
                                                        force_reset_rng=True)


def _graph_safe(tracker, te: bool) -> bool:
    """Whether layer graphs can capture ``tracker``'s forks: TE's tracker for TE attention,
    else megatron's with graph-safe generator states."""
    if te:
        te_tracker = te_rng_tracker_class()
        return te_tracker is not None and isinstance(tracker, te_tracker)
    return bool(getattr(tracker, "use_cudagraphable_rng", False))


def check_precision(fp8_recipe: str | None, local_rank: int) -> None:
    """What the GPU cannot do is a config error, before any process group exists
    (``fp8_recipe``: the plan's; None without FP8)."""
    if fp8_recipe is None:
        return
    major, minor = torch.cuda.get_device_capability(local_rank)
    if fp8_recipe == "mxfp8" and major < 10:
        raise ConfigError(f"train.fp8_recipe='mxfp8': MXFP8 needs a Blackwell GPU (compute "
                          f"capability 10.x); this one is {major}.{minor}. Use current or delayed")
    if (major, minor) < (8, 9):
        raise ConfigError(f"train.precision='fp8': needs compute capability >= 8.9 (Ada or "
                          f"Hopper); this GPU is {major}.{minor}")


def seed_everything(seed: int, d: Dist, graphs: bool = False, te: bool = False) -> None:
    # the RNG streams of dropout: distinct per pipeline stage, the same across data-parallel
    # replicas; megatron offsets the tensor-parallel streams itself. Initial weights do not
    # come from here (vitgraph.models.init draws them per parameter, layout-independently).
    torch.manual_seed(seed + 100 * d.pp_rank)
    if d.cuda:
        # under graphs, TE's attention dropout needs TE's (graph-safe) RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed + 100 * d.pp_rank, te_rng_tracker=graphs and te, use_cudagraphable_rng=graphs,
            force_reset_rng=True)


def destroy_model_parallel() -> None:
    """megatron-core's ``destroy_model_parallel``, after destroying its process groups: 0.16.1
    only drops its references, so every Trainer made in one process (tests, benchmarks) left
    its groups and their communicators alive. On an H200, a pytest process that had made about
    20 trainers failed to make the next one's NCCL groups ("Failed to CUDA calloc async")."""
    groups: dict[int, dist.ProcessGroup] = {}

    def collect(value):
        if isinstance(value, dist.ProcessGroup):
            groups[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)

    for name, value in vars(ps).items():
        if name.isupper() and "GROUP" in name:
            collect(value)
    ps.destroy_model_parallel()  # destroys its gloo groups itself
    for group in groups.values():
        if group is dist.group.WORLD:
            continue
        try:
            dist.destroy_process_group(group)
        except ValueError:  # "Invalid process group": one megatron already destroyed
            pass
    forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's sharding caches (Python and C++). They key each op's output layout by
    its inputs' meshes, and meshes compare by their ranks alone: in a process's second FSDP
    Trainer the parameters, gradients and optimizer state came out on the first Trainer's
    mesh, whose process group was destroyed ("Could not resolve the process group registered
    under the name ...", in megatron's grad norm and in checkpoints)."""
    from torch.distributed.tensor import debug
    debug._clear_sharding_prop_cache()


def collective_timeout(p: ParallelConfig) -> datetime.timedelta:
    """parallel.timeout_minutes: every process group of a run gets it (torch's default for a
    new gloo group is 30 minutes, whatever the default group has)."""
    return datetime.timedelta(minutes=p.timeout_minutes)


def shutdown(failed: bool = False) -> None:
    """Tear down the process groups. ``failed``: this rank is leaving on an error, its peers
    may be blocked in a collective with it; NCCL communicators are aborted, not destroyed
    (destroying waited on the blocked peer, so the failing rank never exited and torchrun
    never stopped the others: an interleaved-pipeline failure on two H200s hung that way)."""
    if not dist.is_initialized():
        return
    ps.destroy_model_parallel()
    if failed and dist.get_backend() == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
                return
            except Exception:  # pragma: no cover - best effort; destroy below
                pass
    dist.destroy_process_group()


ALIGN_BYTES = 256


def misaligned(wrapped: list, align: int = ALIGN_BYTES) -> list[str]:
    """Parameters whose main_grad (megatron DDP's fp32 gradient view) does not start on an
    ``align``-byte boundary. TE accumulates weight gradients straight into main_grad, and
    cuBLAS drops to slow kernels for unaligned output (a 10-class head cost 2x in step time:
    docs/design.md). megatron pads every parameter's start only with the distributed optimizer."""
    out = []
    for w in wrapped:
        for name, p in w.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and g.data_ptr() % align:
                out.append(name)
    return out


def parallelize(chunks: list, plan: Plan, d: Dist):
    """Apply frozen parameters, precision, data parallelism and graphs (in that order) to
    every chunk, as the plan says (its graph path, ``freeze`` rules and ``parallel:``
    section). Frozen parameters go first, so DDP, the optimizer and the graphs leave them out.
    Returns (wrapped chunks, graphs: a graph manager, or NoGraphs)."""
    p = plan.parallel
    if plan.freeze:
        n = freeze_params(chunks, plan.freeze, d.pp_rank, d.pp)
        log.info("frozen: %d parameter tensors on this rank (%s)", n,
                 ", ".join(f"{k}={pat}" for k, pat in plan.freeze))
    wrapped = list(chunks)
    if d.cuda:
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=p.grad_reduce_in_fp32, overlap_grad_reduce=p.overlap_grad_reduce,
            use_distributed_optimizer=p.distributed_optimizer,
            overlap_param_gather=p.overlap_param_gather and p.distributed_optimizer,
            check_for_nan_in_grad=False)
        out = []
        for i, chunk in enumerate(wrapped):
            if chunk.config.bf16:
                chunk = Float16Module(chunk.config, chunk)
            if p.fsdp:
                out.append(fsdp.wrap(chunk, ddp_cfg))
                continue
            # megatron buckets only the first chunk: later chunks reduce as one bucket each
            chunk = DistributedDataParallel(chunk.config, ddp_cfg, chunk, disable_bucketing=i > 0)
            chunk.broadcast_params()  # replicas start from the same weights (they already do)
            out.append(chunk)
        wrapped = out
        bad = [] if p.fsdp else misaligned(wrapped)
        if bad:
            log.warning("%d parameters have a main_grad off a 256-byte boundary (%s...): TE's fused "
                        "weight-gradient GEMMs fall back to slow kernels for them. "
                        "parallel.distributed_optimizer=true pads every one.", len(bad),
                        ", ".join(bad[:3]))
    elif p.fsdp:  # on CPU too: the same sharding and reductions over gloo
        wrapped = [fsdp.wrap(chunk) for chunk in wrapped]
    graphs = NoGraphs()
    if plan.graphs.scope == "step":
        graphs = StepGraphs(plan.graphs.config, barrier=dist.barrier)
    elif plan.graphs.enabled:
        graphs = GraphManager.for_model(wrapped, plan.graphs.config, pipeline_size=d.pp)
    return wrapped, graphs


def for_inference(chunks: list) -> list:
    """Chunks as evaluation runs them: bf16 through megatron-core's ``Float16Module`` (GPU),
    as ``parallelize`` casts them; no data parallelism, no graphs."""
    if not any(c.config.bf16 for c in chunks):
        return list(chunks)
    return [Float16Module(c.config, c) for c in chunks]
