# Session 10, call 2 (one H200). call 1 lost its logs (the tarball held the run folders and was
# too big to come back) and its probe's baseline backward failed (TE's LayerNorm frees its saved
# tensors after one backward). This call: the fixed probe at ViT-L and ViT-B widths, then the
# same FP8 / bf16 tiny runs over four seeds, keeping only log.jsonl and the logs.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
C=benchmarks/h200-2026-12-01-s10/call1
G=/tmp/c2; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pack() { (cd /tmp && find c2 -name '*.log' -o -name '*.txt' -o -name 'log.jsonl' | tar czf $OUT/logs.tgz -T -); }
mark probe
{ timeout 90 python $C/add_ln_probe.py; timeout 60 python $C/add_ln_probe.py --hidden 768; } > $G/add_ln_probe.txt 2>&1
cat $G/add_ln_probe.txt
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
python $C/seed_band.py $G > $G/seed_band.txt 2>&1
mark done
{ cat $G/add_ln_probe.txt $G/seed_band.txt; grep -h "eval step" $G/tiny_*.log; cat $G/marks.txt; } > $G/result.txt 2>&1
cp $G/result.txt $OUT/; pack; cat $G/seed_band.txt $G/marks.txt
