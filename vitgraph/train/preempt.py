"""Preemption: SIGTERM (or SIGUSR1, as SLURM's ``--signal`` sends) finishes the current step,
saves a checkpoint and exits with ``PREEMPTED_EXIT``; the same command resumes."""
from __future__ import annotations

import datetime
import signal

import torch
import torch.distributed as dist

from vitgraph.train.checkpoint import start_writer_helper

# EX_TEMPFAIL (sysexits.h): "try again later". scripts/slurm/train.sbatch requeues on it.
PREEMPTED_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint is saved; the CLI turns it into PREEMPTED_EXIT."""


class StopRequests:
    """Signal handlers that only set a flag; ``poll()`` tells every rank to stop at the same
    step. Ranks agree over a gloo group (a CPU collective: no device sync), and the agreement
    started at one step is read at the next, so the check never waits on the network.

    ``timeout``: the run's collective timeout, given to that group. A failing rank's last
    exchange may wait on a frozen peer, and the group's destructor waits for it at exit: with
    gloo's default (30 minutes) such a rank outlived its own failure and torchrun never
    stopped the run."""

    def __init__(self, timeout: datetime.timedelta):
        self.timeout = timeout
        self.received: str | None = None
        self._previous: dict = {}
        self._group = None
        self._work = None
        self._flag = None

    def install(self) -> "StopRequests":
        """Before start-up, so that a signal during data loading is not lost either."""
        start_writer_helper(SIGNALS)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def poll(self) -> bool:
        """True on every rank at the same step once any rank has received a signal. Every rank
        calls it after every step (the first call makes the group: a collective)."""
        if self._group is None:
            if not dist.is_initialized() or dist.get_world_size() == 1:
                return self.received is not None
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item())
        self._flag = torch.tensor([int(self.received is not None)])
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        return stop

    def close(self, wait: bool = True) -> None:
        """``wait=False`` on a failing run: the last flag exchange may not complete before
        the group's timeout (a peer is stuck or gone)."""
        if self._work is not None:
            if wait:
                try:
                    self._work.wait()
                except Exception:  # a peer is gone (the run is failing already)
                    pass
            self._work = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
