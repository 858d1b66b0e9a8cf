# Session 10, call 3 (one H200): the fused residual add + LayerNorm (ResidualNormLayer).
# 1. its GPU tests (kernel against torch; the layer against megatron's TE layer, kernel counts)
# 2. ViT-L/16 mb 256 bf16 step graphs, fused (with timm + compile in the same process), then
#    the same with model.fused_norm=false
# 3. the kernels' tile sweep against today's kernels (device time)
# 4. graphs, step-graph and train GPU tests, three processes side by side
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
C=benchmarks/h200-2026-12-01-s10/call3
G=/tmp/c3; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pt() { timeout $1 python -m pytest -m gpu tests/gpu/$2.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$2.log 2>&1; }
mark model-tests; pt 120 test_model_gpu
tail -n 3 $G/gt_test_model_gpu.log
mark bench-fused
timeout 170 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
  --systems vitgraph+step-graphs timm+compile --warmup 6 --iters 8 --out $G/mb256_fused.json > $G/mb256_fused.log 2>&1
mark bench-unfused
timeout 100 python scripts/bench.py --model vit_l16_224 --micro-batches 256 \
  --systems vitgraph+step-graphs --override model.fused_norm=false --warmup 6 --iters 8 \
  --out $G/mb256_unfused.json > $G/mb256_unfused.log 2>&1
mark sweep; timeout 100 python $C/norm_sweep.py $G/norm_sweep.json > $G/norm_sweep.txt 2>&1
mark tests
pt 150 test_graphs_gpu & a=$!; pt 150 test_step_graphs_gpu & b=$!; pt 150 test_train_gpu & c=$!
wait $a $b $c
mark done
{ for f in $G/gt_*.log; do echo "$f: $(tail -n 1 $f)"; done
  grep -hE "img/s|ratio|FAIL|Error" $G/mb256_*.log | tail -n 20; cat $G/norm_sweep.txt; cat $G/marks.txt; } > $G/result.txt 2>&1
cp $G/result.txt $OUT/; (cd /tmp && tar czf $OUT/logs.tgz c3); cat $G/result.txt
