#!/usr/bin/env bash
# One device call (H200): install the carried wheels, run pipeline stages, bring the artefacts back under $OUT.
#   STAGES="target regen drafter" bash examples/tiny_target/gpu_call.sh
# GPU_TESTS="tests/kernels tests/fastpath" also runs those tests in the background once the target is trained.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 FLASHDRAFT="python3 -m flashdraft"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
B=build/tiny_target
if [[ " $STAGES " == *" target "* ]]; then
  STAGES=target bash examples/tiny_target/pipeline.sh 2>&1 | tee "$OUT/target.log" | grep -v "Writing model"
  # Now, so a later stage that overruns the call cannot lose it; one archive, as at most 8 files come back.
  tar czf "$OUT/target.tgz" -C build tiny_target/target
fi
if [ -n "${GPU_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-270} python3 -m pytest -q -rfE -p no:cacheprovider ${TEST_ARGS:--n 6} --timeout 150 \
    --junitxml "$OUT/junit.xml" $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1 &
  TESTS_PID=$!
fi
rest=$(echo " $STAGES " | sed 's/ target / /')
STAGES="$rest" bash examples/tiny_target/pipeline.sh 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/pipeline.log" | tail -30
# The whole latest checkpoint (drafter, optimizer, RNG): a later call can go on with --resume.
latest=$(ls -d $B/drafter_run/checkpoints/step_* 2>/dev/null | tail -1)
parts=$(cd build && ls -d tiny_target/regen_t*.jsonl tiny_target/eval_t* tiny_target/drafter_run/*.json* \
  tiny_target/drafter_run/*.png ${latest:+tiny_target/drafter_run/checkpoints/$(basename $latest)} 2>/dev/null)
[ -n "$parts" ] && tar czf "$OUT/artefacts.tgz" -C build $parts
if [ -n "${TESTS_PID:-}" ]; then wait $TESTS_PID; echo "GPU tests:"; tail -15 "$OUT/gpu_tests.log"; fi
ls -la "$OUT"
