"""What vitgraph writes, in helpers every layer may use: files written whole or not at all
(into a temporary file beside the target, renamed over it once complete, so that a reader,
another rank, a rerun or a crash's survivor, never sees half of one), whether a folder can be
written before any work goes into it, and counts in words."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def written_whole(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` (a hidden, unique ``.partial`` name, so that writers of
    one target at once do not collide) for the block to write; when the block ends it becomes
    ``path``, with the mode a plain ``open()`` would have given it. When the block raises it is
    removed and ``path`` is left as it was."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        # mkstemp (and safetensors' own writer) make 0600: weights unreadable by the others
        # of a shared cluster, where every other file of a run is 0644 under umask 022
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unwritable(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot be made or written here, or None. A folder still to be made is
    tried (a folder made and removed in its nearest existing parent), not read off the
    permission bits: root passes those, and /sys still refuses. An existing one (a run to
    resume, left untouched) is asked of access(2), which sees a read-only mount."""
    folder = Path(folder).expanduser().absolute()
    parent = next(p for p in (folder, *folder.parents) if p.exists())
    if not parent.is_dir():
        return f"{folder} is a file" if parent == folder else \
            f"{folder} cannot be made: {parent} is a file"
    if parent == folder:
        return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder} is not writable"
    try:
        tempfile.TemporaryDirectory(dir=parent, prefix=".vitgraph-probe-").cleanup()
    except OSError as e:
        return f"{folder} cannot be made: {parent}: {e.strerror}"
    return None


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` into ``path``, whole or not at all (``written_whole``)."""
    with written_whole(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _umask() -> int:
    """The process's umask, read without setting it where Linux tells it (os.umask can only
    read it by setting it, which a file created meanwhile by another thread would get)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plural(n: int, word: str) -> str:
    """'1 microbatch', '2 microbatches': ``n`` and ``word`` in the number it takes."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('s', 'sh', 'ch', 'x', 'z')) else 's'}"
