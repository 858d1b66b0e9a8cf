# session 9, call 3 (2 x H200). Call 2 showed 8a03f12's in-process setting had no effect (shards
# 0.901x): megatron / TE imports initialise CUDA first. Here: where the variable takes effect
# (queues_probe.py), then on the commit that sets it before any import (vitgraph.set_hardware_queues),
# with nothing set in the shell: GPU 0 - bench.py --data and `vitgraph train` from shards vs
# in-memory (ViT-B/16, step graphs, mb 256); GPU 1 - ViT-L/16 mb 256 bf16, step graphs vs timm +
# torch.compile (issue 6's row under the new default).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/simplejpeg*.whl > /dev/null 2>&1
G=/tmp/s9c3; rm -rf $G; mkdir -p $G; T0=$(date +%s)
(while sleep 20; do tar czf $OUT/logs.tgz -C /tmp s9c3 2>/dev/null; done) & SAVER=$!
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
( python scripts/shapes_imagefolder.py /tmp/s9_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s9_sf /tmp/s9_sh --shard-size 512 ) > $G/shards_make.log 2>&1 &
MK=$!
P=benchmarks/h200x2-2026-12-01-s9/call3/queues_probe.py
{ env | grep -E "^CUDA_DEVICE"; for m in default after_available after_megatron_te vitgraph_first; do
    CUDA_VISIBLE_DEVICES=0 timeout 60 python $P $m; done
  CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=0 timeout 60 python $P shell_32; } > $G/probe.txt 2>&1
mark probe-done; wait $MK
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
  mark gpu1-vitl; timeout 200 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
    --systems vitgraph+step-graphs timm+compile --warmup 6 --iters 8 --out $G/mb256.json > $G/mb256.log 2>&1
  mark gpu1-done
) & P1=$!
wait $P0 $P1
{
cat $G/probe.txt
grep -h "world\|img/s\|from shards\|x timm\|ratio" $G/bench_shards.log $G/mb256.log | cut -c1-175
for f in $G/train_*.log; do echo "== $f"; grep -h "world\|img/s" $f | sed 's/| TFLOP.*//' | cut -c1-140 | tail -8; grep -iE "error|Traceback" $f | head -3; done
cat $G/marks.txt
echo total $(( $(date +%s) - T0 )) s
} > $G/result.txt 2>&1
kill $SAVER; cp $G/result.txt $G/bench_shards.json $G/mb256.json $OUT/; tar czf $OUT/logs.tgz -C /tmp s9c3; cat $G/result.txt
