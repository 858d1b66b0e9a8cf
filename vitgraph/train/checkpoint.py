"""Checkpoints: model, optimizer, schedule, data position and RNG state, written atomically.

Layout under ``<run_dir>/checkpoints``::

    step_000200/dist/               megatron-core dist_checkpointing (torch_dist): model and
                                    optimizer state as sharded tensors keyed by their global
                                    (tp=1, pp=1) names, plus the common state (step, LR
                                    schedule, data position) -- loadable at any tp/pp/vpp/dp
                                    layout, with or without the distributed optimizer
    step_000200/model.safetensors   the model weights alone, full (tp=1) tensors with global
                                    names: ``safetensors`` / ``torch.load(weights_only=True)``
                                    readers, ``vitgraph export``
    step_000200/rng_rank_NNNNN.pt   every rank's RNG state, restored only at the same layout
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


def _layout(d: Dist) -> dict:
    return {"world": d.world, "tp": d.tp, "pp": d.pp, "vpp": d.vpp, "dp": d.dp}


def save(ckpt_dir: Path, step: int, d: Dist, sharded_state: dict, keep: int) -> Path:
    """``sharded_state``: the dict ``dist_checkpointing.save`` takes (see ``sharded_state``
    in vitgraph.train.loop), the same structure on every rank."""
    from megatron.core import dist_checkpointing
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f"step_{step:06d}.tmp"
    if d.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
    _barrier()
    dist_checkpointing.save({**sharded_state, "step": step}, str(tmp / "dist"))
    _atomic_save({**_rng_state(d), "layout": _layout(d)}, tmp / f"rng_rank_{d.rank:05d}.pt")
    _barrier()
    if d.rank == 0:
        from vitgraph.convert import read_dist_weights, save_safetensors
        weights, _ = read_dist_weights(tmp / "dist")
        save_safetensors(weights, tmp / "model.safetensors", metadata={"step": step})
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


def load(path: Path, d: Dist, sharded_template: dict) -> dict:
    """This rank's state from a complete checkpoint directory, loaded into the shapes of
    ``sharded_template`` (this run's layout); restores the RNG state when the layout matches."""
    from megatron.core import dist_checkpointing
    if not (path / "dist").is_dir():
        raise RuntimeError(f"{path}: no dist/ folder; not a vitgraph checkpoint of this format")
    state = dist_checkpointing.load({**sharded_template, "step": None}, str(path / "dist"))
    rng_file = path / f"rng_rank_{d.rank:05d}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        if rng.get("layout") == _layout(d):  # another layout: keep this run's fresh RNG
            _set_rng_state(rng, d)
    return state


def load_model(path: Path, chunks: list) -> int:
    """Only the model weights of a checkpoint into ``chunks`` (this rank's, any layout);
    returns the checkpoint's step."""
    from megatron.core import dist_checkpointing
    template = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    state = dist_checkpointing.load(template, str(path / "dist"))
    for i, c in enumerate(chunks):
        c.load_state_dict(state[f"model{i}"])
    return int(state.get("step", 0))
