"""The training loop: microbatches through megatron-core's schedules, on CPU and GPU alike."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import traceback

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from vitgraph import HARDWARE_QUEUES, StopSignals, hardware_queues
from vitgraph.config import Config, ConfigError, validate_machine
from vitgraph.convert import ConvertError
from vitgraph.convert.export_files import write_classes
from vitgraph.data import DataError, MicrobatchLoader, PackedLoader, build_datasets, decode_line
from vitgraph.data.augment import augment_line
from vitgraph.data.prefetch import Prefetcher
from vitgraph.graphs.cudnn import warn_if_fallback
from vitgraph.models.vit import unwrap
from vitgraph.output import plural
from vitgraph.parallel.setup import (collective_timeout, init_distributed, launched_world_size,
                                     parallelize, shutdown)
from vitgraph.plan import resolve
from vitgraph.tasks import make_task
from vitgraph.train.checkpoint import Checkpointer, NoIntactCheckpoint
from vitgraph.train.ema import build_ema
from vitgraph.train.evaluate import Evaluator, ema_metrics
from vitgraph.train.events import Schedule
from vitgraph.train.health import StepHealth
from vitgraph.train.metrics import (MetricsWindow, RecordLog, StepResult, eval_line, graphs_line,
                                    train_line)
from vitgraph.train.optim import build_optimizer, build_scheduler, lr_scales, optim_line
from vitgraph.train.preempt import INTERRUPTED_EXIT, Preempted, StopRequests
from vitgraph.train.runcheck import (FinishedRun, check_run_dir, is_rank0, new_run_hint,
                                     save_config, set_aside_previous_run)

log = logging.getLogger("vitgraph")


def _start_run_dir(cfg: Config) -> None:
    """The run folder and its log, on rank 0 (torchrun's RANK), before the process groups: the
    others wait for it where the groups are made. Starting over (checkpoint.resume=false)
    first moves the previous run's files aside, into a folder of their own. config.yaml is
    written once start-up is through (Trainer._own_run_dir)."""
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    if not is_rank0():
        log.addHandler(logging.NullHandler())
        return
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    moved = None if cfg.checkpoint.resume else set_aside_previous_run(cfg.run_dir)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    for h in (logging.StreamHandler(sys.stdout), logging.FileHandler(cfg.run_dir / "train.log")):
        h.setFormatter(fmt)
        log.addHandler(h)
    if moved is not None:
        folder, names = moved
        log.info("checkpoint.resume=false: the previous run's %s moved to %s/ (delete it if "
                 "you do not need it)", ", ".join(names), folder)


class Progress:
    """A one-line progress bar on rank 0's terminal (nothing when stderr is not a terminal).
    A log line to the terminal clears it first (the bar has no newline of its own: the line
    was written on after it), and the next update draws it again below."""

    def __init__(self, total: int, start: int, enabled: bool, logger=log):
        self.total, self.start, self.t0 = total, start, time.time()
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False
        # the log's terminal handlers (a FileHandler is a StreamHandler too: not those)
        self._handlers = [h for h in logger.handlers if isinstance(h, logging.StreamHandler)
                          and not isinstance(h, logging.FileHandler)] if self.enabled else []
        for h in self._handlers:
            h.addFilter(self)

    def update(self, step: int, extra: str = "") -> None:
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        done = step - self.start
        eta = (time.time() - self.t0) / done * (self.total - step) if done else 0.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {step}/{self.total} eta {eta:5.0f}s {extra}")
        sys.stderr.flush()
        self.shown = True

    def filter(self, record) -> bool:
        """Before a log line reaches the terminal: the bar's line cleared (logging.Filter)."""
        if self.shown:
            sys.stderr.write("\r\x1b[K")  # to the line's start, erase to its end
            sys.stderr.flush()
            self.shown = False
        return True

    def close(self) -> None:
        for h in self._handlers:
            h.removeFilter(self)
        if self.shown:
            sys.stderr.write("\n")
            self.shown = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # a stop or a failure too: its message starts on a line of its own


class TrainingFailed(RuntimeError):
    """A failure during training, summarised on one line; the traceback is in train.log."""


class Trainer:
    """One run's training on this rank: ``cfg`` resolved into a plan (vitgraph.plan), then
    built from it (process groups, task, data, model, optimizer), then ``run()``. ``stops``:
    the run's stop requests (train() installs them before start-up, so a signal during it is
    not lost: it stops the run at the next start-up milestone); None: installed by ``run``."""

    def __init__(self, cfg: Config, stops: StopRequests | None = None):
        self.stops = stops
        self.cfg = cfg  # for the run folder's config.yaml and the hints of error messages
        self.run_dir = cfg.run_dir
        _start_run_dir(cfg)
        try:
            self._build(cfg)
        except BaseException:  # a stop signal at a milestone, or a failure: let go of what
            self.close(shutdown_dist=False, failed=True)  # was made (train() shuts down)
            raise

    def _at_startup(self, phase: str) -> None:
        """A start-up milestone: stop here, nothing saved, when a stop signal has come."""
        if self.stops is None:
            return
        try:
            self.stops.at_startup(phase)
        except Preempted as e:
            log.warning("%s", e)
            raise

    def _build(self, cfg: Config) -> None:
        """The plan, the process groups, the data, the task and the model, then what trains
        it (_build_training), with a start-up milestone after each long part."""
        self.plan = plan = resolve(cfg, launched_world_size())
        self.d = d = init_distributed(plan)
        self._at_startup("process groups")
        t = plan.train
        queues = hardware_queues()
        log.info("vitgraph: world %d = dp %d x tp %d x pp %d on %s", d.world, d.dp, d.tp, d.pp,
                 f"{torch.cuda.get_device_name()}, {queues} hardware queues "
                 "(CUDA_DEVICE_MAX_CONNECTIONS)" if d.cuda else "CPU (gloo, shims active)")
        if d.cuda and plan.data.decode != "cpu" and queues < HARDWARE_QUEUES:
            log.warning("CUDA_DEVICE_MAX_CONNECTIONS=%d: with data.decode=cuda fewer hardware "
                        "queues slow training from shards (H200, ViT-B/16: 0.86x the synthetic "
                        "rate with 8, 0.95x with 32); unset it for vitgraph's %d",
                        queues, HARDWARE_QUEUES)
        log.info("augmentation: %s%s", augment_line(plan.data.augment,
                                                    plan.task == "classification"),
                 ", on the GPU compiled by torch.compile at its first call"
                 if d.cuda and plan.data.augment.enabled else "")
        # the data, this rank's loader and the run's length
        t0 = time.time()
        self.num_microbatches = plan.num_microbatches
        self.train_set, self.val_set = build_datasets(plan.data, t.seed, plan.native)
        if plan.native:  # one pack per microbatch (vitgraph.data.native)
            self.loader = PackedLoader(self.train_set, plan.pack, self.num_microbatches,
                                       d.dp_rank, d.dp, t.seed, plan.data.packing.window,
                                       augment_cfg=plan.data.augment)
        else:
            self.loader = MicrobatchLoader(self.train_set, t.micro_batch_size,
                                           self.num_microbatches, d.dp_rank, d.dp, t.seed)
        self.total_steps = t.steps or math.ceil(t.epochs * self.loader.steps_per_epoch)
        self._at_startup("data")
        # the task (vitgraph.tasks: the model, its batches and its loss) and this rank's model
        # chunks (one per virtual pipeline stage), wrapped for precision, data parallelism and
        # graphs
        decoded = decode_line(plan.data, plan.native, d.cuda)
        self.task = make_task(plan, d, self.total_steps)
        self.task.attach(self.train_set, self.val_set)
        if plan.data.prefetch:
            self.loader = Prefetcher(self.loader, d.device, self.task.host_fields)
        log.info("data: %s, %d train / %d held-out images, %d classes%s (%.1fs)", plan.data.kind,
                 len(self.train_set.labels), len(self.val_set.labels),
                 len(self.train_set.classes), f", {decoded}" if decoded else "",
                 time.time() - t0)
        self.chunks = self.task.build_model()
        self.model = self.chunks[0]
        self.wrapped, self.graphs = parallelize(self.chunks, plan, d)
        self._build_training()
        self._at_startup("model build")

    def _build_training(self) -> None:
        """What trains the wrapped chunks: the optimizer, its LR schedule, the EMA, megatron's
        hooks, the step, the evaluator, the log and the checkpoints."""
        d, t, plan = self.d, self.plan.train, self.plan
        self.optimizer = build_optimizer(self.wrapped, plan)
        # train.ema: beside the optimizer's fp32 weights (sharded as they are)
        self.ema = build_ema(plan.ema, self.optimizer, d.device)
        self.scheduler = build_scheduler(self.optimizer, plan.optim, self.total_steps)
        self.flops_per_sample = self.task.flops_per_sample
        drop_path = plan.model.drop_path_rate
        log.info("model: %s, %s%s", self.task.describe(self.chunks, t.micro_batch_size),
                 plan.precision_name,
                 f", drop path {drop_path:g} (model.drop_path_rate)" if drop_path else "")
        log.info("optim: %s", optim_line(plan.optim, lr_scales(
            self.chunks, plan.optim.layer_decay, plan.lr_rules), plan.lr_rules))
        log.info("graphs: %s", plan.graphs)
        if plan.pack_layout is not None:
            log.info("packing: %s", plan.pack_layout)
        # a native run's batch counts packs (the model line says what a pack holds), not images
        batch = (plural(t.global_batch_size, "pack") if plan.pack is not None
                 else str(t.global_batch_size))
        log.info("schedule: %d steps (%d per epoch), global batch %s = %s x %d x dp %d",
                 self.total_steps, self.loader.steps_per_epoch, batch,
                 plural(self.num_microbatches, "microbatch"), t.micro_batch_size, d.dp)
        if d.cuda:
            _wire_ddp(self.model.config, self.wrapped, self.optimizer, plan.parallel)
        self.forward_backward = get_forward_backward_func()
        self.evaluator = Evaluator(self.task, self.wrapped, self.chunks, d,
                                   t.eval_batch_size, plan.fp8, plan.pack)
        # graphs.scope=step captures the whole step; every other path runs it eagerly
        self.train_step = self._graphed_step if plan.graphs.scope == "step" else self._eager_step
        self.schedule = Schedule(self.total_steps, t.log_every, t.eval_every)
        self.records = RecordLog(self.run_dir, d.rank == 0, t.tensorboard)
        self.checkpointer = Checkpointer(plan.checkpoint, self.run_dir, self.total_steps, d,
                                         self.chunks, self.optimizer, self.scheduler,
                                         self.loader, self.ema, plan.fsdp,
                                         new_run_hint(self.cfg))
        self.step = 0
        if d.cuda:
            warn_if_fallback(log)

    # ------------------------------------------------------------------ steps

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
            return loss, {"stats": stats}

        return output, loss_func

    def _eager_step(self, batches, between=None) -> StepResult:
        """One optimizer step over ``batches`` (this rank's microbatches): zero grads, the
        schedule's forward and backward, optimizer and LR schedule; each microbatch is
        prepared when the schedule asks for it. ``between``: called once the step's kernels
        are queued, before the host waits for them (the loop puts the next step's data on
        the device there)."""
        data = [(fields, (self.step, i)) for i, fields in enumerate(batches)]
        stats, grad_norm, ok = self._step_body(data, lazy=True, between=between)
        if ok:
            self.scheduler.step(increment=1)
        device = self.d.device
        return StepResult(stats, torch.tensor(float(grad_norm or 0.0), dtype=torch.float64,
                                              device=device),
                          torch.tensor(bool(ok), device=device), ok_on_host=bool(ok))

    def _graphed_step(self, batches, between=None) -> StepResult:
        """The same step replayed as one CUDA graph (graphs.scope=step): every microbatch is
        prepared into the graph's inputs first; nothing is read on the host."""
        self.optimizer.load_lr()
        inputs = [self._prepare(fields, (self.step, i)) for i, fields in enumerate(batches)]
        stats, grad_norm, ok = self.graphs.run(inputs, self._step_body)
        if between is not None:
            between()
        self.scheduler.step(increment=1)  # a skipped step is only known on the device
        return StepResult(stats, grad_norm, ok)

    def _step_body(self, data: list, lazy: bool = False, between=None) -> list:
        """What graphs.scope=step captures: [stats, grad norm, ok] from prepared microbatches
        (``lazy``: raw ones, prepared as the schedule reaches them)."""
        if self.d.cuda:
            for w in self.wrapped:
                w.zero_grad_buffer()
        self.optimizer.zero_grad()
        # a pack is one sequence (micro-batch 1); else the labels' length: raw [1], prepared [-1]
        mb = 1 if self.plan.native else len(data[0][0][1]) if lazy else len(data[0][-1])
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
        if self.ema is not None:  # a skipped step (ok False, or 0 on the device) leaves it
            self.ema.update(ok)
        stats = sum((o["stats"] for o in out),
                    torch.zeros(3 + len(self.task.extra_stats), device=self.d.device))
        if lazy:
            return [stats, grad_norm, ok]
        return [stats, torch.as_tensor(grad_norm, dtype=torch.float32, device=self.d.device),
                torch.as_tensor(ok, device=self.d.device)]

    def evaluate(self, dataset=None) -> dict:
        """The task's held-out metrics on ``dataset`` (default the held-out split)."""
        return self.evaluator(dataset or self.val_set)

    # ------------------------------------------------------------------ checkpoints

    def maybe_resume(self) -> None:
        """Continue from the run's newest intact checkpoint, where there is one."""
        step = self.checkpointer.resume()
        if step is not None:
            self.step = step
            self.graphs.reset()  # parameters were overwritten: capture again

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        """Train to the last step (resuming first), then evaluate, save and write
        metrics.json; its contents are returned."""
        t = self.plan.train
        self.maybe_resume()
        if self.stops is None:
            self.stops = StopRequests(collective_timeout(self.plan.parallel)).install()
        self._at_startup("resume")  # the last milestone: graphs are captured in the first steps
        self._own_run_dir()
        health = StepHealth(t.max_bad_steps)
        window = MetricsWindow(self.d.device, self.d, t.global_batch_size,
                               self.flops_per_sample, t.peak_flops if self.d.cuda else None,
                               pack_flops=self.task.pack_flops if self.plan.native else None,
                               extra_stats=self.task.extra_stats)
        t_start, first_step, record = time.time(), self.step, {}
        with Progress(self.total_steps, self.step, t.progress and self.d.rank == 0) as progress:
            while self.step < self.total_steps:
                self.graphs.step_begin(self.step)
                result = self.train_step(self.loader.next_step(),
                                         getattr(self.loader, "stage_next", None))
                self.step += 1
                health.update(result.outcome)
                window.add(result, getattr(self.loader, "last_counts", None))
                if health.on_host():  # known without a sync: stop at once
                    health.check(self.step)
                due = self.schedule.after(self.step)
                if due.log:
                    eta = (time.time() - t_start) / (self.step - first_step) \
                        * (self.total_steps - self.step)
                    record = self._log_window(window, health, eta)
                progress.update(self.step)
                if due.stop_check and self.stops.poll():
                    self._stop_preempted()
                if due.eval:
                    self._evaluate_and_log()
                    window.restart_clock()
                if self.checkpointer.due(self.step):
                    health.check(self.step)  # a run of bad steps at the limit stops unsaved
                    self.checkpointer.save(self.step)
                    window.restart_clock()
        health.check(self.step)
        return self._finish(record, time.time() - t_start)

    def _own_run_dir(self) -> None:
        """Rank 0, once start-up is through: config.yaml (what a resume is checked against)
        and classes.json (what an export names the classes by). Not earlier: a start that
        fails (every checkpoint damaged, a stop signal) leaves them as they were."""
        if self.d.rank == 0:
            save_config(self.cfg, self.run_dir / "config.yaml")
            write_classes(self.run_dir, self.train_set.classes)

    def _log_window(self, window: MetricsWindow, health: StepHealth, eta_s: float) -> dict:
        graphs = self.graphs.stats()
        record = window.close(self.step, epoch=self.loader.epoch,
                              lr=self.scheduler.get_lr({}),  # the base (head) lr, any groups
                              skipped_steps=health.read()[0],
                              **{f"graphs_{k}": v for k, v in graphs.items()
                                 if isinstance(v, (int, float))})
        self.records.write(record)
        log.info("%s", train_line(record, self.total_steps, eta_s, graphs_line(graphs)))
        health.check(self.step)
        return record

    def _evaluate_and_log(self) -> dict:
        evals = self.evaluate()
        if self.ema is not None and self.plan.ema.eval:  # raw eval_X, EMA eval_ema_X
            with self.ema.swapped(self.wrapped):
                evals.update(ema_metrics(self.evaluate()))
        self.records.write({"step": self.step, **evals})
        log.info("eval step %d | %s", self.step, eval_line(evals))
        return evals

    def _finish(self, record: dict, wall: float) -> dict:
        """The end of the run: the last evaluation, the last checkpoint, metrics.json."""
        evals = self._evaluate_and_log()
        if self.step > self.checkpointer.saved_step:
            self.checkpointer.save(self.step)
        record = record or self.records.last_train_record()  # a run stopped after its save
        metrics = {"step": self.step, **evals,
                   **{k: record[k] for k in ("loss", "loss_task", "loss_distill", "train_top1",
                                             "images_per_s", "mfu",
                                             "peak_mem_gib", "peak_reserved_gib", "skipped_steps")
                                             if k in record},
                   "wall_s_this_process": wall, "model": self.plan.model.name,
                   "run_dir": str(self.run_dir), "total_steps": self.total_steps,
                   "steps_per_epoch": self.loader.steps_per_epoch}
        graphs = self.graphs.stats()
        if graphs:
            metrics["graphs"] = graphs
        if self.d.rank == 0:
            path = self.run_dir / "metrics.json"
            tmp = path.with_name("metrics.json.partial")
            tmp.write_text(json.dumps(metrics, indent=2) + "\n")
            os.replace(tmp, path)
            log.info("final metrics: %s", path.resolve())
        return metrics

    def _stop_preempted(self) -> None:
        """A stop signal reached a rank: every rank is here at the same step. Save and leave."""
        if self.step > self.checkpointer.saved_step:
            self.checkpointer.save(self.step)
        saved, code = self.checkpointer.saved_line(), self.stops.exit_code()
        log.warning("%s received: stopped after step %d/%d; %s", self.stops.by(), self.step,
                    self.total_steps, saved)
        what = f"interrupted by {self.stops.by()}" if code == INTERRUPTED_EXIT else "preempted"
        raise Preempted(f"{what} after step {self.step}/{self.total_steps}; {saved}", code)

    def close(self, shutdown_dist: bool = True, failed: bool = False):
        if self.stops is not None:
            self.stops.close(wait=not failed)
        if isinstance(getattr(self, "loader", None), Prefetcher):
            self.loader.close()
        if getattr(self, "records", None) is not None:
            self.records.close()
        if getattr(self, "graphs", None) is not None:
            self.graphs.restore()
        if shutdown_dist:
            shutdown(failed)


def _wire_ddp(mc, wrapped: list, optimizer, p) -> None:
    """As Megatron-LM wires its DDP chunks into the schedules (GPU): per-chunk no_sync /
    grad_sync (gradient reduction overlapped with the backward pass), finalize."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(fns):
        return fns if len(fns) > 1 else fns[0]

    mc.finalize_model_grads_func = finalize_model_grads
    mc.no_sync_func = per_chunk([w.no_sync for w in wrapped])
    if p.overlap_grad_reduce:
        mc.grad_sync_func = per_chunk([w.start_grad_sync for w in wrapped])
    if p.overlap_param_gather and p.distributed_optimizer:
        mc.param_sync_func = per_chunk([w.start_param_sync for w in wrapped])
    mc.grad_scale_func = optimizer.scale_loss


def train(cfg: Config, signals: StopSignals | None = None) -> dict:
    """Train ``cfg``'s run (resuming it if its folder holds one). Raises ConfigError before any
    work when the folder holds a different run; returns the stored metrics of a finished run
    without touching it. ``signals``: the stop signals the CLI has recorded since before its
    imports (None: recorded from here on). Raises Preempted when one comes: at the next
    start-up milestone, or after the step that is running, saved."""
    validate_machine(cfg)
    try:
        changes = check_run_dir(cfg)
    except FinishedRun as done:
        if is_rank0():
            print(done, flush=True)
        return done.metrics
    trainer, failed = None, False
    stops = StopRequests(collective_timeout(cfg.parallel), signals)
    try:
        stops.at_startup("launch")  # before the run folder, the data and the writer helper
        stops.install()
        trainer = Trainer(cfg, stops)
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
    return isinstance(e, (ConfigError, ConvertError, DataError, NoIntactCheckpoint))


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
    if trainer is not None and trainer.checkpointer.saved_step >= 0:
        resume = f"; the same command resumes from checkpoint step {trainer.checkpointer.saved_step}"
    return (f"training failed {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f" (traceback in {cfg.run_dir / 'train.log'}){resume}")
