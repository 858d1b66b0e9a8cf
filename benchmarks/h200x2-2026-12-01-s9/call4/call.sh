# session 9, call 4 (2 x H200): the two-GPU paths with 32 hardware queues in effect (ca2bb87;
# call 2's runs had the setting too late to count): pp=2 with layer graphs and with step graphs
# against call 2's one-process curve, and the dp=2 step-graph GPU test.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/s9c4; rm -rf $G; mkdir -p $G; T0=$(date +%s)
(while sleep 20; do tar czf $OUT/logs.tgz -C /tmp s9c4 2>/dev/null; done) & SAVER=$!
OUT=$G MULTI="pp2_graphs pp2_step" MULTI_REF=benchmarks/h200x2-2026-12-01-s9/call3/ref_multi_one.jsonl \
  timeout 130 bash scripts/gpu_check.sh multi > $G/multi.log 2>&1
timeout 110 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -q --tb=short -rs \
  -p no:cacheprovider > $G/gt_step_dp2.log 2>&1
{ grep -E "exit|CURVES|max relative loss" $G/summary.txt $G/multi_curves.txt; grep -h "hardware queues" $G/multi_*.log | head -2
  tail -n 2 $G/gt_step_dp2.log; echo total $(( $(date +%s) - T0 )) s; } > $G/result.txt 2>&1
kill $SAVER; cp $G/result.txt $OUT/; tar czf $OUT/logs.tgz -C /tmp s9c4; cat $G/result.txt
