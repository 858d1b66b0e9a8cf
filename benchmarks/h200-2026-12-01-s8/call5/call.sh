# session 8, call 5 (one H200): data.cpu_decode_share with simplejpeg in the loader threads and
# no per-image pinning (pageable copies): ViT-B/16 step graphs from JPEG shards at shares 1.0
# and 0.6 against in-memory data; simplejpeg's decode rate on this host's threads first
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/simplejpeg*.whl > /dev/null 2>&1
G=/tmp/s8c5; rm -rf $G; mkdir -p $G; T0=$(date +%s)
( python scripts/shapes_imagefolder.py /tmp/s8_sf --num-train 8192 --num-val 512 --format jpg \
   --size 500x375 --noise 40 --no-cache && python scripts/make_shards.py /tmp/s8_sf /tmp/s8_sh --shard-size 512 ) > $G/shards_make.log 2>&1
python - > $G/cpu_rate.log 2>&1 <<'PY'
import glob, time
from concurrent.futures import ThreadPoolExecutor
from vitgraph.data import shards
raw = [open(f, "rb").read() for f in sorted(glob.glob("/tmp/s8_sf/train/*/*.jpg"))[:512]]
print("simplejpeg:", shards.simplejpeg is not None)
for t in (1, 8, 16):
    with ThreadPoolExecutor(t) as p:
        list(p.map(lambda b: shards.decode_full(b, 224), raw[:64])); t0 = time.perf_counter()
        list(p.map(lambda b: shards.decode_full(b, 224), raw)); dt = time.perf_counter() - t0
    print(f"decode_full {t:2d} threads: {len(raw) / dt:6.0f} img/s")
PY
cat $G/cpu_rate.log
w=(configs/vit-b16-imagefolder.yaml train.steps=160 train.global_batch_size=256 train.micro_batch_size=256
   train.log_every=20 train.eval_every=0 checkpoint.every=0 train.progress=false
   data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
timeout 60 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s8_sh data.decode=cuda \
   data.cpu_decode_share=1.0 run.dir=/tmp/s8_sh_1 > $G/train_b16_shards_1.0.log 2>&1
timeout 60 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
   data.num_val=512 run.dir=/tmp/s8_mem > $G/train_b16_memory.log 2>&1
timeout 60 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=/tmp/s8_sh data.decode=cuda \
   data.cpu_decode_share=0.6 run.dir=/tmp/s8_sh_06 > $G/train_b16_shards_0.6.log 2>&1
for f in $G/train_b16_*.log; do echo "== $f"; grep -h "img/s" $f | sed 's/| TFLOP.*//' | cut -c1-110 | tail -7; grep -iE "error|Traceback" $f | head -3; done
echo total $(( $(date +%s) - T0 )) s
cp $G/* $OUT/
