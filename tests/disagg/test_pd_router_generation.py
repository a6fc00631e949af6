"""The router against an engine whose stages were restarted (`asyncpp.runtime.recovery`): its KV
generation goes up, so both engines get the other's handshake again, before any params of the new
generation reach the decode engine."""

from __future__ import annotations

import dataclasses

from asyncpp.kv_transfer.handshake import EngineHandshake
from tests.disagg.conftest import PREFILL_HANDSHAKE, RouterSetup, until
from tests.disagg.fakes import client_deltas
from tests.disagg.test_pd_router_early import collect

RESTARTED = dataclasses.replace(PREFILL_HANDSHAKE, params_key=b"new key", generation=1)


async def test_a_new_generation_in_the_health_reply_renews_the_handshakes(pd_early: RouterSetup):
    pd = pd_early
    assert pd.decode.remote_engines == [PREFILL_HANDSHAKE] and pd.router.prefill.kv_generation == 0
    pd.prefill.handshake = None  # its stages are starting again: no handshake yet
    pd.prefill.kv_generation = 1
    await until(lambda: pd.prefill.num_handshake_requests > 2, 3.0, "asked again")
    assert pd.decode.remote_engines == [PREFILL_HANDSHAKE]  # nothing given while it has none
    assert pd.router.prefill.engine_id == "prefill-0" and pd.router.is_healthy  # still routed to
    pd.prefill.handshake = RESTARTED
    await until(lambda: pd.decode.remote_engines[-1] == RESTARTED, 5.0, "the new handshake given")
    assert pd.router.prefill.kv_generation == 1
    num_given = len(pd.decode.remote_engines)
    assert await collect(pd.client(), request_id="r") == client_deltas("r")
    assert len(pd.decode.remote_engines) == num_given  # the same generation: not again


async def test_params_of_a_generation_the_decode_engine_has_no_handshake_of_wait_for_it(pd_early: RouterSetup):
    """The health check has not seen the restart yet (it polls), the params have: exchange first."""
    pd = pd_early
    pd.prefill.handshake = RESTARTED
    params = {"x": 1, "generation": 1}
    pd.prefill.kv_transfer_params = pd.decode.expected_params = params
    assert await collect(pd.client(), request_id="r") == client_deltas("r")
    assert pd.decode.remote_engines == [PREFILL_HANDSHAKE, RESTARTED]
    [done] = pd.decode.prefills_done
    assert done.kv_transfer_params == params


async def test_a_decode_engine_restart_gives_the_prefill_engine_its_new_handshake(pd_early: RouterSetup):
    pd = pd_early
    renewed = EngineHandshake("decode-0", 1, [], generation=1)
    pd.decode.handshake, pd.decode.kv_generation = renewed, 1
    await until(lambda: pd.prefill.remote_engines[-1] == renewed, 3.0, "the decode engine's new handshake given")
    assert pd.router.decode.kv_generation == 1
