# session 6, call 2: GPU0 one-GPU tests after the static-input fix; GPU1 tile sweep, decode cost,
# mb8 step-graph profile, CLIP rows
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/gl2; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp gl2 2>/dev/null; done) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 330 python -m pytest -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_reliability_gpu.py tests/gpu/test_model_gpu.py \
    tests/gpu/test_step_graphs_gpu.py -v --tb=short -rs -p no:cacheprovider > $G/gpu_tests.log 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python .te/act_sweep.py > $G/act_sweep.log 2>&1
  timeout 70 python scripts/bench.py --model vit_l16_224 --micro-batches 8 --systems vitgraph+step-graphs \
     --warmup 8 --iters 10 --kernels 5 --out $G/profile_mb8.json > $G/profile_mb8.log 2>&1
  timeout $((330 - $(date +%s) + T0)) python scripts/bench.py --model clip_vit_b16 --micro-batches 256 --systems \
     vitgraph vitgraph+graphs --warmup 5 --iters 6 --out $G/bench_clip.json > $G/bench_clip.log 2>&1 ) &
P1=$!
wait $P0 $P1
grep -E "passed|failed" $G/gpu_tests.log | tail -3
grep -E "FAILED" $G/gpu_tests.log | head
grep -hE "img/s" $G/bench_*.log $G/profile_mb8.log | tail -6
cat $G/act_sweep.log | head -60
tar czf $R/logs.tgz -C /tmp gl2
