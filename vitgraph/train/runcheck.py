"""Before any work: does this command continue the run in its folder, and is anything left?

A run folder keeps the resolved ``config.yaml`` of the run. Resuming with another model, data
or batch layout would load weights into the wrong network or continue the wrong data order,
so it stops here with the differing keys named. Settings that do not change what is trained
(duration, intervals, logging, the parallel layout, graphs) may change and are logged: each
such key says so on its field (``key(..., resume_ok=True)``, vitgraph.config).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import yaml

from vitgraph.config import Config, ConfigError, may_change_on_resume


class FinishedRun(Exception):
    """The run in this folder is complete and the command asks for nothing more."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, old, new) for every key whose value differs; keys the old run did not record
    (added to vitgraph since) are not compared."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a[k], b.get(k)) for k in a if k in b and a[k] != b[k]]


def has_checkpoints(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return ckpt.is_dir() and any(p.name.startswith("step_") for p in ckpt.iterdir())


def check_run_dir(cfg: Config) -> list[tuple[str, object, object]]:
    """Raises ConfigError when the command would resume a different run, FinishedRun when the
    run is complete; returns the safe changes (to be logged)."""
    run_dir = cfg.run_dir
    stored = run_dir / "config.yaml"
    metrics_path = run_dir / "metrics.json"
    if not cfg.checkpoint.resume or not stored.is_file():
        return []
    if not (has_checkpoints(run_dir) or metrics_path.is_file()):
        return []  # nothing to resume: the run starts from step 0
    try:
        old = yaml.safe_load(stored.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{stored}: not valid YAML ({e}); move the run folder away or pass "
                          f"checkpoint.resume=false") from None
    changes = config_changes(old, cfg.to_dict())
    unsafe = [c for c in changes if not may_change_on_resume(c[0])]
    if unsafe:
        lines = "\n".join(f"  {k}: {o!r} (run) -> {n!r} (now)" for k, o, n in unsafe)
        raise ConfigError(
            f"{run_dir} holds a run with another setup; resuming it with this config would "
            f"train something else:\n{lines}\nStart a new run with {new_run_hint(cfg)}, or start "
            f"this one over with checkpoint.resume=false.")
    if metrics_path.is_file():
        _stop_if_finished(cfg, metrics_path)
    return changes


def _stop_if_finished(cfg: Config, metrics_path: Path) -> None:
    try:
        metrics = json.loads(metrics_path.read_text())
        done = int(metrics["step"])
    except (ValueError, KeyError, TypeError):
        return  # unreadable metrics: resume from the checkpoint and write them again
    t = cfg.train
    if t.steps is not None:
        total = t.steps
    elif "steps_per_epoch" in metrics:
        total = math.ceil(t.epochs * metrics["steps_per_epoch"])
    else:
        return
    if total > done:
        return
    run_dir = cfg.run_dir
    raise FinishedRun(
        f"vitgraph: {run_dir} is a finished run (step {done}); nothing was changed. Results: "
        f"{metrics_path.resolve()} (log {run_dir / 'log.jsonl'}, checkpoints "
        f"{run_dir / 'checkpoints'}). To train it further ask for more steps, e.g. "
        f"train.steps={2 * done}; for a new run pass {new_run_hint(cfg)}.", metrics)


def new_run_hint(cfg: Config) -> str:
    """How this command names another run folder: run.dir when it chose its folder by
    run.dir (run.name then changes nothing), else run.name."""
    if cfg.run.dir:
        return "run.dir=<another folder>"
    return "run.name=<new name> (or run.dir=<folder>)"


# what a run writes into its folder (the ``.tmp`` / ``.partial`` ones: a write cut short)
RUN_FILES = ("config.yaml", "config.tmp", "classes.json*", "train.log", "log.jsonl",
             "metrics.json*", "eval-*.json", "tensorboard", "checkpoints")


def set_aside_previous_run(run_dir: Path) -> tuple[Path, list[str]] | None:
    """Starting over (checkpoint.resume=false): the previous run's files in ``run_dir`` moved
    into ``run_dir/previous-<UTC time>/``, so that the folder holds the new run alone (its
    checkpoints, pruning, log, eval, a later resume) and nothing of the old one is lost.
    Returns (that folder, the names moved), None when there was nothing to move. Rank 0 only,
    before the process groups (the other ranks touch the folder after them)."""
    found = sorted({p.name for pattern in RUN_FILES for p in run_dir.glob(pattern)})
    if not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder, n = run_dir / f"previous-{stamp}", 1
    while folder.exists():  # started over twice in a second
        n += 1
        folder = run_dir / f"previous-{stamp}-{n}"
    folder.mkdir()
    for name in found:
        os.replace(run_dir / name, folder / name)
    return folder, [f"{name}/" if (folder / name).is_dir() else name for name in found]


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
