"""What the bubbles waited on, and phase balance: by hand on tiny logs, and against the simulation."""

from __future__ import annotations

import json

import pytest

from asyncpp.trace import format_summary, parse_lines, phase_balance, pipeline_stats, stage_waits


def _slice(rank: int, step: int, start: int, end: int, tokens: int = 1, reqs: int = 1) -> str:
    return json.dumps(
        {
            "event": "stage_done", "pp_rank": rank, "step_id": step, "start_us": start, "end_us": end,
            "num_tokens": tokens, "num_reqs": reqs,
        }
    )  # fmt: skip


def _dispatch(step: int, t: int, after: int | None = None) -> str:
    return json.dumps({"event": "step_dispatched", "step_id": step, "t_us": t, "after_step_id": after})


def test_gaps_charged_to_the_input_ready_last():
    # Two cohorts (steps 0, 2 and 1, 3) through two stages, async scheduling.
    lines = [
        _dispatch(0, 0), _dispatch(1, 0), _dispatch(2, 12, after=0), _dispatch(3, 36, after=1),
        _slice(0, 0, 0, 10), _slice(0, 1, 10, 20),
        _slice(0, 2, 25, 35),  # free at 20; plan at 12, parent 0 done on stage 1 at 25: tokens, 5
        _slice(0, 3, 37, 47),  # free at 35; parent 1 done at 30, plan at 36: plan, 2
        _slice(1, 0, 10, 25), _slice(1, 1, 25, 30),
        _slice(1, 2, 35, 40),  # free at 30; stage 0 finished step 2 at 35: activations, 5
        _slice(1, 3, 47, 50),  # free at 40; stage 0 finished step 3 at 47: activations, 7
    ]  # fmt: skip
    waits = {w.pp_rank: w for w in stage_waits(parse_lines(lines))}
    assert waits[0].wait_us == {"plan": 2, "activations": 0, "tokens": 5, "stage": 0}
    assert waits[1].wait_us == {"plan": 0, "activations": 12, "tokens": 0, "stage": 0}
    assert waits[0].span_us == 47 and waits[0].fraction("tokens") == pytest.approx(5 / 47)


def test_a_gap_with_every_input_ready_is_the_stage_own_time():
    lines = [_dispatch(0, 0), _dispatch(1, 0, after=None), _slice(0, 0, 0, 10), _slice(0, 1, 13, 20)]
    (w,) = stage_waits(parse_lines(lines))
    assert w.wait_us == {"plan": 0, "activations": 0, "tokens": 0, "stage": 3}


def test_tokens_only_count_on_the_first_stage():
    # Stage 1's step 1 names a parent, but only the first stage waits for sampled tokens.
    lines = [
        _dispatch(0, 0), _dispatch(1, 0, after=0),
        _slice(0, 0, 0, 10), _slice(0, 1, 30, 40),  # waits for step 0 on stage 1 (ends 30): tokens, 20
        _slice(1, 0, 10, 30), _slice(1, 1, 40, 50),  # waits for stage 0's step 1 (ends 40): activations, 10
    ]  # fmt: skip
    waits = {w.pp_rank: w.wait_us for w in stage_waits(parse_lines(lines))}
    assert waits[0]["tokens"] == 20 and waits[1] == {"plan": 0, "activations": 10, "tokens": 0, "stage": 0}


def test_phase_balance_medians():
    lines = [
        # decode-only steps (tokens == reqs): last stage 1.2x, 1.1x, 1.0x the first
        _slice(0, 0, 0, 10, 4, 4), _slice(1, 0, 10, 22, 4, 4),
        _slice(0, 1, 0, 10, 4, 4), _slice(1, 1, 10, 21, 4, 4),
        _slice(0, 2, 0, 10, 4, 4), _slice(1, 2, 10, 20, 4, 4),
        # prompt-heavy (>= 2 tokens per request): 0.8x; a mixed step (6 tokens, 4 requests) is neither
        _slice(0, 3, 0, 20, 40, 4), _slice(1, 3, 20, 36, 40, 4),
        _slice(0, 4, 0, 10, 6, 4), _slice(1, 4, 10, 30, 6, 4),
    ]  # fmt: skip
    balance = phase_balance(parse_lines(lines))
    assert balance.decode_ratio == pytest.approx(1.1) and balance.num_decode == 3
    assert balance.prompt_ratio == pytest.approx(0.8) and balance.num_prompt == 1
    assert phase_balance(parse_lines([_slice(0, 0, 0, 10)])) is None  # one stage


def test_simulation_waits_add_up_to_the_bubbles(sim, parsed):
    # Slices of one stage never overlap in the simulation: its gaps are its span minus its busy time.
    for w in stage_waits(parsed):
        mine = [s for s in sim.slices if s.pp_rank == w.pp_rank]
        span = max(s.end_us for s in mine) - min(s.start_us for s in mine)
        assert w.span_us == span
        assert w.idle_us == span - sim.busy_us(w.pp_rank)
        assert w.wait_us["tokens"] == 0  # the simulation logs no after_step_id
        if w.pp_rank == 0:
            assert w.wait_us["activations"] == 0


def test_summary_names_the_causes(parsed):
    text = format_summary(parsed, pipeline_stats(parsed))
    assert "what the bubbles waited on" in text
    assert "stage 1 waited" in text and "last / first stage step time" in text
