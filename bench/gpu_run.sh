#!/usr/bin/env bash
# Re-measure the GPU figures of bench/RESULTS.md and docs/ on one GPU machine, stage by stage, into one folder.
#   OUT=/tmp/h200 bash bench/gpu_run.sh                    # the default STAGES, in the order given
#   STAGES="mtp train-step" OUT=/tmp/h200 bash bench/gpu_run.sh
# Stages (each is the one command shown; CAP_<STAGE> seconds bound it, with '-' for '_' : CAP_TRAIN_STEP=300):
#   first-step     `flashdraft train` on the bundled default, twice: on a fresh machine the first run is the cold
#                  figure (compiles, autotuning), the second the warm one; each prints its "first step after" line
#                  and writes wall_time.json; Triton prints each kernel it autotunes, and the choices are kept as
#                  <GPU>.json (bench/kernel_configs.py: flashdraft/kernels/tuned/ ships such files);
#                  FIRST_STEP_RUNS=cold skips the warm run
#   first-step-shipped  the bundled default in empty Triton, Inductor and Matplotlib caches, with the kernel choices
#                  the first-step stage kept (where it ran in this call) placed in flashdraft/kernels/tuned/ beside
#                  those shipped (what a fresh machine gets once they ship)
#   first-step-profile  the cold run again under cProfile, in empty Triton and Inductor caches (profile.txt: where
#                  a cold start's seconds go, by function)
#   first-step-27b python -m bench.train_step --seq 3072 --skip-naive --warmup 1 --steps 2, twice in caches that
#                  start empty (FIRST_STEP_27B_RUNS=cold: once): the 27B shape's cold and warm first step, its
#                  phases, torch.compile's seconds and each compiled frame's (compile_s, compile_frames in the
#                  JSON); its autotuning choices kept as <GPU>.json (merge it with the first-step stage's:
#                  python -m bench.kernel_configs --keep A --keep B)
#   mtp            python -m bench.spec_engine_mtp --layers 64        MTP beside DFlash on the 27B shape
#   train-step     python -m bench.train_step --seq 3072,32768 --try target.precision=fp8   (naive trainer included;
#                  TRAIN_STEP_SEQS: other lengths)
#   long           python -m bench.train_step --seq 65536,131072 --warmup 1 --steps 2 --try target.precision=fp8
#                  (LONG_SEQS: other lengths)
#   feature-error  python -m bench.feature_error                      FP8 against bf16 features, per captured layer
#   drafter        examples/tiny_target/pipeline.sh on the bundled target: corpus, regeneration, the drafter
#                  fine-tuned from the bundled one (DRAFTER_ARGS, default drafter.init_from=bundled; REGEN_*),
#                  eval on the package's held-out prompts; the last drafter is kept as final_drafter/
#                  (examples/tiny_target/ship.py ships it). DRAFTER_PIPELINE picks the pipeline's stages (default
#                  "corpus regen drafter eval"): "corpus regen" makes rows for a later call (gzip them and carry
#                  them), "drafter eval" trains on carried rows (DRAFTER_ARGS="data.train=[...]")
#   sweep          tools/sweep.py on the drafter stage's rows, or on SWEEP_DATA (paths), with
#                  SWEEP_ARGS (e.g. --variants ...)
# The stages run one after another, never beside each other, so no timing shares the GPU with a compile.
# WHEELS=DIR: wheels installed first (no dependencies, into a private folder on PYTHONPATH) for what the machine
# lacks, e.g. fla-core (a newer transformers brings its own needs: 5.25 wants huggingface-hub >= 2.4).
# Each stage's output is OUT/<stage>/ with its log; OUT/stages.tsv says how each ended (seconds, exit code:
# 124 = stopped by its cap); OUT/results.tar.gz (in parts where large) holds the results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for the results}
STAGES=${STAGES-first-step mtp train-step long feature-error}  # set and empty: none
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -n "${WHEELS:-}" ]; then
  rm -rf /tmp/flashdraft-wheels  # a warm machine keeps an earlier call's: what WHEELS holds now replaces it
  python3 -m pip install -q --no-index --no-deps --target /tmp/flashdraft-wheels "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/flashdraft-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
FD="python3 -m flashdraft"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c 'import sys, importlib.metadata as md
def v(n):
    try: return md.version(n)
    except md.PackageNotFoundError: return "absent"
print("python", sys.version.split()[0], *(f"{n} {v(n)}" for n in ("torch", "triton", "transformers", "fla-core")))'
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"
printf 'stage\tseconds\texit\n' > "$OUT/stages.tsv"

default_cap() {
  case $1 in
    first-step) echo 400 ;; first-step-shipped) echo 200 ;; first-step-profile) echo 240 ;; first-step-27b) echo 420 ;;
    mtp) echo 480 ;; train-step) echo 480 ;; long) echo 540 ;; feature-error) echo 240 ;;
    drafter) echo 1500 ;; sweep) echo 1500 ;; *) echo 600 ;;
  esac
}

run_stage() {
  local name=$1 dir=$OUT/$1
  mkdir -p "$dir"
  local var=CAP_${name//-/_}
  var=${var^^}
  local cap=${!var:-$(default_cap "$name")} start rc
  start=$(date +%s)
  echo "== $name (cap ${cap} s)"
  timeout --signal=INT --kill-after=30 "$cap" bash -c "$(stage_command "$name" "$dir")" > "$dir/log.txt" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" $(( $(date +%s) - start )) "$rc" >> "$OUT/stages.tsv"
  tail -25 "$dir/log.txt"
}

# A fresh machine's caches, on this one: Triton's kernels and autotuning, Inductor's graphs, Matplotlib's fonts.
EMPTY_CACHES="export TRITON_CACHE_DIR=\$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=\$(mktemp -d) MPLCONFIGDIR=\$(mktemp -d);"

stage_command() {
  local name=$1 dir=$2
  case $name in
    first-step)
      echo "TIMEFORMAT='%R s wall'; export TRITON_PRINT_AUTOTUNING=1;" \
        "for run in ${FIRST_STEP_RUNS:-cold warm}; do time $FD train log.out=$dir/\$run; done;" \
        "python3 -m bench.kernel_configs \${TRITON_CACHE_DIR:-\$HOME/.triton/cache} --out $dir" ;;
    first-step-shipped)
      echo "if [ -d $OUT/first-step ]; then cp $OUT/first-step/*.json flashdraft/kernels/tuned/; fi; $EMPTY_CACHES" \
        "export TRITON_PRINT_AUTOTUNING=1 TIMEFORMAT='%R s wall'; time $FD train log.out=$dir/cold" ;;
    first-step-profile)
      echo "$EMPTY_CACHES export TRITON_PRINT_AUTOTUNING=1;" \
        "python3 -m cProfile -o $dir/profile.out -m flashdraft train log.out=$dir/run;" \
        "python3 -c \"import pstats; pstats.Stats('$dir/profile.out').sort_stats('cumulative').print_stats(80)\"" \
        "> $dir/profile.txt" ;;
    first-step-27b)
      echo "$EMPTY_CACHES export TORCH_LOGS=recompiles; for run in ${FIRST_STEP_27B_RUNS:-cold warm}; do" \
        "python3 -m bench.train_step --seq 3072 --skip-naive --warmup 1 --steps 2 --json $dir/train-step-\$run.json;" \
        "done; python3 -m bench.kernel_configs \$TRITON_CACHE_DIR --out $dir" ;;
    mtp)
      echo "python3 -m bench.spec_engine_mtp --layers 64 --json $dir/spec-engine-mtp.json" ;;
    train-step)
      echo "python3 -m bench.train_step --seq ${TRAIN_STEP_SEQS:-3072,32768} --try target.precision=fp8" \
        "--json $dir/train-step.json" ;;
    long)
      echo "python3 -m bench.train_step --seq ${LONG_SEQS:-65536,131072} --warmup 1 --steps 2 --try target.precision=fp8" \
        "--json $dir/train-step-long.json" ;;
    feature-error)
      echo "python3 -m bench.feature_error --json $dir/feature-error.json" ;;
    drafter)
      # Trained on this machine's standard library (the corpus keeps the held-out files out by path), evaluated
      # on the package's own held-out prompts, the ones every published figure uses.
      echo "BUILD=$dir/build TARGET=bundled HELDOUT=$PWD/flashdraft/bundled/eval.jsonl" \
        "DRAFTER_ARGS='${DRAFTER_ARGS-drafter.init_from=bundled}'" \
        "STAGES='${DRAFTER_PIPELINE:-corpus regen drafter eval}' bash examples/tiny_target/pipeline.sh &&" \
        "if [ -d $dir/build/drafter_run/checkpoints ]; then" \
        "cp -r \$(ls -d $dir/build/drafter_run/checkpoints/step_* | tail -1)/drafter $dir/final_drafter; fi" ;;
    sweep)
      echo "python3 tools/sweep.py --out $dir ${SWEEP_ARGS:-} --data" \
        "${SWEEP_DATA:-$OUT/drafter/build/regen_t0.jsonl $OUT/drafter/build/regen_t1.jsonl}" ;;
    *)
      echo "echo 'unknown stage $name (see the list at the top of bench/gpu_run.sh)'; exit 2" ;;
  esac
}

for name in $STAGES; do
  run_stage "$name"
done
echo "== stages"
column -t "$OUT/stages.tsv" 2>/dev/null || cat "$OUT/stages.tsv"
# One archive of what was measured and made, without what is cheap to remake or only resumes a run (tokenized corpus,
# shards, checkpoints: the drafter stage keeps its last drafter as final_drafter/), in parts of 15 MiB where larger:
# `cat results.tar.gz.part-* | tar -xz`.
tar -czf /tmp/flashdraft-results.tar.gz -C "$OUT" --exclude=results.tar.gz'*' --exclude='*.u16' --exclude=shards \
  --exclude=checkpoints .
rm -f "$OUT"/results.tar.gz*
if [ "$(stat -c %s /tmp/flashdraft-results.tar.gz)" -gt $((15 * 1024 * 1024)) ]; then
  split -b 15M /tmp/flashdraft-results.tar.gz "$OUT/results.tar.gz.part-" && rm /tmp/flashdraft-results.tar.gz
else
  mv /tmp/flashdraft-results.tar.gz "$OUT/results.tar.gz"
fi
ls -l "$OUT"/results.tar.gz*
