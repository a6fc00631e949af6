#!/usr/bin/env bash
# usage: scripts/cpu_vs_peers.sh [OUT_DIR]      (default OUT_DIR: bench_results/peers-<date>)
#
# asyncpp against the servers its users would pick instead, on this machine, in one sitting:
# llama.cpp's llama-server (the GGUF's Q4_1 weights, 2 threads), vLLM CPU at float32 and at
# bfloat16, and asyncpp's default deployment (configs/default.toml: two one-stage replicas behind a
# router, one CPU each, and a two-stage engine on both CPUs for the long prompts) at the CPU's best
# ISA level ("asyncpp-auto"), again with model.cpu_isa = "avx2" ("asyncpp-avx2"), as one stage with two
# threads ("asyncpp-pp1": dp_size = 1, num_threads = 2), as one engine of two stages ("asyncpp-pp2":
# dp_size = 1, pp_size = 2, the default before 2026-11-30) and as the replicas alone ("asyncpp-dp2":
# long_prompt_pp_size = 0), each at concurrency 1, 16 and 64: 64 random words in, 64 tokens
# out, ignore_eos, greedy, a new set of prompts per concurrency (seed = concurrency: no run finds its
# prompts in a prefix cache the run before filled). Every server is driven over its OpenAI API by the same client
# ($PEERS/load.py, `vllm bench serve`'s metrics), so asyncpp's figures include its HTTP front end.
# Prints the tables (`python -m asyncpp.bench.peers_table OUT_DIR`, which reprints them from the JSON
# later): output tok/s and mean TPOT per server and concurrency, the long prompts' TTFT, and every
# target of issue #54 per round. Every run's JSON stays in OUT_DIR. Needs the peers installed once: $PEERS/setup.sh (about 20 min on 2 cores).
#
# env: PEERS (default ../shared/peers next to this checkout), PEERS_DIR (their installs),
#      PROMPTS_C1=16 PROMPTS_C16=64 PROMPTS_C64=128, SKIP="vllm-float32 ..." to leave servers out,
#      WORKLOADS="1 16 64 long": concurrencies, and "long": prefill-bound, 1000 random words in (~1,050
#      tokens), 16 out, concurrency 4, PROMPTS_LONG=16 prompts; its table gives mean and p99 TTFT,
#      ROUNDS=1: runs per server and concurrency, each with its own prompt set (seed = concurrency +
#      1000 x round); with more than one the table gives the median and the range (shared machines
#      move by 10-20% from one minute to the next).
# Rounds are interleaved: round r runs every server in turn (vLLM, llama.cpp, asyncpp's variants) on
# round r's prompts before round r + 1 starts, so a slow spell of the machine falls on all of them
# alike; every ratio (asyncpp-auto over the round's faster peer, one stage over asyncpp-auto) is
# taken within a round, then given as the median [range] and per round. vLLM compiles for minutes at every start, so its servers start once and stay
# up (idle, ~1% of a core) while the others run; llama.cpp and asyncpp start and stop within each
# round. A vLLM server already answering on its port (8100 bfloat16, 8101 float32) is used and left up.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
OUT=${1:-$ROOT/bench_results/peers-$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT"
declare -A PROMPTS=([1]=${PROMPTS_C1:-16} [16]=${PROMPTS_C16:-64} [64]=${PROMPTS_C64:-128})
SKIP=${SKIP:-}
PY=${PY:-python}
ROUNDS=${ROUNDS:-1}
WORKLOADS=${WORKLOADS:-"1 16 64 long"}

lscpu > "$OUT/cpu.txt"

load() {  # load NAME PORT WORKLOAD ROUND (WORKLOAD: a concurrency, or "long"): file NAME-cW.json (round 1) or NAME-cW-rR.json
  local r=$4 f="$OUT/$1-c$3.json" words=64 tokens=64 conc=$3 prompts seed; [ "$r" = 1 ] || f="$OUT/$1-c$3-r$r.json"
  if [ "$3" = long ]; then words=1000; tokens=16; conc=4; prompts=${PROMPTS_LONG:-16}; seed=$(( 7 + 1000 * (r - 1) ))
  else prompts=${PROMPTS[$3]}; seed=$(( $3 + 1000 * (r - 1) )); fi
  "$PY" "$PEERS/load.py" --base-url "http://127.0.0.1:$2" --model auto --label "$1" --quiet \
    --num-prompts "$prompts" --max-concurrency "$conc" --input-words "$words" --max-tokens "$tokens" \
    --seed "$seed" --json-out "$f" >/dev/null
  echo "  $1 c$3 round $r: $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(f\"{d['output_tok_s']:.1f} tok/s, TPOT {d['tpot_ms_mean']:.1f} ms, TTFT {d['ttft_ms_mean']:.0f} ms (p99 {d['ttft_ms_p99']:.0f})\")" "$f")"
}
skip() { [[ " $SKIP " == *" $1 "* ]]; }
# The start scripts' lines, shown on stderr, and the pid they name (`tee /dev/stderr` would reopen a
# redirected stderr and truncate the caller's log).
pid_of() { local out; out=$(cat); echo "$out" >&2; echo "$out" | sed -n 's/.*pid \([0-9]*\).*/\1/p' | head -1; }

declare -A VLLM_PORT=([float32]=8101 [bfloat16]=8100)
VLLM_PIDS=()
stop_vllm() { for pid in "${VLLM_PIDS[@]}"; do "$PEERS/stop.sh" "$pid" >/dev/null; done; }
trap stop_vllm EXIT
for dtype in float32 bfloat16; do  # one at a time: each compiles on both cores for minutes
  skip "vllm-$dtype" && continue
  if curl -sf "http://127.0.0.1:${VLLM_PORT[$dtype]}/health" >/dev/null 2>&1; then  # started by hand: kept
    echo "vllm-$dtype: reusing the server on port ${VLLM_PORT[$dtype]}"
    continue
  fi
  VLLM_PIDS+=("$(PORT=${VLLM_PORT[$dtype]} DTYPE=$dtype VLLM_CPU_OMP_THREADS_BIND=0-1 "$PEERS/start-vllm.sh" | pid_of)")
done

for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  for dtype in float32 bfloat16; do
    skip "vllm-$dtype" && continue
    for c in $WORKLOADS; do load "vllm-$dtype" "${VLLM_PORT[$dtype]}" "$c" "$r"; done
  done

  if ! skip llamacpp; then
    for c in $WORKLOADS; do
      np=16; ctx=4096; if [ "$c" = 64 ]; then np=64; ctx=16384; fi  # -c is split over the -np slots
      if [ "$c" = long ]; then np=4; ctx=8192; fi  # 2048 tokens a slot: the long prompts are ~1,050
      pid=$(NP=$np CTX=$ctx "$PEERS/start-llamacpp.sh" | pid_of)
      load llamacpp 8200 "$c" "$r"
      "$PEERS/stop.sh" "$pid" >/dev/null
    done
  fi

  for variant in auto avx2 pp1 pp2 dp2; do
    skip "asyncpp-$variant" && continue
    config="$OUT/asyncpp-$variant.toml"
    case $variant in
      avx2) sed 's/^cpu_isa = "auto"/cpu_isa = "avx2"/' "$ROOT/configs/default.toml" > "$config" ;;
      pp1) sed -e 's/^dp_size = 2 /dp_size = 1 /' -e 's/^num_threads = 1/num_threads = 2/' "$ROOT/configs/default.toml" > "$config" ;;
      pp2) sed -e 's/^dp_size = 2 /dp_size = 1 /' -e 's/^pp_size = 1 /pp_size = 2 /' "$ROOT/configs/default.toml" > "$config" ;;
      dp2) sed -e 's/^long_prompt_pp_size = 2 /long_prompt_pp_size = 0 /' "$ROOT/configs/default.toml" > "$config" ;;
      *) cp "$ROOT/configs/default.toml" "$config" ;;
    esac
    log="$OUT/asyncpp-$variant-r$r.log"
    (cd "$ROOT" && setsid "$PY" -m asyncpp.launch --config "$config" --http-port 8300 >"$log" 2>&1 &)
    for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8300/health >/dev/null 2>&1 && break; sleep 1; done
    grep -m1 "asyncpp ready" "$log" || true
    for c in $WORKLOADS; do load "asyncpp-$variant" 8300 "$c" "$r"; done
    pkill -INT -f "asyncpp.launch --config $config" || true
    for _ in $(seq 1 30); do pgrep -f "asyncpp.launch --config $config" >/dev/null || break; sleep 1; done
  done
done

"$PY" -m asyncpp.bench.peers_table "$OUT"  # the tables (asyncpp/bench/peers_table.py), also in OUT/table.md
