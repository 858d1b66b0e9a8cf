"""What the one training loop trains: a task supplies the model, the batch and the loss
(base.py has the interface)."""
from vitgraph.tasks.base import Task


def make_task(cfg, d, total_steps: int | None = None) -> Task:
    """The task of ``cfg`` (task.kind, auto resolved from model.name) on this rank, for a run
    of ``total_steps`` (None: evaluation only)."""
    from vitgraph.config import task_kind
    if task_kind(cfg) == "contrastive":
        from vitgraph.tasks.contrastive import ContrastiveTask
        return ContrastiveTask(cfg, d, total_steps)
    from vitgraph.tasks.classification import ClassificationTask
    return ClassificationTask(cfg, d, total_steps)


__all__ = ["Task", "make_task"]
