"""What the one training loop trains: a task supplies the model, the batch and the loss
(base.py has the interface)."""
from vitgraph.tasks.base import Task
from vitgraph.tasks.caption import CaptionTask
from vitgraph.tasks.classification import ClassificationTask
from vitgraph.tasks.contrastive import ContrastiveTask


def make_task(plan, d, total_steps: int | None = None) -> Task:
    """The task of the plan (vitgraph.plan.Plan: task.kind resolved) on this rank, for a run
    of ``total_steps`` (None: evaluation only)."""
    if plan.task == "classification":
        return ClassificationTask(plan, d, total_steps)
    if plan.task == "caption":
        return CaptionTask(plan, d, total_steps)
    return ContrastiveTask(plan, d, total_steps)


__all__ = ["CaptionTask", "ClassificationTask", "ContrastiveTask", "Task", "make_task"]
