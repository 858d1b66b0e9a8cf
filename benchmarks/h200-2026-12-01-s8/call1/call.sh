# session 8, call 1 (one H200): issue 10's last gap (ViT-B/16 step graphs from JPEG shards with
# data.cpu_decode_share 0 / 0.3 / 0.45 / 0.6 against in-memory data, 200 steps), bench_data on
# the shards, and the ViT-L mb256 row on this code (new act tiles, power sampler)
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl > /dev/null 2>&1
G=/tmp/s8c1; rm -rf $G; mkdir -p $G; R=$OUT; T0=$(date +%s)
(while sleep 10; do tar czf $R/logs.tgz -C /tmp s8c1 2>/dev/null; done) &
left() { echo $(( $1 - $(date +%s) + T0 )); }
( python scripts/shapes_imagefolder.py /tmp/s8_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s8_sf /tmp/s8_sh --shard-size 512 ) > $G/shards_make.log 2>&1
echo "shards made at $(( $(date +%s) - T0 )) s" >> $G/marks.txt
w=(configs/vit-b16-imagefolder.yaml train.steps=200 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
timeout 70 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
   data.num_val=512 run.dir=/tmp/s8_mem > $G/train_b16_memory.log 2>&1
for share in 0 0.3 0.45 0.6; do
  timeout 70 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s8_sh data.decode=cuda \
    data.cpu_decode_share=$share run.dir=/tmp/s8_sh_$share > $G/train_b16_shards_$share.log 2>&1
  echo "share $share done at $(( $(date +%s) - T0 )) s" >> $G/marks.txt
done
timeout 60 python3 scripts/bench_data.py --shards /tmp/s8_sh --out $G/bench_data.json > $G/bench_data.log 2>&1
timeout 45 python3 scripts/bench_data.py --shards /tmp/s8_sh --decode cuda --cpu-decode-share 0.4 --out $G/bench_data_share.json > $G/bench_data_share.log 2>&1
timeout $(left 560) python scripts/bench.py --model vit_l16_224 --micro-batches 256 --warmup 6 --iters 8 \
   --systems vitgraph+step-graphs timm+compile --out $G/mb256.json > $G/mb256.log 2>&1
kill %1 2>/dev/null
cat $G/marks.txt
for f in $G/train_b16_*.log; do echo "== $f"; grep -h "img/s" $f | sed 's/| TFLOP.*//' | cut -c1-110 | tail -9; grep -iE "error|Traceback" $f | head -3; done
tail -6 $G/bench_data.log; tail -4 $G/bench_data_share.log
grep -h "img/s" $G/mb256.log | cut -c1-150
echo total $(( $(date +%s) - T0 )) s
tar czf $R/logs.tgz -C /tmp s8c1
