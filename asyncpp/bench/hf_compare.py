"""The reference point: the same prompts through `transformers` generate, static batches.

Same model file and device (the GGUF through `from_pretrained(dir, gguf_file=...)`, or the
HF directory), same dtype, greedy, left padding. A batch generates up to its
longest requested output; with `ignore_eos` it is forced to (min_new_tokens).
Only tokens a request asked for are counted: the rest of a static batch's
work is its overhead. Each batch size is timed on its own; the best is the
baseline asyncpp is compared with.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncpp.bench.datasets import BenchRequest


@dataclass(frozen=True)
class HfResult:
    batch_size: int
    num_threads: int
    duration_s: float
    num_requests: int
    total_output_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.total_output_tokens / self.duration_s

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "num_threads": self.num_threads,
            "duration_s": self.duration_s,
            "num_requests": self.num_requests,
            "total_output_tokens": self.total_output_tokens,
            "output_throughput": self.output_throughput,
            "request_throughput": self.request_throughput,
        }


def load_hf(source: str, path: str | None, dtype: str, device: str = "cpu") -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per weight file is noise in a benchmark log

    if source == "gguf":
        from asyncpp.weights.gguf_loader import default_gguf_path

        file = default_gguf_path() if not path else pathlib.Path(path)
        kwargs = {"gguf_file": file.name}
        directory = file.parent
    elif source == "hf":
        kwargs, directory = {}, pathlib.Path(path)
    else:
        raise ValueError(f"transformers cannot load model source {source!r}")
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).to(getattr(torch, dtype)).to(device).eval()
    return tokenizer, model


def run_batches(
    tokenizer: Any,
    model: Any,
    requests: Sequence[BenchRequest],
    batch_size: int,
    ignore_eos: bool = True,
) -> tuple[float, int]:
    """(seconds, requested output tokens produced) for all requests in static batches."""
    num_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        enc = tokenizer([_text(r.prompt, tokenizer) for r in batch], return_tensors="pt", padding=True).to(model.device)
        max_new = max(r.output_len for r in batch)
        kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        if ignore_eos:
            kwargs["min_new_tokens"] = max_new
        out = model.generate(**enc, **kwargs)
        generated = out[:, enc["input_ids"].shape[1] :]
        for row, r in zip(generated.tolist(), batch):
            num_tokens += min(r.output_len, _length_to_eos(row, tokenizer.eos_token_id, ignore_eos))
    return time.perf_counter() - t0, num_tokens


def compare(
    requests: Sequence[BenchRequest],
    batch_sizes: Sequence[int],
    *,
    source: str,
    path: str | None,
    dtype: str,
    num_threads: int,
    ignore_eos: bool = True,
    device: str = "cpu",
) -> list[HfResult]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        tokenizer, model = load_hf(source, path, dtype, device)
        results = []
        with torch.inference_mode():
            warm = [BenchRequest(r.prompt, 4) for r in requests[:2]]
            run_batches(tokenizer, model, warm, len(warm), ignore_eos)
            for bs in batch_sizes:
                duration_s, num_tokens = run_batches(tokenizer, model, requests, bs, ignore_eos)
                results.append(HfResult(bs, num_threads, duration_s, len(requests), num_tokens))
        return results
    finally:
        torch.set_num_threads(previous)


def _text(prompt: Any, tokenizer: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def _length_to_eos(row: list[int], eos_id: int | None, ignore_eos: bool) -> int:
    if ignore_eos or eos_id is None or eos_id not in row:
        return len(row)
    return row.index(eos_id) + 1
