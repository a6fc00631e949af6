#!/usr/bin/env bash
# Serve the tiny random Llama over three stages on tcp://127.0.0.1:5558 (no download, starts in seconds).
exec python -m asyncpp.launch --config "$(dirname "$0")/../configs/tiny-pp3.toml" "$@"
