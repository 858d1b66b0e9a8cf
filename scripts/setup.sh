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
torch_version=$(.venv/bin/python -W ignore -c "import torch; print(torch.__version__.split('+')[0])")
"${pip[@]}" -c <(echo "torch==$torch_version") -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
# timm (test extra) pulls torchvision. PyPI's x86-64 Linux wheel of it is a CUDA build: beside
# the CPU torch its C++ ops (nms, roi_align, image decoding) cannot load. torchvision works
# without them (each op checks extension._has_ops() and raises only when called), except for
# two fake-kernel registrations (nms, qnms) that assume the ops exist and fail the import
# ("operator torchvision::nms does not exist"); those get the same check. timm's, transformers'
# and open_clip's models use none of the ops.
tv_ok() { .venv/bin/python -c "import torchvision" >/dev/null 2>&1; }
if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1 && ! tv_ok; then
  tv_dir=$(.venv/bin/python -c "import importlib.util as u
print(u.find_spec('torchvision').submodule_search_locations[0])")
  guard='if torchvision.extension._has_ops() else (lambda fn: fn)'
  sed -i "s/^@torch\.library\.register_fake(\"torchvision::\([a-z_]*\)\")\$/@(torch.library.register_fake(\"torchvision::\1\") $guard)/" \
    "$tv_dir/_meta_registrations.py"
  if tv_ok; then
    echo "torchvision: without its C++ ops (a CUDA build beside the CPU torch)"
  else
    # half-installed it confuses transformers, which then imports it
    .venv/bin/python -m pip uninstall -q -y torchvision
    echo "torchvision removed: it cannot be imported beside this torch (timm needs it)" >&2
  fi
fi
if [ "$extra" = test ]; then
  # the converter tests load vitgraph's exports with these, as the README tells users to
  .venv/bin/python -c "import timm, transformers, open_clip"
fi
.venv/bin/python -c "import vitgraph, torch, megatron.core as m; print('vitgraph ready: torch', torch.__version__, '| megatron-core', m.__version__)"
