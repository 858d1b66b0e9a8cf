# Prepared in session 11 for the next session's first device call (not run; session 11 had no
# device time). One H200, about 350 s. Everything comes back as one tarball.
# 1. GPU tests not run since their last change: tests/gpu/test_model_gpu.py (one helper for
#    "same function", 9e42a47) and the one-GPU step-graph tests for both layer kinds
#    (fused_norm never | always, parametrized in c005a47).
# 2. Where model.fused_norm=auto should switch: ViT-L/16 step graphs, always against never, at
#    mb 32, 64 and 128 (measured only at 8 and 256; the threshold, 16,384 tokens, is a guess).
source benchmarks/h200-2026-12-01-s10/next/common.sh
mark tests
timeout 150 python -m pytest -m gpu tests/gpu/test_model_gpu.py \
  "tests/gpu/test_step_graphs_gpu.py::test_step_graphs_equal_eager_on_one_gpu" \
  -q --tb=short -rs -p no:cacheprovider > $G/gpu_tests.log 2>&1; pack
mark threshold
for mb in 32 64 128; do for f in always never; do
  b 60 --micro-batches $mb --systems vitgraph+step-graphs --override model.fused_norm=$f \
    --out $G/mb${mb}_$f.json > $G/mb${mb}_$f.log 2>&1
done; done
mark done
{ tail -n 3 $G/gpu_tests.log; grep -h "img/s" $G/*.log; cat $G/marks.txt; } > $G/result.txt
cp $G/result.txt $OUT/; pack; cat $G/result.txt
