"""The speculative-decoding benchmark: the repetitive workload, its flag, and the spec section of a run."""

from __future__ import annotations

import re

import pytest

from asyncpp.bench import report, serve
from asyncpp.bench.datasets import (
    EDIT_WORDS,
    PASSAGE,
    REPEAT_TAIL_WORDS,
    WORDS_PER_EDIT,
    random_requests,
    repetitive_requests,
)
from asyncpp.bench.spec_report import spec_lines, spec_section
from tests.bench.test_kv_report import fake_run

PASSAGE_TEXT = " ".join(PASSAGE)


def row(name: str, value: str) -> str:
    """A line of a run's block: the name left in 40 columns, the value right in 20."""
    return f"{name:<40}{value:>20}"


def parts(prompt: str) -> tuple[list[str], list[str], list[str]]:
    passage, edited, tail = prompt.split("\n\n")
    return passage.split(), edited.split(), tail.split()


def is_cut_from_the_text(words: list[str]) -> bool:
    """A run of the built-in text's words, wrapping around its end."""
    n = len(PASSAGE)
    return any(all(PASSAGE[(start + j) % n] == w for j, w in enumerate(words)) for start in range(n))


def test_repetitive_prompts_are_seeded():
    requests = repetitive_requests(8, 60, 16, range_ratio=0.3, seed=5)
    assert requests == repetitive_requests(8, 60, 16, range_ratio=0.3, seed=5)
    assert [r.prompt for r in requests] != [r.prompt for r in repetitive_requests(8, 60, 16, range_ratio=0.3, seed=6)]


def test_repetitive_prompts_differ_between_requests():
    requests = repetitive_requests(40, 30, 8, seed=0)
    passages = [" ".join(parts(r.prompt)[0]) for r in requests]
    assert len(set(passages)) == 40  # different places in the text, not one passage with other edits


def test_prompt_is_the_passage_then_a_light_edit_of_it_then_its_opening():
    for r in repetitive_requests(10, 200, 8, seed=2):
        passage, edited, tail = parts(r.prompt)
        assert is_cut_from_the_text(passage) and len(passage) == 200
        assert len(edited) == len(passage) and tail == passage[:REPEAT_TAIL_WORDS]
        changed = [i for i, (a, b) in enumerate(zip(passage, edited)) if a != b]
        assert len(changed) == 200 // WORDS_PER_EDIT  # a light edit: a few words, not none, not many
        assert all(i >= REPEAT_TAIL_WORDS and edited[i] in EDIT_WORDS for i in changed)


def test_short_passage_still_gets_one_edit():
    (r,) = repetitive_requests(1, 5, 8, seed=1)
    passage, edited, tail = parts(r.prompt)
    assert len(passage) == 5 and tail == passage
    assert sum(a != b for a, b in zip(passage, edited)) == 1


@pytest.mark.parametrize("input_len", [40, 150, 2 * len(PASSAGE) + 7])  # longer than the text: it wraps
def test_passage_has_the_asked_length_and_outputs_match_the_random_workload(input_len):
    requests = repetitive_requests(12, input_len, 32, range_ratio=0.25, seed=3)
    lo, hi = round(input_len * 0.75), round(input_len * 1.25)
    lengths = [len(parts(r.prompt)[0]) for r in requests]
    assert all(lo <= n <= hi for n in lengths) and len(set(lengths)) > 1
    assert all(len(r.prompt.split()) == 2 * n + REPEAT_TAIL_WORDS for r, n in zip(requests, lengths))
    assert all(is_cut_from_the_text(parts(r.prompt)[0]) for r in requests)
    assert [r.output_len for r in requests] == [r.output_len for r in random_requests(12, 10, 32, 0.25, 3)]


def test_workload_flag_picks_the_prompts_and_random_stays_the_default():
    common = ["--num-prompts", "6", "--random-input-len", "50", "--random-output-len", "9", "--seed", "4"]
    assert serve.parse_args(common).workload == "random"
    requests, _ = serve.make_requests(serve.parse_args(common))
    assert requests == random_requests(6, 50, 9, 0.0, 4)
    requests, warmup = serve.make_requests(serve.parse_args([*common, "--workload", "repetitive"]))
    assert requests == repetitive_requests(6, 50, 9, 0.0, 4)
    assert all(PASSAGE_TEXT not in r.prompt and len(r.prompt.split()) == 2 * 50 + REPEAT_TAIL_WORDS for r in warmup)


@pytest.mark.parametrize("argv", [
    ["--workload", "copy"],
    ["--workload", "repetitive", "--dataset", "x.jsonl"],
    ["--workload", "repetitive", "--shared-prefix-len", "16"],
])
def test_bad_workload_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(argv)


# Engine stats before and after a window: totals since start, as `client.stats()` has them.
BEFORE = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 35, "spec_decode_num_accepted_tokens": 20,
          "spec_decode_num_accepted_tokens_per_pos": [9, 6, 4, 1]}
AFTER = {"spec_decode_num_drafts": 50, "spec_decode_num_draft_tokens": 195, "spec_decode_num_accepted_tokens": 120,
         "spec_decode_num_accepted_tokens_per_pos": [45, 36, 24, 15]}


def test_section_is_the_window_deltas_and_rates():
    spec = spec_section(BEFORE, AFTER, "ngram")
    assert spec["method"] == "ngram"
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (40, 160, 100)
    assert spec["num_accepted_tokens_per_pos"] == [36, 30, 20, 14]
    assert spec["acceptance_rate"] == pytest.approx(100 / 160)
    assert spec["mean_draft_len"] == pytest.approx(4.0)
    assert spec["mean_accepted_tokens_per_draft"] == pytest.approx(100 / 40)
    assert spec["acceptance_rate_per_pos"] == pytest.approx([0.9, 0.75, 0.5, 0.35])


def test_per_position_counts_absent_before_the_first_draft_count_from_zero():
    spec = spec_section({"spec_decode_num_accepted_tokens_per_pos": []}, AFTER, "ngram")
    assert spec["num_accepted_tokens_per_pos"] == [45, 36, 24, 15] and spec["num_drafts"] == 50


def test_method_on_but_nothing_drafted_is_a_section_without_rates():
    zero = {key: 0 for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                               "spec_decode_num_accepted_tokens")}
    spec = spec_section(zero, zero, "ngram")  # e.g. the adaptive policy never found drafting worth it
    assert spec["num_drafts"] == 0 and spec["num_accepted_tokens_per_pos"] == []
    assert spec["acceptance_rate"] is None and spec["mean_accepted_tokens_per_draft"] is None
    assert spec["mean_draft_len"] is None and spec["acceptance_rate_per_pos"] is None
    assert row("Acceptance rate (%):", "-") in spec_lines(spec)


def test_no_section_without_drafting():
    assert spec_section(AFTER, AFTER, "none") is None  # counters present (the engine always has them), unchanged
    assert spec_section(AFTER, AFTER) is None
    assert spec_section({}, {"num_running": 0}) is None  # an older engine: no such keys at all
    assert spec_section(BEFORE, AFTER) is not None  # the method unknown, but drafts happened


def test_report_shows_the_section_only_for_runs_that_draft():
    spec = spec_section(BEFORE, AFTER, "ngram")
    lines = spec_lines(spec)
    assert lines[0] == row("Spec method:", "ngram")
    assert row("Acceptance rate (%):", "62.50") in lines
    assert row("Mean accepted tokens per draft:", "2.50") in lines
    assert row("Accepted per position:", "36 / 30 / 20 / 14") in lines
    assert row("Acceptance rate per position:", "0.90 / 0.75 / 0.50 / 0.35") in lines
    block = report.run_block(fake_run("ngram", None, ttft_split=False) | {"spec_decode": spec})
    metrics_end = block.index("P99 E2EL (ms):")
    assert metrics_end < block.index("Speculative decoding (measured window)") < block.index("Pipeline stages")
    assert "\n".join(lines) in block
    plain = report.run_block(fake_run("none", None, ttft_split=False) | {"spec_decode": None})
    assert "Speculative" not in plain and "Spec method" not in plain
    runs = [fake_run("none", None, False) | {"spec_decode": None},
            fake_run("ngram", None, False) | {"spec_decode": spec}]
    table = report.summary_table({"runs": runs})
    spec_row = next(line for line in table.splitlines() if line.startswith("spec accept % / tok per draft"))
    assert re.split(r"\s{2,}", spec_row)[1:] == ["-", "62.5% / 2.50"]  # the run without drafting, the one with
    assert "spec accept" not in report.summary_table({"runs": runs[:1]})
