# session 6, call 4: GPU0 tests of the multi-tensor weight copy + step graphs, mb8 rows; GPU1 mb256
# bf16 rows after the copy change, decode cost
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/gl4; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp gl4 2>/dev/null; done) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 190 python -m pytest -m gpu tests/gpu/test_train_gpu.py tests/gpu/test_step_graphs_gpu.py \
     -v --tb=short -rs -p no:cacheprovider > $G/gpu_tests.log 2>&1
  timeout $((330 - $(date +%s) + T0)) python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
     --systems vitgraph+step-graphs timm+compile-reduce-overhead \
     --warmup 10 --iters 20 --out $G/bench_l16_mb8.json > $G/bench_l16_mb8.log 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 180 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
     --systems vitgraph vitgraph+step-graphs timm+compile \
     --warmup 6 --iters 8 --out $G/bench_l16_mb256.json > $G/bench_l16_mb256.log 2>&1
  [ -d /tmp/sf_b16 ] && timeout 60 python .te/decode_diag.py > $G/decode_diag.log 2>&1 ) &
P1=$!
wait $P0 $P1
grep -E "passed|failed" $G/gpu_tests.log | tail -2
grep -E "FAILED" $G/gpu_tests.log | head -5
grep -hE "img/s" $G/bench_*.log | cut -c1-150
head -5 $G/decode_diag.log
tar czf $R/logs.tgz -C /tmp gl4
