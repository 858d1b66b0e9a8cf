# session 8, call 4 (one H200): the batched nvJPEG decoder (batched_decode.py), then ViT-B/16
# step graphs from JPEG shards with it against in-memory data (as call 1)
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/s8c4; rm -rf $G; mkdir -p $G; T0=$(date +%s)
( python scripts/shapes_imagefolder.py /tmp/s8_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s8_sf /tmp/s8_sh --shard-size 512 ) > $G/shards_make.log 2>&1
timeout 120 python benchmarks/h200-2026-12-01-s8/call4/batched_decode.py > $G/batched_decode.log 2>&1
grep -vE "Unknown|Warning|warn|^ +\)|get_qkv_layout|param range" $G/batched_decode.log | tail -32
w=(configs/vit-b16-imagefolder.yaml train.steps=200 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
timeout 75 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s8_sh data.decode=cuda \
   data.gpu_decoder=batched run.dir=/tmp/s8_shb > $G/train_b16_shards_batched.log 2>&1
timeout 75 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
   data.num_val=512 run.dir=/tmp/s8_mem > $G/train_b16_memory.log 2>&1
for f in $G/train_b16_*.log; do echo "== $f"; grep -h "img/s" $f | sed 's/| TFLOP.*//' | cut -c1-110 | tail -9; grep -iE "error|Traceback|warn" $f | grep -v Unknown | head -3; done
gzip -f $G/trace_batched.json
echo total $(( $(date +%s) - T0 )) s
cp $G/* $OUT/
