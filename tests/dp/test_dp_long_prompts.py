"""A long-prompt replica (`parallel.long_prompt_pp_size`): which prompts go to it, its derived config, and
the router sending them there (fake replicas)."""

from __future__ import annotations

import tomllib

import pytest

from asyncpp.client import AsyncClient
from asyncpp.config import ConfigError, config_from_dict
from asyncpp.disagg.link import EngineLink
from asyncpp.dp.config import long_prompt_sections, replica_sections
from asyncpp.dp.deploy import replica_files
from asyncpp.dp.placement import LongPrompts, ReplicaLoads
from asyncpp.dp.router import DPRouter
from asyncpp.http.__main__ import max_in_flight
from asyncpp.toml_write import to_toml
from asyncpp.wire.queues import RouterQueue
from tests.disagg.conftest import until
from tests.disagg.fakes import decode_deltas
from tests.dp.conftest import DPSetup, serving
from tests.dp.test_dp_config import sections

LONG = LongPrompts(replica=2, min_tokens=100)  # replicas 0 and 1, the long-prompt one 2


@pytest.mark.parametrize("live,tokens,expected", [
    ([True, True, True], 99, [True, True, False]),  # short: the replicas
    ([True, True, True], 100, [False, False, True]),  # from min_tokens on: the long-prompt one
    ([True, True, True], 5000, [False, False, True]),
    ([False, True, True], 1, [False, True, False]),  # a dead replica is left out
    ([True, True, False], 100, [True, True, False]),  # the long-prompt one dead: the replicas
    ([False, False, True], 1, [False, False, True]),  # every replica dead: the long-prompt one
    ([False, False, False], 100, [False, False, False]),
])  # fmt: skip
def test_which_replicas_a_prompt_may_go_to(live, tokens, expected):
    assert LONG.eligible(live, tokens) == expected


def test_the_long_prompt_replica_may_sit_anywhere():
    first = LongPrompts(replica=0, min_tokens=10)
    assert first.eligible([True, True], 10) == [True, False] and first.eligible([True, True], 9) == [False, True]


def test_a_choice_among_the_eligible_follows_the_loads():
    loads = ReplicaLoads(3, 128)
    loads.queued(0, 50)
    assert loads.choose(LONG.eligible([True] * 3, 20), 20) == 1  # replica 1 is empty; 2 is not eligible
    assert loads.choose(LONG.eligible([True] * 3, 200), 200) == 2


def test_the_long_prompt_replica_is_the_deployment_with_its_stages():
    base = sections(parallel={"pp_size": 1, "dp_size": 2, "layer_split": [30], "max_steps_in_flight": 2,
                              "long_prompt_pp_size": 2, "long_prompt_tokens": 700})  # fmt: skip
    derived = long_prompt_sections(base, 2, "deployment-secret")
    assert derived["parallel"] == {"pp_size": 2, "dp_size": 1, "num_threads": 1, "layer_split": [],
                                   "max_steps_in_flight": 0, "long_prompt_tokens": 700}  # fmt: skip
    assert derived["server"] == {"port": 0, "http_port": 0, "grace_period_s": 2.0, "engine_secret": "deployment-secret"}
    assert base["parallel"]["long_prompt_pp_size"] == 2 and base["parallel"]["layer_split"] == [30]  # untouched
    config = config_from_dict(derived)
    assert config.parallel.pp_size == 2 and config.parallel.long_prompt_pp_size == 0
    # a replica of the same deployment: one engine, nothing beside it, its own split kept
    replica = replica_sections(base, 0, "s", share_cpus=False)["parallel"]
    assert "long_prompt_pp_size" not in replica and replica["layer_split"] == [30] and replica["pp_size"] == 1


def test_the_long_prompt_replica_has_a_dir_store_of_its_own_and_errors_name_it(tmp_path):
    kv = {"connector": "offload", "store": "dir", "store_path": str(tmp_path)}
    derived = long_prompt_sections(sections(kv_transfer=kv), 2, "s")
    assert derived["kv_transfer"]["store_path"] == str(tmp_path / "long-prompts")
    with pytest.raises(ConfigError, match=r"^long prompts: parallel.devices has 1 entries but parallel.pp_size is 3"):
        long_prompt_sections(sections(parallel={"pp_size": 1, "devices": ["cpu"]}), 3, "s")


def test_the_long_prompt_replica_comes_last_on_every_cpu(tmp_path):
    base = sections(parallel={"pp_size": 1, "dp_size": 2, "long_prompt_pp_size": 2})
    path = tmp_path / "deployment.toml"
    path.write_text(to_toml(base))
    paths, cpus = replica_files(config_from_dict(base), str(path), tmp_path, "s", [0, 1])
    assert [p.name for p in paths] == ["replica-0.toml", "replica-1.toml", "long-prompts.toml"]
    assert cpus == [(0,), (1,), None]
    assert config_from_dict(tomllib.loads(paths[2].read_text())).parallel.pp_size == 2
    plain = sections(parallel={"pp_size": 1, "dp_size": 2})
    path.write_text(to_toml(plain))
    assert len(replica_files(config_from_dict(plain), str(path), tmp_path, "s", [0, 1])[0]) == 2


@pytest.mark.parametrize("parallel,message", [
    ({"dp_size": 2, "long_prompt_pp_size": -1}, "parallel.long_prompt_pp_size must be >= 0, got -1"),
    ({"dp_size": 2, "long_prompt_tokens": 0}, "parallel.long_prompt_tokens must be >= 1, got 0"),
])  # fmt: skip
def test_bad_long_prompt_settings_are_refused(parallel, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(sections(parallel=parallel))


def test_one_engine_has_no_long_prompt_replica_beside_it():
    config = config_from_dict(sections(parallel={"dp_size": 1, "long_prompt_pp_size": 2}, scheduler={"max_num_seqs": 7},
                                       server={"max_queued_requests": 5}))  # fmt: skip
    assert max_in_flight(config) == 7 + 5


def test_the_http_front_end_takes_the_long_prompt_replicas_share_too():
    config = config_from_dict(sections(parallel={"dp_size": 2, "long_prompt_pp_size": 2},
                                       scheduler={"max_num_seqs": 7}, server={"max_queued_requests": 5}))  # fmt: skip
    assert max_in_flight(config) == 3 * 7 + 5


@pytest.fixture
async def dp_long():
    """Replicas 0 and 1 behind a router, replica 2 the long-prompt one (prompts of 100+ tokens)."""
    setup = await serving(3, LONG)
    try:
        yield setup
    finally:
        await setup.close()


async def collect(client: AsyncClient, prompt, request_id: str) -> list:
    return [delta async for delta in client.generate(prompt, {"max_tokens": 3}, request_id)]


async def test_long_prompts_go_to_the_long_prompt_replica_and_the_others_to_the_replicas(dp_long: DPSetup):
    client = dp_long.client()
    for n in range(4):
        assert await collect(client, list(range(99)), f"short{n}") == decode_deltas(f"short{n}")
    for n in range(3):
        assert await collect(client, list(range(100 + n)), f"long{n}") == decode_deltas(f"long{n}")
    assert await collect(client, "x" * 400, "text") == decode_deltas("text")  # 400 characters: about 100 tokens
    assert dp_long.router.num_routed == [2, 2, 4]
    assert [len(r.received[0].prompt) for r in dp_long.replicas] == [99, 99, 100]
    stats = await client.stats()
    assert stats["dp_size"] == 2 and stats["dp_long_prompts"] == {"replica": 2, "min_tokens": 100}
    assert len(stats["replicas"]) == 3 and stats["replicas"][2]["pid"] == 1002


async def test_without_the_long_prompt_replica_long_prompts_go_to_the_replicas_and_back(dp_long: DPSetup):
    dp_long.replicas[2].kill()
    await until(lambda: not dp_long.router.replicas[2].is_alive, 5.0, "the long-prompt replica found dead")
    client = dp_long.client()
    for n in range(2):
        assert await collect(client, list(range(500)), f"long{n}") == decode_deltas(f"long{n}")
    assert dp_long.router.num_routed == [1, 1, 0]
    for replica in dp_long.replicas[:2]:
        replica.kill()
    dp_long.replicas[2].start()
    await until(lambda: [link.is_alive for link in dp_long.router.replicas] == [False, False, True], 5.0, "swapped")
    assert await collect(client, [1, 2], "short") == decode_deltas("short")  # no replica: the long-prompt one
    assert dp_long.router.num_routed == [1, 1, 1]


def test_a_long_prompt_replica_outside_the_list_is_refused():
    queue = RouterQueue("tcp://127.0.0.1:0", 1 << 20)
    link = EngineLink("replica 0", "tcp://127.0.0.1:1", engine_secret="s", log_role="dp_router")
    try:
        with pytest.raises(ValueError, match="no replica 1 for the long prompts among 1"):
            DPRouter(queue, [link], 128, LongPrompts(1, 10))
    finally:
        link.close()
        queue.close()
