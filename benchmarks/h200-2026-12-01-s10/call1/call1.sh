# Prepared in session 9 for the next session's first device call (not run). One H200; the
# two-GPU part runs only when two GPUs are visible. Everything comes back as one tarball.
# 1. add_ln_probe.py at ViT-L and ViT-B widths (issue 6: is the fused residual-add + LN worth
#    integrating? it needs about 2.7% of the ViT-L step for 1.1x).
# 2. FP8 against bf16 on the tiny config over 4 seeds (issue 6's 500-step curve): the seed
#    spread and the seed-mean curves (seed_band.py). The first run fills the dataset cache, the
#    other seven share the GPU.
# 3. Two GPUs: pp=2 with layer / step graphs and the dp=2 step-graph test with 32 hardware
#    queues in effect (session 9's call 4, which was not run).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
N=benchmarks/h200-2026-12-01-s9/next
G=/tmp/next1; rm -rf $G; mkdir -p $G; T0=$(date +%s)
(while sleep 20; do tar czf $OUT/logs.tgz -C /tmp next1 2>/dev/null; done) & SAVER=$!
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
mark probe
{ timeout 90 python $N/add_ln_probe.py; timeout 60 python $N/add_ln_probe.py --hidden 768; } > $G/add_ln_probe.txt 2>&1
mark curves
t=(configs/vit-tiny-shapes.yaml model.spec=te train.steps=500 train.log_every=25 train.eval_every=500
   checkpoint.every=0 train.progress=false)
run() { timeout 240 python -m vitgraph train "${t[@]}" train.seed=$1 train.precision=$2 \
          run.dir=$G/tiny_$2_$1 > $G/tiny_$2_$1.log 2>&1; }
run 1234 bf16
pids=()
for s in 1234 1235 1236 1237; do for p in bf16 fp8; do
  [ "$s$p" = 1234bf16 ] || { run $s $p & pids+=($!); }
done; done
wait "${pids[@]}"
python $N/seed_band.py $G > $G/seed_band.txt 2>&1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  mark multi
  OUT=$G MULTI="one pp2_graphs pp2_step" timeout 200 bash scripts/gpu_check.sh multi > $G/multi.log 2>&1
  timeout 110 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -q --tb=short \
    -rs -p no:cacheprovider > $G/gt_step_dp2.log 2>&1
fi
mark done
{ cat $G/add_ln_probe.txt $G/seed_band.txt; grep -h "eval step" $G/tiny_*.log
  grep -hE "exit|CURVES|max relative loss" $G/summary.txt $G/multi_curves.txt 2>/dev/null
  tail -n 2 $G/gt_step_dp2.log 2>/dev/null; cat $G/marks.txt; } > $G/result.txt 2>&1
kill $SAVER; cp $G/result.txt $OUT/; tar czf $OUT/logs.tgz -C /tmp next1; cat $G/result.txt
