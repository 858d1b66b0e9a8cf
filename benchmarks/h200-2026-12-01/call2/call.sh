# session 7, call 2 (one H200): GPU tests (one process per file), shards vs in-memory with step
# graphs, decode cost after the matmul resize, power/clock log around timm vs vitgraph, FP8 curve
# on the tiny config, act bwd tiles
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/s7c2; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp s7c2 2>/dev/null; done) &
left() { echo $(( $1 - $(date +%s) + T0 )); }
nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > $G/smi.csv 2>&1 &
mark() { echo "$(date +%H:%M:%S.%N | cut -c1-12) $*" >> $G/marks.txt; }
( python scripts/shapes_imagefolder.py /tmp/s7_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s7_sf /tmp/s7_sh --shard-size 512 ) > $G/shards_make.log 2>&1 &
MK=$!
for f in test_model_gpu test_train_gpu test_graphs_gpu test_step_graphs_gpu test_reliability_gpu test_data_gpu; do
  timeout $(left 200) python -m pytest -m gpu tests/gpu/$f.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$f.log 2>&1
done
wait $MK
timeout 30 python .te/decode_diag2.py > $G/decode_diag2.log 2>&1
w=(configs/vit-b16-imagefolder.yaml train.steps=120 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
mark memory; timeout 60 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
   data.num_val=512 run.dir=/tmp/s7_mem > $G/train_b16_memory_step.log 2>&1
mark shards; timeout 60 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s7_sh data.decode=cuda \
   run.dir=/tmp/s7_shd > $G/train_b16_shards_step.log 2>&1
B=(--model vit_l16_224 --micro-batches 256 --warmup 6 --iters 8)
mark timm; timeout 70 python scripts/bench.py "${B[@]}" --systems timm+compile --out $G/mb256_timm.json > $G/mb256_timm.log 2>&1
mark vitgraph; timeout 45 python scripts/bench.py "${B[@]}" --systems vitgraph+step-graphs --out $G/mb256_vg.json > $G/mb256_vg.log 2>&1
mark done
t=(configs/vit-tiny-shapes.yaml model.spec=te train.steps=500 train.log_every=25 train.eval_every=500
   checkpoint.every=0 train.progress=false)
timeout $(left 510) python -m vitgraph train "${t[@]}" run.dir=/tmp/s7_tbf16 > $G/tiny_bf16.log 2>&1
timeout $(left 545) python -m vitgraph train "${t[@]}" run.dir=/tmp/s7_tfp8 train.precision=fp8 > $G/tiny_fp8.log 2>&1
python scripts/compare_curves.py /tmp/s7_tbf16/log.jsonl /tmp/s7_tfp8/log.jsonl --rtol 0.02 > $G/tiny_fp8_curve.txt 2>&1
cp /tmp/s7_tbf16/log.jsonl $G/tiny_bf16.jsonl 2>/dev/null; cp /tmp/s7_tfp8/log.jsonl $G/tiny_fp8.jsonl 2>/dev/null
kill %2 2>/dev/null
for f in $G/gt_*.log; do echo "$f: $(tail -1 $f)"; grep FAILED $f | head -3; done
head -30 $G/decode_diag2.log | grep -v "^---"
grep -h "img/s" $G/train_b16_*_step.log | sed 's/| TFLOP.*//' | cut -c1-120
grep -h "img/s" $G/mb256_*.log | cut -c1-130; cat $G/marks.txt
tail -5 $G/tiny_fp8_curve.txt; grep -h "eval step" $G/tiny_*.log
echo total $(( $(date +%s) - T0 )) s
tar czf $R/logs.tgz -C /tmp s7c2
