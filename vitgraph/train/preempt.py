"""Preemption: SIGTERM (or SIGUSR1, as SLURM's ``--signal`` sends) finishes the current step,
saves a checkpoint and exits with ``PREEMPTED_EXIT``; during start-up (before the first step)
it stops at the next start-up milestone, nothing saved, with the same exit code. The same
command resumes (or starts) the run."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from vitgraph import STOP_SIGNALS, StopSignals
from vitgraph.train.checkpoint import start_writer_helper

# EX_TEMPFAIL (sysexits.h): "try again later". scripts/slurm/train.sbatch requeues on it: a
# run stopped during start-up has nothing to lose and is as worth requeueing.
PREEMPTED_EXIT = 75


class Preempted(Exception):
    """Raised after the checkpoint is saved, or at a start-up milestone with nothing to save;
    the CLI turns it into PREEMPTED_EXIT."""


class StopRequests:
    """Signal handlers that only set a flag (``signals``: the CLI's, installed before its
    imports; None: installed by ``install``); ``poll()`` tells every rank to stop at the same
    step, ``at_startup()`` at the same start-up milestone. Ranks agree over a gloo group (a
    CPU collective: no device sync); in the loop the agreement started at one step is read at
    the next, so the check never waits on the network.

    ``timeout``: the run's collective timeout, given to that group. A failing rank's last
    exchange may wait on a frozen peer, and the group's destructor waits for it at exit: with
    gloo's default (30 minutes) such a rank outlived its own failure and torchrun never
    stopped the run."""

    def __init__(self, timeout: datetime.timedelta, signals: StopSignals | None = None):
        self.timeout = timeout
        self._own = signals is None
        self.signals = signals if signals is not None else StopSignals()
        self._group = None
        self._work = None
        self._flag = None

    @property
    def received(self) -> str | None:
        """The first stop signal this rank received (``SIGTERM``), None before one."""
        return self.signals.received

    def install(self) -> "StopRequests":
        """Before start-up, so that a signal during data loading is not lost either."""
        if self._own:
            self.signals.install()
        start_writer_helper(STOP_SIGNALS)
        return self

    def _several_ranks(self) -> bool:
        """Whether the ranks must agree (the first call with a process group of several
        makes the agreement's group: a collective)."""
        if self._group is None:
            if not dist.is_initialized() or dist.get_world_size() == 1:
                return False
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return True

    def at_startup(self, phase: str) -> None:
        """A start-up milestone (``phase``: what start-up was doing): raise Preempted on every
        rank once any rank has received a stop signal. Every rank reaches the milestones in
        the same order; with several ranks the agreement waits for all of them (an
        all-reduce), before the process groups exist this rank decides alone."""
        stop = self.received is not None
        if self._several_ranks():
            flag = torch.tensor([int(stop)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            stop = bool(flag.item())
        if stop:
            raise Preempted(f"stopped by {self.received or 'a stop signal (on another rank)'} "
                            f"during start-up ({phase}), nothing saved")

    def poll(self) -> bool:
        """True on every rank at the same step once any rank has received a signal. Every rank
        calls it after every step."""
        if not self._several_ranks():
            return self.received is not None
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
        if self._own:
            self.signals.restore()
