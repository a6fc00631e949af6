"""What a benchmark run with `structured=json` adds to its report: the grammar's compile time.

Measured in the benchmark's own process on the run's tokenizer, with a fresh compiler: the llguidance
tokenizer built from the model's, then the first check of the bench's schema (the JSON schema
compiled into a grammar and a matcher), then the same schema again (the cache). The engine's own
counts (`grammar_num_compiled`, `grammar_num_cache_hits`) show the cache at work over the run.
"""

from __future__ import annotations

import time
from typing import Any

from asyncpp.sampling.structured import StructuredOutputs


def grammar_section(config, spec: dict[str, Any], stats_after: dict[str, Any]) -> dict[str, Any]:
    from asyncpp.structured.compiler import GrammarCompiler
    from asyncpp.tokenizer.loader import load_tokenizer
    from asyncpp.weights import read_arch

    arch = read_arch(config.model.source, config.model.path_or_none)
    tokenizer = load_tokenizer(config.model.source, config.model.path_or_none, arch.vocab_size)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, arch.vocab_size)
    t1 = time.perf_counter()
    structured = StructuredOutputs.from_dict(spec)
    compiler.check(structured)
    t2 = time.perf_counter()
    compiler.check(structured)
    t3 = time.perf_counter()
    return {
        "tokenizer_s": t1 - t0,
        "compile_first_s": t2 - t1,
        "compile_cached_s": t3 - t2,
        "engine_num_compiled": stats_after.get("grammar_num_compiled"),
        "engine_num_cache_hits": stats_after.get("grammar_num_cache_hits"),
    }
