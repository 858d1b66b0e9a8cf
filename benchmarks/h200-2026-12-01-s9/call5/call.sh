# session 9, call 5 (one H200; the 2-GPU kind was no longer lent): queues_probe.py with its
# kernels loaded first (call 3's version measured lazy module loading), and bench_data.py on
# JPEG shards with 32 hardware queues (ca2bb87).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/simplejpeg*.whl > /dev/null 2>&1
G=/tmp/s9c5; rm -rf $G; mkdir -p $G; T0=$(date +%s)
( python scripts/shapes_imagefolder.py /tmp/s9_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s9_sf /tmp/s9_sh --shard-size 512 ) > $G/shards_make.log 2>&1 &
MK=$!
P=benchmarks/h200x2-2026-12-01-s9/call3/queues_probe.py
{ for m in default after_available after_megatron_te vitgraph_first; do timeout 60 python $P $m; done
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 python $P shell_32; } > $G/probe.txt 2>&1
wait $MK
timeout 100 python3 scripts/bench_data.py --shards /tmp/s9_sh --out $G/bench_data.json > $G/bench_data.log 2>&1
{ cat $G/probe.txt; tail -n 6 $G/bench_data.log; echo total $(( $(date +%s) - T0 )) s; } > $G/result.txt
cp $G/* $OUT/ 2>/dev/null; cat $G/result.txt
