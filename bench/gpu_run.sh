#!/usr/bin/env bash
# One device call: install carried wheels, build Dao's causal-conv1d (sm_90 only) in the background as an anchor,
# run the GPU tests, then the kernel benchmark. Usage (on the GPU machine, repo root): bash bench/gpu_run.sh
# Knobs (environment): TESTS, TEST_TIMEOUT, TEST_WORKERS, DOCTOR, EXTRA, DAO_WAIT, DAO_JOBS, SKIP_DAO, SKIP_BENCH, KERNEL_ARGS, BENCH_TIMEOUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Once per machine: a warm machine's later call (or a job started before this script) already has them.
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# DOCTOR=1: `flashdraft doctor --json` first, on an idle machine (its first run compiles Triton kernels).
if [ -n "${DOCTOR:-}" ]; then
  s=$SECONDS; timeout ${DOCTOR_TIMEOUT:-150} python3 -m flashdraft doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
  echo "doctor exit $? in $(( SECONDS - s )) s"; grep '^\[doctor\]' "$OUT/doctor.err" | grep ' s$'
fi
# Any carried causal-conv1d source tarball: the PyPI sdist, or `git archive --prefix=causal_conv1d-<rev>/` of the repo.
CC_SDIST=$(ls .whl/causal_conv1d-*.tar.gz 2>/dev/null | head -1)
if [ -z "${SKIP_DAO:-}" ] && [ -n "$CC_SDIST" ]; then
  CC_DIR=$(basename "$CC_SDIST" .tar.gz)
  ( set -e; mkdir -p /tmp/cc && tar xzf "$CC_SDIST" -C /tmp/cc && cd "/tmp/cc/$CC_DIR" \
    && python3 "$OLDPWD/bench/build_dao_sm90.py" setup.py \
    && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${DAO_JOBS:-12} python3 -m pip install -q --no-build-isolation --no-deps \
       --target /tmp/site2 . ) > "$OUT/dao_build.log" 2>&1 &
  DAO_PID=$!
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
timeout ${TEST_TIMEOUT:-270} python3 -m pytest -q -rfE -p no:cacheprovider -n ${TEST_WORKERS:-6} --timeout 150 \
  ${TESTS:-tests/kernels tests/fastpath} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25
# EXTRA: more commands (GPU work that does not mind the compile in the background), before waiting for it.
[ -z "${EXTRA:-}" ] || bash -c "$EXTRA"
if [ -n "${DAO_PID:-}" ]; then
  t0=$(date +%s); ( sleep ${DAO_WAIT:-200}; kill $DAO_PID 2>/dev/null ) & wait $DAO_PID; echo "Dao build exit $? (waited $(( $(date +%s) - t0 )) s more)"; tail -3 "$OUT/dao_build.log"
  export PYTHONPATH=/tmp/site:/tmp/site2:$PWD
fi
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-300} python3 bench/kernels.py ${KERNEL_ARGS:-} --json "$OUT/kernels.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -40
