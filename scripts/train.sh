#!/usr/bin/env bash
# Launch vitgraph training with torchrun on this node.
#
#   scripts/train.sh CONFIG [key=value ...]
#
#   scripts/train.sh configs/vit-b16-imagefolder.yaml data.path=/data/imagenet
#   NPROC=2 scripts/train.sh configs/vit-b16-imagefolder.yaml train.steps=100
#   # two nodes: run on both (NODE_RANK=0 on 10.0.0.1, NODE_RANK=1 on the other)
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/train.sh configs/vit-l16-imagefolder.yaml
#
# Environment (all optional):
#   NPROC        processes (GPUs) on this node   default: the GPUs CUDA_VISIBLE_DEVICES names
#                                                when set, else those `nvidia-smi -L` lists, else 1
#   NNODES       nodes in the job                 default: 1
#   NODE_RANK    this node's rank                 default: 0
#   MASTER_ADDR  address of node 0                default: 127.0.0.1
#   MASTER_PORT  its port                         default: 29500
#   RDZV_BACKEND c10d or static (multi-node)      default: c10d
#   RDZV_ID      c10d rendezvous id, the same on all nodes             default: vitgraph
#   DRY_RUN=1    print the command instead of running it
#
# One node uses torchrun's static rendezvous at MASTER_ADDR:MASTER_PORT. With NNODES > 1 the
# default is the c10d rendezvous, hosted by the torchrun on MASTER_ADDR at MASTER_PORT: torchrun
# then assigns node ranks itself (NODE_RANK is ignored) and the nodes may start in any order.
# RDZV_BACKEND=static keeps the static rendezvous, where NODE_RANK decides each node's ranks.
# Network settings (NCCL_*) are site-specific: export them before calling this script.
#
# The interpreter is the repository's .venv/bin/python when it exists (scripts/setup.sh makes
# it), else python3 (as in the Docker image).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

if [ $# -lt 1 ]; then
  echo "error: no CONFIG given" >&2
  echo >&2
  usage >&2
  exit 2
fi
case "$1" in
  -h|--help) usage; exit 0 ;;
  -*) echo "error: the first argument must be the CONFIG path, got '$1' (see --help)" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"
else
  python=python3
fi

if [ -z "${NPROC:-}" ]; then
  NPROC=0
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    # nvidia-smi -L lists every GPU of the node, also those hidden from CUDA
    IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
    NPROC=${#visible[@]}
  elif command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  [ "$NPROC" -gt 0 ] || NPROC=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

cmd=("$python" -m torch.distributed.run
  --nnodes "$NNODES"
  --nproc-per-node "$NPROC"
  --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR"
  --master-port "$MASTER_PORT")
if [ "$NNODES" != 1 ]; then
  case "${RDZV_BACKEND:-c10d}" in
    c10d)
      cmd+=(--rdzv-backend c10d
        --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "${RDZV_ID:-vitgraph}") ;;
    static) ;;
    *) echo "error: RDZV_BACKEND must be c10d or static, got '$RDZV_BACKEND'" >&2; exit 2 ;;
  esac
fi
cmd+=(-m vitgraph train "$@")

if [ "${DRY_RUN:-0}" != 0 ]; then
  printf '%q' "${cmd[0]}"
  printf ' %q' "${cmd[@]:1}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
