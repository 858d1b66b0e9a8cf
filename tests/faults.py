"""Faults for the reliability tests, installed by the test (the trainer knows nothing of them):
a wrapper around the tasks' loss that makes the loss of chosen training steps NaN, and a stop
signal the process sends itself as a chosen step starts (on a GPU a tiny run's steps take
milliseconds: a signal from outside, timed by the log, lands anywhere).

The factor is a device scalar that ``prepare`` fills on the host before each step's kernels
are queued (NaN for a chosen step, else 1); ``loss`` multiplies by it, so a step captured
whole in a CUDA graph reads the new value at every replay. Eval batches (key None) get 1.

    with nan_loss_at("4-5"):        # in this process
        main(["train", ...])
    python tests/faults.py 4-5 train CONFIG key=value ...   # as a command
    python tests/faults.py sigterm@7 train CONFIG ...       # SIGTERM as step 7 starts
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch

from vitgraph.tasks.classification import ClassificationTask
from vitgraph.tasks.contrastive import ContrastiveTask


def parse_steps(text: str) -> set[int]:
    """'5-7,9' -> {5, 6, 7, 9}; '' -> set()."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return steps


@contextlib.contextmanager
def nan_loss_at(steps: str):
    """Training steps ``steps`` (1-based, '4-5' or '5,7') have a NaN loss while inside."""
    nan_steps = parse_steps(steps)
    saved = [(cls, cls.prepare, cls.loss) for cls in (ClassificationTask, ContrastiveTask)]
    factors: dict = {}  # device -> the scalar

    def wrap(cls, prepare, loss):
        def faulty_prepare(self, raw, key, device, first_stage):
            f = factors.setdefault(str(device), torch.ones((), device=device))
            f.fill_(float("nan") if key is not None and key[0] + 1 in nan_steps else 1.0)
            return prepare(self, raw, key, device, first_stage)

        def faulty_loss(self, inputs, output):
            value, stats = loss(self, inputs, output)
            f = factors.get(str(value.device))
            return (value, stats) if f is None else (value * f, stats * f)

        cls.prepare, cls.loss = faulty_prepare, faulty_loss

    for cls, prepare, loss in saved:
        wrap(cls, prepare, loss)
    try:
        yield
    finally:
        for cls, prepare, loss in saved:
            cls.prepare, cls.loss = prepare, loss


@contextlib.contextmanager
def sigterm_at(step: int):
    """SIGTERM to this process as training step ``step`` (1-based) starts, while inside."""
    saved = [(cls, cls.prepare) for cls in (ClassificationTask, ContrastiveTask)]

    def wrap(cls, prepare):
        def signalling_prepare(self, raw, key, device, first_stage):
            if key is not None and key == (step - 1, 0):
                os.kill(os.getpid(), signal.SIGTERM)
            return prepare(self, raw, key, device, first_stage)
        cls.prepare = signalling_prepare

    for cls, prepare in saved:
        wrap(cls, prepare)
    try:
        yield
    finally:
        for cls, prepare in saved:
            cls.prepare = prepare


if __name__ == "__main__":
    from vitgraph.cli import main
    fault = sys.argv[1]
    with (sigterm_at(int(fault.split("@")[1])) if fault.startswith("sigterm@")
          else nan_loss_at(fault)):
        raise SystemExit(main(sys.argv[2:]))
