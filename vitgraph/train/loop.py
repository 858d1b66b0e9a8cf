"""The training loop: microbatches through megatron-core's schedules, on CPU and GPU alike."""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from vitgraph import HARDWARE_QUEUES, hardware_queues
from vitgraph.config import Config, parse_steps, save_config, validate_machine
from vitgraph.convert.export_files import write_classes
from vitgraph.data import MicrobatchLoader, build_datasets, iterate_eval
from vitgraph.data.prefetch import Prefetcher
from vitgraph.data.shards import EncodedImages
from vitgraph.graphs.step import StepGraphs
from vitgraph.models.vit import unwrap
from vitgraph.parallel.setup import (Dist, collective_timeout, init_distributed, parallelize,
                                     shutdown, use_bf16)
from vitgraph.tasks import make_task
from vitgraph.tasks.base import reduce_stats
from vitgraph.train import checkpoint
from vitgraph.train.health import StepHealth
from vitgraph.train.optim import build_optimizer, build_scheduler
from vitgraph.train.preempt import Preempted, StopRequests
from vitgraph.train.runcheck import FinishedRun, check_run_dir, is_rank0

log = logging.getLogger("vitgraph")


def _setup_logging(run_dir: Path, rank: int, to_file: bool = True) -> None:
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    if rank != 0:
        log.addHandler(logging.NullHandler())
        return
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout)]
    if to_file:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)


class Progress:
    """A one-line progress bar on rank 0's terminal (nothing when stderr is not a terminal)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.t0 = total, start, time.time()
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, step: int, extra: str = "") -> None:
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        done = step - self.start
        eta = (time.time() - self.t0) / done * (self.total - step) if done else 0.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {step}/{self.total} eta {eta:5.0f}s {extra}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _eval_line(evals: dict) -> str:
    """'top1 0.9705 | loss 0.1234 | ...': a task's eval metrics, top-1 first."""
    keys = sorted((k for k in evals if k.startswith("eval_") and k != "eval_images"),
                  key=lambda k: (k != "eval_top1", k != "eval_loss", k))
    return " | ".join(f"{k[5:]} {evals[k]:.4f}" for k in keys)


class TrainingFailed(RuntimeError):
    """A failure during training, summarised on one line; the traceback is in train.log."""


def _split_padded(fields: tuple, k: int, multiple: int = 1, fill_label: int = -1) -> list:
    """One eval batch (images, labels, ...) as ``k`` equal microbatches of a multiple of
    ``multiple`` samples, filled up with copies of the first sample labelled ``fill_label``
    (the task leaves them out)."""
    labels = fields[1]
    m = -(-len(labels) // k)
    m = -(-m // multiple) * multiple
    pad = m * k - len(labels)
    def fill(i, f):
        if isinstance(f, EncodedImages):  # data.decode=cuda: finished on the device
            return f.padded(pad)
        return torch.cat([f, f.new_full((pad,), fill_label) if i == 1
                          else f[:1].expand(pad, *f.shape[1:])])
    if pad:
        fields = tuple(fill(i, f) for i, f in enumerate(fields))
    return list(zip(*(f.split(m) for f in fields)))


class Trainer:
    _fault = None  # test-only fault injection (train.inject_nan_steps): a device scalar
    _saved_step = -1  # the step of the newest checkpoint this process wrote or loaded
    stops: StopRequests | None = None

    def __init__(self, cfg: Config, readonly: bool = False):
        """``readonly`` (``vitgraph eval``): write nothing into the run directory (no config,
        train.log or TensorBoard files); log to stdout only."""
        self.cfg = cfg
        self.d: Dist = init_distributed(cfg)
        d = self.d
        self.run_dir = cfg.run_dir
        if d.rank == 0 and not readonly:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        dist.barrier()
        _setup_logging(self.run_dir, d.rank, to_file=not readonly)
        queues = hardware_queues()
        log.info("vitgraph: world %d = dp %d x tp %d x pp %d on %s", d.world, d.dp, d.tp, d.pp,
                 f"{torch.cuda.get_device_name()}, {queues} hardware queues "
                 "(CUDA_DEVICE_MAX_CONNECTIONS)" if d.cuda else "CPU (gloo, shims active)")
        if d.cuda and cfg.data.decode == "cuda" and queues < HARDWARE_QUEUES:
            log.warning("CUDA_DEVICE_MAX_CONNECTIONS=%d: with data.decode=cuda fewer hardware "
                        "queues slow training from shards (H200, ViT-B/16: 0.86x the synthetic "
                        "rate with 8, 0.95x with 32); unset it for vitgraph's %d",
                        queues, HARDWARE_QUEUES)

        # what is trained: the model, its batches and its loss (vitgraph.tasks)
        self.task = make_task(cfg, d)
        t0 = time.time()
        self.train_set, self.val_set = build_datasets(cfg.data, cfg.train.seed)
        self.task.attach(self.train_set, self.val_set)
        if d.rank == 0 and not readonly:  # the class names an export carries
            write_classes(self.run_dir, self.train_set.classes)
        log.info("data: %s, %d train / %d held-out images, %d classes (%.1fs)", cfg.data.kind,
                 len(self.train_set.labels), len(self.val_set.labels),
                 len(self.train_set.classes), time.time() - t0)

        # this rank's model chunks: one per virtual pipeline stage (parallel.vpp)
        self.chunks = self.task.build_model()
        self.model = self.chunks[0]
        if cfg.model.init_from and not readonly:
            from vitgraph.convert import init_from
            for chunk in self.chunks:
                init_from(chunk, cfg.model.init_from, cfg.model.init_format)
        self.wrapped, self.graphs = parallelize(self.chunks, cfg, d)
        self.bf16 = use_bf16(cfg, d)
        self.optimizer = build_optimizer(self.wrapped, cfg, d.cuda)

        t = cfg.train
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * d.dp)
        self.loader = MicrobatchLoader(self.train_set, t.micro_batch_size, self.num_microbatches,
                                       d.dp_rank, d.dp, t.seed)
        if cfg.data.prefetch:
            self.loader = Prefetcher(self.loader, d.device)
        self.total_steps = t.steps or math.ceil(t.epochs * self.loader.steps_per_epoch)
        self.task.total_steps = self.total_steps  # for schedules of the task's own
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.flops_per_sample = self.task.flops_per_sample
        log.info("model: %s, %s", self.task.describe(self.chunks, t.micro_batch_size),
                 self._precision_name())
        log.info("schedule: %d steps (%d per epoch), global batch %d = %d microbatches x %d x dp %d",
                 self.total_steps, self.loader.steps_per_epoch, t.global_batch_size,
                 self.num_microbatches, t.micro_batch_size, d.dp)

        mc = self.model.config
        if d.cuda:
            # as Megatron-LM wires its DDP chunks into the schedules: per-chunk no_sync /
            # grad_sync (gradient reduction overlapped with the backward pass), finalize
            from megatron.core.distributed import finalize_model_grads

            def per_chunk(fns):
                return fns if len(fns) > 1 else fns[0]

            mc.finalize_model_grads_func = finalize_model_grads
            mc.no_sync_func = per_chunk([w.no_sync for w in self.wrapped])
            if cfg.parallel.overlap_grad_reduce:
                mc.grad_sync_func = per_chunk([w.start_grad_sync for w in self.wrapped])
            if cfg.parallel.overlap_param_gather and cfg.parallel.distributed_optimizer:
                mc.param_sync_func = per_chunk([w.start_param_sync for w in self.wrapped])
            mc.grad_scale_func = self.optimizer.scale_loss
        self.forward_backward = get_forward_backward_func()
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.step = 0
        self.writer = None
        if d.rank == 0 and t.tensorboard and not readonly:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        if d.cuda:
            from vitgraph.graphs.cudnn import warn_if_fallback
            warn_if_fallback(log)

    # ------------------------------------------------------------------ steps

    def _precision_name(self) -> str:
        if self.cfg.train.precision == "fp8":
            return f"fp8 ({self.cfg.train.fp8_recipe} scaling) + bf16"
        return "bf16" if self.bf16 else "fp32"

    def _prepare(self, raw: tuple, key, model=None) -> tuple:
        """One microbatch as the model takes it, on the device (the task's ``prepare``).
        ``key`` = (step, microbatch) for training (augmented when data.augment is on), None
        for eval; ``model``: the chunk it is for (None: any chunk of this rank)."""
        models = [model] if model is not None else self.chunks
        first_stage = any(unwrap(m).pre_process for m in models)
        return self.task.prepare(raw, key, self.d.device, first_stage)

    def _feed(self, raw: list, model):
        """The schedule's data iterator for one model chunk: ``raw`` [(fields, key)] prepared
        one microbatch at a time, as the schedule asks."""
        for fields, key in raw:
            yield self._prepare(fields, key, model)

    def _forward_step(self, data_iterator, model):
        """megatron-core's ``forward_step_func``: (output, loss_func) for one microbatch."""
        inputs = next(data_iterator)
        output = self.task.forward(model, inputs)

        def loss_func(out):
            loss, stats = self.task.loss(inputs, out)
            if self._fault is not None:  # train.inject_nan_steps: 1, or NaN at a chosen step
                loss = loss * self._fault
                stats = stats * self._fault
            return loss, {"stats": stats}

        return output, loss_func

    def _eval_step(self, data_iterator, model):
        inputs = next(data_iterator)
        output = self.task.forward(model, inputs)
        return output, lambda out: (torch.zeros((), device=self.d.device),
                                    self.task.eval_outputs(inputs, out))

    def train_step(self, batches, between=None) -> tuple[torch.Tensor, object, object]:
        """One optimizer step over ``batches`` (this rank's microbatches): zero grads, the
        schedule's forward and backward, optimizer and LR schedule. Returns ([loss*n, correct, n]
        summed over microbatches, grad norm, whether the step was applied); the last two are
        device tensors with graphs.scope=step (nothing is read on the host then).
        ``between``: called once the step's kernels are queued, before the host waits for
        them (the loop puts the next step's data on the device there)."""
        keys = [(self.step, i) for i in range(len(batches))]
        if isinstance(self.graphs, StepGraphs):
            self.optimizer.load_lr()
            inputs = [self._prepare(fields, k) for fields, k in zip(batches, keys)]
            stats, grad_norm, ok = self.graphs.run(inputs, self._step_body)
            if between is not None:
                between()
            self.scheduler.step(increment=1)  # a skipped step is only known on the device
            return stats, grad_norm, ok
        # eager: each microbatch is prepared when the schedule asks for it
        data = list(zip(batches, keys))
        stats, grad_norm, ok = self._step_body(data, lazy=True, between=between)
        if ok:
            self.scheduler.step(increment=1)
        return stats, float(grad_norm or 0.0), ok

    def _step_body(self, data: list, lazy: bool = False, between=None) -> list:
        """What graphs.scope=step captures: [stats, grad norm, ok] from prepared microbatches
        (``lazy``: raw ones, prepared as the schedule reaches them)."""
        if self.d.cuda:
            for w in self.wrapped:
                w.zero_grad_buffer()
        self.optimizer.zero_grad()
        mb = len(data[0][0][1]) if lazy else len(data[0][-1])  # labels: raw [1], prepared [-1]
        out = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=[self._feed(data, w) if lazy else iter(data) for w in self.wrapped],
            model=self.wrapped, num_microbatches=len(data),
            seq_length=self.task.seq_length(self.chunks, mb), micro_batch_size=mb,
            forward_only=False)
        if between is not None:  # megatron's optimizer step waits for the device
            between()
        ok, grad_norm, _ = self.optimizer.step()
        self.task.after_update(self.chunks)
        stats = sum((o["stats"] for o in out), torch.zeros(3, device=self.d.device))
        if lazy:
            return [stats, grad_norm, ok]
        return [stats, torch.as_tensor(grad_norm, dtype=torch.float32, device=self.d.device),
                torch.as_tensor(ok, device=self.d.device)]

    @torch.no_grad()
    def evaluate(self, dataset=None) -> dict:
        """The task's held-out metrics on ``dataset`` (default the held-out split), never
        augmented: forward-only through the schedule, reduced by the task."""
        for w in self.wrapped:
            w.eval()
        outputs = []
        # the interleaved schedule needs at least pp microbatches; FP8 GEMMs a token count that
        # is a multiple of 16: a model that does not pad its tokens gets filled-up batches
        k = self.d.pp if self.d.vpp > 1 else 1
        fill = 16 if self.cfg.train.precision == "fp8" and \
            getattr(self.model, "pad_to", None) is None else 1
        for fields in iterate_eval(dataset or self.val_set, self.cfg.train.eval_batch_size,
                                   self.d.dp_rank, self.d.dp):
            mbs = _split_padded(fields, k, fill, self.task.fill_label)
            mb = len(mbs[0][1])
            outputs += self.forward_backward(
                forward_step_func=self._eval_step,
                data_iterator=[self._feed([(f, None) for f in mbs], w) for w in self.wrapped],
                model=self.wrapped, num_microbatches=k,
                seq_length=self.task.seq_length(self.chunks, mb), micro_batch_size=mb,
                forward_only=True)
        metrics = self.task.eval_metrics(outputs, self.chunks)
        for w in self.wrapped:
            w.train()
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def sharded_state(self, is_loading: bool = False) -> dict:
        """What a checkpoint holds, as megatron-core's dist_checkpointing takes it: model
        chunks and optimizer as sharded tensors with global names (any layout can load
        them), schedule and data position as common state."""
        model = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(self.chunks)}
        # fully_reshardable: the distributed optimizer's state gathered into per-parameter
        # tensors named after the model's (megatron's other formats reshard only across dp)
        optim = self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata={
            "distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True})
        return {**model, "optimizer": optim, "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict()}

    def save(self) -> None:
        path = checkpoint.save(self.ckpt_dir, self.step, self.d, self.sharded_state(),
                               self.cfg.checkpoint.keep)
        self._saved_step = self.step
        log.info("checkpoint: %s", path)

    def maybe_resume(self) -> None:
        if not self.cfg.checkpoint.resume:
            return
        path = checkpoint.find_resumable(self.ckpt_dir, self.d)
        if path is None:
            return
        state = checkpoint.load(path, self.d, self.sharded_state(is_loading=True))
        for i, c in enumerate(self.chunks):
            c.load_state_dict(state[f"model{i}"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.step = self._saved_step = state["step"]
        if self.graphs is not None:
            self.graphs.reset()  # parameters were overwritten: capture again
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------ the loop

    def _log(self, record: dict) -> None:
        if self.d.rank != 0:
            return
        with open(self.run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, record["step"])

    def _peak_mem_gib(self) -> float:
        if self.d.cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB

    def run(self) -> dict:
        cfg, d = self.cfg, self.d
        self.maybe_resume()
        t = cfg.train
        if self.stops is None:
            self.stops = StopRequests(collective_timeout(cfg)).install()
        health = StepHealth(t.max_bad_steps)
        nan_steps = parse_steps(t.inject_nan_steps)
        if nan_steps:
            self._fault = torch.ones((), device=d.device)
        progress = Progress(self.total_steps, self.step, t.progress and d.rank == 0)
        window = torch.zeros(3, device=d.device)
        window_steps, window_norm, window_good = 0, 0.0, 0
        t_window = t_start = time.time()
        record, nan = {}, float("nan")
        while self.step < self.total_steps:
            if self.graphs is not None:
                self.graphs.step_begin(self.step)
            if self._fault is not None:
                self._fault.fill_(nan if self.step + 1 in nan_steps else 1.0)
            stats, grad_norm, ok = self.train_step(self.loader.next_step(),
                                                   getattr(self.loader, "stage_next", None))
            self.step += 1
            window_steps += 1
            health.update(ok)
            if torch.is_tensor(ok):  # a skipped step's NaN stays out of the logged means
                window += torch.where(ok, stats, torch.zeros_like(stats))
                window_norm = window_norm + torch.where(ok, torch.as_tensor(grad_norm), 0.0)
                window_good = window_good + ok.long()
            elif ok:
                window += stats
                window_norm += grad_norm
                window_good += 1
            if health.on_host():  # known without a sync: stop at once
                health.check(self.step)
            last = self.step == self.total_steps
            if self.step % t.log_every == 0 or last:
                loss_sum, correct, n = reduce_stats(window, d).tolist()
                window_norm, window_good = float(window_norm), int(window_good)
                if d.cuda:
                    torch.cuda.synchronize()
                dt = time.time() - t_window
                ips = window_steps * t.global_batch_size / dt
                tflops = ips * self.flops_per_sample / d.world / 1e12  # per GPU
                record = {"step": self.step, "epoch": self.loader.epoch,
                          # None when every step of the window was skipped
                          "loss": loss_sum / n if n else None,
                          "train_top1": correct / n if n else None,
                          "lr": self.optimizer.param_groups[0]["lr"],
                          "grad_norm": window_norm / window_good if window_good else None,
                          "images_per_s": ips,
                          "tflops_per_gpu": tflops, "mfu": tflops * 1e12 / t.peak_flops,
                          "peak_mem_gib": self._peak_mem_gib(),
                          "skipped_steps": health.read()[0]}
                if self.graphs is not None:
                    record.update({f"graphs_{k}": v for k, v in self.graphs.stats().items()
                                   if isinstance(v, (int, float))})
                self._log(record)
                log.info("step %d/%d | loss %.4f | top1 %.3f | lr %.2e | grad %.3f | %.1f img/s "
                         "| %.2f TFLOP/s/gpu | MFU %.1f%% | mem %.2f GiB%s%s", self.step,
                         self.total_steps, *(nan if v is None else v for v in (
                             record["loss"], record["train_top1"], record["lr"],
                             record["grad_norm"])), ips, tflops, 100 * record["mfu"],
                         record["peak_mem_gib"], self._graph_summary(),
                         f" | skipped {record['skipped_steps']} non-finite steps"
                         if record["skipped_steps"] else "")
                health.check(self.step)
                window.zero_()
                window_steps, window_norm, window_good = 0, 0.0, 0
                t_window = time.time()
            progress.update(self.step)
            if not last and self.stops.poll():
                self._stop_preempted()
            if (t.eval_every and self.step % t.eval_every == 0) and not last:
                evals = self.evaluate()
                self._log({"step": self.step, **evals})
                log.info("eval step %d | %s", self.step, _eval_line(evals))
                t_window = time.time()  # eval time stays out of img/s
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and not last:
                health.check(self.step)  # a run of bad steps at the limit stops unsaved
                self.save()
                t_window = time.time()
        progress.close()
        health.check(self.step)
        wall = time.time() - t_start
        evals = self.evaluate()
        self._log({"step": self.step, **evals})
        log.info("eval step %d | %s", self.step, _eval_line(evals))
        if self.step > self._saved_step:
            self.save()
        record = record or self._last_train_record()  # finishing a run stopped after its save
        metrics = {"step": self.step, **evals,
                   **{k: record[k] for k in ("loss", "train_top1", "images_per_s", "mfu",
                                             "peak_mem_gib", "skipped_steps") if k in record},
                   "wall_s_this_process": wall, "model": cfg.model.name,
                   "run_dir": str(self.run_dir), "total_steps": self.total_steps,
                   "steps_per_epoch": self.loader.steps_per_epoch}
        if self.graphs is not None:
            metrics["graphs"] = self.graphs.stats()
        if d.rank == 0:
            path = self.run_dir / "metrics.json"
            tmp = path.with_name("metrics.json.partial")
            tmp.write_text(json.dumps(metrics, indent=2) + "\n")
            os.replace(tmp, path)
            log.info("final metrics: %s", path.resolve())
        return metrics

    def _stop_preempted(self) -> None:
        """A stop signal reached a rank: every rank is here at the same step. Save and leave."""
        if self.step > self._saved_step:
            self.save()
        log.warning("%s received: stopped after step %d/%d with checkpoint step_%06d saved; "
                    "run the same command to resume", self.stops.received or "a stop signal "
                    "(on another rank)", self.step, self.total_steps, self._saved_step)
        raise Preempted(f"preempted after step {self.step}/{self.total_steps}; checkpoint "
                        f"{self.ckpt_dir / f'step_{self._saved_step:06d}'} saved; run the same "
                        f"command to resume")

    def _last_train_record(self) -> dict:
        path = self.run_dir / "log.jsonl"
        if self.d.rank != 0 or not path.is_file():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return next((r for r in reversed(records) if "loss" in r), {})

    def _graph_summary(self) -> str:
        if self.graphs is None:
            return ""
        s = self.graphs.stats()
        fallbacks = sum(s["eager_fallbacks"].values())
        return (f" | graphs {s['graphs']} (capture {s['capture_time_s']:.2f}s, pool "
                f"{s['pool_bytes'] / 2**20:.0f} MiB, replays {s['replays']}, eager calls "
                f"{fallbacks}, unseen shapes {s['unseen_shapes']})")

    def close(self, shutdown_dist: bool = True, failed: bool = False):
        if self.stops is not None:
            self.stops.close(wait=not failed)
        if isinstance(getattr(self, "loader", None), Prefetcher):
            self.loader.close()
        if self.writer is not None:
            self.writer.close()
        if self.graphs is not None:
            self.graphs.restore()
        if shutdown_dist:
            shutdown(failed)


def train(cfg: Config) -> dict:
    """Train ``cfg``'s run (resuming it if its folder holds one). Raises ConfigError before any
    work when the folder holds a different run; returns the stored metrics of a finished run
    without touching it."""
    validate_machine(cfg)
    try:
        changes = check_run_dir(cfg)
    except FinishedRun as done:
        if is_rank0():
            print(done, flush=True)
        return done.metrics
    trainer, failed = None, False
    stops = StopRequests(collective_timeout(cfg)).install()
    try:
        trainer = Trainer(cfg)
        trainer.stops = stops
        for key, old, new in changes:
            log.info("resuming with a changed setting: %s %r -> %r", key, old, new)
        return trainer.run()
    except Preempted:
        raise
    except BaseException as e:
        failed = True
        step = trainer.step if trainer is not None else None
        _log_failure(cfg, step)
        if isinstance(e, Exception) and not _users_input(e):
            raise TrainingFailed(_summary(cfg, trainer, e)) from e
        raise
    finally:
        stops.close(wait=not failed)
        if trainer is not None:
            trainer.close(failed=failed)
        else:
            shutdown(failed)


def _users_input(e: Exception) -> bool:
    """Errors the CLI reports as the user's input (exit 2) rather than a training failure."""
    from vitgraph.config import ConfigError
    from vitgraph.convert import ConvertError
    from vitgraph.data import DataError
    return isinstance(e, (ConfigError, ConvertError, DataError, checkpoint.NoIntactCheckpoint))


def _log_failure(cfg: Config, step) -> None:
    """Every failing rank appends its traceback to train.log; the terminal gets one line."""
    path = cfg.run_dir / "train.log"
    if not path.parent.is_dir():
        return
    where = f"at step {step}" if step is not None else "before training"
    stamp = time.strftime("%H:%M:%S")
    with open(path, "a") as f:
        f.write(f"{stamp} ERROR rank {os.environ.get('RANK', '0')} failed {where}:\n"
                f"{traceback.format_exc()}")


def _summary(cfg: Config, trainer, e: Exception) -> str:
    where = f"after step {trainer.step}" if trainer is not None else "before training"
    resume = ""
    if trainer is not None and trainer._saved_step >= 0:
        resume = f"; the same command resumes from checkpoint step {trainer._saved_step}"
    return (f"training failed {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f" (traceback in {cfg.run_dir / 'train.log'}){resume}")
