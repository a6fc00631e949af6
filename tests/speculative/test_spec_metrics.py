"""Speculative decoding's counters on `/metrics`, under vLLM's names, from the engine's totals."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asyncpp.http.metrics import HttpMetrics

STATS = {
    "num_kv_blocks": 10,
    "num_free_kv_blocks": 10,
    "spec_decode_num_drafts": 3,
    "spec_decode_num_draft_tokens": 9,
    "spec_decode_num_accepted_tokens": 4,
    "spec_decode_num_accepted_tokens_per_pos": [3, 1, 0],
}


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_spec_decode_counters_follow_the_engine_totals():
    samples = _samples(HttpMetrics("m").render(STATS))
    model = (("model_name", "m"),)
    assert samples[("vllm:spec_decode_num_drafts_total", model)] == 3
    assert samples[("vllm:spec_decode_num_draft_tokens_total", model)] == 9
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", model)] == 4
    per_pos = {
        dict(labels)["position"]: v
        for (name, labels), v in samples.items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 3, "1": 1, "2": 0}


def test_no_spec_decode_counters_while_it_is_off():
    stats = {k: v for k, v in STATS.items() if not k.startswith("spec_decode")}
    names = {name for name, _ in _samples(HttpMetrics("m").render(stats))}
    assert not any(name.startswith("vllm:spec_decode") for name in names)
    names = {name for name, _ in _samples(HttpMetrics("m").render({**stats, "spec_decode_num_accepted_tokens_per_pos": []}))}
    assert not any(name.startswith("vllm:spec_decode") for name in names)
