"""Benchmark requests: synthetic random prompts or a JSON-lines file.

Random: input lengths (in words) and output lengths (in tokens) are drawn
uniformly from [len * (1 - ratio), len * (1 + ratio)], seeded, so two runs
with the same seed send the same requests. A dataset file has one JSON object
per line with "prompt" (text or chat messages) and optional "output_len".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncpp.bench.prompts import synthetic_prompts


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[dict[str, str]]
    output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))


def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    prompts = synthetic_prompts(num_prompts, in_lo, in_hi, seed)
    rng = random.Random(seed + 1)  # independent of the prompt words
    return [BenchRequest(p, rng.randint(out_lo, out_hi)) for p in prompts]


def load_dataset(path: str | Path, num_prompts: int, default_output_len: int) -> list[BenchRequest]:
    """The first `num_prompts` lines of a JSON-lines file (fewer if the file is shorter)."""
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' key")
            output_len = int(obj.get("output_len", default_output_len))
            if output_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be >= 1, got {output_len}")
            requests.append(BenchRequest(obj["prompt"], output_len))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests

