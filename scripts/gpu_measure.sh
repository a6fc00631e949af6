#!/usr/bin/env bash
# #58's table in one short device call (~4-5 min on an H200, timeout_s 300): asyncpp's step phases
# at c = 1, 64, 256 for pp = 1 and pp = 2 (scripts/gpu_profile.sh's asyncpp part), the CUDA tests
# of the step path, then the plain graph-captured decode loop the table is held against.
# Reports go to $OUT (default ./gpu-out).
#
#   ../shared/device/wheels.sh llguidance==1.9.1   # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_measure.sh               # there, with carry [".whl"]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
PY=python3
record_machine

echo "== step phases"
PLAIN=0 RUNS="${RUNS:-pp=1;pp=2}" PROFILE_TIMEOUT=90 STEP_PHASES_ONLY=1 bash scripts/gpu_profile.sh 2>&1 \
  | grep -E "^pp=|^  (engine|stage)|^    (forward|sample|wait_|prepare|report|schedule|process)" | tee "$OUT/step_phases.txt"

echo "== CUDA tests of the step path"
timeout "${TEST_TIMEOUT:-120}" $PY -m pytest -q -ra -m cuda -p no:cacheprovider --timeout 100 \
  tests/cuda/test_cuda_path.py > "$OUT/cuda_tests.txt" 2>&1
tail -4 "$OUT/cuda_tests.txt"
echo "files left in /dev/shm: $(ls /dev/shm | grep -c -E '^(cuda\.shm\.|torch_)')"

echo "== plain decode loop (ms per step)"
timeout 60 $PY scripts/plain_decode_loop.py > "$OUT/plain_loop.txt" 2>&1; tail -1 "$OUT/plain_loop.txt"
