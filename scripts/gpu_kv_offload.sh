#!/usr/bin/env bash
# The KV offload connector on a lent GPU machine, in one command (see ../shared/device/README.md):
# its CUDA tests (the mover on CUDA caches, in-process and launched engines saving from and
# loading into GPU caches) and `asyncpp.bench.kv_copy --device cuda`. Reports go to $OUT
# (default ./gpu-out). About 3 minutes on an H100/H200.
#
#   ../shared/device/wheels.sh crc32c         # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_kv_offload.sh       # there, with carry [".whl"] and timeout_s 420
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
record_machine

echo "== KV offload CUDA tests"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -ra -m cuda -p no:cacheprovider \
  tests/cuda/test_offload_cuda.py tests/cuda/test_offload_engine_cuda.py > "$OUT/kv_offload_cuda_tests.txt" 2>&1
tail -15 "$OUT/kv_offload_cuda_tests.txt"

echo "== block moves vs a device -> pinned host copy"
for placement in random runs; do
  timeout 90 python3 -m asyncpp.bench.kv_copy --device cuda --placement $placement > "$OUT/kv_copy_cuda_$placement.txt" 2>&1
  tail -12 "$OUT/kv_copy_cuda_$placement.txt"
done
