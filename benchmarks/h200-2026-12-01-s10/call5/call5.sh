# Session 10, call 5 (one H200): the first layer's norm, the last layer's add and the ViT's
# final norm on the fused kernels too. 1. model GPU tests; 2. ViT-L/16 mb 256 bf16: eager,
# layer graphs, step graphs, timm + compile; 3. graphs, step-graph and train GPU tests side
# by side; 4. ViT-L/16 mb 8: layer and step graphs, timm + compile (reduce-overhead).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/c5; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pt() { timeout $1 python -m pytest -m gpu tests/gpu/$2.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$2.log 2>&1; }
pack() { cp $G/result.txt $OUT/ 2>/dev/null; (cd /tmp && tar czf $OUT/logs.tgz c5); }
mark model-tests; pt 120 test_model_gpu; tail -n 3 $G/gt_test_model_gpu.log
mark bench256
timeout 200 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
  --systems vitgraph vitgraph+graphs vitgraph+step-graphs timm+compile --warmup 6 --iters 8 \
  --out $G/mb256.json > $G/mb256.log 2>&1
grep -A6 "^ratios" $G/mb256.log; pack
mark tests
pt 150 test_graphs_gpu & a=$!; pt 150 test_step_graphs_gpu & b=$!; pt 150 test_train_gpu & c=$!
wait $a $b $c
for f in $G/gt_*.log; do echo "$f: $(grep -E 'passed|failed' $f | tail -n 1)"; done; pack
mark bench8
timeout 150 python scripts/bench.py --model vit_l16_224 --micro-batches 8 \
  --systems vitgraph+graphs vitgraph+step-graphs timm+compile-reduce-overhead --warmup 10 --iters 30 \
  --out $G/mb8.json > $G/mb8.log 2>&1
mark done
{ for f in $G/gt_*.log; do echo "$f: $(grep -E 'passed|failed' $f | tail -n 1)"; done
  grep -hE "img/s|x speed|FAIL|Error" $G/mb256.log $G/mb8.log | tail -n 20; cat $G/marks.txt; } > $G/result.txt 2>&1
pack; cat $G/result.txt
