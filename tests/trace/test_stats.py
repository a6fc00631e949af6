"""Busy / bubble fractions: by hand on a tiny log, and against the simulation's ground truth."""

from __future__ import annotations

import json

import pytest

from asyncpp.trace import format_summary, parse_lines, pipeline_stats


def _slice(rank: int, step: int, start: int, end: int) -> str:
    return json.dumps({"event": "stage_done", "pp_rank": rank, "step_id": step, "start_us": start, "end_us": end})


def test_by_hand():
    # span 0..100; stage 0 busy 0..40 (two overlapping slices count once), stage 1 busy 50..100.
    log = parse_lines([_slice(0, 0, 0, 30), _slice(0, 1, 20, 40), _slice(1, 0, 50, 100)])
    stats = pipeline_stats(log)
    assert stats.span_us == 100
    assert [s.busy_us for s in stats.stages] == [40, 50]
    assert [s.bubble_fraction for s in stats.stages] == pytest.approx([0.6, 0.5])
    assert stats.mean_bubble_fraction == pytest.approx(0.55)


def test_matches_simulation(sim, parsed):
    stats = pipeline_stats(parsed)
    assert stats.span_us == sim.span_us
    for st in stats.stages:
        assert st.busy_us == sim.busy_us(st.pp_rank)
        assert st.bubble_fraction == pytest.approx(1 - sim.busy_us(st.pp_rank) / sim.span_us)
    # A pipeline with in-flight steps has bubbles, but is far from idle.
    assert 0.05 < stats.mean_bubble_fraction < 0.6


def test_summary_mentions_steps_bubbles_and_skips(sim, parsed):
    text = format_summary(parsed, pipeline_stats(parsed))
    assert f"{sim.num_steps} steps on {sim.pp_size} stages" in text
    assert "stage 2:" in text and "mean bubble fraction" in text
    assert f"{sim.skipped.total()} lines skipped" in text


def test_no_slices_gives_no_stats_and_a_hint():
    log = parse_lines([json.dumps({"event": "step_completed", "step_id": 0, "t_us": 10})])
    assert pipeline_stats(log) is None
    assert "no stage_done lines" in format_summary(log, None)


def test_repeated_step_ids_warn():
    log = parse_lines([_slice(0, 0, 0, 10), _slice(0, 0, 100, 110)])
    assert "repeat" in format_summary(log, pipeline_stats(log))
