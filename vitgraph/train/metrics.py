"""What the training loop reports: one step's result, the window of steps between two log
steps (summed on the device, read on the host once per window), the log line, and the
records of log.jsonl and TensorBoard."""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vitgraph.tasks.base import reduce_stats


@dataclass
class StepResult:
    """One optimizer step, as device tensors whatever ran it (eager or a captured graph):
    ``stats`` [loss x n, correct, n, *extra x n] summed over its microbatches, ``grad_norm`` and ``ok``
    (the update was applied). ``ok_on_host``: the same flag where the host knows it without a
    sync (eager: megatron read the norm), None under step graphs."""
    stats: torch.Tensor
    grad_norm: torch.Tensor
    ok: torch.Tensor
    ok_on_host: bool | None = None

    @property
    def outcome(self):
        """``ok`` as cheaply as it can be had: the host's bool, else the device tensor."""
        return self.ok if self.ok_on_host is None else self.ok_on_host


def eval_line(evals: dict) -> str:
    """'top1 0.9705 | loss 0.1234 | ...': a task's eval metrics, top-1 (a classifier's, or an
    image-text pair's zero-shot) first; the EMA weights' (``eval_ema_*``, train.ema.eval)
    after the raw weights', in the same order: '... | ema_top1 0.9712 | ema_loss 0.1201'."""
    first = ("top1", "zero_shot_top1", "loss")

    def order(k):
        name = k[5:]
        ema = name.startswith("ema_")
        name = name[4:] if ema else name
        return ema, first.index(name) if name in first else len(first), name

    keys = sorted((k for k in evals if k.startswith("eval_") and k != "eval_images"), key=order)
    return " | ".join(f"{k[5:]} {evals[k]:.4f}" for k in keys)


def duration(seconds: float) -> str:
    """'42s', '7m05s', '3h02m': an ETA as a person reads it."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class MetricsWindow:
    """The steps since the last log step. ``add`` sums on the device (a skipped step's
    non-finite values stay out); ``close`` reduces over the ranks, reads the sums once and
    starts the next window. ``peak_flops``: the device's peak FLOP/s, None where it is not
    known (CPU): then the record has no MFU. ``extra_stats``: the names of the task's further
    loss terms (Task.extra_stats), each logged as its mean over the window's samples."""

    def __init__(self, device: torch.device, d, global_batch: int, flops_per_sample: float,
                 peak_flops: float | None,
                 pack_flops: tuple[float, float, float] | None = None,
                 extra_stats: tuple[str, ...] = ()):
        self.device, self.d = device, d
        self.global_batch, self.flops_per_sample = global_batch, flops_per_sample
        self.peak_flops = peak_flops
        # native resolution: a step's images and tokens vary; the loader counts them on the
        # host (PackedLoader.last_counts) and FLOPs are (per token, per attended token pair,
        # per image: the task's Task.pack_flops)
        self.pack_flops = pack_flops
        self.extra_stats = extra_stats
        self.stats = torch.zeros(3 + len(extra_stats), device=device)
        self._clear()

    def _clear(self) -> None:
        self.stats.zero_()
        self.norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.good = torch.zeros((), dtype=torch.long, device=self.device)
        self.steps = 0
        self.counts = {"images": 0, "tokens": 0, "patches": 0, "token_pairs": 0}
        self.t0 = time.time()

    def add(self, r: StepResult, counts: dict | None = None) -> None:
        """One step; ``counts``: its images and tokens over the world where they vary (packs:
        images, tokens with their prefix, real patches, sum of squared image token counts)."""
        if counts is not None:
            for k in self.counts:
                self.counts[k] += counts[k]
        self.stats += torch.where(r.ok, r.stats, torch.zeros_like(r.stats))
        self.norm += torch.where(r.ok, r.grad_norm.to(torch.float64), 0.0)
        self.good += r.ok.long()
        self.steps += 1

    def restart_clock(self) -> None:
        """Time spent outside training steps (eval, checkpoints) stays out of img/s."""
        self.t0 = time.time()

    def close(self, step: int, **extra) -> dict:
        """The window's record (a sync point); the next window starts empty."""
        loss_sum, correct, n, *extra_sums = reduce_stats(self.stats, self.d).tolist()
        norm, good = float(self.norm), int(self.good)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - self.t0
        extra_rates = {}
        if self.pack_flops is not None:  # packs: what the loader counted
            c, (per_token, per_pair, per_image) = self.counts, self.pack_flops
            ips = c["images"] / dt
            flops = c["tokens"] * per_token + c["token_pairs"] * per_pair + c["images"] * per_image
            tflops = flops / dt / self.d.world / 1e12
            extra_rates["real_tokens_per_s"] = c["patches"] / dt
        else:
            ips = self.steps * self.global_batch / dt
            tflops = ips * self.flops_per_sample / self.d.world / 1e12  # per GPU
        record = {"step": step, "epoch": extra.pop("epoch"),
                  # None when every step of the window was skipped
                  "loss": loss_sum / n if n else None,
                  "train_top1": correct / n if n else None,
                  **{k: s / n if n else None for k, s in zip(self.extra_stats, extra_sums)},
                  "lr": extra.pop("lr"),
                  "grad_norm": norm / good if good else None,
                  "images_per_s": ips, **extra_rates, "tflops_per_gpu": tflops}
        if self.peak_flops:
            record["mfu"] = tflops * 1e12 / self.peak_flops
        record.update(peak_mem_gib=peak_mem_gib(self.device), **extra)
        if self.device.type == "cuda":
            # what the caching allocator holds (graph pools included): what `vitgraph plan`
            # predicts and what runs out first
            record["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        self._clear()
        return record


def peak_mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def train_line(record: dict, total_steps: int, eta_s: float, graphs: str = "") -> str:
    """The log line of a window's record: 'step 10/200 | loss 2.3049 | ... | eta 1m02s'."""
    nan = float("nan")
    loss, top1, lr, norm = (nan if record[k] is None else record[k]
                            for k in ("loss", "train_top1", "lr", "grad_norm"))
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    skipped = record.get("skipped_steps")
    # distillation: the two terms the loss mixes
    terms = "".join(f" | {k[5:]} {record[k]:.4f}" for k in ("loss_task", "loss_distill")
                    if record.get(k) is not None)
    return (f"step {record['step']}/{total_steps} | loss {loss:.4f}{terms} | top1 {top1:.3f} | "
            f"lr {lr:.2e} | grad {norm:.3f} | {record['images_per_s']:.1f} img/s | "
            f"{record['tflops_per_gpu']:.2f} TFLOP/s/{'gpu' if mfu else 'device'}{mfu} | "
            f"mem {record['peak_mem_gib']:.2f} GiB | eta {duration(eta_s)}{graphs}"
            + (f" | skipped {skipped} non-finite steps" if skipped else ""))


def graphs_line(stats: dict) -> str:
    """' | graphs 12 (capture ...)': the graph managers' counters; '' without graphs."""
    if not stats:
        return ""
    fallbacks = sum(stats["eager_fallbacks"].values())
    return (f" | graphs {stats['graphs']} (capture {stats['capture_time_s']:.2f}s, pool "
            f"{stats['pool_bytes'] / 2**20:.0f} MiB, replays {stats['replays']}, eager calls "
            f"{fallbacks}, unseen shapes {stats['unseen_shapes']})")


class RecordLog:
    """log.jsonl (and TensorBoard's scalars) of rank 0; other ranks write nothing."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.path = run_dir / "log.jsonl"
        self.enabled = enabled
        self.tensorboard = run_dir / "tensorboard" if enabled and tensorboard else None
        self.writer = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None and self.writer is None:
            # at the first record, not before: a start that fails writes no events file
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.tensorboard))
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, record["step"])

    def last_train_record(self) -> dict:
        """The newest training record of log.jsonl ({} on other ranks or without one)."""
        if not self.enabled or not self.path.is_file():
            return {}
        records = [json.loads(line) for line in self.path.read_text().splitlines()
                   if line.strip()]
        return next((r for r in reversed(records) if "loss" in r), {})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
