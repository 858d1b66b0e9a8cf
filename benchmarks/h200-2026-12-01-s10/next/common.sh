# Sourced by call1..3.sh: environment, the log folder (one tarball under $OUT), marks, bench.
export PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
G=/tmp/n1; rm -rf $G; mkdir -p $G; T0=$(date +%s)
mark() { echo "$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> $G/marks.txt; }
pack() { (cd /tmp && tar czf $OUT/logs.tgz n1); }
b() { timeout $1 python scripts/bench.py --model vit_l16_224 --warmup 6 --iters 10 "${@:2}"; }
