# Prepared in session 10 for the next session's first device call (not run). One H200; the
# two-GPU part runs only when two GPUs are visible. Everything comes back as one tarball.
# 1. Where model.fused_norm=auto should switch: ViT-L/16 step graphs, always against never, at
#    mb 32, 64 and 128 (measured only at 8 and 256; the threshold, 16,384 tokens, is a guess).
# 2. ViT-L/16 mb 256 bf16: vitgraph (auto: fused) and timm + compile in one process, twice, for
#    the ratio's spread on one machine (calls 4 and 5 gave 1.098x and 1.081x on two machines).
# 3. Layer graphs at mb 8 with 8 and with 32 hardware queues (190-211 img/s now, 322.6 in the
#    sixth session; the ninth session's queue default is one suspect).
# 4. Two GPUs: the dp=2 step-graph test for both layer kinds, and gpu_check.sh multi (its mb 8
#    runs megatron's layer under auto).
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/n1; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pack() { (cd /tmp && tar czf $OUT/logs.tgz n1); }
b() { timeout $1 python scripts/bench.py --model vit_l16_224 --warmup 6 --iters 10 "${@:2}"; }
mark threshold
for mb in 32 64 128; do for f in always never; do
  b 80 --micro-batches $mb --systems vitgraph+step-graphs --override model.fused_norm=$f \
    --out $G/mb${mb}_$f.json > $G/mb${mb}_$f.log 2>&1
done; done; pack
mark ratio
for i in 1 2; do
  b 150 --micro-batches 256 --systems vitgraph+step-graphs timm+compile --out $G/mb256_$i.json \
    > $G/mb256_$i.log 2>&1
done; pack
mark queues
for q in 8 32; do
  CUDA_DEVICE_MAX_CONNECTIONS=$q b 60 --micro-batches 8 --systems vitgraph+graphs \
    --out $G/mb8_layer_q$q.json > $G/mb8_layer_q$q.log 2>&1
done; pack
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  mark two-gpus
  timeout 110 python -m pytest -m gpu tests/gpu/test_step_graphs_gpu.py -k two_data_parallel -q \
    --tb=short -rs -p no:cacheprovider > $G/gt_step_dp2.log 2>&1
  OUT=$G MULTI="one pp2_graphs pp2_step" timeout 200 bash scripts/gpu_check.sh multi > $G/multi.log 2>&1
fi
mark done
{ grep -h "img/s" $G/*.log; tail -n 2 $G/gt_step_dp2.log 2>/dev/null; cat $G/marks.txt; } > $G/result.txt
cp $G/result.txt $OUT/; pack; cat $G/result.txt
