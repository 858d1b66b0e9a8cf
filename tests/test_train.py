"""End-to-end training on CPU: metrics, checkpoints, kill + resume, multi-process layouts."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, tiny_overrides, vitgraph_cmd

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir) if "loss" in r}


def run(env, *args, timeout=300):
    r = subprocess.run(vitgraph_cmd("train", DEFAULT, *args), env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_train_end_to_end_writes_metrics_and_run_dir(tmp_path, env):
    r = run(env, *tiny_overrides(tmp_path / "run", steps=30, **{"train.eval_every": 15,
                                                                 "train.tensorboard": "true"}))
    run_dir = tmp_path / "run"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 30 and 0.0 <= metrics["eval_top1"] <= 1.0
    assert str((run_dir / "metrics.json").resolve()) in r.stdout
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    log = read_log(run_dir)
    for key in ("loss", "lr", "grad_norm", "images_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib"):
        assert all(key in rec for rec in log if "loss" in rec), key
    assert [rec["step"] for rec in log if "eval_top1" in rec] == [15, 30]
    losses = train_losses(run_dir)
    assert losses[30] < losses[5], losses  # it learns something in 30 steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000030"


def test_killed_run_resumes_and_continues_the_loss_curve(tmp_path, env):
    steps, every = 60, 10
    over = dict(**{"checkpoint.every": every, "checkpoint.keep": 10})
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "killed"
    run(env, *tiny_overrides(ref_dir, steps=steps, **over))

    cmd = vitgraph_cmd("train", DEFAULT, *tiny_overrides(dir_, steps=steps, **over))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = dir_ / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000020":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = int(latest.read_text().strip().split("_")[1])
    assert killed_at < steps
    # a half-written checkpoint of a later step must never be loaded
    half = dir_ / "checkpoints" / f"step_{killed_at + every:06d}.tmp"
    half.mkdir(exist_ok=True)
    (half / "mp_rank_00_000.pt").write_bytes(b"garbage")

    r = run(env, *tiny_overrides(dir_, steps=steps, **over))
    assert f"at step {killed_at}" in r.stdout
    assert not half.exists()  # cleaned by the next save
    ref, got = train_losses(ref_dir), train_losses(dir_)
    after = [s for s in ref if s > killed_at]
    assert after and all(s in got for s in after)
    for s in after:  # the same curve as the uninterrupted run
        assert got[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-6), (s, got[s], ref[s])


