#!/usr/bin/env bash
# The bundled target and its drafter, end to end; each stage is one command, runnable on its own (README.md).
#   bash examples/tiny_target/pipeline.sh                      # corpus, target, regen, drafter, eval (one GPU)
#   STAGES="target regen" bash examples/tiny_target/pipeline.sh
#   TARGET=bundled STAGES="corpus regen drafter eval" bash ...   # on the bundled target, as its drafter was made
# Stages:
#   corpus   python examples/tiny_target/corpus.py                      stdlib source -> tokens + prompts (T=0 and T=1)
#   target   python examples/tiny_target/train_target.py                the tiny hybrid Qwen3.5 target (<= 5 min)
#   regen    flashdraft regenerate (T=0 and T=1)                         responses written by the target itself
#   drafter  flashdraft train --config examples/tiny_target/drafter.yaml
#   eval     flashdraft eval at T=0 and T=1, block 16, held-out prompts (with prompt lookup and autoregressive)
#   ship     python examples/tiny_target/ship.py (not in the default STAGES: replaces the package's bundled drafter)
# Extra arguments per stage: TARGET_ARGS, REGEN_ARGS, DRAFTER_ARGS, EVAL_ARGS. BUILD (build/tiny_target): where every
# stage writes and reads; HELDOUT ($BUILD/corpus/heldout_prompts.jsonl): the prompts the drafter is evaluated on, e.g.
# flashdraft/bundled/eval.jsonl, the package's own, which every published figure uses.
# Data: PROMPTS_PER_FILE (120) and T1_PROMPTS_PER_FILE (60) windows per stdlib file, disjoint, for the T=0 and T=1
# regenerations; REGEN_TOKENS (256) new tokens each; REGEN_T0_LIMIT / REGEN_T1_LIMIT (all) prompts;
# REGEN_SECONDS (none; REGEN_T0_SECONDS / REGEN_T1_SECONDS per temperature): stop a regeneration after that long,
# keeping every finished row (prompts are shuffled, so what is kept is a random sample).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # the stage scripts; BUILD and the rest are relative to where it is run
B=${BUILD:-build/tiny_target}
TARGET=${TARGET:-$B/target}
STAGES=${STAGES:-corpus target regen drafter eval}
HELDOUT=${HELDOUT:-$B/corpus/heldout_prompts.jsonl}
FD=${FLASHDRAFT:-python3 -m flashdraft}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
t() { local s=$(date +%s) rc=0; "$@" || rc=$?; echo "[stage time] $(( $(date +%s) - s )) s: $*"; return $rc; }

stage corpus && t python3 "$HERE"/corpus.py --out "$B/corpus" \
  --prompts-per-file ${PROMPTS_PER_FILE:-120} --t1-prompts-per-file ${T1_PROMPTS_PER_FILE:-60}
stage target && [ "$TARGET" != bundled ] && t python3 "$HERE"/train_target.py --corpus "$B/corpus" --out "$B/target" ${TARGET_ARGS:-}
# A regeneration cut short by REGEN_SECONDS: its finished rows stay, a half-written last line is dropped.
keep_whole_lines() { python3 -c 'import sys; b = open(sys.argv[1], "rb").read(); open(sys.argv[1], "wb").write(b[: b.rfind(b"\n") + 1])' "$1"; }
if stage regen; then
  for temp in 0 1; do
    prompts="$B/corpus/drafter_prompts.jsonl"
    [ $temp = 1 ] && [ -f "$B/corpus/drafter_prompts_t1.jsonl" ] && prompts="$B/corpus/drafter_prompts_t1.jsonl"
    limit_var=REGEN_T${temp}_LIMIT; limit=""; [ -n "${!limit_var:-}" ] && limit="--limit ${!limit_var}"
    secs_var=REGEN_T${temp}_SECONDS; secs=${!secs_var:-${REGEN_SECONDS:-}}
    bound=""; [ -n "$secs" ] && bound="timeout --signal=INT --kill-after=20 $secs"
    t $bound $FD regenerate --target "$TARGET" $limit \
      --data "$prompts" --out "$B/regen_t$temp.jsonl" --temperature $temp \
      --max-new-tokens ${REGEN_TOKENS:-256} --batch-size ${REGEN_BATCH:-512} --no-progress ${REGEN_ARGS:-} \
      || { rc=$?; [ $rc = 124 ] || [ $rc = 137 ]; }  # 124: stopped by REGEN_SECONDS (137: killed 20 s later)
    keep_whole_lines "$B/regen_t$temp.jsonl"
    echo "regen T=$temp: $(wc -l < "$B/regen_t$temp.jsonl") rows in $B/regen_t$temp.jsonl"
  done
fi
stage drafter && t $FD train --config "$HERE"/drafter.yaml target.path="$TARGET" log.out="$B/drafter_run" \
  "data.train=[$B/regen_t0.jsonl, $B/regen_t1.jsonl]" data.eval_prompts="$HELDOUT" ${DRAFTER_ARGS:-}
if stage eval; then
  for temp in 0 1; do
    t $FD eval --target "$TARGET" --drafter "$B/drafter_run" --prompts "$HELDOUT" \
      --temperature $temp --block-size 16 --max-new-tokens ${EVAL_TOKENS:-128} --no-progress \
      --json "$B/eval_t$temp.json" --plot "$B/eval_t$temp.png" ${EVAL_ARGS:-}
  done
fi
if stage ship; then
  latest=$(ls -d "$B"/drafter_run/checkpoints/step_* | tail -1)
  t python3 "$HERE"/ship.py --drafter "$latest/drafter" --build "$B"
fi
