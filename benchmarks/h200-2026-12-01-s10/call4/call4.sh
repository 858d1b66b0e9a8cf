# Session 10, call 4 (one H200): ResidualNormLayer with fc2's bias in the fused add too, and
# the swept tiles. 1. model GPU tests; 2. ViT-L/16 mb 256 bf16: eager, layer graphs, step
# graphs, timm + compile in one process, the step-graph kernels profiled after the timing;
# 3. a backward tile check past the sweep's edge (per_sm 12, 16); 4. graphs, step-graph and
# train GPU tests side by side.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/c4; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pt() { timeout $1 python -m pytest -m gpu tests/gpu/$2.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$2.log 2>&1; }
mark model-tests; pt 120 test_model_gpu; tail -n 3 $G/gt_test_model_gpu.log
mark bench
timeout 260 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
  --systems vitgraph vitgraph+graphs vitgraph+step-graphs timm+compile --warmup 6 --iters 8 \
  --kernels 3 --out $G/mb256.json > $G/mb256.log 2>&1
mark tiles
timeout 60 python benchmarks/h200-2026-12-01-s10/call4/tiles.py > $G/tiles.txt 2>&1
mark tests
pt 150 test_graphs_gpu & a=$!; pt 150 test_step_graphs_gpu & b=$!; pt 150 test_train_gpu & c=$!
wait $a $b $c
mark done
{ for f in $G/gt_*.log; do echo "$f: $(tail -n 1 $f)"; done
  grep -hE "img/s|ratio|FAIL|Error|profile:|ms/step" $G/mb256.log | head -n 40; cat $G/tiles.txt; cat $G/marks.txt; } > $G/result.txt 2>&1
cp $G/result.txt $OUT/; (cd /tmp && tar czf $OUT/logs.tgz c4); cat $G/result.txt
