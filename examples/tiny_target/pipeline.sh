#!/usr/bin/env bash
# The bundled target and its drafter, end to end; each stage is one command, runnable on its own (README.md).
#   bash examples/tiny_target/pipeline.sh                      # corpus, target, regen, drafter, eval (one GPU)
#   STAGES="target regen" bash examples/tiny_target/pipeline.sh
#   TARGET=bundled STAGES="corpus regen drafter eval" bash ...   # on the bundled target, as its drafter was made
# Stages:
#   corpus   python examples/tiny_target/corpus.py                      stdlib source -> tokens + prompts
#   target   python examples/tiny_target/train_target.py                the tiny hybrid Qwen3.5 target (<= 5 min)
#   regen    flashdraft regenerate (T=0 and T=1)                         responses written by the target itself
#   drafter  flashdraft train --config examples/tiny_target/drafter.yaml
#   eval     flashdraft eval at T=0 and T=1, block 16, held-out prompts (with prompt lookup and autoregressive)
#   ship     python examples/tiny_target/ship.py (not in the default STAGES: replaces the package's bundled drafter)
# Extra arguments per stage: TARGET_ARGS, REGEN_ARGS, DRAFTER_ARGS, EVAL_ARGS.
set -euo pipefail
B=${BUILD:-build/tiny_target}
TARGET=${TARGET:-$B/target}
STAGES=${STAGES:-corpus target regen drafter eval}
FD=${FLASHDRAFT:-python3 -m flashdraft}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
t() { local s=$(date +%s); "$@"; echo "[stage time] $(( $(date +%s) - s )) s: $*"; }

stage corpus && t python3 examples/tiny_target/corpus.py --out "$B/corpus"
stage target && [ "$TARGET" != bundled ] && t python3 examples/tiny_target/train_target.py --corpus "$B/corpus" --out "$B/target" ${TARGET_ARGS:-}
if stage regen; then
  for temp in 0 1; do
    # T=1 on the first REGEN_T1_LIMIT prompts (the held-out τ that matters most is T=0's).
    limit=""; [ $temp = 1 ] && limit="--limit ${REGEN_T1_LIMIT:-6000}"
    t $FD regenerate --target "$TARGET" $limit \
      --data "$B/corpus/drafter_prompts.jsonl" --out "$B/regen_t$temp.jsonl" --temperature $temp \
      --max-new-tokens ${REGEN_TOKENS:-192} --batch-size ${REGEN_BATCH:-512} --no-progress ${REGEN_ARGS:-}
  done
fi
stage drafter && t $FD train --config examples/tiny_target/drafter.yaml target.path="$TARGET" log.out="$B/drafter_run" ${DRAFTER_ARGS:-}
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
