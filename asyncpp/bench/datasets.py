"""Benchmark requests: synthetic random or repetitive prompts, or a JSON-lines file.

Random: input lengths (in words) and output lengths (in tokens) are drawn
uniformly from [len * (1 - ratio), len * (1 + ratio)], seeded, so two runs
with the same seed send the same requests. A dataset file has one JSON object
per line with "prompt" (text or chat messages) and optional "output_len".

Repetitive (for speculative decoding by prompt lookup): each prompt is a
passage of the drawn input length cut from a fixed English text at a seeded
offset (wrapping around), then the passage again with a few words replaced,
then its first `REPEAT_TAIL_WORDS` words once more, blank lines between. A
model continues by copying the passage, which n-gram drafting predicts. The
prompt is thus about twice the input length; output lengths as for random.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncpp.bench.prompts import synthetic_prompts

# Written for this benchmark: plain prose, no repeats of its own beyond common words.
_TEXT = """\
The lighthouse on the northern point had been automated for eleven years, but the keeper's cottage
below it was never left empty. Every spring a volunteer arrived with a suitcase of books and a list
of small repairs, and every autumn the same volunteer left with the books read and the list finished.
This year the volunteer was a retired surveyor named Ada, who had spent her working life measuring
roads that other people would build. She liked the cottage at once. The kitchen faced the harbour,
the stove drew well, and the only sound at night was the slow turn of the lamp above and the water
working at the rocks. On her first morning she walked the length of the point with a notebook,
writing down what needed attention: a loose gutter on the east wall, a gate that would not latch, a
path where the gravel had washed into the grass. By noon the list filled two pages. She made tea,
sat on the step and read it through twice, then put the pages in order of the weather they would
need. The gutter wanted a dry day and a steady ladder. The gate wanted only patience and a file.
The path wanted a wheelbarrow, which she found in the shed behind a stack of fishing nets that
nobody had used since the harbour closed. In the afternoon a boy from the village came up the hill
with the post and a loaf of bread from his mother. He asked whether the light still needed someone
to watch it, and Ada told him the truth: the light watched itself now, and she was there to watch
the house. He seemed disappointed, so she showed him the notebook, and he offered to help with the
path on Saturday if she would teach him how to read the old survey maps pinned in the hall. They
shook hands on it. That evening the wind came round to the west, the first rain arrived off the
sea, and Ada sat by the stove with a map of the coast spread over her knees, tracing the roads she
had measured forty years before and wondering which of them were still there.
"""
PASSAGE = _TEXT.split()
REPEAT_TAIL_WORDS = 8  # the passage's opening words, repeated at the end of the prompt
WORDS_PER_EDIT = 50  # one replaced word per this many passage words, at least one
EDIT_WORDS = ("red", "small", "quiet", "early", "second", "green", "narrow", "cold", "old", "bright")


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


def repetitive_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[BenchRequest]:
    """`num_prompts` prompts "{passage}\\n\\n{passage, lightly edited}\\n\\n{its first words}"."""
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    rng = random.Random(seed)
    out_rng = random.Random(seed + 1)  # output lengths drawn as the random workload draws them
    # Every offset once before any repeats, so requests start in different places.
    offsets = rng.sample(range(len(PASSAGE)), len(PASSAGE))
    requests = []
    for i in range(num_prompts):
        start, num_words = offsets[i % len(offsets)], rng.randint(in_lo, in_hi)
        passage = [PASSAGE[(start + j) % len(PASSAGE)] for j in range(num_words)]
        edited = lightly_edited(passage, rng)
        tail = passage[:REPEAT_TAIL_WORDS]
        prompt = "\n\n".join(" ".join(words) for words in (passage, edited, tail))
        requests.append(BenchRequest(prompt, out_rng.randint(out_lo, out_hi)))
    return requests


def lightly_edited(words: list[str], rng: random.Random) -> list[str]:
    """`words` with one word in `WORDS_PER_EDIT` replaced by another, never among the opening
    `REPEAT_TAIL_WORDS` (so both copies open like the prompt's tail) unless the passage is that short."""
    editable = range(REPEAT_TAIL_WORDS, len(words)) if len(words) > REPEAT_TAIL_WORDS else range(len(words))
    num_edits = min(len(editable), max(1, len(words) // WORDS_PER_EDIT))
    edited = list(words)
    for pos in rng.sample(editable, num_edits):
        edited[pos] = rng.choice([w for w in EDIT_WORDS if w != words[pos]])
    return edited


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

