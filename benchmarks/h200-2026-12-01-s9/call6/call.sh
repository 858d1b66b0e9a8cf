# session 9, call 6 (one H200, the machine of call 5 still warm, its shards in /tmp/s9_sh), run
# inline as the `run` command on eb9cb46's tree: bench.py --data with vitgraph's default (32
# hardware queues) and with CUDA_DEVICE_MAX_CONNECTIONS=8 (CUDA's default) set in the shell.
source .te/te-install >/dev/null 2>&1; export PYTHONWARNINGS=ignore PYTHONPATH=$PWD:$PYTHONPATH
B=(--model vit_b16_224 --micro-batches 256 --systems vitgraph+step-graphs --data /tmp/s9_sh --warmup 10 --iters 30)
timeout 80 python scripts/bench.py "${B[@]}" --out $OUT/bench_shards_q32.json > $OUT/bench_shards_q32.log 2>&1
CUDA_DEVICE_MAX_CONNECTIONS=8 timeout 80 python scripts/bench.py "${B[@]}" --out $OUT/bench_shards_q8.json > $OUT/bench_shards_q8.log 2>&1
