#!/usr/bin/env bash
# The tiny trained target and its drafter, end to end; each stage is one command, runnable on its own.
#   bash examples/tiny_target/pipeline.sh                      # all stages (a GPU: ~10 minutes on an H200)
#   STAGES="target regen" bash examples/tiny_target/pipeline.sh
#   TARGET=embedded STAGES="corpus regen drafter eval" bash ...   # on the shipped target (how the shipped drafter was made)
# Stages:
#   corpus   python examples/tiny_target/corpus.py                      stdlib source -> tokens + prompts
#   target   python examples/tiny_target/train_target.py                the tiny hybrid Qwen3.5 target (<= 5 min)
#   regen    flashdraft regenerate (T=0 and T=1)                         responses written by the target itself
#   drafter  flashdraft train --config examples/tiny_target/drafter.yaml
#   eval     flashdraft eval at T=0 and T=1, block 16, held-out prompts (with prompt lookup and autoregressive)
#   ship     python examples/tiny_target/ship.py (not in the default STAGES: replaces the package's embedded drafter)
set -euo pipefail
B=${BUILD:-build/tiny_target}
TARGET=${TARGET:-$B/target}
STAGES=${STAGES:-corpus target regen drafter eval}
FD=${FLASHDRAFT:-python3 -m flashdraft}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
t() { local s=$(date +%s); "$@"; echo "[stage time] $(( $(date +%s) - s )) s: $*"; }

stage corpus && t python3 examples/tiny_target/corpus.py --out "$B/corpus"
stage target && [ "$TARGET" != embedded ] && t python3 examples/tiny_target/train_target.py --corpus "$B/corpus" --out "$B/target" ${TARGET_ARGS:-}
if stage regen; then
  for temp in 0 1; do
    # Resumable: with REGEN_TIMEOUT set, a run that is stopped keeps what it wrote, and the next run continues it.
    # T=1 on the first REGEN_T1_LIMIT prompts (the held-out τ that matters most is T=0's).
    limit=""; [ $temp = 1 ] && limit="--limit ${REGEN_T1_LIMIT:-6000}"
    t ${REGEN_TIMEOUT:+timeout $REGEN_TIMEOUT} $FD regenerate --target "$TARGET" $limit \
      --data "$B/corpus/drafter_prompts.jsonl" --out "$B/regen_t$temp.jsonl" --temperature $temp \
      --max-new-tokens ${REGEN_TOKENS:-192} --batch-size ${REGEN_BATCH:-256} --no-progress ${REGEN_ARGS:-} \
      || echo "regenerate T=$temp stopped after ${REGEN_TIMEOUT:-?} s; $(wc -l < "$B/regen_t$temp.jsonl") rows kept"
  done
fi
# With DRAFTER_TIMEOUT, `timeout` sends SIGTERM: the trainer finishes its step, checkpoints and stops (--resume goes on).
if stage drafter; then
  t ${DRAFTER_TIMEOUT:+timeout $DRAFTER_TIMEOUT} $FD train --config examples/tiny_target/drafter.yaml \
    target.path="$TARGET" log.out="$B/drafter_run" ${DRAFTER_ARGS:-} || echo "drafter training stopped after ${DRAFTER_TIMEOUT:-?} s"
fi
if stage eval; then
  for temp in 0 1; do
    t $FD eval --target "$TARGET" --drafter "$B/drafter_run" --prompts "$B/corpus/heldout_prompts.jsonl" \
      --temperature $temp --block-size 16 --max-new-tokens ${EVAL_TOKENS:-128} --no-progress \
      --json "$B/eval_t$temp.json" --plot "$B/eval_t$temp.png" ${EVAL_ARGS:-}
  done
fi
if stage ship; then
  latest=$(ls -d "$B"/drafter_run/checkpoints/step_* | tail -1)
  t python3 examples/tiny_target/ship.py --drafter "$latest/drafter" --build "$B"
fi
