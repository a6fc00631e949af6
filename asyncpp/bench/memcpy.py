"""The floor for an activation hand-off: a plain `dst.copy_(src)` of the same bytes.

A non-last stage writes `hidden_states` and `residual`, each
[num_tokens, hidden_size] in the model dtype, into the next stage's slot.
`handoff_nbytes` is that size; `time_memcpy_us` times one contiguous copy of
it in this process (median and p99 of many single copies, after warm-up), so
the engine's hand-off figure can be read against it.
"""

from __future__ import annotations

import time

import torch

from asyncpp.bench.metrics import percentile
from asyncpp.model.intermediate import INTERMEDIATE_KEYS


def handoff_nbytes(hidden_size: int, num_tokens: int, dtype: str) -> int:
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return hidden_size * num_tokens * len(INTERMEDIATE_KEYS) * element_size


def time_memcpy_us(nbytes: int, num_threads: int = 1, repeats: int = 200) -> dict[str, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        for _ in range(10):
            dst.copy_(src)
        samples_us = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples_us.append((time.perf_counter() - t0) * 1e6)
    finally:
        torch.set_num_threads(previous)
    return {"nbytes": nbytes, "p50_us": percentile(samples_us, 50), "p99_us": percentile(samples_us, 99)}
