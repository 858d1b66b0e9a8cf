"""Checkpoints: model, optimizer, schedule, data position and RNG state, written atomically and
verified before use.

Layout under ``<run_dir>/checkpoints``::

    step_000200/dist/               megatron-core dist_checkpointing (torch_dist): model and
                                    optimizer state as sharded tensors keyed by their global
                                    (tp=1, pp=1) names, plus the common state (step, LR
                                    schedule, data position) -- loadable at any tp/pp/vpp/dp
                                    layout, with or without the distributed optimizer; with
                                    train.ema also the EMA of the weights (``ema.<name>``, fp32)
                                    and its step count (common ``ema.steps``)
    step_000200/model.safetensors   the model weights alone, full (tp=1) tensors with global
                                    names: ``safetensors`` / ``torch.load(weights_only=True)``
                                    readers, ``vitgraph export``
    step_000200/rng_rank_NNNNN.pt   every rank's RNG state, restored only at the same layout
    step_000200/manifest.json       every other file under step_000200/ (recursively): size and
                                    sha256; written last
    latest                          the name of the newest complete step directory (for people;
                                    resuming scans the step directories)

The integrity layer does not care what the payload is: ``write_payload`` / ``read_payload`` are
the only functions that know the files above, and the manifest covers whatever they leave in
the step directory. Every rank writes into ``step_XXXXXX.tmp/``; once all ranks report success,
rank 0 hashes the files, writes the manifest, renames the directory and rewrites ``latest``.
A crash or a failed write (full disk, unwritable folder) leaves a ``.tmp`` directory, which is
never loaded and is removed by the next save; the checkpoints before it are untouched.

On resume the newest step directory whose manifest matches its files is used; damaged ones are
reported with the file named. Pruning to ``keep`` never removes the newest intact checkpoint.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from vitgraph.config import CheckpointConfig
from vitgraph.convert import ConvertError, read_dist_weights, save_safetensors
from vitgraph.convert.checkpoints import (CheckpointError, CheckpointMismatch, damage, newest_intact,
                                          quiet_reads, step_dirs, verify, write_manifest)
from vitgraph.parallel import fsdp
from vitgraph.parallel.dist import Dist
from vitgraph.train.optim import allocate_offloaded_state, offload_pickled_classes

log = logging.getLogger("vitgraph")

class NoIntactCheckpoint(CheckpointError):
    """Checkpoints exist and every one is damaged: the user decides (exit 2)."""


class Checkpointer:
    """The run's checkpoints (the checkpoint: section): what one holds, when one is due, saving
    it and resuming from the newest intact one.

    A checkpoint holds, as megatron-core's dist_checkpointing takes it, the model chunks and
    the optimizer as sharded tensors with global names (any layout can load them), the LR
    schedule and the data position as common state; with train.ema (``ema``) the EMA of the
    weights under the model's names prefixed "ema." and its step count. parallel.fsdp
    (``fsdp``): the same tensors, this rank's pieces of them (vitgraph.parallel.fsdp).
    ``new_run``: how the command would name another run folder, for the message when every
    checkpoint is damaged (vitgraph.train.runcheck.new_run_hint)."""

    def __init__(self, section: CheckpointConfig, run_dir: Path, total_steps: int, d: Dist,
                 chunks: list, optimizer, scheduler, loader, ema=None, fsdp: bool = False,
                 new_run: str = "run.dir=<another folder>"):
        self.section, self.dir = section, run_dir / "checkpoints"
        self.new_run = new_run
        self.total_steps, self.d, self.fsdp = total_steps, d, fsdp
        # what a checkpoint holds
        self.chunks, self.optimizer, self.scheduler = chunks, optimizer, scheduler
        self.loader, self.ema = loader, ema
        self.saved_step = -1  # the step of the newest checkpoint this process wrote or loaded

    def due(self, step: int) -> bool:
        """checkpoint.every: a save after ``step`` (the last step's is the run's end's)."""
        every = self.section.every
        return bool(every) and step % every == 0 and step != self.total_steps

    def state(self, is_loading: bool = False, ema: bool = True) -> dict:
        """What a checkpoint holds (see the class); ``ema``: with the EMA, where there is one."""
        state = self._state(is_loading, ema)
        return fsdp.to_shards(state) if self.fsdp else state

    def _state(self, is_loading: bool, ema: bool) -> dict:
        """``state`` before FSDP's DTensors are cut into this rank's pieces."""
        with fsdp.unsharded_view() if self.fsdp else contextlib.nullcontext():
            model = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(self.chunks)}
            extra = {}
            if self.ema is not None and ema:
                extra["ema"] = self.ema.sharded_state_dict(model, is_loading)
            # fully_reshardable: the distributed optimizer's state gathered into per-parameter
            # tensors named after the model's (megatron's other formats reshard only across dp)
            optim = self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata={
                "distrib_optim_sharding_type": "fully_reshardable",
                "chained_optim_avoid_prefix": True})
        return {**model, "optimizer": optim, "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict(), **extra}

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (nothing with checkpoint.save=false)."""
        if not self.section.save:
            log.info("checkpoint: none saved at step %d (checkpoint.save=false)", step)
            return
        path = save(self.dir, step, self.d, self.state(), self.section.keep)
        self.saved_step = step
        log.info("checkpoint: %s", path)

    def resume(self) -> int | None:
        """Load the newest intact checkpoint into the model, optimizer, schedule, data position
        and EMA; its step, or None where there is none (or checkpoint.resume=false)."""
        if not self.section.resume:
            return None
        path = find_resumable(self.dir, self.d, self.new_run)
        if path is None:
            return None
        with_ema = self.ema is not None and holds_ema(path)
        allocate_offloaded_state(self.optimizer)  # before the load fills the weights in place
        template = self._state(is_loading=True, ema=with_ema)
        pieces = fsdp.to_shards(template) if self.fsdp else template
        with torch.serialization.safe_globals(offload_pickled_classes()):
            state = load(path, self.d, pieces)
        if self.fsdp:
            state = fsdp.restore(template, state)
        for i, c in enumerate(self.chunks):
            c.load_state_dict(state[f"model{i}"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None:
            self.ema.rebind(self.optimizer)
            if with_ema:
                self.ema.load_sharded(state["ema"])
            else:
                self.ema.restart()
                log.warning("checkpoint %s holds no EMA of the weights: the EMA starts from "
                            "its weights at step %d, its warm-up from n = 0", path.name,
                            state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.saved_step = state["step"]
        log.info("resumed from %s at step %d", path, self.saved_step)
        return self.saved_step

    def saved_line(self) -> str:
        """Where the newest checkpoint of this process is, for a stop message."""
        if not self.section.save:
            return "no checkpoint saved (checkpoint.save=false)"
        return (f"checkpoint {self.dir / f'step_{self.saved_step:06d}'} saved; run the same "
                "command to resume")


# ---------------------------------------------------------------- the payload (swappable)

def _layout(d: Dist) -> dict:
    return {"world": d.world, "tp": d.tp, "pp": d.pp, "vpp": d.vpp, "dp": d.dp}


def write_payload(directory: Path, d: Dist, sharded_state: dict, step: int) -> None:
    """Every rank's part of a checkpoint, written into ``directory`` (which exists).
    ``sharded_state``: the dict ``dist_checkpointing.save`` takes, the same on every rank."""
    from megatron.core import dist_checkpointing
    if d.rank == 0:
        (directory / "dist").mkdir()
    _barrier()
    dist_checkpointing.save({**sharded_state, "step": step}, str(directory / "dist"))
    _save({**_rng_state(d), "layout": _layout(d)}, directory / f"rng_rank_{d.rank:05d}.pt")
    _barrier()
    if d.rank == 0:
        weights, _ = read_dist_weights(directory / "dist")
        if weights:
            save_safetensors(weights, directory / "model.safetensors", metadata={"step": step})


def check_shapes(directory: Path, sharded_template: dict) -> None:
    """CheckpointMismatch naming the tensors whose shape in the checkpoint at ``directory``
    differs from this run's (another model, vocabulary or text length): megatron-core's load
    does not check, and a model loaded so evaluates as garbage without a word."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    try:
        saved = dcp.FileSystemReader(str(directory / "dist")).read_metadata().state_dict_metadata
    except Exception:  # unreadable: the load says so, naming the file
        return
    wrong = []
    for sh in nested_values(sharded_template):
        if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
            continue
        have = getattr(saved.get(sh.key), "size", None)
        if have is not None and tuple(have) != tuple(sh.global_shape):
            wrong.append(f"{sh.key} is {list(have)} there, {list(sh.global_shape)} here")
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise CheckpointMismatch(
            f"{directory}: its weights do not fit the model this config builds: "
            f"{'; '.join(wrong[:3])}{more}. Use the config (and overrides) it was trained with")


def read_payload(directory: Path, d: Dist, sharded_template: dict) -> dict:
    """This rank's state, loaded into the shapes of ``sharded_template`` (this run's layout);
    restores the RNG state when the layout matches."""
    from megatron.core import dist_checkpointing
    if not (directory / "dist").is_dir():
        raise CheckpointError(f"{directory}: no dist/ folder; not a vitgraph checkpoint of this "
                              f"format")
    check_shapes(directory, sharded_template)
    try:
        with quiet_reads():
            state = dist_checkpointing.load({**sharded_template, "step": None},
                                            str(directory / "dist"))
    except Exception as e:
        raise CheckpointError(f"{directory / 'dist'}: cannot be read ({type(e).__name__}: "
                              f"{e})") from None
    rng_file = directory / f"rng_rank_{d.rank:05d}.pt"
    if rng_file.is_file():
        rng = _load(rng_file, "cpu")
        if rng.get("layout") == _layout(d):  # another layout: keep this run's fresh RNG
            _set_rng_state(rng, d)
    return state


def start_writer_helper(signals) -> None:
    """Start megatron's checkpoint-writer helper process now, deaf to ``signals``, and bound
    to this process's life.

    megatron-core 0.16.1 collects its writers' results through a multiprocessing manager, a
    process spawned at the first save and kept. ``timeout``, a terminal and SLURM signal a
    job's whole process group: a stop signal killed that helper, so the preemption save that
    signal asked for failed (EOFError or BrokenPipeError, on an H200 run). So the signals
    are blocked in this thread while the helper is spawned: it inherits the mask across
    exec, and its initializer (``_die_with_parent``) ignores them before unblocking them.
    Blocked, not ignored, here: a signal meant for this process waits until the helper has
    started (seconds: it imports torch and megatron-core) and then reaches the run's handler;
    ignoring it here for that while lost it, and the run trained on. The helper ends with
    this process (megatron's finalizer) or, when this process is killed outright (``kill
    -9``, the OOM killer), by the parent-death signal ``_die_with_parent`` asks the kernel
    for. Made here as megatron makes it (a spawn-context manager's queue), in megatron's slot.
    ``signals`` include SIGINT: with Python's default handler a Ctrl-C raised KeyboardInterrupt
    in the middle of the spawn, and the process then waited at exit, forever, for a helper
    that ignores the signals."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", True) is not None or not hasattr(fa, "_get_write_results_queue"):
        return  # started already, or a megatron-core that does not keep one
    import multiprocessing
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager
    signals = tuple(int(s) for s in signals)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        # a spawn starts multiprocessing's resource tracker first, which blocks SIGINT and
        # SIGTERM to spawn it and then unblocks them (not the mask it found): the helper
        # spawned after would take SIGTERM again. So the tracker first, then block again.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_die_with_parent, (os.getpid(), signals))
        fa._results_queue = manager.Queue()  # the proxy keeps the manager (and its finalizer)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a pending signal arrives now


def _die_with_parent(parent: int, signals: tuple = ()) -> None:
    """In the writer helper: ``signals`` (blocked since it was spawned) ignored, and SIGKILL
    when the training process's thread that started it ends (Linux prctl
    PR_SET_PDEATHSIG; elsewhere nothing changes)."""
    for s in signals:
        signal.signal(s, signal.SIG_IGN)  # discards one pending: it was the job's, not ours
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL)) == 0
    except (OSError, AttributeError):
        return
    if ok and os.getppid() != parent:  # the parent died before the request
        os._exit(0)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load(path: Path, device):
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError...
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


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


# ---------------------------------------------------------------- collectives that agree

def _everyone(fn, d: Dist, what: str):
    """Run ``fn`` on every rank and agree on the outcome: if it failed anywhere, every rank
    raises CheckpointError naming the failures (a plain barrier would hang the healthy ranks).
    Returns rank 0's result on every rank."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # OSError (ENOSPC, EACCES, EROFS), pickling errors...
        error = f"rank {d.rank}: {type(e).__name__}: {e}"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        outcomes = [(result, error)]
    else:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (result, error))
    errors = [e for _, e in outcomes if e]
    if errors:
        raise CheckpointError(f"{what} failed: {'; '.join(errors[:4])}")
    return outcomes[0][0]


# ---------------------------------------------------------------- save / find / load

def save(ckpt_dir: Path, step: int, d: Dist, state: dict, keep: int) -> Path:
    """Write ``state`` (the sharded state dict, see ``write_payload``) as checkpoint ``step``. Raises CheckpointError on every rank if any rank fails; the earlier
    checkpoints are untouched then."""
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f"step_{step:06d}.tmp"

    def prepare():
        if d.rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()

    def finish():
        if d.rank != 0:
            return
        write_manifest(tmp, step)
        _fsync_dir(tmp)
        if final.exists():  # a damaged checkpoint of the same step, passed over on resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        pointer = ckpt_dir / "latest.partial"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, ckpt_dir / "latest")
        _prune(ckpt_dir, keep, final)

    try:
        _everyone(prepare, d, f"checkpoint {tmp}: creating the folder")
        _everyone(lambda: write_payload(tmp, d, state, step), d, f"checkpoint {tmp}: writing")
        _everyone(finish, d, f"checkpoint {final}: finishing")
    except CheckpointError as e:
        if d.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [p.name for p in step_dirs(ckpt_dir) if p != final]
        raise CheckpointError(f"{e}. The earlier checkpoints are untouched "
                              f"({', '.join(previous[-3:]) or 'none'}); {_remedy(str(e))}"
                              ) from None
    return final


def _remedy(failure: str) -> str:
    """What to do about a failed save: the disk's space or permissions when an OSError says
    so; otherwise (a helper process gone, a bug) only that a rerun resumes."""
    if any(f"[Errno {n}]" in failure for n in (errno.ENOSPC, errno.EDQUOT, errno.EACCES,
                                                errno.EPERM, errno.EROFS)):
        return "free space or fix the folder's permissions, then run the same command to resume"
    return "run the same command to resume"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(ckpt_dir: Path, keep: int, newest: Path) -> None:
    """Keep the ``keep`` newest intact checkpoints (sizes checked) and ``newest``, which was
    just written and hashed; remove leftovers of failed saves and everything older."""
    for stale in ckpt_dir.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    kept = {newest}
    for path in reversed(step_dirs(ckpt_dir)):
        if len(kept) >= keep:
            break
        if path != newest and not verify(path, checksums=False):
            kept.add(path)
    for path in step_dirs(ckpt_dir):
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)


def find_resumable(ckpt_dir: Path, d: Dist, new_run: str = "run.dir=<another folder>"
                   ) -> Path | None:
    """The newest intact checkpoint, checked on rank 0 and agreed by all ranks. None when there
    is no checkpoint at all; NoIntactCheckpoint when there are some and none is intact (its
    message suggests ``new_run`` for a new run)."""
    def choose():
        if d.rank != 0:
            return None
        path, damaged = newest_intact(ckpt_dir)
        for passed, problems in damaged:
            log.warning("checkpoint %s; passing over it", damage(passed, problems))
        return str(path) if path else None, [problems for _, problems in damaged]

    chosen, damaged = _everyone(choose, d, f"checking the checkpoints in {ckpt_dir}")
    if chosen is None and damaged:
        raise NoIntactCheckpoint(
            f"no intact checkpoint in {ckpt_dir}: "
            + "; ".join(p[0] for p in damaged[:3])
            + f". Start over with checkpoint.resume=false (the damaged ones are moved aside), "
            f"or start a new run with {new_run}")
    return Path(chosen) if chosen else None


def load(path: Path, d: Dist, sharded_template: dict) -> dict:
    """This rank's state from a verified checkpoint directory; restores the RNG state."""
    return read_payload(path, d, sharded_template)


def holds_ema(path: Path) -> bool:
    """Whether a step directory holds an EMA of the weights (train.ema)."""
    common = _load(path / "dist" / "common.pt", "cpu")
    return isinstance(common, dict) and "ema" in common


def load_model(path: Path, chunks: list, ema: bool = False) -> int:
    """Only the model weights of a checkpoint into ``chunks`` (this rank's, any layout);
    returns the checkpoint's step. ``ema``: the EMA of the weights where the checkpoint
    holds one (parameters without one, frozen, keep their weights); ConvertError naming the
    checkpoint when it holds none."""
    from megatron.core import dist_checkpointing
    template = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    check_shapes(path, template)
    with quiet_reads():
        state = dist_checkpointing.load(template, str(path / "dist"))
    for i, c in enumerate(chunks):
        c.load_state_dict(state[f"model{i}"])
    if ema:
        _load_ema_weights(path, chunks)
    return int(state.get("step", 0))


def _load_ema_weights(path: Path, chunks: list) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    if not holds_ema(path):
        raise ConvertError(f"{path}: this checkpoint holds no EMA of the weights (the run "
                           f"trained without train.ema.decay); leave out --ema")
    keys = dcp.FileSystemReader(str(path / "dist")).read_metadata().state_dict_metadata
    params, template = [], {}
    for c in chunks:
        for sh in nested_values(c.sharded_state_dict()):
            if (isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.nn.Parameter)
                    and f"ema.{sh.key}" in keys):
                params.append(sh.data)
                template[str(len(template))] = make_sharded_optimizer_tensor(
                    sh, torch.empty(sh.data.shape, dtype=torch.float32, device=sh.data.device),
                    "ema")
    with quiet_reads():
        state = dist_checkpointing.load({"ema": {"weights": template}}, str(path / "dist"))
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(state["ema"]["weights"][str(i)])
