"""What the one training loop trains: a task supplies the model, the batch and the loss
(base.py has the interface)."""
from vitgraph.tasks.base import Task


def make_task(cfg, d) -> Task:
    """The task of ``cfg`` (task.kind, auto resolved from model.name) on this rank."""
    from vitgraph.config import task_kind
    if task_kind(cfg) == "contrastive":
        from vitgraph.tasks.contrastive import ContrastiveTask
        return ContrastiveTask(cfg, d)
    from vitgraph.tasks.classification import ClassificationTask
    return ClassificationTask(cfg, d)


__all__ = ["Task", "make_task"]
