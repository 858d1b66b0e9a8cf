"""This rank's place in the process groups (made by vitgraph.parallel.setup.init_distributed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    vpp: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
