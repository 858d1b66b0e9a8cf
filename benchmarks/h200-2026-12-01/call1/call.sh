# session 7, call 1 (one H200): act tiles, mb256 profiles (default / no wgrad fusion / bf16 grads),
# decode cost, FP8-vs-bf16 500-step curve
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/s7c1; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp s7c1 2>/dev/null; done) &
left() { echo $(( $1 - $(date +%s) + T0 )); }
timeout 70 python .te/act_sweep2.py > $G/act_sweep2.log 2>&1
B=(--model vit_l16_224 --micro-batches 256 --warmup 6 --iters 6 --kernels 3)
timeout 130 python scripts/bench.py "${B[@]}" --systems vitgraph+step-graphs timm+compile \
   --out $G/mb256_default.json > $G/mb256_default.log 2>&1
timeout 60 python scripts/bench.py "${B[@]}" --systems vitgraph+step-graphs \
   --override model.gradient_accumulation_fusion=false --out $G/mb256_nofuse.json > $G/mb256_nofuse.log 2>&1
timeout 60 python scripts/bench.py "${B[@]}" --systems vitgraph+step-graphs \
   --override parallel.grad_reduce_in_fp32=false --out $G/mb256_bf16grad.json > $G/mb256_bf16grad.log 2>&1
( timeout 40 python scripts/shapes_imagefolder.py /tmp/s7_sf --num-train 512 --num-val 16 --format jpg \
   --size 500x375 --noise 40 --no-cache && \
  mkdir -p /tmp/sf_b16/train && cp -r /tmp/s7_sf/train/* /tmp/sf_b16/train/ ) > $G/jpgs.log 2>&1
timeout 40 python .te/decode_diag.py > $G/decode_diag.log 2>&1
f=(configs/vit-b16-imagefolder.yaml data.kind=shapes data.render_size=32 data.num_train=20000 data.workers=8
   data.augment.enabled=false train.label_smoothing=0 train.steps=500 train.global_batch_size=128
   train.micro_batch_size=128 train.log_every=25 train.eval_every=500 optim.warmup_steps=50 optim.lr=5e-4
   checkpoint.every=0 train.progress=false graphs.enabled=true graphs.scope=step)
timeout $(left 450) python -m vitgraph train "${f[@]}" run.dir=/tmp/s7bf16 > $G/curve_bf16.log 2>&1
timeout $(left 565) python -m vitgraph train "${f[@]}" run.dir=/tmp/s7fp8 train.precision=fp8 > $G/curve_fp8.log 2>&1
python scripts/compare_curves.py /tmp/s7bf16/log.jsonl /tmp/s7fp8/log.jsonl --rtol 0.02 > $G/fp8_curve.txt 2>&1
cp /tmp/s7bf16/log.jsonl $G/bf16.jsonl; cp /tmp/s7fp8/log.jsonl $G/fp8.jsonl
grep -h "default\|    \|N=\|copy" $G/act_sweep2.log | head -30
grep -hE "img/s|profile:|^  [a-z]" $G/mb256_*.log | cut -c1-150
head -12 $G/decode_diag.log; tail -4 $G/fp8_curve.txt; grep -h "top1\|held" $G/curve_*.log | tail -4
echo total $(( $(date +%s) - T0 )) s
tar czf $R/logs.tgz -C /tmp s7c1
