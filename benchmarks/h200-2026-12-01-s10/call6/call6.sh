# Session 10, call 6 (one H200, the last ~3 minutes of device time): ViT-L/16 mb 8 after
# giving the fused norm's backward at least 8 rows per program (call 5: step graphs 555.0
# against timm reduce-overhead 565.1, layer graphs 210.4), and layer graphs with
# model.fused_norm=false for the A/B.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/c6; rm -rf $G; mkdir -p $G
pack() { (cd /tmp && tar czf $OUT/logs.tgz c6); }
timeout 100 python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
  --systems vitgraph+graphs vitgraph+step-graphs timm+compile-reduce-overhead --warmup 10 --iters 30 \
  --out $G/mb8.json > $G/mb8.log 2>&1; pack
timeout 40 python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
  --systems vitgraph+graphs --override model.fused_norm=false --warmup 10 --iters 30 \
  --out $G/mb8_unfused.json > $G/mb8_unfused.log 2>&1; pack
grep -h "img/s" $G/mb8.log $G/mb8_unfused.log
