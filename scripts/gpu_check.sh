#!/usr/bin/env bash
# The whole GPU check in one command, for a lent GPU machine (see ../shared/device/README.md):
# the CUDA tests (only the files that mark any: the image lacks the HTTP server's packages),
# the hand-off benchmark, the serving benchmark (pp=1/2, graphs on/off, c = 1, 64, 256) and
# transformers generate on the same GPU. Reports go to $OUT (default ./gpu-out).
#
#   ../shared/device/wheels.sh                # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_check.sh            # there, with carry [".whl"] and timeout_s 600
#
# The defaults fit one device call as a rule (~400 s expected; the timeouts below bound it at
# 770 s): on an H200 (2026-11-26) these settings took 530 s with 32
# prompts at c = 1 and a 115 s limit per concurrency, which cut c = 1's graphs-off run short;
# 16 prompts there halve it. Sized by the environment:
#   CONCURRENCIES        default "1 64 256" (prompts: 4 per concurrency, at least 16)
#   RUNS                 default "pp=1;pp=2;pp=1,graphs=false"
#   COMPARE_AT           the concurrency that also runs transformers (default 64; "" for none)
#   COMPARE_BATCH_SIZES  its static batches (default 64,256; batch 1 takes ~80 ms a token)
#   TEST_TIMEOUT         s per CUDA test (default 120)
#   TESTS_TIMEOUT        s for all the tests (default 200; they took 93 s)
#   SERVE_TIMEOUT        s per concurrency (default 150)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
PY=python3
record_machine

$PY -m asyncpp.weights.export_random smollm2-135m /tmp/smollm2-shape > /dev/null

echo "== CUDA tests"
mapfile -t CUDA_TEST_FILES < <(grep -rl "mark\.cuda" tests --include='test_*.py')
timeout "${TESTS_TIMEOUT:-200}" $PY -m pytest -q -ra -m cuda -p no:cacheprovider --timeout "${TEST_TIMEOUT:-120}" \
  "${CUDA_TEST_FILES[@]}" > "$OUT/cuda_tests.txt" 2>&1
tail -15 "$OUT/cuda_tests.txt"

echo "== hand-off vs device copy"
timeout 120 $PY -m asyncpp.bench.handoff --device cuda --result-json "$OUT/handoff.json" 2>&1 | tail -7

echo "== serving benchmark"
CFG=configs/gpu-smollm2-shape.toml
RUNS=${RUNS:-"pp=1;pp=2;pp=1,graphs=false"}
for c in ${CONCURRENCIES:-1 64 256}; do
  n=$(( c * 4 < 16 ? 16 : c * 4 ))
  extra=()
  if [ "$c" = "${COMPARE_AT-64}" ]; then extra=(--compare transformers --compare-batch-sizes "${COMPARE_BATCH_SIZES:-64,256}"); fi
  timeout "${SERVE_TIMEOUT:-150}" $PY -m asyncpp.bench --config $CFG --runs "$RUNS" --max-concurrency $c --num-prompts $n \
    --random-input-len 64 --random-output-len 128 --result-json "$OUT/serve_c$c.json" "${extra[@]}" \
    > "$OUT/serve_c$c.txt" 2>&1
  echo "-- concurrency $c"; grep -E "TPOT|output tok/s|Output token throughput|ratio|transformers" "$OUT/serve_c$c.txt" | head -20
done
