"""Request ids are scoped per client on a launched engine (the session's shared pp=2 one; issue #53, case 5): two clients send
the same `request_id` at once and both get their whole greedy answer (the one each gets alone);
a request right after is served, and nothing is left held."""

from __future__ import annotations

import asyncio

from asyncpp.client import AsyncClient
from asyncpp.sampling.params import SamplingParams
from tests.runtime.conftest import is_idle, log_events, poll_until

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ([5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45])  # one per client: answers that differ


async def answer(stream) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    async for delta in stream:
        tokens += delta.token_ids
        text += delta.text
        reason = delta.finish_reason
    return tokens, text, reason


async def both_live_at_once(a: AsyncClient, b: AsyncClient, request_id: str) -> list[tuple[list[int], str, str | None]]:
    """Each client's request under `request_id`, both unfinished once each has its first delta."""
    streams = [c.generate(p, GREEDY, request_id=request_id) for c, p in zip((a, b), PROMPTS)]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    assert not any(d.finished for d in firsts), firsts  # both live at once
    rests = await asyncio.gather(*(answer(s) for s in streams))
    return [
        (first.token_ids + tokens, first.text + text, reason) for first, (tokens, text, reason) in zip(firsts, rests)
    ]


async def test_two_clients_with_one_request_id_both_get_their_own_answers(shared_pp2_engine):
    engine = shared_pp2_engine
    a, b = AsyncClient(engine.address), AsyncClient(engine.address)
    try:
        async with asyncio.timeout(120):
            alone = [await answer(c.generate(p, GREEDY)) for c, p in zip((a, b), PROMPTS)]
            assert alone[0][0] != alone[1][0] and all(len(t) == 24 for t, _, _ in alone)
            assert await both_live_at_once(a, b, "same") == alone
            assert await answer(a.generate(PROMPTS[0], GREEDY, request_id="same")) == alone[0]
            stats = await poll_until(a.stats, is_idle, timeout_s=10)
            assert stats["kv_usage"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    finally:
        a.close()
        b.close()
    # The second "same" ran under a derived engine id, and the engine's events for it name both
    # (the log is line-buffered: they were written before the answers came).
    derived = log_events(engine.log_file, client_request_id="same")
    assert "request_id_derived" in derived and "request_received" in derived, derived
