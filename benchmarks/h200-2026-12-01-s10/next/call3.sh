# Prepared in session 10, split in session 11 (not run): on nvidia-h200-x2 (two GPUs), about
# 420 s. The dp=2 step-graph test for both layer kinds (last passed in session 9, before the
# fused layer), and gpu_check.sh multi (its mb 8 runs megatron's layer under auto).
source benchmarks/h200-2026-12-01-s10/next/common.sh
mark two-gpus
timeout 200 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -q \
  --tb=short -rs -p no:cacheprovider > $G/gt_step_dp2.log 2>&1
OUT=$G MULTI="one pp2_graphs pp2_step" timeout 200 bash scripts/gpu_check.sh multi > $G/multi.log 2>&1
mark done
{ tail -n 3 $G/gt_step_dp2.log; grep -h "img/s\|PASS\|FAIL" $G/multi.log; cat $G/marks.txt; } > $G/result.txt
cp $G/result.txt $OUT/; pack; cat $G/result.txt
