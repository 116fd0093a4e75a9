#!/usr/bin/env bash
# Drafter variants for the tiny target, trained side by side on one GPU (each run is launch-bound and far from filling
# an H200), then each evaluated at T=0 on the held-out prompts. One variant per line of $VARIANTS: "name overrides...";
# $COMMON is added to every variant.
#   VARIANTS=$'base drafter.target_layer_ids=[1,2,3,4,5]\nlate drafter.target_layer_ids=[1,3,5,6,7]' \
#     COMMON="train.epochs=8" bash examples/tiny_target/sweep.sh
# With DRAFTER_TIMEOUT, a run still training then is stopped (it checkpoints first) and evaluated as it stands.
set -uo pipefail
B=${BUILD:-build/tiny_target}
TARGET=${TARGET:-$B/target}  # or embedded: the shipped target
FD=${FLASHDRAFT:-python3 -m flashdraft}
mkdir -p "$B/sweep"
while read -r name overrides; do
  [ -n "$name" ] || continue
  (
    s=$(date +%s)
    ${DRAFTER_TIMEOUT:+timeout $DRAFTER_TIMEOUT} $FD train --config examples/tiny_target/drafter.yaml \
      target.path="$TARGET" log.out="$B/sweep/$name" $overrides ${COMMON:-} > "$B/sweep/$name.train.log" 2>&1
    echo "[$name] trained (exit $?) in $(( $(date +%s) - s )) s"
    $FD eval --target "$TARGET" --drafter "$B/sweep/$name" --prompts "$B/corpus/heldout_prompts.jsonl" \
      --temperature 0 --block-size 16 --max-new-tokens ${EVAL_TOKENS:-128} --no-progress ${EVAL_ARGS:-} \
      --json "$B/sweep/$name.eval_t0.json" > "$B/sweep/$name.eval.log" 2>&1
    echo "[$name] evaluated (exit $?) in $(( $(date +%s) - s )) s"
  ) &
done <<< "$VARIANTS"
wait
python3 - "$B/sweep" <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
print(f"{'variant':<10} {'steps':>6} {'loss':>6} {'tau':>6} {'PL tau':>7} {'tau/PL':>7} {'acc@1':>6} {'acc@2':>6}")
for ev in sorted(root.glob("*.eval_t0.json")):
    name = ev.name.split(".")[0]
    rows = [json.loads(line) for line in open(root / name / "metrics.jsonl") if '"loss"' in line]
    r = json.load(open(ev))
    acc = r["per_position_acceptance"]
    print(f"{name:<10} {rows[-1]['step']:>6} {rows[-1]['loss']:>6.3f} {r['tau']:>6.2f} {r['prompt_lookup_tau']:>7.2f} "
          f"{r['tau'] / r['prompt_lookup_tau']:>7.2f} {acc[0]:>6.3f} {acc[1]:>6.3f}")
PY
