"""Numerical faults: skip a step whose gradients are not finite, count skipped steps without
reading the device every step, and stop after too many in a row.

A non-finite loss always gives non-finite gradients (softmax of a NaN/inf logit is NaN), and
the gradient norm is reduced over every rank that holds a piece of the model after the
data-parallel reduction, so deciding on the norm gives the same answer on every rank.
"""
from __future__ import annotations

import math

import torch


class NumericalError(RuntimeError):
    """Too many non-finite steps in a row."""


def skip_nonfinite_steps(optimizer):
    """Make a megatron-core optimizer skip the update when the gradient norm is not finite.

    megatron's bf16 / fp32 optimizers check for inf/NaN only through the fp16 loss scaler; with
    bf16 they clip by a NaN norm (a no-op) and step, and the weights become NaN. Its step
    already reads the norm on the host (``clip_grad_norm`` calls ``.item()``), so testing it
    there costs no further sync; only with ``clip_grad=0`` does the norm have to be computed
    here. A skipped step leaves the weights and the optimizer state (moments, step counts) as
    they were: ``step_with_ready_grads`` is what changes them, and it is not called.
    """
    state = {"norm": None}
    clip_grad_norm, get_grad_norm = optimizer.clip_grad_norm, optimizer.get_grad_norm
    step, step_with_ready_grads = optimizer.step, optimizer.step_with_ready_grads

    def record_clip(clip):
        state["norm"] = clip_grad_norm(clip)
        return state["norm"]

    def record_norm():
        state["norm"] = get_grad_norm()
        return state["norm"]

    def guarded_step_with_ready_grads():
        if state["norm"] is None:  # clipping off: megatron did not compute the norm
            record_norm()
        if not math.isfinite(state["norm"]):
            return False
        return step_with_ready_grads()

    def guarded_step():
        state["norm"] = None
        ok, norm, zeros = step()
        if state["norm"] is not None:  # megatron returns 0.0 when it did not clip
            norm = state["norm"]
        return ok, norm, zeros

    optimizer.clip_grad_norm = record_clip
    optimizer.get_grad_norm = record_norm
    optimizer.step_with_ready_grads = guarded_step_with_ready_grads
    optimizer.step = guarded_step
    return optimizer


class StepHealth:
    """Skipped-step counters. ``ok`` from the optimizer is a bool today (megatron and the CPU
    optimizer read the norm on the host); a step captured whole in a CUDA graph will give a
    device tensor, and then the counters stay on the device until ``read()`` at a log step."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps
        self.total = 0      # skipped steps in the run so far (this process)
        self.streak = 0     # skipped steps in a row, ending now
        self.worst = 0      # longest streak since the last check

    def update(self, ok) -> None:
        if torch.is_tensor(ok):
            if not torch.is_tensor(self.streak):  # once: move the counters next to `ok`
                self.total, self.streak, self.worst = (
                    torch.tensor(v, device=ok.device) for v in (self.total, self.streak, self.worst))
            bad = (~ok.bool()).long()
            self.total = self.total + bad
            self.streak = (self.streak + 1) * bad
            self.worst = torch.maximum(self.worst, self.streak)
        else:
            bad = int(not ok)
            self.total += bad
            self.streak = (self.streak + 1) * bad
            self.worst = max(self.worst, self.streak)

    def on_host(self) -> bool:
        return not torch.is_tensor(self.worst)

    def read(self) -> tuple[int, int]:
        """(skipped steps so far, longest streak since the last check); a sync point."""
        return int(self.total), int(self.worst)

    def check(self, step: int) -> None:
        """Raise NumericalError after ``max_bad_steps`` skipped steps in a row."""
        _, worst = self.read()
        if worst >= self.max_bad_steps:
            raise NumericalError(
                f"{worst} steps in a row had a non-finite loss or gradient norm (up to step "
                f"{step}; train.max_bad_steps={self.max_bad_steps}); the weights of the last "
                f"good step are in the newest checkpoint. Lower optim.lr or check the data")
        self.worst = self.streak.clone() if torch.is_tensor(self.streak) else self.streak
