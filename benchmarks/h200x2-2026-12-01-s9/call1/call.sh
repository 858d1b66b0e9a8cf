# session 9, call 1 (2 x H200): the dp=2 step-graph test (both GPUs), then side by side:
# GPU 0 - ViT-B/16 step graphs from JPEG shards (nvJPEG) against in-memory data, with the default
# and with 32 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS), then bench.py --data (JSON);
# GPU 1 - the rest of the step-graph tests, reliability and data tests, FP8 vs bf16 on the tiny
# config for 500 steps at two seeds (and bf16 vs bf16 across the seeds: the noise floor).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/simplejpeg*.whl > /dev/null 2>&1
G=/tmp/s9c1; rm -rf $G; mkdir -p $G; T0=$(date +%s)
(while sleep 15; do cp $G/*.log $G/*.txt $OUT/ 2>/dev/null; done) &
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
{ nvidia-smi -L; env | grep -E "^CUDA|^NCCL|^TORCH" ; nproc; } > $G/env.txt 2>&1
( python scripts/shapes_imagefolder.py /tmp/s9_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s9_sf /tmp/s9_sh --shard-size 512 ) > $G/shards_make.log 2>&1 &
MK=$!
mark dp2-test
timeout 200 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -q --tb=short -rs \
  -p no:cacheprovider > $G/gt_step_dp2.log 2>&1
mark dp2-done; wait $MK
w=(configs/vit-b16-imagefolder.yaml train.steps=160 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
mem=(data.kind=shapes data.render_size=32 data.num_train=8192 data.num_val=512)
shd=(data.kind=webdataset data.path=/tmp/s9_sh data.decode=cuda)
(
  export CUDA_VISIBLE_DEVICES=0
  mark gpu0-memory; timeout 70 python -m vitgraph train "${w[@]}" "${mem[@]}" run.dir=/tmp/s9_mem > $G/train_memory.log 2>&1
  mark gpu0-shards; timeout 70 python -m vitgraph train "${w[@]}" "${shd[@]}" run.dir=/tmp/s9_shd > $G/train_shards.log 2>&1
  mark gpu0-shards32; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 70 python -m vitgraph train "${w[@]}" "${shd[@]}" run.dir=/tmp/s9_shd32 > $G/train_shards_conn32.log 2>&1
  mark gpu0-memory32; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 70 python -m vitgraph train "${w[@]}" "${mem[@]}" run.dir=/tmp/s9_mem32 > $G/train_memory_conn32.log 2>&1
  B=(--model vit_b16_224 --micro-batches 256 --systems vitgraph+step-graphs --data /tmp/s9_sh --warmup 10 --iters 30)
  mark gpu0-bench; timeout 100 python scripts/bench.py "${B[@]}" --out $G/bench_shards.json > $G/bench_shards.log 2>&1
  mark gpu0-bench32; CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 100 python scripts/bench.py "${B[@]}" --out $G/bench_shards_conn32.json > $G/bench_shards_conn32.log 2>&1
  mark gpu0-done
) &
G0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for f in test_step_graphs_gpu test_reliability_gpu test_data_gpu; do
    timeout 120 python -m pytest -m gpu tests/gpu/$f.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$f.log 2>&1
  done
  mark gpu1-curves
  t=(configs/vit-tiny-shapes.yaml model.spec=te train.steps=500 train.log_every=25 train.eval_every=500
     checkpoint.every=0 train.progress=false)
  for s in 1234 1235; do
    timeout 70 python -m vitgraph train "${t[@]}" train.seed=$s run.dir=/tmp/s9_bf16_$s > $G/tiny_bf16_$s.log 2>&1
    timeout 70 python -m vitgraph train "${t[@]}" train.seed=$s train.precision=fp8 run.dir=/tmp/s9_fp8_$s > $G/tiny_fp8_$s.log 2>&1
    cp /tmp/s9_bf16_$s/log.jsonl $G/tiny_bf16_$s.jsonl; cp /tmp/s9_fp8_$s/log.jsonl $G/tiny_fp8_$s.jsonl
    python scripts/compare_curves.py $G/tiny_bf16_$s.jsonl $G/tiny_fp8_$s.jsonl --rtol 0.02 > $G/tiny_curve_$s.txt 2>&1
  done
  python scripts/compare_curves.py $G/tiny_bf16_1234.jsonl $G/tiny_bf16_1235.jsonl --rtol 0.02 > $G/tiny_curve_bf16_seeds.txt 2>&1
  mark gpu1-done
) &
wait
for f in $G/gt_*.log; do echo "$f: $(tail -1 $f)"; grep -E "FAILED|Error" $f | head -3; done
for f in $G/train_*.log; do echo "== $f"; grep -h "img/s" $f | sed 's/| TFLOP.*//' | cut -c1-100 | tail -7; grep -iE "error|Traceback" $f | head -3; done
tail -4 $G/bench_shards*.log
for f in $G/tiny_curve_*.txt; do echo "== $f"; grep -E "max relative loss|DIFFER|MATCH|agree" $f; done
grep -h "eval step" $G/tiny_*.log
cat $G/marks.txt $G/env.txt
echo total $(( $(date +%s) - T0 )) s
kill %1 2>/dev/null; cp $G/* $OUT/
