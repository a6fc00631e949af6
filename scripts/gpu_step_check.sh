#!/usr/bin/env bash
# #39's step check in one device call (~6-7 min on an H200, timeout_s 480): what changed in the GPU step, measured
# against what it replaced in the same call. Reports go to $OUT (default ./gpu-out).
#   1. the decode-attention kernel's tile variants (scripts/attention_tiles.py), each checked first;
#   2. the CUDA tests of the step path (tests/cuda/test_cuda_path.py, the Triton kernel's checks);
#   3. step phases (scripts/gpu_profile.sh's asyncpp part): pp=1 with async output (the default on
#      CUDA) and without it, and pp=2 (whose CUDA IPC events the cuda.shm count checks), at c = 1,
#      64, 256 (RUNS to change the runs);
#   4. where the host time of one served step goes at c = 256: cProfile (wall clock) of the engine
#      and the stage, top functions by own time;
#   5. the in-process engine's kernel totals at batch 256 (scripts/profile_step.py); PLAIN=1 adds
#      the plain loop (scripts/plain_decode_loop.py).
#
#   ../shared/device/wheels.sh                 # here, once: fills .whl (carry it)
#   run: bash scripts/gpu_step_check.sh        # there, with carry [".whl"] and timeout_s 540
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
PY=python3
record_machine

echo "== decode attention: tile variants"
timeout 120 $PY scripts/attention_tiles.py --json "$OUT/attention_tiles.json" > "$OUT/attention_tiles.txt" 2>&1
tail -8 "$OUT/attention_tiles.txt"

echo "== CUDA tests of the step path"
timeout 200 $PY -m pytest -q -ra -m cuda -p no:cacheprovider --timeout 100 \
  tests/cuda/test_cuda_path.py tests/kernels/test_triton_attention.py > "$OUT/cuda_tests.txt" 2>&1
tail -8 "$OUT/cuda_tests.txt"

echo "== step phases"
shm_before=$(ls /dev/shm | grep -c '^cuda\.shm\.')
PLAIN=0 RUNS="${RUNS:-pp=1;pp=1,async_output=off;pp=2}" PROFILE_TIMEOUT=120 STEP_PHASES_ONLY=1 \
  bash scripts/gpu_profile.sh 2>&1 | grep -v -E "^    (kv_|update_states|send_output)" | grep -v "^logs in"

echo "cuda.shm files the served engines left in /dev/shm: $(( $(ls /dev/shm | grep -c '^cuda\.shm\.') - shm_before ))"

echo "== cProfile of a served step at c = 256 (wall clock, own time)"
rm -rf "$OUT/prof"
ASYNCPP_PROFILE_DIR="$OUT/prof" ASYNCPP_PROFILE_CLOCK=wall timeout 100 $PY -m asyncpp.bench.step_phases \
  --config configs/gpu-smollm2-shape.toml --runs "pp=1" --concurrency 256 --num-prompts 512 \
  --input-len 64 --output-len 128 > "$OUT/prof_run.txt" 2>&1
head -1 "$OUT/prof_run.txt"
for f in "$OUT"/prof/engine-*.prof "$OUT"/prof/stage0-*.prof; do
  [ -f "$f" ] || continue
  echo "-- $(basename "$f")"
  $PY -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(18)" "$f" 2>&1 \
    | grep -E "^ +[0-9]" | cut -c1-150
done

echo "== in-process engine at batch 256: kernel totals"
PROFILE_BATCH=256 timeout 100 $PY scripts/profile_step.py > "$OUT/profile_step_256.txt" 2>&1
head -1 "$OUT/profile_step_256.txt"
if [ "${PLAIN:-0}" = 1 ]; then
  echo "== plain decode loop (ms per step)"
  timeout 60 $PY scripts/plain_decode_loop.py > "$OUT/plain_loop.txt" 2>&1; tail -1 "$OUT/plain_loop.txt"
fi
