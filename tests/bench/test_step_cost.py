"""The step-cost benchmark: its ceiling arithmetic and a run on the tiny random model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import asyncpp.bench.step_cost as step_cost
from asyncpp.bench.step_cost import StepCost, main, measure, pp2_ceiling
from asyncpp.config import load_config
from asyncpp.engine.engine import Engine

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-pp3.toml"


def test_pp2_ceiling_is_full_step_over_half_step():
    costs = {4: StepCost(4, 10.0), 8: StepCost(8, 15.0), 16: StepCost(16, 20.0)}
    assert pp2_ceiling(costs, 8) == 1.5  # twice the steps of half the size: 2 * 10 ms vs 15 ms per 8 tokens
    assert pp2_ceiling(costs, 16) == 20.0 / 15.0
    assert pp2_ceiling(costs, 4) is None  # no steps of 2
    assert costs[8].ms_per_token == 15.0 / 8


def test_step_cost_runs_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["--config", str(TINY_CONFIG), "--batch-sizes", "2,4", "--num-steps", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["step_ms"]) == {"2", "4"} and all(ms > 0 for ms in result["step_ms"].values())
    assert result["pp2_ceiling"]["2"] is None
    assert result["pp2_ceiling"]["4"] == result["step_ms"]["4"] / result["step_ms"]["2"]
    assert "pp=2 ceiling" in capsys.readouterr().out


def test_measure_times_full_batches_when_the_prompts_take_more_steps_than_are_timed():
    # A 16-token budget spreads 8 prompts over many more steps than the 2 timed ones: no request may
    # finish before the timed steps (the 512-request run used to lose some and crash), and every
    # timed step must decode the whole batch.
    config = load_config(TINY_CONFIG).replace(
        parallel={"pp_size": 1, "layer_split": ()}, scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 8}
    )
    engine = Engine(config)
    cost = measure(engine, 8, 2)
    assert cost.batch_size == 8 and cost.step_ms > 0
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.capacity.num_blocks  # the aborted requests' KV is freed


def test_split_counts_the_layer_stacks_kernels_only_while_asked(tmp_path, capsys):
    out = tmp_path / "split.json"
    argv = ["--config", str(TINY_CONFIG), "--batch-sizes", "2", "--num-steps", "3", "--split", "--prefill-tokens", "24"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for split in (result["decode_split_ms"]["2"], result["prefill_split_ms"]["24"]):
        assert set(split) == {"linears", "attention", "other", "outside"}
        assert all(split[k] > 0 for k in ("linears", "attention", "other")), split
    printed = capsys.readouterr().out
    assert "decode    2 requests: linears" in printed and "prompt   24 tokens:   linears" in printed


def test_layer_stack_timing_is_off_unless_set():
    config = load_config(TINY_CONFIG).replace(parallel={"pp_size": 1, "layer_split": ()})
    engine = Engine(config)
    stack = engine.executor.runners[0].model.stack
    assert stack is not None
    stack.take_times()
    measure(engine, 2, 2)
    assert set(stack.take_times().values()) == {0.0}  # nothing counted while off
    stack.set_timing(True)
    measure(engine, 2, 2)
    counted = stack.take_times()
    stack.set_timing(False)
    assert all(seconds > 0 for seconds in counted.values()), counted
    assert set(stack.take_times().values()) == {0.0}  # taking them starts the counts again


def test_prompt_words_set_the_decode_steps_prompts(monkeypatch):
    asked = []
    real = step_cost.synthetic_prompts

    def recording(num_prompts, min_words, max_words, seed):
        asked.append((num_prompts, min_words, max_words, seed))
        return real(num_prompts, min_words, max_words, seed)

    monkeypatch.setattr(step_cost, "synthetic_prompts", recording)
    argv = ["--config", str(TINY_CONFIG), "--batch-sizes", "2,3", "--num-steps", "2", "--min-words", "5", "--max-words", "7"]
    assert main(argv) == 0
    assert asked == [(2, 5, 7, 0), (2, 5, 7, 0), (3, 5, 7, 0)]  # the warm-up, then each batch size
    asked.clear()
    engine = Engine(load_config(TINY_CONFIG).replace(parallel={"pp_size": 1, "layer_split": ()}))
    measure(engine, 2, 1, seed=5)
    assert asked == [(2, 8, 16, 5)]  # measure's default: short prompts; its seed goes to them


@pytest.mark.parametrize("words", [("1", "1"), ("3", "3"), ("64", "128")])
def test_prompt_words_bounds_are_inclusive(words, monkeypatch):
    asked = []

    def recording(engine, batch_size, num_steps, split=False, prompt_words=None):
        asked.append(prompt_words)
        return StepCost(batch_size, 1.0)

    monkeypatch.setattr(step_cost, "measure", recording)
    monkeypatch.setattr(step_cost, "decode_engine", lambda *a: None)
    assert main(["--batch-sizes", "2", "--min-words", words[0], "--max-words", words[1]]) == 0
    assert asked == [(int(words[0]), int(words[1]))] * 2  # the warm-up and the batch size


def test_a_step_time_is_the_median_in_milliseconds():
    engine = Engine(load_config(TINY_CONFIG).replace(parallel={"pp_size": 1, "layer_split": ()}))
    t0 = time.perf_counter()
    cost = measure(engine, 2, 5)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert 0.01 < cost.step_ms <= elapsed_ms / 3  # of 5 timed steps, 3 took at least the median


@pytest.mark.parametrize(
    "low, high, message",
    [
        ("9", "3", "--min-words and --max-words need 1 <= min <= max, got 9 and 3"),
        ("0", "4", "--min-words and --max-words need 1 <= min <= max, got 0 and 4"),
        ("a", "4", "argument --min-words: invalid int value: 'a'"),
        ("2", "1.5", "argument --max-words: invalid int value: '1.5'"),
    ],
)
def test_prompt_words_must_be_min_max(low, high, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(TINY_CONFIG), "--batch-sizes", "2", "--min-words", low, "--max-words", high])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
