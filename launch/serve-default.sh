#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct (bfloat16, CPU, two pipeline stages) on tcp://127.0.0.1:5557.
exec python -m asyncpp.launch --config "$(dirname "$0")/../configs/default.toml" "$@"
