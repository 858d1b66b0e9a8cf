"""graphs.enabled=false: no graphs, behind the same life-cycle methods as GraphManager and
StepGraphs (step_begin / reset / restore / stats), so the trainer drives every path alike."""
from __future__ import annotations


class NoGraphs:
    active = False

    def step_begin(self, step: int | None = None) -> None:
        pass

    def reset(self) -> None:
        pass

    def restore(self, drop_graphs: bool = True) -> None:
        pass

    def stats(self) -> dict:
        """Empty: nothing of graphs goes into the log or metrics.json."""
        return {}
