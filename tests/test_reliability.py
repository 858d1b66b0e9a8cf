"""Faults injected on purpose, and what must survive them (docs/reliability.md lists them all).

Each test names the fault, injects it, and checks the outcome and that nothing was lost.
"""
import datetime
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from conftest import (ROOT, assert_results, checkpoint_tensors, free_port, tiny_overrides,
                      vitgraph_cmd, write_result)
from vitgraph import config as config_module
from vitgraph.cli import main
from vitgraph.config import ConfigError, load_config
from vitgraph.convert.checkpoints import checkpoint_dir
from vitgraph.graphs.backend import RerunBackend
from vitgraph.train.runcheck import save_config
from faults import nan_loss_at
from vitgraph.parallel.dist import Dist
from vitgraph.train import checkpoint, loop
from vitgraph import INTERRUPTED_EXIT, StopSignals
from vitgraph.train.preempt import PREEMPTED_EXIT, StopRequests
from vitgraph.train.runcheck import check_run_dir

DEFAULT = str(ROOT / "configs" / "vit-tiny-shapes.yaml")
ONE = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"), tp=1, pp=1, dp=1,
           tp_rank=0, pp_rank=0, dp_rank=0)


@pytest.fixture
def world():
    """A gloo world of one for checkpoint.save / load called directly (dist_checkpointing
    needs a process group); in-process training runs tear theirs down, so made per test."""
    import torch.distributed as dist
    from vitgraph.parallel import cpu_shims
    cpu_shims.install()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    yield ONE
    dist.destroy_process_group()


def payload_file(step_dir: Path) -> Path:
    """The largest file of a checkpoint's payload (a dist_checkpointing shard)."""
    return max((p for p in (step_dir / "dist").iterdir() if p.is_file()),
               key=lambda p: p.stat().st_size)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir) if "loss" in r}


def train_here(capsys, run_dir, *extra, steps=12, **over) -> tuple[int, str, str]:
    """``vitgraph train`` in this process (no interpreter start-up): (exit code, out, err)."""
    code = main(["train", DEFAULT, *tiny_overrides(run_dir, steps, **over), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(run_dir: Path) -> dict:
    """Every file under the run folder: (size, mtime, content hash)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns,
                                          hash(p.read_bytes()))
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- 1. finished runs


def test_finished_run_is_read_only_and_more_steps_continue_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_here(capsys, run_dir, steps=10, **{"checkpoint.every": 5})[0] == 0
    before = snapshot(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 10 and "loss" in metrics and "images_per_s" in metrics

    code, out, _ = train_here(capsys, run_dir, steps=10, **{"checkpoint.every": 5})
    assert code == 0
    assert snapshot(run_dir) == before  # metrics, logs, checkpoints, config: untouched
    assert "finished run" in out
    assert str((run_dir / "metrics.json").resolve()) in out
    assert "train.steps=20" in out  # how to ask for more
    assert "for a new run pass run.dir=<another folder>" in out and "run.name" not in out

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # as a command shows them, past pytest's filters
        code, out, err = train_here(capsys, run_dir, steps=15, **{"checkpoint.every": 5})
    assert code == 0, err
    assert "at step 10" in out
    # torch's ShardedTensor / load_state_dict deprecations, said on every resume
    assert not [str(w.message) for w in said if "ShardedTensor" in str(w.message)
                or "load_state_dict" in str(w.message)], said
    log = (run_dir / "train.log").read_text()
    assert "resuming with a changed setting: train.steps 10 -> 15" in log
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 15 and metrics["loss"] > 0
    steps = [r["step"] for r in read_log(run_dir) if "loss" in r]
    assert steps == [5, 10, 15]  # no step trained twice
    assert [r["step"] for r in read_log(run_dir) if "eval_top1" in r] == [10, 15]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 15


# ---------------------------------------------------------------- 2. resume checks


def _existing_run(tmp_path, *overrides):
    """A run folder as a finished training leaves it (config + a checkpoint), without training."""
    run_dir = tmp_path / "run"
    cfg = load_config(DEFAULT, [f"run.dir={run_dir}", "train.steps=10", *overrides])
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "checkpoints" / "step_000010").mkdir(parents=True)
    return run_dir


@pytest.mark.parametrize("change,keys", [
    (["model.name=vit_tiny_patch4_32"], ["model.name"]),
    (["data.kind=imagefolder", "data.path={tmp}"], ["data.kind", "data.path"]),
    (["train.global_batch_size=64", "train.seed=1"], ["train.global_batch_size", "train.seed"]),
    (["optim.lr=0.5"], ["optim.lr"]),
    (["parallel.distributed_optimizer=false"], ["parallel.distributed_optimizer"]),
])
def test_resuming_another_setup_exits_2_naming_each_key(tmp_path, change, keys, capsys):
    run_dir = _existing_run(tmp_path)
    for split in ("train", "val"):
        (tmp_path / split / "x").mkdir(parents=True, exist_ok=True)
    before = snapshot(run_dir)
    change = [c.format(tmp=tmp_path) for c in change]
    assert main(["train", DEFAULT, f"run.dir={run_dir}", "train.steps=10", *change]) == 2
    err = capsys.readouterr().err
    for key in keys:
        assert re.search(rf"^  {re.escape(key)}: .* \(run\) -> .* \(now\)$", err, re.M), err
    # the folder was chosen by run.dir: run.name would change nothing
    assert "run.dir=<another folder>" in err and "run.name" not in err
    assert "checkpoint.resume=false" in err and "Traceback" not in err
    assert snapshot(run_dir) == before  # stopped before any work: no log, no new files


def test_a_run_chosen_by_name_is_told_to_take_another_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/<run.name>
    cfg = load_config(DEFAULT, ["run.name=a", "train.steps=10"])
    save_config(cfg, cfg.run_dir / "config.yaml")
    (cfg.run_dir / "checkpoints" / "step_000010").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        check_run_dir(load_config(DEFAULT, ["run.name=a", "train.steps=10", "optim.lr=0.5"]))
    assert "Start a new run with run.name=<new name> (or run.dir=<folder>)" in str(e.value)


def test_safe_changes_pass_the_resume_check(tmp_path):
    run_dir = _existing_run(tmp_path)
    safe = ["train.steps=40", "train.log_every=1", "train.eval_every=7", "checkpoint.every=3",
            "checkpoint.keep=5", "train.progress=false", "train.tensorboard=false",
            "parallel.tp=1", "train.micro_batch_size=16", "graphs.enabled=true",
            "data.workers=1"]
    cfg = load_config(DEFAULT, [f"run.dir={run_dir}", *safe])
    changed = {k for k, _, _ in check_run_dir(cfg)}
    assert {"train.steps", "train.log_every", "checkpoint.every", "graphs.enabled"} <= changed
    # start over explicitly: no check
    cfg = load_config(DEFAULT, [f"run.dir={run_dir}", "model.name=vit_tiny_patch4_32",
                                "checkpoint.resume=false", "train.steps=10"])
    assert check_run_dir(cfg) == []
    with pytest.raises(ConfigError, match="model.name"):
        check_run_dir(load_config(DEFAULT, [f"run.dir={run_dir}", "train.steps=10",
                                            "model.name=vit_tiny_patch4_32"]))


def test_starting_over_moves_the_previous_run_aside(tmp_path, capsys):
    """checkpoint.resume=false: the folder then holds the new run alone (pruning, the log,
    eval and a later resume saw the old run's files beside it), and the old run is kept
    whole in previous-<time>/."""
    run_dir = tmp_path / "run"
    over = {"checkpoint.every": 2, "checkpoint.keep": 2, "train.log_every": 2}
    assert train_here(capsys, run_dir, steps=6, **over)[0] == 0
    old = snapshot(run_dir)
    code, out, err = train_here(capsys, run_dir, "checkpoint.resume=false", steps=4, **over)
    assert code == 0, err
    aside = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and snapshot(aside[0]) == old  # moved whole, not a file changed
    assert (f"the previous run's checkpoints/, classes.json, config.yaml, log.jsonl, "
            f"metrics.json, train.log moved to {aside[0]}/ (delete it") in out
    ckpt = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.step_dirs(ckpt)] == ["step_000002", "step_000004"]
    assert [r["step"] for r in read_log(run_dir)] == [2, 4, 4]  # two log steps, one eval
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 4
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 4
    assert checkpoint_dir(run_dir) == ckpt / "step_000004"  # what vitgraph eval scores
    assert checkpoint.find_resumable(ckpt, ONE) == ckpt / "step_000004"
    # a later, longer run continues this one (not the old step 6: "finished")
    cfg = load_config(DEFAULT, tiny_overrides(run_dir, 6, **over))
    assert {c[0] for c in check_run_dir(cfg)} == {"train.steps", "checkpoint.resume"}


# ---------------------------------------------------------------- 3. damaged checkpoints


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "optimizer": {}, "scheduler": {},
            "loader": {}}


def test_manifest_lists_every_file_and_verify_names_the_damage(tmp_path, world):
    path = checkpoint.save(tmp_path, 5, world, _state(1.0), keep=3)
    (path / "sub").mkdir()  # a payload writer may use sub-folders: covered too
    manifest = json.loads((path / "manifest.json").read_text())
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"rng_rank_00000.pt", "dist/common.pt"} <= files  # sub-folders (dist/) covered
    assert all(len(m["sha256"]) == 64 for m in manifest["files"].values())
    assert checkpoint.verify(path) == []
    model = path / "dist" / "common.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit, same size
    model.write_bytes(bytes(data))
    assert checkpoint.verify(path, checksums=False) == []
    assert checkpoint.verify(path) == [f"{model}: checksum differs from the manifest"]
    model.write_bytes(bytes(data[: len(data) // 2]))  # cut in half
    assert re.match(rf"{re.escape(str(model))}: \d+ bytes, the manifest says \d+",
                    checkpoint.verify(path)[0])
    (path / "rng_rank_00000.pt").unlink()
    assert any("rng_rank_00000.pt: missing" in p for p in checkpoint.verify(path))
    (path / "manifest.json").unlink()
    assert "manifest.json: missing" in checkpoint.verify(path)[0]


def test_prune_keeps_intact_checkpoints_over_damaged_ones(tmp_path, world):
    for step in (5, 10, 15):
        checkpoint.save(tmp_path, step, world, _state(step), keep=10)
    (tmp_path / "step_000010" / "dist" / "common.pt").write_bytes(b"")
    (tmp_path / "step_000015" / "manifest.json").unlink()
    checkpoint.save(tmp_path, 20, world, _state(20), keep=2)
    # the newest intact one before step 20 is step 5: kept; the damaged ones go
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000005", "step_000020"]
    checkpoint.save(tmp_path, 25, world, _state(25), keep=1)
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000025"]
    assert (tmp_path / "latest").read_text().strip() == "step_000025"


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES, None],
                         ids=["disk-full", "unwritable", "writer-helper-gone"])
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, error, world):
    checkpoint.save(tmp_path, 5, world, _state(5.0), keep=1)
    real_save = checkpoint._save

    def fail_halfway(obj, path):
        if path.name.startswith("rng"):
            path.write_bytes(b"\0" * 100)  # part of the file reached the disk
            if error is None:  # as megatron's writer saw its dead helper process
                raise EOFError()
            raise OSError(error, os.strerror(error), str(path))
        real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_save", fail_halfway)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(tmp_path, 10, world, _state(10.0), keep=1)
    msg = str(e.value)
    assert (os.strerror(error) if error else "EOFError") in msg
    assert "step_000010.tmp" in msg and "step_000005" in msg
    # the remedy fits the failure: disk space and permissions only when the OS said so
    assert ("free space or fix the folder's permissions" in msg) == (error is not None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000005"]
    assert checkpoint.verify(tmp_path / "step_000005") == []
    assert checkpoint.find_resumable(tmp_path, world) == tmp_path / "step_000005"
    state = checkpoint.load(tmp_path / "step_000005", world, {})
    assert torch.equal(state["model"]["w"], torch.full((64,), 5.0))


def test_damaged_newest_checkpoints_fall_back_to_the_newest_intact_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    over = {"checkpoint.every": 4, "checkpoint.keep": 5}
    assert train_here(capsys, run_dir, steps=12, **over)[0] == 0
    ckpt = run_dir / "checkpoints"
    (run_dir / "metrics.json").unlink()  # as if stopped right after its last save
    model = payload_file(ckpt / "step_000012")
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # cut in half
    rng = ckpt / "step_000008" / "rng_rank_00000.pt"
    rng.write_bytes(b"")  # an empty RNG file
    code, out, err = train_here(capsys, run_dir, steps=12, **over)
    assert code == 0, err
    assert f"resumed from {ckpt / 'step_000004'} at step 4" in out
    log = (run_dir / "train.log").read_text()
    assert str(model) in log and str(rng) in log and "damaged" in log
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 12
    assert checkpoint.verify(ckpt / "step_000012") == []  # written again, intact

    for d in checkpoint.step_dirs(ckpt):  # now damage every one
        (d / "manifest.json").write_text("{")
    before = snapshot(run_dir)
    code, out, err = train_here(capsys, run_dir, steps=16, **over)
    assert code == 2, err
    assert "no intact checkpoint" in err and "checkpoint.resume=false" in err
    assert "run.dir=<another folder>" in err and "run.name" not in err  # chosen by run.dir
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    after = snapshot(run_dir)  # a failed start: only its lines added to train.log
    assert {k: v for k, v in after.items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}


# ---------------------------------------------------------------- 4. preemption


def _wait_for_steps(proc, run_dir: Path, n: int, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        log = run_dir / "log.jsonl"
        if log.is_file() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps (exit {proc.poll()})")


def test_sigterm_saves_exits_75_and_the_resumed_run_continues_the_curve(tmp_path, env, capsys):
    steps = 24
    over = {"train.log_every": 1, "checkpoint.every": 0}
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    assert train_here(capsys, ref, steps=steps, **over)[0] == 0  # in this process: no start-up
    cmd = vitgraph_cmd("train", DEFAULT, *tiny_overrides(run_dir, steps, **over))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for_steps(proc, run_dir, 7)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, out[-2000:] + err[-2000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert 7 <= stopped < steps and max(losses(run_dir)) == stopped  # finished its step
    assert checkpoint.verify(run_dir / "checkpoints" / latest) == []
    assert "SIGTERM received" in out
    assert f"preempted after step {stopped}/{steps}; checkpoint " in err and " saved" in err, err
    assert not (run_dir / "metrics.json").exists()

    code, out, err = train_here(capsys, run_dir, steps=steps, **over)
    assert code == 0, err
    assert f"at step {stopped}" in out
    want, got = losses(ref), losses(run_dir)
    assert sorted(got) == list(range(1, steps + 1))
    for s in range(1, steps + 1):  # the uninterrupted curve, before and after the stop
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), (s, got[s], want[s])


def test_sigterm_to_the_process_group_still_saves(tmp_path, env):
    """`timeout`, a terminal and SLURM signal a job's whole process group. megatron's
    checkpoint writer keeps a helper process (a multiprocessing manager, started by the first
    save) whose death made the preemption save fail with EOFError (on an H200 run)."""
    run_dir = tmp_path / "run"
    over = {"train.log_every": 1, "checkpoint.every": 3}  # the helper exists before the signal
    cmd = vitgraph_cmd("train", DEFAULT, *tiny_overrides(run_dir, 40, **over))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _wait_for_steps(proc, run_dir, 5)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, out[-2000:] + err[-2000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("_")[1]) >= 5
    assert checkpoint.verify(run_dir / "checkpoints" / latest) == []


def test_ctrl_c_saves_exits_130_and_a_second_one_exits_at_once(tmp_path, env):
    """Ctrl-C reaches the whole foreground process group, the run and megatron's writer
    helper; under torchrun the workers get it twice (from the terminal, and passed on by
    torchrun at once). Handled as SIGTERM is: the step finishes, a checkpoint is saved, one
    line, no traceback, but exit 130 (not 75: a scheduler must not requeue what the user
    stopped). It printed a KeyboardInterrupt traceback and saved nothing."""
    run_dir = tmp_path / "run"
    over = {"train.log_every": 1, "checkpoint.every": 3}  # the helper exists before the signal
    cmd = vitgraph_cmd("train", DEFAULT, *tiny_overrides(run_dir, 40, **over))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _wait_for_steps(proc, run_dir, 5)
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)  # torchrun's copy: the same Ctrl-C
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == INTERRUPTED_EXIT, out[-2000:] + err[-2000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert stopped == max(losses(run_dir)) and checkpoint.verify(run_dir / "checkpoints" / latest) == []
    assert err == (f"vitgraph: interrupted by SIGINT after step {stopped}/40; checkpoint "
                   f"{run_dir / 'checkpoints' / latest} saved; run the same command to resume "
                   f"(exit {INTERRUPTED_EXIT})\n"), err
    assert "SIGINT received: stopped after step" in out and "Traceback" not in out

    # a second Ctrl-C (a second after the first: vitgraph.AGAIN_AFTER_S) ends it at once
    program = ("import os, signal, time, vitgraph\n"
               "s = vitgraph.StopSignals().install()\n"
               "os.kill(os.getpid(), signal.SIGINT)\n"
               "assert s.received == 'SIGINT'\n"
               "s._at -= vitgraph.AGAIN_AFTER_S\n"
               "os.kill(os.getpid(), signal.SIGINT)\n"
               "time.sleep(60)\n")
    r = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == INTERRUPTED_EXIT and r.stderr.startswith(
        "vitgraph: interrupted again (SIGINT): stopped at once, nothing saved") \
        and len(r.stderr.splitlines()) == 1, r.stderr


def test_ctrl_c_while_the_writer_helper_starts_does_not_hang(tmp_path, env):
    """Ctrl-C as megatron's checkpoint-writer helper is spawned (seconds into a run): a
    KeyboardInterrupt in the middle of the spawn left the helper, which ignores the stop
    signals, running, and the process waited for it at exit forever. Now the run records it
    as a stop (that the helper is deaf to it: the test below)."""
    program = ("import datetime, os, signal, multiprocessing.context as mc\n"
               "from vitgraph.train.preempt import StopRequests\n"
               "real = mc.SpawnProcess.start\n"
               "def start(self):\n"
               "    real(self)\n"
               "    os.kill(os.getpid(), signal.SIGINT)  # the helper starting\n"
               "mc.SpawnProcess.start = start\n"
               "stops = StopRequests(datetime.timedelta(minutes=1)).install()\n"
               "stops.close()\n"
               "print('received', stops.received)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)  # a hang fails here
    finally:
        _kill_group(proc)
    assert proc.returncode == 0 and out == "received SIGINT\n", out + err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def _kill_group(proc) -> None:
    """Whatever is left of a test's process group (a helper of a failed run)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.mark.multiproc
def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, env):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "vitgraph", "train", DEFAULT,
           *tiny_overrides(run_dir, steps=300, **{"train.log_every": 1,
                                                 "train.global_batch_size": 32,
                                                 "train.micro_batch_size": 16})]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(cmd, env=dict(env, OMP_NUM_THREADS="1"), stdout=out, stderr=err)
        _wait_for_steps(proc, run_dir, 4)
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGUSR1)  # one rank only, as a signal may reach ranks apart
        proc.wait(timeout=180)
    err = (tmp_path / "err").read_text()
    assert proc.returncode != 0  # torchrun reports the workers' exit 75 as a failure
    assert f"exitcode  : {PREEMPTED_EXIT}" in err or f"exit code {PREEMPTED_EXIT}" in err \
        or f"exit {PREEMPTED_EXIT}" in err, err[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert stopped == max(losses(run_dir)) < 300
    ckpt = run_dir / "checkpoints" / latest
    assert checkpoint.verify(ckpt) == [] and (ckpt / "rng_rank_00001.pt").is_file()
    assert "stop signal (on another rank)" in (run_dir / "train.log").read_text()


def _signal_during(monkeypatch, module, name: str, sig) -> None:
    """``sig`` sent to this process as ``module.name`` starts: a signal during that phase."""
    real = getattr(module, name)

    def signalled(*args, **kwargs):
        if not isinstance(getattr(signal.getsignal(sig), "__self__", None), StopSignals):
            pytest.fail(f"{sig.name} during {name} would be lost or end the run unsaid")
        os.kill(os.getpid(), sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, signalled)


@pytest.mark.parametrize("phase,where,sig", [
    ("launch", (config_module, "load_config"), signal.SIGTERM),
    ("data", (loop, "build_datasets"), signal.SIGTERM),
    ("model build", (loop, "parallelize"), signal.SIGUSR1),
    ("launch", (config_module, "load_config"), signal.SIGINT),
    ("data", (loop, "build_datasets"), signal.SIGINT)],
    ids=["launch", "data", "model-build", "launch-sigint", "data-sigint"])
def test_a_stop_signal_during_start_up_exits_75_with_nothing_saved(tmp_path, capsys, monkeypatch,
                                                                  phase, where, sig):
    """A job preempted while it starts: stopped at the next start-up milestone, exit 75 (130
    for a Ctrl-C), one line naming the signal and the phase, no traceback; nothing of the run
    is made beyond its log, and the handlers of before the command are back."""
    _signal_during(monkeypatch, *where, sig)
    before = signal.getsignal(sig)
    run_dir = tmp_path / "run"
    code, out, err = train_here(capsys, run_dir)
    exit_code = INTERRUPTED_EXIT if sig == signal.SIGINT else PREEMPTED_EXIT
    line = f"stopped by {sig.name} during start-up ({phase}), nothing saved"
    assert code == exit_code and err == f"vitgraph: {line} (exit {exit_code})\n", err
    assert signal.getsignal(sig) is before
    if phase == "launch":
        assert not run_dir.exists()
    else:
        assert line in (run_dir / "train.log").read_text()
        made = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}
        assert made == {"train.log"}, made


def test_a_stop_signal_during_graph_capture_stops_after_that_step_saved(tmp_path, capsys,
                                                                         monkeypatch):
    """The graphs are captured in the first steps: a signal then is one during training."""
    _signal_during(monkeypatch, RerunBackend, "capture", signal.SIGTERM)
    run_dir = tmp_path / "run"
    code, out, err = train_here(capsys, run_dir, "graphs.enabled=true", "graphs.warmup_steps=0")
    assert code == PREEMPTED_EXIT, err
    assert "SIGTERM received: stopped after step 1/12" in out and "preempted after step 1" in err
    assert checkpoint.verify(run_dir / "checkpoints" / "step_000001") == []


def test_a_stop_signal_while_the_writer_helper_starts_is_kept(monkeypatch):
    """megatron's checkpoint-writer helper takes seconds to start (it imports torch and
    megatron-core): it is spawned with the stop signals blocked (a signal to the whole
    process group must not kill it), and one sent meanwhile reaches the run's handler once it
    has started (it was ignored, and the run trained on)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    import multiprocessing.managers
    import multiprocessing.resource_tracker

    def tracker_started():  # as the stdlib's, after spawning its tracker
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    class Manager:
        def __init__(self, ctx):
            pass

        def start(self, initializer, args):
            Manager.args, Manager.blocked = args, signal.pthread_sigmask(signal.SIG_BLOCK, [])
            os.kill(os.getpid(), signal.SIGTERM)

        def Queue(self):
            return "queue"

    monkeypatch.setattr(fa, "_results_queue", None)
    monkeypatch.setattr(multiprocessing.managers, "SyncManager", Manager)
    monkeypatch.setattr(multiprocessing.resource_tracker, "ensure_running", tracker_started)
    stops = StopRequests(datetime.timedelta(minutes=1)).install()
    try:
        # Python runs the handler in the main thread some bytecodes after the C-level one
        # (in one fresh-clone run `received` was still None at the assertion)
        for _ in range(200):
            if stops.received is not None:
                break
            time.sleep(0.01)
        assert fa._results_queue == "queue" and stops.received == "SIGTERM"
    finally:
        stops.close()
    stops = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}
    assert stops <= Manager.blocked  # inherited by the helper
    assert set(Manager.args[1]) == stops  # what it then ignores (a Ctrl-C too)
    assert not stops & signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_stop_signal_during_the_imports_exits_75_not_143(tmp_path, env):
    """The first seconds of `vitgraph train` import torch and megatron-core: a signal then
    (sent here as torch starts to import) is recorded, not fatal (it killed the process with
    143, nothing said)."""
    run_dir = tmp_path / "run"
    program = ("import os, signal, sys\n"
               "class SignalAtTorch:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name == 'torch':\n"
               "            sys.meta_path.remove(self)\n"
               "            os.kill(os.getpid(), signal.SIGTERM)\n"
               "sys.meta_path.insert(0, SignalAtTorch())\n"
               "from vitgraph.cli import main\n"
               "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", program, "train", DEFAULT,
                        *tiny_overrides(run_dir)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == PREEMPTED_EXIT, r.stderr[-2000:]
    assert "stopped by SIGTERM during start-up (launch), nothing saved" in r.stderr
    assert not run_dir.exists()


def startup_stop_check(out: str, run_dir: str) -> None:
    """A call job of the session's launch of two (conftest.launched): SIGUSR1 reaches rank 1
    alone while it builds the data; both ranks stop at that milestone with exit 75."""
    import torch.distributed as dist
    rank, real = dist.get_rank(), loop.build_datasets

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)
        return real(*args, **kwargs)

    if rank == 1:
        loop.build_datasets = signalled
    try:
        code = main(["train", DEFAULT, *tiny_overrides(run_dir, **{
            "train.global_batch_size": 32, "train.micro_batch_size": 16})])
    finally:
        loop.build_datasets = real

    def check():
        assert code == PREEMPTED_EXIT, code
        if rank == 0:
            log = (Path(run_dir) / "train.log").read_text()
            assert ("stopped by a stop signal (on another rank) during start-up (data), "
                    "nothing saved") in log, log
            assert not (Path(run_dir) / "checkpoints").exists()
    write_result(out, f"rank{rank}", check)


def launch_jobs(root) -> dict[int, list]:
    return {2: [("startup-stop", {"call": "test_reliability:startup_stop_check",
                                  "kwargs": {"out": str(root / "startup-stop"),
                                             "run_dir": str(root / "startup-stop-run")}})]}


@pytest.mark.multiproc
def test_a_stop_signal_to_one_rank_during_start_up_stops_every_rank(launched):
    assert_results(*launched[__name__]["startup-stop"], ["rank0", "rank1"])


# ---------------------------------------------------------------- 5. numerical faults


@pytest.mark.parametrize("extra", [[], ["graphs.enabled=true", "graphs.warmup_steps=1"],
                                   ["graphs.enabled=true", "graphs.scope=step",
                                    "graphs.warmup_steps=1"]],
                         ids=["eager", "graphs", "step-graphs"])
def test_nan_steps_are_skipped_without_touching_weights_or_optimizer(tmp_path, capsys, extra):
    run_dir = tmp_path / "run"
    with nan_loss_at("4-5"):
        code, _, err = train_here(capsys, run_dir, *extra, steps=8,
                                  **{"train.log_every": 1, "checkpoint.every": 1,
                                     "checkpoint.keep": 20})
    assert code == 0, err
    log = {r["step"]: r for r in read_log(run_dir) if "skipped_steps" in r}
    assert [log[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 1, 2, 2, 2, 2]
    assert log[4]["loss"] is None and log[6]["loss"] > 0  # NaN kept out of the logged means
    ckpt = run_dir / "checkpoints"
    a, b, c = (checkpoint_tensors(ckpt / f"step_{s:06d}") for s in (3, 5, 6))
    weights = [k for k in a if not k.startswith("optimizer.")]
    moments = [k for k in a if k.startswith("optimizer.state.")]
    assert weights and moments and a.keys() == b.keys()
    for k in weights + moments:
        assert torch.equal(a[k], b[k]), k  # skipped: weights and Adam moments untouched
    assert any(not torch.equal(a[k], c[k]) for k in weights)  # trained
    common = [torch.load(ckpt / f"step_{s:06d}" / "dist" / "common.pt", weights_only=False)
              for s in (3, 5, 6)]
    # AdamW's step count: skipped steps do not count; nor does the LR schedule move, except
    # with the whole step in a graph (the host never learns that a step was skipped)
    assert [x["optimizer"]["steps_taken"] for x in common] == [3, 3, 4]
    if "graphs.scope=step" in extra:
        assert common[0]["scheduler"] != common[1]["scheduler"]
    else:
        assert common[0]["scheduler"] == common[1]["scheduler"] != common[2]["scheduler"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["skipped_steps"] == 2 and metrics["eval_loss"] == metrics["eval_loss"]


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_megatron_optimizer_step_skips_a_non_finite_grad_norm(clip):
    """megatron's own step() control flow (bf16 has no loss scaler to catch NaN), with the GPU
    optimizer's methods stubbed: the update runs only for a finite norm."""
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from vitgraph.train.health import skip_nonfinite_steps

    class Stub:
        step = MixedPrecisionOptimizer.step

        def __init__(self, norm):
            self.config = SimpleNamespace(timers=None, clip_grad=clip, log_num_zeros_in_grad=False)
            self.norm, self.updates, self.norms = norm, 0, 0

        def prepare_grads(self):
            return False  # no loss scaler: megatron finds nothing

        def clip_grad_norm(self, clip_grad):
            self.norms += 1
            return self.norm

        def get_grad_norm(self):
            self.norms += 1
            return self.norm

        def step_with_ready_grads(self):
            self.updates += 1
            return True

    for norm, ok in ((0.5, True), (float("nan"), False), (float("inf"), False)):
        opt = skip_nonfinite_steps(Stub(norm))
        success, got, _ = opt.step()
        assert success is ok and opt.updates == int(ok) and opt.norms == 1
        assert got == norm or (got != got and norm != norm)


def test_too_many_bad_steps_in_a_row_stop_and_keep_the_last_good_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with nan_loss_at("4-20"):
        code, _, err = train_here(capsys, run_dir, steps=20,
                                  **{"train.log_every": 5, "checkpoint.every": 2,
                                     "checkpoint.keep": 1, "train.max_bad_steps": 3})
    assert code == 1, err
    line = err.strip().splitlines()
    assert len(line) == 1 and "after step 6" in line[0] and "NumericalError" in line[0]
    assert str(run_dir / "train.log") in line[0] and "checkpoint step 4" in line[0]
    assert "Traceback" in (run_dir / "train.log").read_text()
    ckpt = run_dir / "checkpoints"
    assert [p.name for p in checkpoint.step_dirs(ckpt)] == ["step_000004"]
    assert checkpoint.verify(ckpt / "step_000004") == []
    kept = checkpoint_tensors(ckpt / "step_000004")
    assert kept and all(torch.isfinite(v).all() for v in kept.values())
    assert not (run_dir / "metrics.json").exists()


# ---------------------------------------------------------------- 6. bad data


def _folder(root: Path, classes=("a", "b"), per_class=24, val_classes=None):
    for split, names in (("train", classes), ("val", val_classes or classes)):
        for c, name in enumerate(names):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class if split == "train" else 4):
                Image.new("RGB", (12, 12), (200 * c, i * 9, 50)).save(
                    root / split / name / f"{i:03d}.png")
    return root


def test_corrupt_images_are_skipped_and_named_and_the_run_goes_on(tmp_path, capsys):
    data = _folder(tmp_path / "data")
    bad = [data / "train" / "a" / "000.png", data / "train" / "b" / "zz.jpg"]
    bad[0].write_bytes(bad[0].read_bytes()[:30])  # cut short
    bad[1].write_bytes(b"not a jpeg")
    (data / "train" / "a" / "labels.csv").write_text("x,y\n")  # not an image: ignored
    run_dir = tmp_path / "run"
    code = main(["train", DEFAULT, "data.kind=imagefolder", f"data.path={data}",
                 *tiny_overrides(run_dir, steps=3, **{"train.global_batch_size": 16,
                                                      "train.micro_batch_size": 16})])
    assert code == 0, capsys.readouterr().err
    log = (run_dir / "train.log").read_text()
    assert "skipped 2 unreadable image(s) of 49" in log
    assert str(bad[0]) in log and str(bad[1]) in log and "labels.csv" not in log
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 3


def test_a_val_class_missing_from_train_is_an_error_at_start(tmp_path, capsys):
    data = _folder(tmp_path / "data", val_classes=("a", "b", "c"))
    run_dir = tmp_path / "run"
    code = main(["train", DEFAULT, "data.kind=imagefolder", f"data.path={data}",
                 *tiny_overrides(run_dir, steps=3)])
    assert code == 2
    err = capsys.readouterr().err
    assert "data error" in err and str(data / "val") in err and ": c" in err
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "log.jsonl").exists()


# ---------------------------------------------------------------- 7. failures reported alike


def test_te_spec_without_cuda_is_a_config_error_before_anything_is_made(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    run_dir = tmp_path / "run"
    assert main(["train", DEFAULT, "model.spec=te", f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "model.spec" in err and "CUDA" in err
    assert not run_dir.exists()


def test_a_failure_during_training_logs_the_traceback_and_prints_one_line(tmp_path,
                                                                       monkeypatch, capsys):
    real_save = checkpoint._save
    calls = []

    def disk_full_on_second_checkpoint(obj, path):
        calls.append(path)
        if "step_000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_save", disk_full_on_second_checkpoint)
    run_dir = tmp_path / "run"
    code = main(["train", DEFAULT, *tiny_overrides(run_dir, steps=8, **{"checkpoint.every": 2,
                                                                         "checkpoint.keep": 1})])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(r"training failed after step 4: CheckpointError: .*No space left on device",
                     err[0]), err[0]
    assert str(run_dir / "train.log") in err[0] and "checkpoint step 2" in err[0]
    log = (run_dir / "train.log").read_text()
    assert "Traceback" in log and "No space left on device" in log
    ckpt = run_dir / "checkpoints"
    assert [p.name for p in ckpt.iterdir() if p.name != "latest"] == ["step_000002"]
    assert checkpoint.verify(ckpt / "step_000002") == []


# ---------------------------------------------------------------- 8. the table stays true


def test_reliability_doc_names_only_tests_that_exist():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", doc)
    assert len(named) >= 12
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} is gone"
    this = Path(__file__).read_text()
    for name in re.findall(r"^def (test_\w+)\(", this, re.M):
        assert name in doc, f"{name} is not in docs/reliability.md"
