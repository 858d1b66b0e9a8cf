"""When the training loop does what besides a step: log, evaluate, look for a stop request.
One schedule, asked once per step (checkpoints: vitgraph.train.checkpoint.Checkpointer.due)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Events:
    """What is due after a step. The last step always logs; its evaluation and stop are the
    end of the run's own (Trainer.finish), so neither is due here."""
    log: bool
    stop_check: bool
    eval: bool
    last: bool


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    log_every: int
    eval_every: int = 0  # 0: only at the end

    def after(self, step: int) -> Events:
        last = step == self.total_steps
        return Events(log=step % self.log_every == 0 or last,
                      stop_check=not last,
                      eval=bool(self.eval_every) and step % self.eval_every == 0 and not last,
                      last=last)
