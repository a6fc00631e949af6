#!/usr/bin/env bash
# #58's table in one short device call (~4-5 min on an H200, timeout_s 360): asyncpp's step phases
# at c = 1, 64, 256 for pp = 1 and pp = 2 (RUNS; scripts/gpu_profile.sh's asyncpp part), the plain
# graph-captured decode loop the table is held against, then the CUDA tests (TESTS) and what they
# left in /dev/shm. `RUNS="pp=2;pp=2,parallel.token_handoff=host"` compares the token ring.
# Reports go to $OUT (default ./gpu-out).
#
#   ../shared/device/wheels.sh llguidance==1.9.1   # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_measure.sh               # there, with carry [".whl"]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
PY=python3
record_machine

echo "== step phases"
PLAIN=0 RUNS="${RUNS:-pp=1;pp=2}" PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-100} STEP_PHASES_ONLY=1 bash scripts/gpu_profile.sh 2>&1 \
  | grep -E "^pp=|^  (engine|stage)|^    (forward|sample|wait_|prepare|report|schedule|process)" | tee "$OUT/step_phases.txt"

echo "== plain decode loop (ms per step)"
timeout 60 $PY scripts/plain_decode_loop.py > "$OUT/plain_loop.txt" 2>&1; tail -1 "$OUT/plain_loop.txt"

echo "== CUDA tests (TESTS, default the step path and structured outputs)"
# pytest prints its pid: a file left in /dev/shm (cuda.shm.<dev>.<pid in hex>.<n>) then names its maker.
timeout "${TEST_TIMEOUT:-200}" $PY -c 'import os, sys, pytest
print("pytest pid", os.getpid(), hex(os.getpid()), flush=True)
sys.exit(pytest.main(sys.argv[1:]))' -q -ra -m cuda -p no:cacheprovider --timeout 100 \
  ${TESTS:-tests/cuda/test_cuda_path.py tests/cuda/test_structured_cuda.py} > "$OUT/cuda_tests.txt" 2>&1
head -1 "$OUT/cuda_tests.txt"; tail -4 "$OUT/cuda_tests.txt"
echo "files left in /dev/shm: $(ls /dev/shm | grep -E '^(cuda\.shm\.|torch_)' | tr '\n' ' ')"
