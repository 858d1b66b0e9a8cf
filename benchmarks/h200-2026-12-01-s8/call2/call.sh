# session 8, call 2 (one H200): where nvJPEG's cost to a step goes (decode_cost.py), and the GPU
# tests, one pytest process per file, on code never run on a GPU (tile defaults, process-group
# teardown, warning filter, cached resize weights, CPU decode share)
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/s8c2; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp s8c2 2>/dev/null; done) &
left() { echo $(( $1 - $(date +%s) + T0 )); }
python scripts/shapes_imagefolder.py /tmp/s8_sf --num-train 256 --num-val 16 --format jpg \
   --size 500x375 --noise 40 --no-cache > $G/jpgs.log 2>&1
timeout 150 python benchmarks/h200-2026-12-01-s8/call2/decode_cost.py > $G/decode_cost.log 2>&1
for f in test_model_gpu test_train_gpu test_graphs_gpu test_step_graphs_gpu test_reliability_gpu test_data_gpu; do
  timeout $(left 560) python -m pytest -m gpu tests/gpu/$f.py -q --tb=short -rs -p no:cacheprovider > $G/gt_$f.log 2>&1
  echo "$f done at $(( $(date +%s) - T0 )) s" >> $G/marks.txt
done
kill %1 2>/dev/null
grep -vE "Unknown|Warning|warn|^ +\)|get_qkv_layout|param range" $G/decode_cost.log | tail -70
cat $G/marks.txt
for f in $G/gt_*.log; do echo "$f: $(tail -1 $f)"; grep -E "FAILED|ERROR" $f | head -4; done
echo total $(( $(date +%s) - T0 )) s
tar czf $R/logs.tgz -C /tmp s8c2
