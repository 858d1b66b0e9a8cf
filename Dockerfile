# vitgraph training image: ViT encoders on megatron-core + Transformer Engine (TE).
#
#   docker build -t vitgraph .
#   docker run --rm --gpus all --ipc=host --ulimit memlock=-1 vitgraph          # prints the CLI help
#   docker run --rm --gpus all --ipc=host --ulimit memlock=-1 -v /data:/data vitgraph \
#       scripts/train.sh configs/vit-b16-imagefolder.yaml data.path=/data/imagenet
#
# docs/deploy.md covers multi-node runs (torchrun, SLURM + pyxis/enroot).
#
# Base image: NGC PyTorch 26.03 -- Python 3.12, CUDA 13.2, torch 2.11.0a0+nv26.03 and
# Transformer Engine 2.13 preinstalled and built against that torch. vitgraph needs TE >= 2.13
# (the first release whose make_graphed_callables tolerates None outputs, which the per-layer
# CUDA graphs rely on); older tags ship an older TE, so do not move the base below 26.03
# without rebuilding TE. The build below checks the TE version and fails if it is too old.
# The host driver must support CUDA 13.2 (see the NGC 26.03 release notes for driver branches).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3
FROM ${BASE_IMAGE}

# megatron-core version installed into the image, within pyproject's range (>=0.16.1,<0.20).
# 0.16.1 is the release vitgraph is tested against. Releases >= 0.18 assert at import time
# (megatron.core.dist_checkpointing) that nvidia-resiliency-ext >= 0.6.0 when it is installed,
# and the NGC base may carry an older one: the version check at the end of the build catches that.
# An empty value leaves the choice to pip within pyproject's range.
ARG MEGATRON_CORE_VERSION=0.16.1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace/vitgraph

# Dependencies first, read from pyproject.toml (the single source of truth), so that this layer
# is rebuilt only when pyproject.toml changes. The base image's torch must stay: its version is
# written into a constraints file, so pip can neither upgrade nor replace it (the NGC image's own
# /etc/pip/constraint.txt guards the rest of its stack). TE is not installed here (the `te` extra
# is skipped): the base image's TE is the build that matches its torch. The `clip` extra is in
# (CLIP's BPE vocabulary comes with open_clip).
COPY pyproject.toml ./
RUN set -eux; \
    python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
        > /tmp/vitgraph-constraints.txt; \
    if [ -n "${MEGATRON_CORE_VERSION}" ]; then \
        echo "megatron-core==${MEGATRON_CORE_VERSION}" >> /tmp/vitgraph-constraints.txt; \
    fi; \
    python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["clip"]))' \
        > /tmp/vitgraph-requirements.txt; \
    python -m pip install --no-cache-dir -c /tmp/vitgraph-constraints.txt -r /tmp/vitgraph-requirements.txt

# The package itself, without dependencies (installed above), plus configs and scripts. The
# last step fails the build when pip moved torch, when TE is older than 2.13, or when
# megatron-core >= 0.18 meets an nvidia-resiliency-ext older than 0.6.0; it prints the versions.
COPY README.md ./
COPY vitgraph/ vitgraph/
COPY configs/ configs/
COPY scripts/ scripts/
RUN set -eux; \
    python -m pip install --no-cache-dir --no-deps -c /tmp/vitgraph-constraints.txt .; \
    rm -rf build ./*.egg-info; \
    chmod +x scripts/*.sh; \
    python -c 'from importlib.metadata import distributions; from packaging.version import Version as V; \
v = {}; [v.setdefault((d.metadata["Name"] or "").lower().replace("_", "-"), d.version) for d in distributions()]; \
pin = open("/tmp/vitgraph-constraints.txt").readline().strip(); \
tv = v["torch"]; assert pin == "torch==" + tv, f"pip replaced the base image torch ({pin}) with {tv}"; \
te, mc, nvrx = v.get("transformer-engine", "0"), v["megatron-core"], v.get("nvidia-resiliency-ext"); \
assert V(te).release >= (2, 13), f"Transformer Engine {te} < 2.13: use a newer base image"; \
assert not (nvrx and V(mc).release >= (0, 18) and V(nvrx).release < (0, 6)), \
    f"megatron-core {mc} needs nvidia-resiliency-ext >= 0.6.0, the image has {nvrx}"; \
print("torch", v["torch"], "| transformer-engine", te, "| megatron-core", mc, "| vitgraph", v["vitgraph"])'

# The base image's entrypoint (NGC banner, driver checks) is kept; it runs the command given.
CMD ["python", "-m", "vitgraph", "--help"]
