#!/usr/bin/env bash
# Where `model.fused_norm: auto` should switch to the fused residual-add + LayerNorm: one
# bench.py row per micro-batch size with the fused layer forced on (always) and off (never),
# step graphs, one process per row. auto takes the fused layer from 16,384 tokens a
# micro-batch (vitgraph/parallel/setup.py), a line through the two measured points (ViT-L/16:
# fused 1.4% faster at mb 256, 3.8% slower at mb 8; benchmarks/BENCHMARKS.md).
#   usage: scripts/fused_norm_threshold.sh [MODEL] [MICRO_BATCH ...]
#          (default: vit_l16_224 32 64 128; JSON and logs go to $OUT, or ./norm-threshold)
# Needs a CUDA GPU with TE (on the H200 device host: `source .te/te-install` first).
set -uo pipefail
case ${1:-} in -h|--help) sed -n 2,9p "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
model=${1:-vit_l16_224}; shift || true
mbs=("$@"); [ ${#mbs[@]} -eq 0 ] && mbs=(32 64 128)
out=${OUT:-norm-threshold}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
for mb in "${mbs[@]}"; do
  for f in always never; do
    timeout 120 python scripts/bench.py --model "$model" --micro-batches "$mb" --warmup 6 \
      --iters 10 --systems vitgraph+step-graphs --override model.fused_norm=$f \
      --out "$out/mb${mb}_$f.json" > "$out/mb${mb}_$f.log" 2>&1
    echo "mb $mb fused_norm=$f: $(grep -h 'img/s' "$out/mb${mb}_$f.log" | tail -n 1)"
  done
done
