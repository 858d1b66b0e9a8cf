"""What vitgraph writes, in two helpers every layer may use: files written whole or not at all
(into a temporary file beside the target, renamed over it once complete, so that a reader,
another rank, a rerun or a crash's survivor, never sees half of one), and counts in words."""
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
