# Prepared in session 10, split in session 11 (not run): the next session's second device call.
# One H200, about 350 s.
# 1. ViT-L/16 mb 256 bf16: vitgraph (auto: fused) and timm + compile in one process, twice, for
#    the ratio's spread on one machine (calls 4 and 5 gave 1.098x and 1.081x on two machines).
# 2. Layer graphs at mb 8 with 8 and with 32 hardware queues (190-211 img/s now, 322.6 in the
#    sixth session; the ninth session's queue default is one suspect).
source benchmarks/h200-2026-12-01-s10/next/common.sh
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
mark done
{ grep -h "img/s" $G/*.log; cat $G/marks.txt; } > $G/result.txt
cp $G/result.txt $OUT/; pack; cat $G/result.txt
