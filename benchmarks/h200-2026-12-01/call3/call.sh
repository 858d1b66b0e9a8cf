# session 7, call 3 (one H200): act kernels after the rewrite, what decoding costs a step-graph
# step by part, the GPU tests call 2 did not reach, mb256 rows
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/s7c3; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp s7c3 2>/dev/null; done) &
left() { echo $(( $1 - $(date +%s) + T0 )); }
[ -d /tmp/s7_sf/train ] || python scripts/shapes_imagefolder.py /tmp/s7_sf --num-train 512 --num-val 16 --format jpg \
   --size 500x375 --noise 40 --no-cache > $G/jpgs.log 2>&1
timeout 60 python .te/act_sweep3.py > $G/act_sweep3.log 2>&1
timeout 130 python .te/shard_overlap.py > $G/shard_overlap.log 2>&1
timeout 90 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -q --tb=short -rs -p no:cacheprovider > $G/gt_step.log 2>&1
timeout $(left 330) python -m pytest -m gpu tests/gpu/test_reliability_gpu.py tests/gpu/test_data_gpu.py -q --tb=short -rs -p no:cacheprovider > $G/gt_rel_data.log 2>&1
timeout $(left 360) python -m pytest -m gpu tests/gpu/test_model_gpu.py -q --tb=short -k "fused or bias" -p no:cacheprovider > $G/gt_model.log 2>&1
timeout $(left 445) python scripts/bench.py --model vit_l16_224 --micro-batches 256 --warmup 6 --iters 8 \
   --systems vitgraph+step-graphs timm+compile --out $G/mb256.json > $G/mb256.log 2>&1
cat $G/act_sweep3.log; cat $G/shard_overlap.log | grep -v Unknown | tail -14
for f in $G/gt_*.log; do echo "$f: $(tail -1 $f)"; grep FAILED $f | head -3; done
grep -h "img/s" $G/mb256.log | cut -c1-130
echo total $(( $(date +%s) - T0 )) s
tar czf $R/logs.tgz -C /tmp s7c3
