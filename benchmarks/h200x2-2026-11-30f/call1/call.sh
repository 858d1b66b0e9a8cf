# session 6, call 1 (2 GPUs side by side). GPU0: all one-GPU tests (shared-pool fix, fused
# bias-act test), then the ViT-L mb256 bench rows. GPU1: fused act timing, mb8 bench, mb256
# kernel profile, shards-train (3 ways), CLIP bench. Then the dp2 step test.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/gl; mkdir -p $G; R=$OUT; T0=$(date +%s)
git log --oneline -1 > $G/commit.txt; git status --short >> $G/commit.txt
(while sleep 10; do tar czf $R/logs.tgz -C /tmp gl 2>/dev/null; done) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 270 python -m pytest -m gpu tests/gpu -v --tb=short -rs -p no:cacheprovider > $G/gpu_tests.log 2>&1
  timeout $((540 - $(date +%s) + T0)) python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
     --systems vitgraph vitgraph+graphs vitgraph+step-graphs timm+compile \
     --warmup 6 --iters 8 --out $G/bench_l16_mb256.json > $G/bench_l16_mb256.log 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 60 python .te/act_timing.py > $G/act_timing.log 2>&1
  timeout 110 python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
     --systems vitgraph+step-graphs timm+compile-reduce-overhead \
     --warmup 10 --iters 20 --out $G/bench_l16_mb8.json > $G/bench_l16_mb8.log 2>&1
  timeout 80 python scripts/bench.py --model vit_l16_224 --micro-batches 256 --systems vitgraph \
     --warmup 6 --iters 4 --kernels 3 --out $G/profile_mb256.json > $G/profile_mb256.log 2>&1
  sh=/tmp/shards_b16
  python scripts/shapes_imagefolder.py /tmp/sf_b16 --num-train 8192 --num-val 512 --format jpg \
     --size 500x375 --noise 40 --no-cache > $G/shards_make.log 2>&1
  python scripts/make_shards.py /tmp/sf_b16 $sh --shard-size 512 >> $G/shards_make.log 2>&1
  w=(configs/vit-b16-imagefolder.yaml train.steps=120 train.global_batch_size=256 train.micro_batch_size=256
     train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
     data.augment.enabled=false data.workers=16 model.num_classes=10)
  timeout 80 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
     data.num_val=512 run.dir=/tmp/b16_memory > $G/train_b16_memory.log 2>&1
  timeout 80 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=$sh data.decode=cuda \
     run.dir=/tmp/b16_shards > $G/train_b16_shards.log 2>&1
  VITGRAPH_STAGE_IN_THREAD=1 timeout 80 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=$sh \
     data.decode=cuda run.dir=/tmp/b16_shards_thread > $G/train_b16_shards_thread.log 2>&1
  timeout $((520 - $(date +%s) + T0)) python scripts/bench.py --model clip_vit_b16 --micro-batches 256 --systems \
     vitgraph vitgraph+graphs open_clip+compile --warmup 5 --iters 6 --out $G/bench_clip.json > $G/bench_clip.log 2>&1 ) &
P1=$!
wait $P0 $P1
timeout $((585 - $(date +%s) + T0)) python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -v --tb=short -rs -p no:cacheprovider > $G/dp2_test.log 2>&1
grep -E "passed|failed" $G/gpu_tests.log $G/dp2_test.log | tail -4
grep -hE "img/s" $G/bench_*.log | tail -20
grep -H "img/s" $G/train_b16_*.log | sed 's/| TFLOP.*//' | tail -9
cat $G/act_timing.log
tar czf $R/logs.tgz -C /tmp gl
