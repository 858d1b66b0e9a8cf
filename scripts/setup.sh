#!/usr/bin/env bash
# Sets up .venv for vitgraph on this machine (idempotent). Without a GPU it pins the CPU build
# of torch first, so that the plain `torch` requirement does not pull a multi-GB CUDA build.
#   usage: bash scripts/setup.sh          (runtime)
#          bash scripts/setup.sh test     (runtime + test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" torch
  else
    "${pip[@]}" torch==2.13.0
  fi
fi
spec="."
[ "$extra" = test ] && spec=".[test]"
# keep the torch installed above: without the pin, a dependency's newest release (timm ->
# torchvision) asks for a newer torch, and pip replaces the CPU build by a multi-GB CUDA one
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
"${pip[@]}" -c <(echo "torch==$torch_version") -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
# timm (test extra) pulls torchvision, whose PyPI wheel is built for CUDA torch: against the CPU
# torch it cannot even be imported, and half-installed it confuses transformers. Remove it
# there; the tests import timm with a stand-in (tests/conftest.py: import_timm).
if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1 \
    && ! .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y torchvision
fi
.venv/bin/python -c "import vitgraph, torch, megatron.core as m; print('vitgraph ready: torch', torch.__version__, '| megatron-core', m.__version__)"
