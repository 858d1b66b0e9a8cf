#!/usr/bin/env bash
# The GPU checks, in one go, for a CUDA machine with TE and megatron-core importable
# (on the H200 device host: `source .te/te-install` first). Logs go to $OUT (or ./gpu-logs).
#   usage: scripts/gpu_check.sh [tests|tests-a|tests-b|tests-c|configs|plan|train|graphs-train|
#          multi|resume-optim|fp8-curve|data|clip|profile|loop-rate|bench|native|vlm|l16-mb8|
#          configs-bench|towers|augment ...]   (default: tests train)
#   tests: `pytest -m gpu tests/gpu` (more than one 10-minute call: on one H100 pytest took
#   359 s for tests-a, 435 s for tests-b, 83 s for tests-c); tests-a / -b / -c: its parts (the
#   VLM's tests in c).
#   native (1 GPU): the native-resolution rows of record (docs/native.md), one bench process and
#   one JSON per model of $NATIVE_MODELS (default: all four; one model a 10-minute call): packed
#   (two 32,768-token packs a step; $NATIVE_PACKS: other bench.py pack flags), padded and timm
#   NaFlexViT + compile on the same stream at 256 / 576 / 1024 patches (and 729 for SO400M/14).
#   vlm (1 GPU): bench.py --vlm at $VLM_PATCHES (default 576 1024), one JSON each; byte-level ids
#   unless open_clip is importable (CLIP's BPE); 16 padded / dense images a step (about one
#   16,384-token pack at 1024 patches; 32 ran out of an H100's 80 GB there).
#   l16-mb8 (1 GPU): ViT-L/16 at micro-batch 8, step graphs against timm + compile
#   reduce-overhead in one process.
#   configs-bench (1 GPU): bench.py --configs, every bundled GPU config as shipped (or those of
#   $BENCH_CONFIGS) on JPEGs made here; $BENCH_STEPS / $BENCH_WINDOW_S: each run's window
#   (default: bench.py's), $BENCH_TIMEOUT the whole step's limit (default 560 s).
#   towers (1 H200): the three big towers as shipped (at tp 1 they need 79-99 GiB), one bench
#   process and JSON each, a 60-step window (a 10,000-step warm-up cannot fall on one GPU);
#   $TOWERS: some of them (default vit-6b vit-bigG14 vit-g14; on an H200 vit-6b took 433 s,
#   vit-g14 257 s, and vit-bigG14 was cut at 276 s, one bench row short).
#   augment (1 GPU): ViT-B/16 mb 128 x 2 step graphs, the shipped augmentation off and on, each
#   on synthetic input and from the JPEG ImageFolder configs-bench makes, with kernel tables.
#   configs (1 GPU): every GPU config's header smoke line (scripts/smoke_configs.py); fails unless
#   each one's loss falls and its held-out top-1 reaches the figure its header asks for.
#   plan (1 GPU): every GPU config for a few steps against `vitgraph plan` (scripts/plan_check.py);
#   fails unless each measured peak (reserved) is within 10% of the plan.
#   multi (2 GPUs): pp=2 1F1B eager and with graphs, pp=2 interleaved (vpp 2) with graphs, tp=2
#   with sequence parallel, dp=2 with the distributed optimizer, each against the one-GPU curve
#   (ViT-B/16, 8 microbatches of 8 a step); then the pp=2 run resumes at dp=2 from step 25.
#   resume-optim (1 GPU): saved with the distributed optimizer, resumed without it.
#   fp8-curve (1 GPU): ViT-B/16, 500 steps on the embedded data, bf16 against fp8 (current).
#   data (1 GPU): scripts/bench_data.py, JPEG decode at 224 (nvJPEG and CPU threads).
#   shards-train (1 GPU): ViT-B/16 with step graphs trained from JPEG shards (nvJPEG; then with
#   CUDA's default 8 hardware queues instead of vitgraph's 32, and with all of each microbatch
#   decoded by CPU threads) against in-memory data, then bench.py --data: the same ratio as JSON.
#   clip (1 GPU): clip_vit_b16 eager vs graphs over 100 steps, and the CLIP bench rows (open_clip
#   from a wheel: `python3 -m pip install -q --no-deps --target /tmp/site .te/wheels/*.whl`).
#   profile (1 GPU): torch.profiler kernel table of the ViT-L/16 step-graph step, mb 8 and 256.
#   loop-rate (1 GPU): ViT-L/16 at micro-batch 256 through `vitgraph train` on the embedded data
#   (the input pipeline included), to hold against bench.py's step rate.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests train)
nvidia-smi -L | tee "$out/gpu.txt"
# photos DIR LOG: 8,192 photo-like 500x375 JPEGs (+ 512 held out) in DIR unless it is there,
# written back to disk before any row reads them (a row reading them during the writeback ran
# slow)
photos() {
  [ -d "$1" ] && return
  python scripts/shapes_imagefolder.py "$1" --num-train 8192 --num-val 512 --format jpg \
    --size 500x375 --noise 40 --no-cache >> "$2" 2>&1
  sync
}
b16=(configs/vit-b16-imagefolder.yaml data.kind=shapes data.render_size=32 data.num_train=20000
     data.workers=8 train.steps=200 train.global_batch_size=256 train.micro_batch_size=64
     train.log_every=20 train.eval_every=100 optim.warmup_steps=20 optim.lr=5e-4 train.progress=false)
for s in "${steps[@]}"; do
  echo "=== $s" | tee -a "$out/summary.txt"
  case $s in
    tests|tests-a|tests-b|tests-c)
      # b: every file that a and c do not name
      declare -A PART=([tests-a]="checkpoint data distill freeze fsdp graphs model native_data
                                  native" [tests-c]="caption tower")
      named=$(printf "tests/gpu/test_%s_gpu.py\n" ${PART[tests-a]} ${PART[tests-c]})
      case $s in
        tests) files=(tests/gpu) ;;
        tests-b) files=($(ls tests/gpu/test_*_gpu.py | grep -v -x -F "$named")) ;;
        *) files=($(printf "tests/gpu/test_%s_gpu.py " ${PART[$s]})) ;;
      esac
      timeout -s INT $([ "$s" = tests ] && echo 1200 || echo 560) python -m pytest -m gpu "${files[@]}" -v \
        -rfEs -p no:cacheprovider --durations=15 2>&1 | tee "$out/gpu_$s.log" | tail -60 ;;
    configs) timeout 900 python scripts/smoke_configs.py --out "$out/smoke_configs.json" 2>&1 | tee "$out/smoke_configs.log" ;;
    plan) timeout 900 python scripts/plan_check.py --out "$out/plan_check.json" 2>&1 | tee "$out/plan_check.log" ;;
    train) timeout 100 python -m vitgraph train "${b16[@]}" run.dir=/tmp/b16 train.steps=400 \
             train.global_batch_size=128 train.micro_batch_size=128 optim.lr=1e-3 optim.warmup_steps=40 \
             train.eval_every=200 2>&1 | tee "$out/train_b16.log" | grep -E "step|eval|error|Error" | tail -20 ;;
    graphs-train)
      # eager vs graphs, 200 steps each; then the graphs run resumes from its step-100
      # checkpoint and must continue on graphs with the same curve
      g=("${b16[@]}" train.global_batch_size=32 train.micro_batch_size=32 train.log_every=10
         checkpoint.every=100 checkpoint.keep=5)
      timeout 110 python -m vitgraph train "${g[@]}" run.dir=/tmp/eager > "$out/train_eager.log" 2>&1
      timeout 110 python -m vitgraph train "${g[@]}" run.dir=/tmp/graphs graphs.enabled=true > "$out/train_graphs.log" 2>&1
      cp /tmp/graphs/log.jsonl /tmp/graphs_first.jsonl
      echo step_000100 > /tmp/graphs/checkpoints/latest; rm -rf /tmp/graphs/checkpoints/step_000200
      : > /tmp/graphs/log.jsonl
      timeout 110 python -m vitgraph train "${g[@]}" run.dir=/tmp/graphs graphs.enabled=true > "$out/train_graphs_resumed.log" 2>&1
      python scripts/compare_curves.py /tmp/eager/log.jsonl /tmp/graphs_first.jsonl /tmp/graphs/log.jsonl 2>&1 | tee "$out/curves.txt"
      grep -E "graphs|resumed|cudnn|cuDNN" "$out/train_graphs_resumed.log" | tail -8 ;;
    multi)
      # 128 images without augmentation: the curve falls within 50 steps (at chance level a
      # wrong gradient would hide), so matching curves say something
      m=("${b16[@]}" data.num_train=128 data.augment.enabled=false train.label_smoothing=0
         train.steps=50 train.global_batch_size=64 train.micro_batch_size=8 train.log_every=5
         train.eval_every=0 checkpoint.every=25 checkpoint.keep=5 optim.warmup_steps=5 optim.lr=2e-4)
      tr() { local name=$1 n=$2 t0=$SECONDS; shift 2
        timeout 170 torchrun --nproc-per-node "$n" --master-port $((29500 + RANDOM % 1000)) \
          -m vitgraph train "${m[@]}" run.dir=/tmp/multi/$name "$@" > "$out/multi_$name.log" 2>&1
        echo "$name: exit $? ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
        # every rank's failure traceback is appended there (the terminal gets one line)
        cp /tmp/multi/$name/train.log "$out/multi_${name}_train.log" 2>/dev/null; }
      # MULTI="name ..." runs a subset (default: all, in this order)
      declare -A RUNS=(
        [one]="1"
        [pp2]="2 parallel.pp=2"
        [pp2_graphs]="2 parallel.pp=2 graphs.enabled=true"
        [tp2_sp]="2 parallel.tp=2 parallel.sequence_parallel=true"
        [tp2_sp_graphs]="2 parallel.tp=2 parallel.sequence_parallel=true graphs.enabled=true"
        [dp2_distopt]="2 parallel.distributed_optimizer=true"
        [pp2_vpp2]="2 parallel.pp=2 parallel.vpp=2 parallel.timeout_minutes=1"
        [pp2_vpp2_graphs]="2 parallel.pp=2 parallel.vpp=2 graphs.enabled=true parallel.timeout_minutes=1"
        [pp2_vpp2_overlap]="2 parallel.pp=2 parallel.vpp=2 parallel.overlap_p2p_comm=true parallel.timeout_minutes=1"
        [pp2_step]="2 parallel.pp=2 graphs.enabled=true graphs.scope=step"
        [dp2_step]="2 graphs.enabled=true graphs.scope=step"
        [pp2_te]="2 parallel.pp=2 graphs.enabled=true graphs.impl=te")
      names=(${MULTI:-one pp2 pp2_graphs tp2_sp tp2_sp_graphs dp2_distopt pp2_vpp2 pp2_vpp2_graphs pp2_vpp2_overlap pp2_step dp2_step pp2_te resume})
      d=/tmp/multi
      for name in "${names[@]}"; do
        if [ "$name" = resume ]; then
          # the pp=2 run, rolled back to its step-25 checkpoint, resumes at dp=2
          rm -rf $d/pp2/checkpoints/step_000050 $d/pp2/metrics.json
          mv $d/pp2/log.jsonl $d/pp2_first.jsonl
          tr pp2 2 parallel.distributed_optimizer=true
          mv $d/pp2/log.jsonl $d/pp2_resumed_dp2.jsonl
          cp $d/pp2_first.jsonl "$out/multi_pp2.jsonl"
          cp $d/pp2_resumed_dp2.jsonl "$out/multi_pp2_resumed_dp2.jsonl"
          continue
        fi
        tr $name ${RUNS[$name]}
        cp $d/$name/log.jsonl "$out/multi_$name.jsonl" 2>/dev/null
      done
      ls $out/multi_*.jsonl
      # against the one-GPU curve (MULTI_REF: another file when `one` is not in this subset)
      ref=${MULTI_REF:-$out/multi_one.jsonl}
      python scripts/compare_curves.py "$ref" $(ls "$out"/multi_*.jsonl | grep -v "^$ref$") 2>&1 \
        | tee "$out/multi_curves.txt" ;;
    resume-optim)
      r=("${b16[@]}" data.num_train=4000 train.steps=30 train.global_batch_size=64
         train.micro_batch_size=64 train.log_every=3 train.eval_every=0 checkpoint.every=15
         checkpoint.keep=5 optim.warmup_steps=3)
      timeout 120 python -m vitgraph train "${r[@]}" run.dir=/tmp/ro > "$out/resume_first.log" 2>&1
      rm -rf /tmp/ro/checkpoints/step_000030 /tmp/ro/metrics.json; mv /tmp/ro/log.jsonl /tmp/ro_first.jsonl
      timeout 120 python -m vitgraph train "${r[@]}" run.dir=/tmp/ro parallel.distributed_optimizer=false \
        > "$out/resume_second.log" 2>&1
      python scripts/compare_curves.py /tmp/ro_first.jsonl /tmp/ro/log.jsonl 2>&1 | tee "$out/resume_curves.txt" ;;
    fp8-curve)
      f=("${b16[@]}" data.num_train=20000 train.steps=500 train.global_batch_size=128
         train.micro_batch_size=128 train.log_every=25 train.eval_every=0 optim.warmup_steps=50
         optim.lr=5e-4 checkpoint.every=0)
      timeout 150 python -m vitgraph train "${f[@]}" run.dir=/tmp/bf16 > "$out/curve_bf16.log" 2>&1
      timeout 150 python -m vitgraph train "${f[@]}" run.dir=/tmp/fp8 train.precision=fp8 > "$out/curve_fp8.log" 2>&1
      python scripts/compare_curves.py /tmp/bf16/log.jsonl /tmp/fp8/log.jsonl --rtol 0.02 2>&1 | tee "$out/fp8_curve.txt" ;;
    loop-rate)
      timeout 150 python -m vitgraph train configs/vit-l16-imagefolder.yaml data.kind=shapes \
        data.render_size=32 data.num_train=12800 data.num_val=256 data.workers=8 train.steps=50 \
        train.global_batch_size=256 train.micro_batch_size=256 train.log_every=10 train.eval_every=0 \
        checkpoint.every=0 train.progress=false run.dir=/tmp/loop \
        model.num_classes=10 data.augment.enabled=false parallel.tp=1 > "$out/loop_rate.log" 2>&1
      grep "img/s" "$out/loop_rate.log" | tail -4 ;;
    data) timeout 120 python3 scripts/bench_data.py --out "$out/bench_data.json" 2>&1 | tee "$out/bench_data.log" | tail -8 ;;
    shards-train)
      # ViT-B/16 (mb 256, 160 steps) from photo-like JPEG shards decoded by nvJPEG, against the
      # same run on in-memory data (the shapes, resized on the device): the step rates must be
      # within 5%. bench_data.py reads the same shards first.
      sh=/tmp/shards_b16
      if [ ! -d $sh ]; then
        photos /tmp/sf_b16 "$out/shards_make.log"
        python scripts/make_shards.py /tmp/sf_b16 $sh --shard-size 512 >> "$out/shards_make.log" 2>&1
      fi
      timeout 120 python3 scripts/bench_data.py --shards $sh --out "$out/bench_data.json" 2>&1 | tee "$out/bench_data.log" | tail -4
      # Step graphs (the host then has time to decode); data.cpu_decode_share moves that share
      # of each microbatch's decoding from nvJPEG to the loader's 16 threads.
      w=(configs/vit-b16-imagefolder.yaml train.steps=160 train.global_batch_size=256 train.micro_batch_size=256
         train.log_every=40 train.eval_every=0 checkpoint.every=0 train.progress=false
         data.augment.enabled=false data.workers=16 model.num_classes=10 graphs.enabled=true graphs.scope=step)
      timeout 120 python -m vitgraph train "${w[@]}" data.kind=shapes data.render_size=32 data.num_train=8192 \
        data.num_val=512 run.dir=/tmp/b16_memory > "$out/train_b16_memory.log" 2>&1
      for share in 0 1.0; do
        timeout 120 python -m vitgraph train "${w[@]}" data.kind=webdataset data.path=$sh data.decode=cuda \
          data.cpu_decode_share=$share run.dir=/tmp/b16_shards_$share > "$out/train_b16_shards_$share.log" 2>&1
      done
      # vitgraph sets 32 hardware queues; with CUDA's 8, nvJPEG's 14 streams ran mostly after
      # the step graph (0.86-0.90x the synthetic rate against 0.95-0.96x; benchmarks/BENCHMARKS.md)
      CUDA_DEVICE_MAX_CONNECTIONS=8 timeout 120 python -m vitgraph train "${w[@]}" data.kind=webdataset \
        data.path=$sh data.decode=cuda run.dir=/tmp/b16_shards_q8 > "$out/train_b16_shards_q8.log" 2>&1
      grep -H "img/s" "$out"/train_b16_*.log | sed 's/| TFLOP.*//'
      # the same comparison as JSON: bench.py's synthetic-input row and its row fed from the
      # shards through the loop's input pipeline, in one process
      timeout 200 python scripts/bench.py --model vit_b16_224 --micro-batches 256 \
        --systems vitgraph+step-graphs --data $sh --warmup 10 --iters 20 \
        --out "$out/bench_shards.json" 2>&1 | tee "$out/bench_shards.log" | tail -4 ;;
    clip)
      # clip_vit_b16 (TE, bf16) on the captioned shapes: eager and layer graphs, 100 steps each,
      # then vitgraph's contrastive step against open_clip's (its wheel: see the header)
      c=(configs/clip-b16.yaml data.kind=shapes data.render_size=32 data.num_train=20000
         data.num_val=1000 data.workers=8 train.steps=100 train.global_batch_size=128
         train.micro_batch_size=128 train.log_every=10 train.eval_every=0 checkpoint.every=0
         optim.lr=1e-4 optim.warmup_steps=30 train.progress=false)  # 5e-4 after 10 warm-up steps collapses (loss ln 128 by step 20)
      timeout 150 python -m vitgraph train "${c[@]}" graphs.enabled=false run.dir=/tmp/clip_eager > "$out/clip_eager.log" 2>&1
      timeout 150 python -m vitgraph train "${c[@]}" run.dir=/tmp/clip_graphs > "$out/clip_graphs.log" 2>&1
      cp /tmp/clip_eager/log.jsonl "$out/clip_eager.jsonl"; cp /tmp/clip_graphs/log.jsonl "$out/clip_graphs.jsonl"
      python scripts/compare_curves.py "$out/clip_eager.jsonl" "$out/clip_graphs.jsonl" --rtol 2e-3 2>&1 | tee "$out/clip_curves.txt"
      timeout 240 python scripts/bench.py --model clip_vit_b16 --micro-batches 256 --systems \
        ${CLIP_SYSTEMS:-vitgraph vitgraph+graphs vitgraph+step-graphs open_clip open_clip+compile} --warmup 5 --iters 6 \
        --out "$out/bench_clip.json" 2>&1 | tee "$out/bench_clip.log" | tail -8 ;;
    profile)
      # GPU time by kernel of the step-graph step at micro-batch 8 and 256 (ViT-L/16)
      for mb in 8 256; do
        timeout 150 python scripts/bench.py --model vit_l16_224 --micro-batches $mb \
          --systems vitgraph+step-graphs --warmup 6 --iters 3 --kernels 5 \
          --out "$out/profile_mb$mb.json" > "$out/profile_mb$mb.log" 2>&1
        grep -A40 "^profile:" "$out/profile_mb$mb.log" | head -45
      done ;;
    native)
      for m in ${NATIVE_MODELS:-vit_so400m14_378 vit_so400m16_256 vit_l16_224 vit_b16_224}; do
        p=(256 576 1024); [ "$m" = vit_so400m14_378 ] && p=(256 576 729 1024)
        # two 32,768-token packs a step ran 2.9-4.9% faster than four of 16,384 (BENCHMARKS.md)
        timeout -s INT ${NATIVE_TIMEOUT:-560} python scripts/bench.py --native --images 1536 --seed 7 \
          --warmup 4 --iters 5 --models "$m" --max-patches "${p[@]}" ${NATIVE_PACKS:---pack-tokens 32768 --packs-per-step 2} \
          --systems vitgraph+packed+step-graphs \
          vitgraph+padded+step-graphs timm-naflex+compile --out "$out/native-$m.json" 2>&1 \
          | tee "$out/native-$m.log" | grep -E "real tok|Error|error" | tail -20
      done ;;
    vlm)
      python -c "import open_clip" 2>/dev/null && tok=() || tok=(--lm-tokenizer byte)
      for p in ${VLM_PATCHES:-576 1024}; do
        timeout -s INT ${VLM_TIMEOUT:-420} python scripts/bench.py --vlm "${tok[@]}" --max-patches $p --timm-batch 16 --warmup 4 --iters 6 \
          --out "$out/vlm-so400m16-$p.json" 2>&1 | tee "$out/vlm-$p.log" | tail -12
      done ;;
    l16-mb8)
      # ViT-L/16 at micro-batch 8: step graphs (the fused norm as auto picks it) against timm
      # + compile reduce-overhead, one process
      timeout -s INT 400 python scripts/bench.py --model vit_l16_224 --micro-batches 8 --systems \
        vitgraph+step-graphs timm+compile-reduce-overhead --warmup 10 --iters 30 \
        --out "$out/vit_l16-mb8.json" 2>&1 | tee "$out/vit_l16-mb8.log" | tail -8 ;;
    configs-bench)
      # classifiers on a JPEG ImageFolder (500x375, photo-like noise), pairs on captioned shards
      # of it; $BENCH_CONFIGS: some of them (default all)
      f=/tmp/cfg_folder; sh=/tmp/cfg_shards
      if [ ! -d $sh ]; then
        photos $f "$out/configs_data.log"
        python scripts/make_shards.py $f $sh --shard-size 512 --captions >> "$out/configs_data.log" 2>&1
        sync
      fi
      win=(${BENCH_STEPS:+--steps $BENCH_STEPS} ${BENCH_WINDOW_S:+--window-s $BENCH_WINDOW_S})
      timeout -s INT ${BENCH_TIMEOUT:-560} python scripts/bench.py --configs ${BENCH_CONFIGS:-all} \
        --imagefolder $f --shards $sh "${win[@]}" --out "$out/configs.json" 2>&1 \
        | tee "$out/configs.log" | tail -30 ;;
    towers)
      f=/tmp/cfg_folder; photos $f "$out/towers_data.log"
      for c in ${TOWERS:-vit-6b vit-bigG14 vit-g14}; do
        timeout -s INT ${TOWER_TIMEOUT:-480} python scripts/bench.py --configs \
          configs/$c-imagefolder.yaml --imagefolder $f --shards /tmp/cfg_shards --steps 60 \
          --window-s 100 --warmup 3 --iters 4 --out "$out/towers-$c.json" 2>&1 \
          | tee "$out/towers-$c.log" | grep -E "as shipped|Error" | tail -3
      done ;;
    augment)
      f=/tmp/cfg_folder; photos $f "$out/augment_data.log"
      a=(--model vit_b16_224 --micro-batches 128 --microbatches 2 --systems vitgraph+step-graphs
         --data $f --warmup 6 --iters 6 --kernels 3)
      timeout 150 python scripts/bench.py "${a[@]}" --out "$out/augment-off.json" 2>&1 \
        | tee "$out/augment-off.log" | grep -E "img/s|input rate"
      timeout 180 python scripts/bench.py "${a[@]}" --override data.augment.enabled=true \
        train.label_smoothing=0.1 --out "$out/augment-on.json" 2>&1 | tee "$out/augment-on.log" \
        | grep -E "img/s|input rate" ;;
    bench) timeout 470 python scripts/bench.py --warmup 6 --iters 8 --out "$out/bench.json" 2>&1 | tee "$out/bench.log" | tail -30 ;;
  esac
done
