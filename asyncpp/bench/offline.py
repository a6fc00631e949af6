"""Offline throughput: the in-process `Engine` vs `transformers.generate`, same prompts, same run.

    python -m asyncpp.bench.offline [--num-prompts 64] [--output-len 64] [--threads 2]

Every request generates exactly `--output-len` tokens (ignore_eos / min_new_tokens),
greedy, bfloat16. transformers runs static batches (left padding) of each size in
`--hf-batch-sizes`; its best is the baseline. Prints output tok/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from asyncpp.bench.prompts import synthetic_prompts
from asyncpp.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, CacheConfig
from asyncpp.engine.engine import Engine
from asyncpp.sampling.params import SamplingParams
from asyncpp.weights.gguf_loader import default_gguf_path


def run_asyncpp(prompts: list[str], output_len: int, threads: int, dtype: str, max_num_seqs: int) -> float:
    config = EngineConfig(
        model=ModelConfig(source="gguf", dtype=dtype, max_model_len=1024),
        parallel=ParallelConfig(pp_size=1, num_threads=threads),
        cache=CacheConfig(kv_cache_memory_mb=512),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    num_tokens = sum(len(r.token_ids) for r in results)
    assert num_tokens == len(prompts) * output_len, num_tokens
    return num_tokens / elapsed


def run_transformers(prompts: list[str], output_len: int, threads: int, dtype: str, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    path = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).to(getattr(torch, dtype)).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        warm = tok(prompts[:2], return_tensors="pt", padding=True)
        model.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        num_tokens = 0
        for i in range(0, len(prompts), batch_size):
            batch = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
            out = model.generate(**batch, **kwargs)
            num_tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
        elapsed = time.perf_counter() - t0
    return num_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-words", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    prompts = synthetic_prompts(args.num_prompts, args.min_words, args.max_words, args.seed)

    figures: dict[str, float] = {}
    figures["asyncpp_tok_s"] = run_asyncpp(prompts, args.output_len, args.threads, args.dtype, args.max_num_seqs)
    print(f"asyncpp in-process engine: {figures['asyncpp_tok_s']:.1f} output tok/s", flush=True)
    for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
        figures[f"transformers_bs{bs}_tok_s"] = run_transformers(prompts, args.output_len, args.threads, args.dtype, bs)
        print(f"transformers static batch {bs}: {figures[f'transformers_bs{bs}_tok_s']:.1f} output tok/s", flush=True)
    best = max(v for k, v in figures.items() if k.startswith("transformers"))
    figures["ratio_vs_best_transformers"] = figures["asyncpp_tok_s"] / best
    print(f"ratio asyncpp / best transformers: {figures['ratio_vs_best_transformers']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "figures": figures}, f, indent=2)


if __name__ == "__main__":
    main()
