"""Preemption: SIGTERM (or SIGUSR1, as SLURM's ``--signal`` sends) finishes the current step,
saves a checkpoint and exits with ``PREEMPTED_EXIT``; during start-up (before the first step)
it stops at the next start-up milestone, nothing saved, with the same exit code. SIGINT
(Ctrl-C) does the same and exits with ``INTERRUPTED_EXIT`` (130); a second one exits at once
(vitgraph.StopSignals). The same command resumes (or starts) the run."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from vitgraph import INTERRUPTED_EXIT, STOP_SIGNALS, StopSignals
from vitgraph.train.checkpoint import start_writer_helper

# EX_TEMPFAIL (sysexits.h): "try again later". scripts/slurm/train.sbatch requeues on it: a
# run stopped during start-up has nothing to lose and is as worth requeueing.
PREEMPTED_EXIT = 75


class Preempted(Exception):
    """Raised after the checkpoint is saved, or at a start-up milestone with nothing to save;
    the CLI exits with ``exit_code``: PREEMPTED_EXIT, or INTERRUPTED_EXIT for a SIGINT."""

    def __init__(self, message: str, exit_code: int = PREEMPTED_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


# what the ranks agree on (the largest wins): no stop, a stop signal, SIGINT (the user's)
NONE, STOP, INTERRUPT = 0, 1, 2


def _kind(received: str | None) -> int:
    return NONE if received is None else INTERRUPT if received == "SIGINT" else STOP


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
        self.agreed = NONE  # what the ranks last agreed on (NONE, STOP or INTERRUPT)

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
        self.agreed = _kind(self.received)
        if self._several_ranks():
            flag = torch.tensor([self.agreed])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            self.agreed = int(flag.item())
        if self.agreed:
            raise Preempted(f"stopped by {self.by()} during start-up ({phase}), nothing saved",
                            self.exit_code())

    def poll(self) -> bool:
        """True on every rank at the same step once any rank has received a signal. Every rank
        calls it after every step."""
        if not self._several_ranks():
            self.agreed = _kind(self.received)
            return bool(self.agreed)
        if self._work is not None:
            self._work.wait()
            self.agreed = int(self._flag.item())
        self._flag = torch.tensor([_kind(self.received)])
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group,
                                     async_op=True)
        return bool(self.agreed)

    def by(self) -> str:
        """What stopped the run, once agreed: this rank's signal, or another rank's."""
        if _kind(self.received) == self.agreed:
            return self.received
        return "SIGINT (on another rank)" if self.agreed == INTERRUPT else \
            "a stop signal (on another rank)"

    def exit_code(self) -> int:
        """The same on every rank: INTERRUPTED_EXIT once a SIGINT reached any of them."""
        return INTERRUPTED_EXIT if self.agreed == INTERRUPT else PREEMPTED_EXIT

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
