"""`python -m asyncpp.launch` with `parallel.dp_size = 2`: two child engines and the router, launched on the tiny model."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import httpx
import pytest

from asyncpp import launch
from asyncpp.bench.runs import to_toml
from asyncpp.client import AsyncClient
from asyncpp.engine.engine import Engine
from asyncpp.errors import EngineDeadError
from asyncpp.sampling.params import SamplingParams
from tests.conftest import tiny_config, tiny_prompts
from tests.http.test_openai_server import free_port
from tests.runtime.conftest import collect_all, wait_until
from tests.runtime.harness import launched, pid_alive, tiny_sections

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)


def dp_sections(model_dir, dp_size: int = 2, **sections) -> dict:
    base = tiny_sections(model_dir, 1, **sections)
    base["parallel"]["dp_size"] = dp_size
    return base


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(321, 6)


async def test_replicas_serve_like_one_engine_then_survive_a_dead_replica(tmp_path, tiny_hf_dir, prompts):
    engine = Engine(tiny_config(tiny_hf_dir))
    greedy = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    seeded = [r.token_ids for r in engine.generate(prompts, SEEDED)]
    http_port = free_port()
    with launched(tmp_path, dp_sections(tiny_hf_dir, server={"http_port": http_port, "served_model_name": "tiny"})) as dp:
        assert "data-parallel router: 2 replicas" in "".join(dp.output)
        client = AsyncClient(dp.address)
        try:
            # Every prompt at once, twice: both replicas serve some of them.
            results, stats = await collect_all(dp.address, prompts + prompts, GREEDY)
            assert [r[0] for r in results] == greedy + greedy
            assert 0 not in stats["dp_num_routed"] and stats["dp_num_finished"] == 12
            pids = [r["pid"] for r in stats["replicas"]]
            assert len(set(pids)) == 2 and stats["num_kv_blocks"] == sum(r["num_kv_blocks"] for r in stats["replicas"])
            # Each prompt twice at once, one prompt after another: the second copy goes to the replica
            # without a prompt queued, so every prompt runs on both (seeded sampling too).
            before = stats["dp_num_routed"]
            for prompt, expected in zip(prompts, seeded):
                results, stats = await collect_all(dp.address, [prompt, prompt], SEEDED)
                assert [r[0] for r in results] == [expected, expected]
                assert [b - a for a, b in zip(before, stats["dp_num_routed"])] == [1, 1]
                before = stats["dp_num_routed"]
            assert await client.health()

            # The HTTP front end talks to the router; /metrics sums the replicas.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
                body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                reply = (await http.post("/v1/completions", json=body)).json()
                assert reply["usage"]["completion_tokens"] == 16
                assert (await http.get("/health")).status_code == 200
                metrics = (await http.get("/metrics")).text
                assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics, metrics

            # A replica killed mid-request: its request fails at once, the other replica serves on.
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            streams = [client.generate(prompts[i], long) for i in (1, 2)]
            await anext(aiter(streams[0]))
            victim = (await client.stats())["dp_num_unfinished"].index(1)
            await anext(aiter(streams[1]))
            assert (await client.stats())["dp_num_unfinished"] == [1, 1]  # the other one got the second
            survivor = 1 - victim
            t0 = time.monotonic()
            os.kill(stats["replicas"][victim]["pid"], signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=rf"replica {victim} engine .* is dead: its process exited"):
                async for _ in streams[0]:
                    pass
            assert time.monotonic() - t0 < 2.0
            assert sum([len(d.token_ids) async for d in streams[1]]) == 199  # untouched, on the other replica
            assert not await client.health()
            before = (await client.stats())["dp_num_routed"]
            results, after = await collect_all(dp.address, prompts, GREEDY)  # all on the survivor now
            assert [r[0] for r in results] == greedy
            assert after["replicas"][victim] is None and after["dp_num_unfinished"] == [0, 0]
            assert after["dp_num_routed"][survivor] == before[survivor] + len(prompts)
            assert dp.proc.poll() is None
        finally:
            client.close()
        dp.proc.send_signal(signal.SIGTERM)
        assert dp.wait(timeout_s=30) == 1  # a replica died during the run
    survivors = [stats["replicas"][survivor]["pid"], *stats["replicas"][survivor]["stage_pids"],
                 *stats["replicas"][victim]["stage_pids"]]  # fmt: skip
    wait_until(lambda: not any(pid_alive(p) for p in survivors), 10, "every replica process gone")


async def test_long_prompts_run_on_the_long_prompt_replica_with_the_same_tokens(tmp_path, tiny_hf_dir, prompts):
    greedy = [r.token_ids for r in Engine(tiny_config(tiny_hf_dir)).generate(prompts, GREEDY)]
    parallel = {"dp_size": 2, "long_prompt_pp_size": 2, "long_prompt_tokens": 33}  # prompts of 33, 48, 61, 70 tokens
    with launched(tmp_path, dp_sections(tiny_hf_dir, parallel=parallel)) as dp:
        assert re.search(r"2 replicas, \S+, \S+; prompts of 33\+ tokens: 2 stages, tcp://", "".join(dp.output))
        results, stats = await collect_all(dp.address, prompts + prompts, GREEDY)
        assert [r[0] for r in results] == greedy + greedy
        is_long = [len(p) >= 33 for p in prompts]
        assert stats["dp_num_routed"][2] == 2 * sum(is_long) and sum(stats["dp_num_routed"][:2]) == 2 * is_long.count(False)
        assert stats["dp_long_prompts"] == {"replica": 2, "min_tokens": 33}
        assert [len(r["stage_pids"]) for r in stats["replicas"]] == [1, 1, 2]


def test_a_prefill_decode_role_exits_2(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "dp.toml"
    kv = {"connector": "pd_stub", "module": "tests.disagg.stub_connector", "kv_role": "consumer"}
    config.write_text(to_toml(dp_sections(tiny_hf_dir, kv_transfer=kv)))
    t0 = time.monotonic()
    assert launch.main(["--config", str(config), "--log-level", "warning"]) == 2
    assert "error: parallel.dp_size = 2 cannot take kv_transfer.kv_role 'consumer'" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5.0


def test_a_taken_port_exits_2_naming_it_before_any_replica_starts(tmp_path, tiny_hf_dir, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = tmp_path / "dp.toml"
        config.write_text(to_toml(dp_sections(tiny_hf_dir, server={"port": port})))
        assert launch.main(["--config", str(config), "--log-level", "info"]) == 2
    err = capsys.readouterr().err
    assert f"error: server.port {port} on 127.0.0.1 is already in use" in err.splitlines(), err
    assert "engine_started" not in err and "Traceback" not in err, err


def test_a_replica_that_fails_at_start_up_stops_the_launch(tmp_path, tiny_hf_dir, capsys):
    config = tmp_path / "dp.toml"
    config.write_text(to_toml(dp_sections(tiny_hf_dir, model={"path": str(tmp_path / "missing")})))
    assert launch.main(["--config", str(config), "--log-level", "warning"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: the replica [01] engine exited with code 1 before it was ready:\n.*missing", err, re.S), err
