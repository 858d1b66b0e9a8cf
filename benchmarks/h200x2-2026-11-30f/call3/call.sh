# session 6, call 3 (record): GPU0 ViT-L mb256 bf16 + fp8-current rows with timm+compile, then
# GPU tests of this session's code; GPU1 mb8 rows, CLIP rows, shards-train
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/gl3; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp gl3 2>/dev/null; done) &
( export CUDA_VISIBLE_DEVICES=0
  timeout 330 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
     --systems vitgraph vitgraph+graphs vitgraph+step-graphs timm+compile --precisions bf16 fp8-current \
     --warmup 6 --iters 8 --out $G/bench_l16_mb256.json > $G/bench_l16_mb256.log 2>&1
  timeout $((555 - $(date +%s) + T0)) python -m pytest -m gpu tests/gpu/test_model_gpu.py tests/gpu/test_train_gpu.py \
     tests/gpu/test_graphs_gpu.py -v --tb=short -rs -p no:cacheprovider > $G/gpu_tests.log 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 100 python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
     --systems vitgraph+graphs vitgraph+step-graphs timm+compile-reduce-overhead \
     --warmup 10 --iters 20 --out $G/bench_l16_mb8.json > $G/bench_l16_mb8.log 2>&1
  timeout 200 python scripts/bench.py --model clip_vit_b16 --micro-batches 256 --systems \
     vitgraph vitgraph+graphs open_clip open_clip+compile --warmup 5 --iters 6 --out $G/bench_clip.json > $G/bench_clip.log 2>&1
  sh=/tmp/shards_b16
  if [ ! -d $sh ]; then
    python scripts/shapes_imagefolder.py /tmp/sf_b16 --num-train 8192 --num-val 512 --format jpg \
       --size 500x375 --noise 40 --no-cache > $G/shards_make.log 2>&1
    python scripts/make_shards.py /tmp/sf_b16 $sh --shard-size 512 >> $G/shards_make.log 2>&1
  fi
  w=(configs/vit-b16-imagefolder.yaml train.steps=120 train.global_batch_size=256 train.micro_batch_size=256
     train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
     data.augment.enabled=false data.workers=16 model.num_classes=10)
  timeout 75 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
     data.num_val=512 run.dir=/tmp/b16_memory3 > $G/train_b16_memory.log 2>&1
  timeout $((555 - $(date +%s) + T0)) python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=$sh data.decode=cuda \
     run.dir=/tmp/b16_shards3 > $G/train_b16_shards.log 2>&1 ) &
P1=$!
wait $P0 $P1
grep -E "passed|failed" $G/gpu_tests.log | tail -2
grep -E "FAILED" $G/gpu_tests.log | head -5
grep -hE "img/s" $G/bench_*.log | cut -c1-150
grep -H "img/s" $G/train_b16_*.log | sed 's/| TFLOP.*//' | cut -c1-140
tar czf $R/logs.tgz -C /tmp gl3
