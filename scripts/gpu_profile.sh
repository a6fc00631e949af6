#!/usr/bin/env bash
# Where a GPU step's time goes (#39's profile), in one device call on a lent GPU machine:
# the plain single-process decode loop this path is held against (scripts/plain_decode_loop.py,
# a copy of ../shared/device/plain_decode_loop.py: ms per step at batch 1/16/64/256, eager and
# one CUDA graph per step; then under torch.compile), and asyncpp's per-step phases
# (`python -m asyncpp.bench.step_phases`: per process, host ms per step of each phase and the
# GPU ms of the forward and the sampling, with the client's TPOT) at c = 1, 64, 256, pp = 1 and 2.
# Reports go to $OUT (default ./gpu-out).
#
#   ../shared/device/wheels.sh                # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_profile.sh          # there, with carry [".whl"] and timeout_s 600
#
# Then scripts/profile_step.py (a copy of ../shared/device/profile_step.py): cProfile of an in-process
# pp=1 engine's host side and torch.profiler's kernel totals, 64 requests x 64 tokens.
#
# Sized by the environment: PLAIN=0 (no plain loop), STEP_PHASES_ONLY=1 (no in-process profile), PLAIN_COMPILE=1 (also the compiled plain loop), CONCURRENCIES (default "1 64 256"), RUNS (default "pp=1;pp=2"),
# PROMPTS_PER_SLOT (prompts = this x concurrency, at least 8; default 2), PROFILE_TIMEOUT (s per
# concurrency, default 150).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
PY=python3
record_machine

if [ "${PLAIN:-1}" = 1 ]; then
  echo "== plain decode loop (ms per step)"
  timeout 90 $PY scripts/plain_decode_loop.py > "$OUT/plain_loop.txt" 2>&1; tail -1 "$OUT/plain_loop.txt"
fi
if [ "${PLAIN_COMPILE:-0}" = 1 ]; then  # known (H200, 2026-11-26): 1.17 / 1.68 / 4.08 / 18.7 ms
  timeout 120 $PY scripts/plain_decode_loop.py --compile > "$OUT/plain_loop_compiled.txt" 2>&1; tail -1 "$OUT/plain_loop_compiled.txt"
fi

echo "== asyncpp step phases"
$PY -m asyncpp.weights.export_random smollm2-135m /tmp/smollm2-shape > /dev/null
for c in ${CONCURRENCIES:-1 64 256}; do
  n=$(( c * ${PROMPTS_PER_SLOT:-2} < 8 ? 8 : c * ${PROMPTS_PER_SLOT:-2} ))
  timeout "${PROFILE_TIMEOUT:-150}" $PY -m asyncpp.bench.step_phases --config configs/gpu-smollm2-shape.toml \
    --runs "${RUNS:-pp=1;pp=2}" --concurrency "$c" --num-prompts "$n" \
    --input-len 64 --output-len 128 --result-json "$OUT/step_phases_c$c.json" > "$OUT/step_phases_c$c.txt" 2>&1
  cat "$OUT/step_phases_c$c.txt"
done

if [ "${STEP_PHASES_ONLY:-0}" != 1 ]; then
  echo "== in-process engine: cProfile and kernel totals"
  timeout 120 $PY scripts/profile_step.py > "$OUT/profile_step.txt" 2>&1; head -3 "$OUT/profile_step.txt"  # PROFILE_BATCH
fi
