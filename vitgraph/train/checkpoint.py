"""Checkpoints: model, optimizer, schedule, data position and RNG state, written atomically.

Layout under ``<run_dir>/checkpoints``::

    step_000200/mp_rank_TT_PPP.pt   model + optimizer + schedule + data position (DP rank 0 of
                                    each tensor/pipeline rank, as Megatron-LM names them)
    step_000200/rng_rank_NNNNN.pt   every rank's RNG state
    latest                          the name of the newest complete step directory

Every rank writes into ``step_XXXXXX.tmp/`` (each file via tmp + rename); after a barrier rank 0
renames the directory and then rewrites ``latest``. A crash at any point leaves either the old
``latest`` or the new one pointing at a complete directory: a half-written checkpoint is a
``.tmp`` directory, never loaded and removed by the next save.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from vitgraph.parallel.setup import Dist

STEP_DIR = re.compile(r"^step_(\d+)$")


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state(d: Dist) -> dict:
    state = {"torch": torch.get_rng_state()}
    if d.cuda:
        from megatron.core import tensor_parallel
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict, d: Dist) -> None:
    torch.set_rng_state(state["torch"])
    if d.cuda and "cuda" in state:
        from megatron.core import tensor_parallel
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(ckpt_dir: Path, step: int, d: Dist, state: dict, keep: int) -> Path:
    """``state`` holds this rank's model / optimizer / scheduler / loader state dicts."""
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f"step_{step:06d}.tmp"
    if d.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    if d.dp_rank == 0:
        _atomic_save({**state, "step": step}, tmp / f"mp_rank_{d.tp_rank:02d}_{d.pp_rank:03d}.pt")
    _atomic_save(_rng_state(d), tmp / f"rng_rank_{d.rank:05d}.pt")
    _barrier()
    if d.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = ckpt_dir / "latest.partial"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, ckpt_dir / "latest")
        _prune(ckpt_dir, keep)
    _barrier()
    return final


def _prune(ckpt_dir: Path, keep: int) -> None:
    for stale in ckpt_dir.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    done = sorted(p for p in ckpt_dir.iterdir() if STEP_DIR.match(p.name))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    pointer = ckpt_dir / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = ckpt_dir / name
    if not STEP_DIR.match(name) or not path.is_dir():
        raise RuntimeError(f"{pointer}: points at {name!r}, which is not a complete checkpoint")
    return path


def load(path: Path, d: Dist) -> dict:
    """This rank's state from a complete checkpoint directory; restores the RNG state."""
    model_file = path / f"mp_rank_{d.tp_rank:02d}_{d.pp_rank:03d}.pt"
    rng_file = path / f"rng_rank_{d.rank:05d}.pt"
    if not model_file.is_file():
        raise RuntimeError(f"{model_file}: missing (was the checkpoint written with another "
                           f"tp/pp layout?)")
    state = torch.load(model_file, map_location=d.device, weights_only=False)
    if rng_file.is_file():  # a different world size has other RNG files: keep fresh RNG
        _set_rng_state(torch.load(rng_file, weights_only=False), d)
    return state
