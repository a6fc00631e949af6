#!/usr/bin/env bash
# usage: scripts/dp_probe.sh [OUT_DIR]      (default OUT_DIR: bench_results/dp-probe-<date>)
#
# A probe of data parallelism on a CPU, not a deployment asyncpp has: the default deployment
# (configs/default.toml, two pipeline stages) against two one-stage engines ("dp2"), each bound with
# `taskset` to one of the first two CPUs this shell may use (its engine, HTTP front end and stage alike)
# and serving on its own HTTP port, every workload split in halves between them: two clients at half the
# concurrency and half the prompts each, at once (concurrency 1 goes to the first engine alone). vLLM is
# measured too when it answers on $VLLM_URL (start it with ../shared/peers/start-vllm.sh). Workloads as in
# scripts/cpu_vs_peers.sh (its seeds, its `load.py`): concurrency 1, 16 and 64 (64 random words in, 64
# tokens out) and "long" (1000 words in, 16 out, concurrency 4). Rounds are interleaved (ROUNDS=3).
# `python -m asyncpp.bench.dp_probe_table OUT_DIR` tables the JSON files (again later too), a split run
# counted as one. Without a router in front, this is what a data-parallel deployment could reach, less
# the router's own hop.
#
# env: PEERS (default ../shared/peers next to this checkout), PY=python, ROUNDS=3, VLLM_URL
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
OUT=${1:-$ROOT/bench_results/dp-probe-$(date +%Y%m%d-%H%M)}
PY=${PY:-python}
ROUNDS=${ROUNDS:-3}
VLLM_URL=${VLLM_URL:-http://127.0.0.1:8100}
mkdir -p "$OUT"
lscpu > "$OUT/cpu.txt"
read -r CPU_A CPU_B <<< "$("$PY" -c 'import os; print(*sorted(os.sched_getaffinity(0))[:2])')"
[ -n "${CPU_B:-}" ] || { echo "dp_probe: needs two CPUs" >&2; exit 1; }
cp "$ROOT/configs/default.toml" "$OUT/pp2.toml"  # its own path: stopping it by name stops nothing else
for half in a b; do  # one stage, its own client port
  port=$([ $half = a ] && echo 5561 || echo 5562)
  sed -e 's/^pp_size = 2/pp_size = 1/' -e "s/^port = 5557/port = $port/" "$ROOT/configs/default.toml" > "$OUT/dp2-$half.toml"
done

load() {  # load FILE URL CONC PROMPTS WORKLOAD ROUND SEED_OFFSET
  local words=64 tokens=64 base=$5
  if [ "$5" = long ]; then words=1000; tokens=16; base=7; fi
  local seed=$(( base + 1000 * ($6 - 1) + $7 ))
  "$PY" "$PEERS/load.py" --base-url "$2" --model auto --label "$(basename "$1" .json)" --quiet --num-prompts "$4" \
    --max-concurrency "$3" --input-words "$words" --max-tokens "$tokens" --seed "$seed" --json-out "$1" >/dev/null
}
shape() { case $1 in 1) echo "1 16";; 16) echo "16 64";; 64) echo "64 128";; long) echo "4 16";; esac; }  # concurrency, prompts
wait_health() {  # wait_health URL LOG
  for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "dp_probe: $1 not healthy after 300 s; see $2" >&2; exit 1
}
stop_launch() { pkill -INT -f "asyncpp.launch --config $1" || true; for _ in $(seq 1 30); do pgrep -f "asyncpp.launch --config $1" >/dev/null || break; sleep 1; done; }

for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  if curl -sf "$VLLM_URL/health" >/dev/null 2>&1; then
    for w in 1 16 64 long; do read -r c n <<< "$(shape $w)"; load "$OUT/vllm-c$w-r$r.json" "$VLLM_URL" "$c" "$n" "$w" "$r" 0; done
  fi
  (cd "$ROOT" && setsid "$PY" -m asyncpp.launch --config "$OUT/pp2.toml" --http-port 8300 >"$OUT/pp2-r$r.log" 2>&1 &)
  wait_health http://127.0.0.1:8300 "$OUT/pp2-r$r.log"
  for w in 1 16 64 long; do read -r c n <<< "$(shape $w)"; load "$OUT/pp2-c$w-r$r.json" http://127.0.0.1:8300 "$c" "$n" "$w" "$r" 0; done
  stop_launch "$OUT/pp2.toml"
  (cd "$ROOT" && setsid taskset -c "$CPU_A" "$PY" -m asyncpp.launch --config "$OUT/dp2-a.toml" --http-port 8301 >"$OUT/dp2-a-r$r.log" 2>&1 &)
  (cd "$ROOT" && setsid taskset -c "$CPU_B" "$PY" -m asyncpp.launch --config "$OUT/dp2-b.toml" --http-port 8302 >"$OUT/dp2-b-r$r.log" 2>&1 &)
  wait_health http://127.0.0.1:8301 "$OUT/dp2-a-r$r.log"
  wait_health http://127.0.0.1:8302 "$OUT/dp2-b-r$r.log"
  for w in 1 16 64 long; do
    read -r c n <<< "$(shape $w)"
    if [ "$c" = 1 ]; then load "$OUT/dp2a-c$w-r$r.json" http://127.0.0.1:8301 1 "$n" "$w" "$r" 0; continue; fi
    load "$OUT/dp2a-c$w-r$r.json" http://127.0.0.1:8301 $((c / 2)) $((n / 2)) "$w" "$r" 0 &
    first=$!
    load "$OUT/dp2b-c$w-r$r.json" http://127.0.0.1:8302 $((c / 2)) $((n / 2)) "$w" "$r" 500
    wait "$first"  # its status: a failed half stops the probe
  done
  stop_launch "$OUT/dp2-a.toml"; stop_launch "$OUT/dp2-b.toml"
done

"$PY" -m asyncpp.bench.dp_probe_table "$OUT"  # the tables (asyncpp/bench/dp_probe_table.py), also in OUT/table.md
