"""`python -m asyncpp.launch` with a `[disagg]` config: two child engines and the router, launched.

The deployment runs on the tiny model with the `pd_stub` connector (`tests.disagg.stub_connector`:
the protocol without moving KV) so that it is tested whatever the state of the real connector;
`test_pd_connector_equals_one_engine` runs the real `pd` connector end to end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from asyncpp import launch
from asyncpp.bench.runs import to_toml
from asyncpp.client import AsyncClient, ClientRefusedError
from asyncpp.config import ConfigError
from asyncpp.engine.engine import Engine
from asyncpp.errors import EngineDeadError
from asyncpp.kernels import isa
from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.kv_transfer.registry import connector_classes
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.http.test_openai_server import metric_values
from tests.runtime.conftest import collect, collect_all, wait_until
from tests.runtime.harness import launched, pid_alive, tiny_sections

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
STUB = {"connector": "pd_stub", "module": "tests.disagg.stub_connector"}


def pd_sections(model_dir, kv_transfer: dict, prefill: dict | None = None, decode: dict | None = None, **sections) -> dict:
    base = tiny_sections(model_dir, 1, kv_transfer=kv_transfer, **sections)
    base["disagg"] = {
        "prefill": {"kv_transfer.engine_id": "prefill-0", **(prefill or {})},
        "decode": {"kv_transfer.engine_id": "decode-0", **(decode or {})},
    }
    return base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(320, 6)


@pytest.fixture(scope="module")
def one_engine(tiny_hf_dir, prompts):
    """Greedy token ids from one in-process engine: what the deployment must give."""
    return [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]


async def test_deployment_serves_like_one_engine_then_survives_a_dead_decode_engine(
    tmp_path, tiny_hf_dir, prompts, one_engine
):
    http_port = free_port()
    sections = pd_sections(tiny_hf_dir, STUB, server={"http_port": http_port, "served_model_name": "tiny"})
    with launched(tmp_path, sections) as pd:
        client = AsyncClient(pd.address)
        try:
            results, stats = await collect_all(pd.address, prompts, GREEDY)
            assert [r[0] for r in results] == one_engine
            assert stats["pd_num_handovers"] == stats["pd_num_finished"] == len(prompts)
            assert stats["prefill"]["num_kv_blocks"] > 0 and stats["decode"]["pid"] == stats["pid"]
            assert stats["prefill"]["pid"] != stats["decode"]["pid"] and not stats["is_dead"]
            assert await client.health()

            # The HTTP front end talks to the router: same answer, and /metrics reads the decode engine.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
                body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                reply = (await http.post("/v1/completions", json=body)).json()
                assert reply["usage"]["completion_tokens"] == 16
                assert (await http.get("/health")).status_code == 200
                metrics = (await http.get("/metrics")).text
                assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics, metrics
                # The transfer counters: the decode engine's connector totals, the router's handovers.
                assert 'asyncpp:kv_blocks_loaded_total{model_name="tiny"}' in metrics, metrics
                assert f'asyncpp:pd_handovers_total{{model_name="tiny"}} {len(prompts) + 1}.0' in metrics, metrics

            # A decode engine killed mid-request: the request fails at once, the router stays up.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = client.generate(prompts[1], long)
            await anext(aiter(stream))
            decode_pids = [stats["decode"]["pid"], *stats["decode"]["stage_pids"]]
            prefill_pids = [stats["prefill"]["pid"], *stats["prefill"]["stage_pids"]]
            t0 = time.monotonic()
            os.kill(decode_pids[0], signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="decode engine"):
                async for _ in stream:
                    pass
            assert time.monotonic() - t0 < 2.0
            assert not await client.health()
            with pytest.raises(EngineDeadError, match="decode engine .* is dead: its process exited"):
                await collect(client, prompts[0], GREEDY)
            assert pd.proc.poll() is None  # still serving
        finally:
            client.close()
        pd.proc.send_signal(signal.SIGTERM)
        assert pd.wait(timeout_s=30) == 1  # an engine died during the run
    wait_until(lambda: not any(pid_alive(p) for p in decode_pids + prefill_pids), 10, "every engine process gone")


async def test_a_deployment_with_a_client_secret_serves_its_own_clients_and_no_one_else(tmp_path, tiny_hf_dir, prompts):
    """The router and the HTTP front end the launcher starts present the secret and serve; a client
    without it is refused; one with it, straight at an engine, is served but never gets a KV handshake
    nor adds an engine (that needs the engine secret, which the launcher gave only to its own)."""
    http_port, secret = free_port(), "test-client-secret"
    server = {"http_port": http_port, "served_model_name": "tiny", "client_secret": secret}
    with launched(tmp_path, pd_sections(tiny_hf_dir, STUB, server=server)) as pd:
        client, stranger = AsyncClient(pd.address, secret=secret), AsyncClient(pd.address)
        direct: list[AsyncClient] = []
        try:
            async with asyncio.timeout(120):  # a call that never ends fails here, with its stack
                await _serves_its_own_only(pd, client, stranger, direct, prompts, secret, http_port)
        finally:
            for c in (client, stranger, *direct):
                c.close()


async def _serves_its_own_only(pd, client, stranger, direct, prompts, secret, http_port) -> None:
    """What a deployment with a client secret must do, each call bounded by the caller's timeout."""
    assert len([t async for d in client.generate(prompts[0], GREEDY) for t in d.token_ids]) == 16
    with pytest.raises(ClientRefusedError, match="refused this client's credentials"):
        await stranger.health(timeout_s=30)
    engines = (await client.stats())["pd_engines"]
    for role in ("prefill", "decode"):
        direct.append(AsyncClient(engines[role]["address"], secret=secret))
        assert await direct[-1].health()
        with pytest.raises(RuntimeError, match="KVHandshakeRequest needs the engine role"):
            await direct[-1].kv_handshake(timeout_s=30)
        with pytest.raises(RuntimeError, match="AddRemoteEngine needs the engine role"):
            await direct[-1].add_remote_engine(EngineHandshake("evil", 1), timeout_s=30)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
        body = {"model": "tiny", "prompt": prompts[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        assert (await http.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"] == 16
    # Still serving after all that: the refusals cost nobody else anything.
    assert len([t async for d in client.generate(prompts[2], GREEDY) for t in d.token_ids]) == 16


def test_a_bad_override_exits_2_naming_its_engine(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "pd.toml"
    config.write_text(to_toml(pd_sections(tiny_hf_dir, STUB, decode={"parallel.pp_sise": 2})))
    assert launch.main(["--config", str(config), "--log-level", "warning"]) == 2
    assert "error: disagg.decode: unknown config key parallel.pp_sise" in capsys.readouterr().err
    config.write_text(to_toml(pd_sections(tiny_hf_dir, STUB, prefill={"kv_transfer.kv_role": "consumer"})))
    assert launch.main(["--config", str(config)]) == 2
    assert "disagg.prefill: kv_transfer.kv_role must be 'producer'" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["server.port", "server.http_port"])
def test_a_taken_port_exits_2_naming_it_before_any_engine_starts(tmp_path, tiny_hf_dir, capsys, key):
    with socket.socket() as holder:  # another process's port, as far as the launcher can tell
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = {"port": port} if key == "server.port" else {"port": 0, "http_port": port}
        config = tmp_path / "pd.toml"
        config.write_text(to_toml(pd_sections(tiny_hf_dir, STUB, server=server)))
        t0 = time.monotonic()
        assert launch.main(["--config", str(config), "--log-level", "info"]) == 2
        took_s = time.monotonic() - t0
    err = capsys.readouterr().err
    assert f"error: {key} {port} on 127.0.0.1 is already in use" in err.splitlines(), err
    assert "engine_started" not in err and "Traceback" not in err, err
    assert took_s < 5.0  # no engine was started (one takes longer than this to be ready)


@pytest.mark.skipif(isa.cpu_info().supports("amx"), reason="this CPU has AMX")
def test_an_engine_that_fails_at_start_up_stops_the_launch(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "pd.toml"
    config.write_text(to_toml(pd_sections(tiny_hf_dir, STUB, decode={"model.cpu_isa": "amx"})))
    t0 = time.monotonic()
    assert launch.main(["--config", str(config), "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert "the decode engine exited with code 2 before it was ready" in err and "model.cpu_isa = 'amx'" in err
    assert time.monotonic() - t0 < 60


def _has_pd_connector() -> bool:
    try:
        connector_classes("pd")
        return True
    except (ConfigError, ImportError):
        return False


@pytest.fixture(scope="module", params=["early", "after_prefill"])
def pd_deployment(request, tmp_path_factory, tiny_hf_dir):
    """A deployment with the real `pd` connector and the HTTP server, one per handover, shared by the
    module's two `pd` tests (each counts its own requests); it must stop cleanly, with no traceback.
    Early: the decode engine has every request while the prefill engine computes it; after_prefill:
    once it is done."""
    http_port = free_port()
    sections = pd_sections(tiny_hf_dir, {"connector": "pd", "pull_timeout_s": 60.0},
                           server={"http_port": http_port, "served_model_name": "tiny"})  # fmt: skip
    sections["disagg"]["handover"] = request.param
    with launched(tmp_path_factory.mktemp(f"pd-{request.param}"), sections) as pd:
        pd.handover, pd.base_url = request.param, f"http://127.0.0.1:{http_port}"
        yield pd
        pd.proc.send_signal(signal.SIGTERM)
        assert pd.wait(timeout_s=30) == 0, "".join(pd.output[-40:])
    assert not any("Traceback" in line for line in pd.output), "".join(pd.output[-40:])


@pytest.mark.skipif(not _has_pd_connector(), reason="the 'pd' KV connector (asyncpp/kv_transfer/pd/) is not registered yet")
async def test_pd_connector_equals_one_engine(pd_deployment, prompts, one_engine):
    """The decode engine pulls each prompt's KV from the prefill engine: same greedy tokens."""
    client = AsyncClient(pd_deployment.address)
    try:
        before = await client.stats()
    finally:
        client.close()
    results, stats = await collect_all(pd_deployment.address, prompts, GREEDY)
    assert [r[0] for r in results] == one_engine

    decode, decode_before = stats["decode"], before["decode"]  # counts of this test's requests only
    early = len(prompts) if pd_deployment.handover == "early" else 0
    assert stats["pd_num_handovers"] - before["pd_num_handovers"] == len(prompts)
    assert decode["pd_num_early_handovers"] - decode_before["pd_num_early_handovers"] == early
    assert decode["kv_num_handovers"] - decode_before["kv_num_handovers"] == len(prompts)
    # KV came from the prefill engine
    assert decode["num_external_prefix_hit_tokens"] > decode_before["num_external_prefix_hit_tokens"]


@pytest.mark.skipif(not _has_pd_connector(), reason="the 'pd' KV connector (asyncpp/kv_transfer/pd/) is not registered yet")
async def test_a_stop_string_in_the_first_token_ends_the_request_as_on_one_engine(pd_deployment):
    """The prefill engine's token completes a stop string: a 200 with "" and finish_reason "stop",
    streamed or not, chat or completion; nothing fails, nothing stays held on either engine, and
    the next request is served."""
    client = AsyncClient(pd_deployment.address)
    try:
        async with asyncio.timeout(120), httpx.AsyncClient(base_url=pd_deployment.base_url, timeout=30) as http:
            await _stops_at_the_first_token(http, client, TEXTS)
    finally:
        client.close()


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, who are you?", "Once upon a time", "1, 2, 3,",
         "What is the capital of France?", "Tell me a story.", "abc", "Paris is"]  # fmt: skip


async def _stops_at_the_first_token(http: httpx.AsyncClient, client: AsyncClient, prompts: list[str]) -> None:
    greedy = {"model": "tiny", "temperature": 0}
    num_finished_before = (await client.stats())["pd_num_finished"]  # the deployment may have served others
    cases = []
    for prompt in prompts:  # the first token's text, for a completion and for a chat
        for path, key, body in (("/v1/completions", "text", {"prompt": prompt}),
                                ("/v1/chat/completions", "message", {"messages": [{"role": "user", "content": prompt}]})):  # fmt: skip
            reply = (await http.post(path, json={**greedy, **body, "max_tokens": 1})).json()["choices"][0]
            first = reply["text"] if key == "text" else reply["message"]["content"]
            if first.strip() and first.isascii():  # a whole character (the tiny tokenizer's tokens are bytes)
                cases.append((path, body, first.strip()))
    assert {path for path, _, _ in cases} == {"/v1/completions", "/v1/chat/completions"}, cases
    for path, body, stop in cases[:4]:
        reply = await http.post(path, json={**greedy, **body, "max_tokens": 30, "stop": [stop]})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert (text, choice["finish_reason"]) == ("", "stop"), reply.json()
        async with http.stream("POST", path, json={**greedy, **body, "max_tokens": 30, "stop": [stop], "stream": True}) as events:
            assert events.status_code == 200
            lines = [line async for line in events.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert lines[-1] == "data: [DONE]" and not any("error" in c for c in chunks), lines
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop", lines
    normal = await http.post("/v1/completions", json={**greedy, "prompt": prompts[0], "max_tokens": 16, "ignore_eos": True})
    assert normal.json()["usage"]["completion_tokens"] == 16
    stats = await client.stats()
    num_finished = stats["pd_num_finished"] - num_finished_before
    assert stats["pd_num_failed"] == 0 and num_finished == 2 * len(cases[:4]) + 2 * len(prompts) + 1

    def idle(s) -> bool:
        return all(e["num_running"] == e["num_waiting"] == e["num_held_for_transfer"] == e["kv_usage"] == 0
                   for e in (s["prefill"], s["decode"]))  # fmt: skip

    deadline = time.monotonic() + 10  # well under pull_timeout_s: nothing may wait for it
    while not idle(stats := await client.stats()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert idle(stats), stats
    metrics = metric_values((await http.get("/metrics")).text)
    assert metrics["vllm:num_requests_running"] == metrics["vllm:kv_cache_usage_perc"] == 0, metrics
