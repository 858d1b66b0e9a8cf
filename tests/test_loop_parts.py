"""The training loop's parts on their own: the metrics window (device sums, reduction, the log
line), the event schedule, the checkpoint interval, the start-up's augmentation line, the names
of eval files and the progress bar beside the log."""
import io
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import world_of_one
from vitgraph.data.augment import AugmentConfig, augment_line
from vitgraph.config import CheckpointConfig
from vitgraph.train.checkpoint import Checkpointer
from vitgraph.train.events import Schedule
from vitgraph.train.evaluate import eval_file_name, is_runs_own_data
from vitgraph.train.loop import Progress
from vitgraph.train.metrics import MetricsWindow, StepResult, duration, graphs_line, train_line

dist1 = world_of_one("torch")


def result(loss_sum, correct, n, norm, ok):
    return StepResult(torch.tensor([loss_sum, correct, n]), torch.tensor(norm),
                      torch.tensor(ok), ok_on_host=ok)


def test_metrics_window_keeps_skipped_steps_out_and_starts_empty(dist1):
    w = MetricsWindow(dist1.device, dist1, global_batch=8, flops_per_sample=1e9,
                      peak_flops=None)
    w.add(result(16.0, 3.0, 8.0, 2.0, True))
    w.add(result(float("nan"), 0.0, 8.0, float("nan"), False))  # a skipped step
    w.add(result(8.0, 5.0, 8.0, 4.0, True))
    r = w.close(3, epoch=0, lr=1e-3, skipped_steps=1)
    assert r["loss"] == pytest.approx(24 / 16) and r["train_top1"] == pytest.approx(8 / 16)
    assert r["grad_norm"] == pytest.approx(3.0) and r["skipped_steps"] == 1
    assert r["images_per_s"] > 0 and r["tflops_per_gpu"] > 0
    assert "mfu" not in r  # no known peak (CPU): no MFU at all rather than 0.0%
    w.add(result(float("nan"), 0.0, 8.0, float("nan"), False))
    empty = w.close(4, epoch=0, lr=1e-3, skipped_steps=2)  # every step of it skipped
    assert empty["loss"] is None and empty["grad_norm"] is None


def test_metrics_window_reports_mfu_against_a_known_peak(dist1):
    w = MetricsWindow(dist1.device, dist1, global_batch=8, flops_per_sample=1e12,
                      peak_flops=1e15)
    w.add(result(8.0, 1.0, 8.0, 1.0, True))
    r = w.close(1, epoch=0, lr=0.1, skipped_steps=0)
    assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] * 1e12 / 1e15)
    assert "| MFU " in train_line(r, 10, 5.0)


def test_train_line_has_an_eta_and_leaves_out_what_is_unknown():
    r = {"step": 10, "loss": None, "train_top1": 0.5, "lr": 1e-3, "grad_norm": 1.5,
         "images_per_s": 100.0, "tflops_per_gpu": 0.02, "peak_mem_gib": 0.5,
         "skipped_steps": 2}
    line = train_line(r, 200, 125.0)
    assert line.startswith("step 10/200 | loss nan | top1 0.500 | lr 1.00e-03 | grad 1.500")
    assert "| eta 2m05s" in line and "MFU" not in line
    assert line.endswith("| skipped 2 non-finite steps")
    assert [duration(s) for s in (0, 59.4, 61, 3 * 3600 + 125)] == ["0s", "59s", "1m01s", "3h02m"]
    assert graphs_line({}) == ""
    stats = {"graphs": 2, "capture_time_s": 0.5, "pool_bytes": 2 ** 21, "replays": 7,
             "eager_fallbacks": {"a": 1, "b": 2}, "unseen_shapes": 0}
    assert graphs_line(stats) == (" | graphs 2 (capture 0.50s, pool 2 MiB, replays 7, eager "
                                  "calls 3, unseen shapes 0)")


def test_schedule_says_what_is_due_after_each_step():
    s = Schedule(total_steps=10, log_every=3, eval_every=4)
    due = {step: s.after(step) for step in range(1, 11)}
    assert [k for k, e in due.items() if e.log] == [3, 6, 9, 10]  # and always the last
    assert [k for k, e in due.items() if e.eval] == [4, 8]  # the last one's is the run's end
    assert [k for k, e in due.items() if not e.stop_check] == [10]
    assert [k for k, e in due.items() if e.last] == [10]
    off = Schedule(total_steps=4, log_every=10)
    assert not any(off.after(k).eval for k in range(1, 5))


def test_the_checkpointer_says_when_a_save_is_due():
    def checkpointer(total_steps, **section):
        return Checkpointer(CheckpointConfig(**section), Path("unused"), total_steps,
                            SimpleNamespace(rank=1), [], None, None, None)
    every5 = checkpointer(10, every=5)
    assert [k for k in range(1, 11) if every5.due(k)] == [5]  # the last one's is the run's end
    assert not any(checkpointer(4).due(k) for k in range(1, 5))  # every=0: only at the end


def test_augment_line_names_what_is_on():
    assert augment_line(AugmentConfig()) == "off"
    on = augment_line(AugmentConfig(enabled=True))
    assert "randaugment 2 ops m9" in on and "mixup 0.8 / cutmix 1" in on
    assert "erasing 0.25" in on and "flip 0.5" in on
    assert "mixup" not in augment_line(AugmentConfig(enabled=True), mixes_labels=False)
    quiet = augment_line(AugmentConfig(enabled=True, auto="none", mixup_alpha=0,
                                       cutmix_alpha=0, erase_prob=0, flip=0))
    assert quiet == "crop 0.08-1 of the area"


def test_eval_files_are_named_after_other_data(tmp_path):
    own = {"kind": "shapes", "path": None, "split": "val", "images": 200}
    assert eval_file_name(12, "val", own, own=True) == "eval-12.json"
    assert eval_file_name(12, "train", own, own=True) == "eval-12-train.json"
    a = {"kind": "imagefolder", "path": "/data/a/val2", "split": "val", "images": 50}
    b = {**a, "path": "/data/b/val2"}
    name_a, name_b = (eval_file_name(12, "val", x, own=False) for x in (a, b))
    assert name_a.startswith("eval-12-imagefolder-val2-") and name_a.endswith(".json")
    assert name_a != name_b  # the same folder name elsewhere: another file
    assert eval_file_name(12, "val", dict(a), own=False) == name_a  # the same data: same file
    assert eval_file_name(12, "train", a, own=False).endswith("-train.json")


def test_runs_own_data_is_what_its_config_yaml_names(tmp_path):
    from conftest import ROOT
    from vitgraph.config import load_config
    from vitgraph.train.runcheck import save_config
    cfg = load_config(ROOT / "configs" / "vit-tiny-shapes.yaml", [f"run.dir={tmp_path}"])
    save_config(cfg, cfg.run_dir / "config.yaml")
    assert is_runs_own_data(cfg)
    cfg.data.num_val = 100
    assert not is_runs_own_data(cfg)


def _terminal(written: str) -> list[str]:
    """The lines a terminal shows for ``written``: a carriage return goes back to the line's
    start, ESC [K erases to its end, later text overwrites earlier."""
    lines = []
    for raw in written.split("\n"):
        line, pos = "", 0
        for part in re.split(r"(\r|\x1b\[K)", raw):
            if part == "\r":
                pos = 0
            elif part == "\x1b[K":
                line = line[:pos]
            else:
                line, pos = line[:pos] + part + line[pos + len(part):], pos + len(part)
        lines.append(line)
    return lines


def test_progress_bar_is_cleared_before_a_log_line_on_the_terminal(tmp_path, monkeypatch):
    """The bar and the log share the terminal; a log line used to be written on after the
    bar ('... eta 12s 15:19:26 INFO step 100/200 ...')."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    logger = logging.getLogger("vitgraph.test_progress")
    logger.propagate, logger.level = False, logging.INFO
    on_terminal, to_file = logging.StreamHandler(tty), logging.FileHandler(tmp_path / "train.log")
    logger.handlers = [on_terminal, to_file]
    try:
        with Progress(10, 0, True, logger) as progress:
            progress.update(4)
            logger.info("step 4/10 | loss 2.3")
            progress.update(5)
        with pytest.raises(RuntimeError), Progress(10, 5, True, logger) as progress:
            progress.update(6)
            raise RuntimeError("a failure: its message starts on a line of its own")
    finally:
        logger.handlers = []
    shown = _terminal(tty.getvalue())
    assert shown[0] == "step 4/10 | loss 2.3", shown
    assert shown[1].startswith("[###############               ] 5/10 eta") and \
        shown[2].startswith("[##################            ] 6/10 eta") and shown[3] == "", shown
    assert not on_terminal.filters and "\x1b" not in (tmp_path / "train.log").read_text()
