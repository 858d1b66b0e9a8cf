"""A run's checkpoint folders on disk: the step directories under ``<run_dir>/checkpoints``,
the manifest that makes one complete (every other file's size and sha256, written last), and
which is intact and newest. vitgraph.train.checkpoint writes them; training, ``vitgraph
eval`` / ``export`` and a distillation teacher find them here."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vitgraph.convert.tables import ConvertError
from vitgraph.output import written_whole

log = logging.getLogger("vitgraph")

# what torch (2.13) and megatron-core (0.16.1) say on every checkpoint read, to no one who can
# act on it: megatron's dist_checkpointing reads through torch's deprecated ShardedTensor and
# load_state_dict, and a read without a process group (vitgraph export) is one process as asked
_READ_NOTICES = ((FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
                 (FutureWarning, r"`load_state_dict` is deprecated and will be removed"),
                 (UserWarning, r"torch.distributed is disabled, unavailable or uninitialized"))


@contextlib.contextmanager
def quiet_reads():
    """A checkpoint read without torch's and megatron-core's notices (_READ_NOTICES)."""
    with warnings.catch_warnings():
        for category, message in _READ_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint's tensors do not fit the model this config builds (the user's input)."""


def _sha256(path: Path) -> str:
    h, buf = hashlib.sha256(), bytearray(1 << 22)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _hash_all(directory: Path, names: list[str]) -> list[str]:
    # hashlib releases the GIL: threads read and hash files in parallel
    with ThreadPoolExecutor(min(8, max(1, len(names)), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda n: _sha256(directory / n), names))


def write_manifest(directory: Path, step: int) -> dict:
    names = _files(directory)
    digests = _hash_all(directory, names)
    manifest = {"format": 1, "step": step, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {n: {"size": (directory / n).stat().st_size, "sha256": h}
                          for n, h in zip(names, digests)}}
    with written_whole(directory / MANIFEST) as tmp, open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and files
    except Exception:
        raise CheckpointError(f"{path}: not a valid manifest") from None
    return manifest


def verify(directory: Path, checksums: bool = True) -> list[str]:
    """Problems with a step directory, each naming a file; empty when it is intact.
    ``checksums=False`` checks presence and sizes only (cheap)."""
    try:
        files = _read_manifest(directory)["files"]
    except CheckpointError as e:
        return [str(e)]
    problems, present = [], []
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != meta["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says "
                            f"{meta['size']}")
        else:
            present.append(name)
    if checksums and not problems:
        for name, digest in zip(present, _hash_all(directory, present)):
            if digest != files[name]["sha256"]:
                problems.append(f"{directory / name}: checksum differs from the manifest")
    return problems



def step_dirs(ckpt_dir: Path) -> list[Path]:
    """Complete-looking step directories (not ``.tmp``), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                  key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def newest_intact(ckpt_dir: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest step directory that verifies (sizes and checksums), None when none does; and
    the newer ones passed over, newest first, each with its problems (``verify``)."""
    damaged = []
    for path in reversed(step_dirs(ckpt_dir)):
        problems = verify(path)
        if not problems:
            return path, damaged
        damaged.append((path, problems))
    return None, damaged


def damage(path: Path, problems: list[str]) -> str:
    """'step_000060 is damaged: <the first problems>', for a log or an error line."""
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{path.name} is damaged: {'; '.join(problems[:3])}{more}"


def find_checkpoint(run_dir: str | Path, checkpoint: str | int | None = None
                    ) -> tuple[Path, list[str]]:
    """A run's step directory that verifies against its manifest: the newest intact one, or
    the one named by a step number or a path; and a line (``damage``) for each newer one passed
    over. ConvertError (the user's input, as for a weights file) naming what is wrong when
    there is none to read: the named checkpoint's damage, or each damaged checkpoint's."""
    ckpts = Path(run_dir) / "checkpoints"
    if checkpoint is None:
        path, damaged = newest_intact(ckpts)
        if path is None and damaged:
            raise ConvertError(f"{run_dir}: no intact checkpoint under {ckpts}: "
                               + "; ".join(damage(p, problems) for p, problems in damaged))
        if path is None:
            raise ConvertError(f"{run_dir}: no checkpoint under {ckpts}")
        return path, [damage(p, problems) for p, problems in damaged]
    s = str(checkpoint)
    path = ckpts / f"step_{int(s):06d}" if s.isdigit() else Path(s)
    if not path.is_dir() or path.name.endswith(".tmp"):
        raise ConvertError(f"checkpoint {s!r}: no complete checkpoint directory {path}")
    problems = verify(path)
    if problems:
        raise ConvertError(f"checkpoint {path.parent / damage(path, problems)}")
    return path, []


def checkpoint_dir(run_dir: str | Path, checkpoint: str | int | None = None) -> Path:
    """``find_checkpoint``'s step directory; the newer ones it passed over are logged."""
    path, passed = find_checkpoint(run_dir, checkpoint)
    for line in passed:
        log.warning("checkpoint %s; passing over it", line)
    return path
