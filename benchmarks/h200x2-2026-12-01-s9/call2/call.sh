# session 9, call 2 (2 x H200), on the commit that gives every vitgraph process 32 hardware
# queues (CUDA_DEVICE_MAX_CONNECTIONS unset here: the code sets it). Call 1's logs were lost
# (its script waited on its own copy loop), so its measurements are repeated:
# both GPUs - pp=2 with layer graphs and with step graphs against one process (gpu_check multi);
# then side by side: GPU 0 - bench.py --data (ViT-B/16 step graphs, shards vs synthetic, JSON),
# then `vitgraph train` from the shards and from in-memory data; GPU 1 - FP8 vs bf16 on the tiny
# config, 500 steps, two seeds, and bf16 vs bf16 across the seeds (the noise floor).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/simplejpeg*.whl > /dev/null 2>&1
G=/tmp/s9c2; rm -rf $G; mkdir -p $G; T0=$(date +%s)
(while sleep 20; do tar czf $OUT/logs.tgz -C /tmp s9c2 2>/dev/null; done) & SAVER=$!
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
{ nvidia-smi -L; env | grep -E "^CUDA|^NCCL" ; nproc; } > $G/env.txt 2>&1
( python scripts/shapes_imagefolder.py /tmp/s9_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s9_sf /tmp/s9_sh --shard-size 512 ) > $G/shards_make.log 2>&1 &
MK=$!
mark multi; OUT=$G MULTI="one pp2_graphs pp2_step" timeout 200 bash scripts/gpu_check.sh multi > $G/multi.log 2>&1
mark multi-done; wait $MK
w=(configs/vit-b16-imagefolder.yaml train.steps=160 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
(
  export CUDA_VISIBLE_DEVICES=0
  mark gpu0-bench; timeout 110 python scripts/bench.py --model vit_b16_224 --micro-batches 256 \
    --systems vitgraph+step-graphs --data /tmp/s9_sh --warmup 10 --iters 40 --out $G/bench_shards.json > $G/bench_shards.log 2>&1
  mark gpu0-shards; timeout 70 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s9_sh \
    data.decode=cuda run.dir=/tmp/s9_shd > $G/train_shards.log 2>&1
  mark gpu0-memory; timeout 70 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 \
    data.num_train=8192 data.num_val=512 run.dir=/tmp/s9_mem > $G/train_memory.log 2>&1
  mark gpu0-done
) & P0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  t=(configs/vit-tiny-shapes.yaml model.spec=te train.steps=500 train.log_every=25 train.eval_every=500
     checkpoint.every=0 train.progress=false)
  for s in 1234 1235; do
    mark gpu1-seed$s
    timeout 70 python -m vitgraph train "${t[@]}" train.seed=$s run.dir=/tmp/s9_bf16_$s > $G/tiny_bf16_$s.log 2>&1
    timeout 70 python -m vitgraph train "${t[@]}" train.seed=$s train.precision=fp8 run.dir=/tmp/s9_fp8_$s > $G/tiny_fp8_$s.log 2>&1
    cp /tmp/s9_bf16_$s/log.jsonl $G/tiny_bf16_$s.jsonl; cp /tmp/s9_fp8_$s/log.jsonl $G/tiny_fp8_$s.jsonl
    python scripts/compare_curves.py $G/tiny_bf16_$s.jsonl $G/tiny_fp8_$s.jsonl --rtol 0.02 > $G/tiny_curve_$s.txt 2>&1
  done
  python scripts/compare_curves.py $G/tiny_bf16_1234.jsonl $G/tiny_bf16_1235.jsonl --rtol 0.02 > $G/tiny_curve_bf16_seeds.txt 2>&1
  mark gpu1-done
) & P1=$!
wait $P0 $P1
{
grep -E "exit|CURVES|max relative loss" $G/multi.log $G/summary.txt $G/multi_curves.txt 2>/dev/null
grep -h "world\|img/s" $G/bench_shards.log | cut -c1-170
for f in $G/train_*.log; do echo "== $f"; grep -h "world\|img/s" $f | sed 's/| TFLOP.*//' | cut -c1-140 | tail -8; grep -iE "error|Traceback" $f | head -3; done
for f in $G/tiny_curve_*.txt; do echo "== $f"; grep -E "max relative loss|CURVES" $f; done
grep -H "eval step" $G/tiny_*.log
cat $G/marks.txt $G/env.txt
echo total $(( $(date +%s) - T0 )) s
} > $G/result.txt 2>&1
kill $SAVER; cp $G/result.txt $G/bench_shards.json $OUT/; tar czf $OUT/logs.tgz -C /tmp s9c2; cat $G/result.txt
