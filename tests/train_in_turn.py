"""Several ``vitgraph train`` runs in turn in one process per rank (one torchrun launch per
world size, conftest.Launches): start-up (interpreter, torch, megatron-core,
gloo) is paid once per world size instead of once per run.

    python -m torch.distributed.run --nproc-per-node N tests/train_in_turn.py JOBS.json

JOBS.json is a list of jobs:
- {"args": [the `vitgraph train` arguments]}, which may also say
  {"resume": {"from": RUN_DIR, "step": K}}: rank 0 first copies RUN_DIR to the job's run.dir
  rolled back to its step-K checkpoint (later checkpoints, metrics and log removed), as if
  that run had stopped after step K;
- {"call": "test_module:function", "kwargs": {"out": FOLDER, ...}}: a test's own multi-rank
  check, called on every rank (the default process group made first if no run made it yet);
  it writes its results under FOLDER (conftest.write_result).
The default process group lives over all jobs (each run's shutdown still destroys its
model-parallel groups; the next run makes new ones, as a second Trainer in one process does).
The first job to fail ends the launch with its exit code, so torchrun stops every rank; the
jobs after it have no log."""
import datetime
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vitgraph.cli import main

# one intra-op thread a rank (a Trainer takes cpu_count / local ranks: two for a world of
# one), as in the pytest process, which runs tests beside the launch
torch.set_num_threads = lambda n, _set=torch.set_num_threads: _set(1)


def roll_back(src: Path, dst: Path, step: int) -> None:
    shutil.copytree(src, dst)
    ckpts = dst / "checkpoints"
    for d in ckpts.glob("step_*"):
        if int(d.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"step_{step:06d}\n")
    (dst / "metrics.json").unlink(missing_ok=True)
    (dst / "log.jsonl").unlink()


def run_dir(job: dict) -> Path:
    """Where a job writes: its run.dir, or a call's results folder."""
    if "call" in job:
        return Path(job["kwargs"]["out"])
    return Path(next(a.split("=", 1)[1] for a in job["args"] if a.startswith("run.dir=")))


def call(job: dict) -> None:
    if not dist.is_initialized():  # vitgraph's default parallel.timeout_minutes
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    module, name = job["call"].split(":")
    getattr(importlib.import_module(module), name)(**job["kwargs"])


def run(jobs: list[dict]) -> int:
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    try:
        for job in jobs:
            if "call" in job:
                call(job)
                continue
            if "resume" in job:
                if dist.is_initialized():
                    dist.barrier()
                if int(os.environ.get("RANK", "0")) == 0:
                    roll_back(Path(job["resume"]["from"]), run_dir(job), job["resume"]["step"])
                if dist.is_initialized():
                    dist.barrier()  # no rank reads the folder before it is rolled back
            code = main(["train", *job["args"]])
            if code != 0:
                print(f"train_in_turn: exit {code}: {' '.join(job['args'])}", file=sys.stderr,
                      flush=True)
                return code
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
