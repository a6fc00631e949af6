"""Deterministic synthetic prompts for benchmarks: N prompts of a word-count range."""

from __future__ import annotations

import random

_WORDS = (
    "the of and to in is was for on that with as by at from his her an were which are this be had not but "
    "river mountain garden kitchen window engine market silver winter summer story letter doctor teacher "
    "music paper forest ocean city village bridge station train coffee morning evening history science "
    "language computer network memory signal pattern number answer question reason simple quiet bright "
    "careful ancient modern gentle sudden distant golden hidden open narrow heavy light warm cold"
).split()


def synthetic_prompts(num_prompts: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n = rng.randint(min_words, max_words)
        prompts.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    return prompts
