"""Stage handshakes (seed 004): aggregated by (pp_rank, tp_rank) and handed to the scheduler connector
once at start-up, in process and launched; a connector that is not PP-aware refuses pp_rank > 0 and
the engine does not start; the client protocol's kv_handshake / add_remote_engine reach the connector."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tests.kv_transfer.pd.connectors  # noqa: F401  (registers the test connectors)
from asyncpp.bench.runs import to_toml
from asyncpp.client import AsyncClient, ClientRefusedError
from asyncpp.engine.engine import Engine
from asyncpp.kv_transfer.base import ConnectorContext
from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata, aggregate_handshakes
from asyncpp.kv_transfer.multi import MultiScheduler
from asyncpp.sampling.params import SamplingParams
from asyncpp.worker.kv_connector import KVConnectorWrapper
from tests.conftest import tiny_config
from tests.kv_transfer.pd.connectors import PlainScheduler, PublishingWorker
from tests.runtime.harness import launched, tiny_sections

MODULE = "tests.kv_transfer.pd.connectors"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
RANGES = ((0, 1), (1, 4))


def md(pp_rank: int, tp_rank: int = 0, start: int = 0, end: int = 4) -> KVHandshakeMetadata:
    return KVHandshakeMetadata(pp_rank, tp_rank, start, end, 16, block_nbytes=1024, dtype="float32", num_blocks=8)


def ctx(name: str, children: tuple[ConnectorContext, ...] = (), layer_ranges=RANGES) -> ConnectorContext:
    return ConnectorContext(
        name=name, pp_size=len(layer_ranges), layer_ranges=layer_ranges, block_size=16, num_kv_heads=2,
        head_dim=8, dtype="float32", model_id="test", run_id="test", engine_id="engine-a", children=children,
    )  # fmt: skip


# ---- aggregation and the connector API --------------------------------------------------------
def test_aggregation_is_keyed_by_pp_rank_and_tp_rank():
    items = [(0, 0, md(0)), (0, 1, md(0, 1)), (1, 0, md(1)), (2, 0, None)]
    assert aggregate_handshakes(items) == {(0, 0): md(0), (0, 1): md(0, 1), (1, 0): md(1)}
    assert aggregate_handshakes([(0, 0, None), (1, 0, None)]) == {}
    assert aggregate_handshakes([]) == {}


def test_aggregation_refuses_a_rank_twice_and_metadata_of_another_rank():
    with pytest.raises(ValueError, match=r"two handshakes from \(pp_rank, tp_rank\) \(1, 0\)"):
        aggregate_handshakes([(0, 0, md(0)), (1, 0, md(1)), (1, 0, md(1))])
    with pytest.raises(ValueError, match=r"two handshakes"):  # also when one of them publishes nothing
        aggregate_handshakes([(1, 0, None), (1, 0, md(1))])
    with pytest.raises(ValueError, match=r"\(pp_rank, tp_rank\) \(1, 0\) published handshake metadata of \(0, 0\)"):
        aggregate_handshakes([(1, 0, md(0))])


def test_the_base_class_refuses_pp_rank_above_zero():
    plain = PlainScheduler(ctx("handshake-plain"))
    with pytest.raises(ValueError, match=r"not pipeline-parallel aware.*\[\(1, 0\)\]"):
        plain.set_xfer_handshake_metadata_pp_aware({(0, 0): md(0), (1, 0): md(1)})
    assert plain.tp_handshakes is None  # nothing was taken


def test_the_base_class_passes_pp_rank_zero_on_by_tp_rank():
    plain = PlainScheduler(ctx("handshake-plain", layer_ranges=((0, 4),)))
    plain.set_xfer_handshake_metadata_pp_aware({(0, 0): md(0), (0, 1): md(0, 1)})
    assert plain.tp_handshakes == {0: md(0), 1: md(0, 1)}
    plain.set_xfer_handshake_metadata_pp_aware({})
    assert plain.tp_handshakes == {}


def test_multi_forwards_the_handshakes_to_every_child():
    children = (ctx("handshake-recorder"), ctx("handshake-recorder"))
    multi = MultiScheduler(ctx("multi", children))
    handshakes = {(0, 0): md(0, end=1), (1, 0): md(1, start=1)}
    multi.set_xfer_handshake_metadata_pp_aware(handshakes)
    assert [child.handshakes for child in multi.children] == [handshakes, handshakes]
    # A child that is not PP-aware refuses the stages beyond the first: so does the multi connector.
    mixed = MultiScheduler(ctx("multi", (ctx("handshake-recorder"), ctx("handshake-plain"))))
    with pytest.raises(ValueError, match="not pipeline-parallel aware"):
        mixed.set_xfer_handshake_metadata_pp_aware(handshakes)
    single = MultiScheduler(ctx("multi", (ctx("handshake-recorder"), ctx("handshake-plain")), layer_ranges=((0, 4),)))
    single.set_xfer_handshake_metadata_pp_aware({(0, 0): md(0)})
    assert single.children[0].handshakes == {(0, 0): md(0)} and single.children[1].tp_handshakes == {0: md(0)}


def test_the_wrapper_publishes_only_after_the_caches_are_registered():
    assert KVConnectorWrapper().get_handshake_metadata() is None
    wrapper = KVConnectorWrapper(PublishingWorker(ctx("handshake-recorder"), 1))
    with pytest.raises(RuntimeError, match="before register_kv_caches"):
        wrapper.get_handshake_metadata()
    caches = [(torch.zeros(8 * 16, 2, 8), torch.zeros(8 * 16, 2, 8)) for _ in range(3)]
    wrapper.register_kv_caches(caches, start_layer=1)
    published = wrapper.get_handshake_metadata()
    assert (published.pp_rank, published.start_layer, published.end_layer) == (1, 1, 4)
    assert (published.block_nbytes, published.num_blocks) == (16 * 2 * 8 * 4, 8)
    assert published.region(3, "v").addr == caches[2][1].data_ptr()


# ---- in process --------------------------------------------------------------------------------
def in_process(tiny_hf_dir, connector: str, pp_size: int) -> Engine:
    kv = {"connector": connector, "module": MODULE, "engine_id": "engine-a"}
    parallel = {"pp_size": pp_size, "layer_split": (1, 3) if pp_size == 2 else ()}
    return Engine(tiny_config(tiny_hf_dir, parallel=parallel, kv_transfer=kv))


def test_in_process_every_stage_handshake_reaches_the_scheduler(tiny_hf_dir):
    engine = in_process(tiny_hf_dir, "handshake-recorder", 2)
    try:
        got = engine.kv_connector.handshakes
        assert sorted(got) == [(0, 0), (1, 0)]
        assert [(m.pp_rank, m.start_layer, m.end_layer) for m in got.values()] == [(0, 0, 1), (1, 1, 4)]
        for (pp_rank, _), m in got.items():
            runner = engine.executor.runners[pp_rank]
            assert m == runner.kv_connector.connector.get_handshake_metadata()
            assert (m.block_size, m.dtype, m.num_blocks) == (16, "float32", engine.capacity.num_blocks)
        handshake = engine.kv_connector.engine_handshake()
        assert (handshake.engine_id, handshake.pp_size) == ("engine-a", 2)
        assert len(engine.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids) == 4
    finally:
        engine.close()


def test_in_process_a_connector_that_is_not_pp_aware(tiny_hf_dir):
    engine = in_process(tiny_hf_dir, "handshake-plain", 1)
    try:
        assert list(engine.kv_connector.tp_handshakes) == [0]
        assert engine.kv_connector.tp_handshakes[0].end_layer == 4
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"kv_transfer.connector: KV connector PlainScheduler is not pipeline"):
        in_process(tiny_hf_dir, "handshake-plain", 2)


# ---- launched ----------------------------------------------------------------------------------
def remote(engine_id: str) -> EngineHandshake:
    return EngineHandshake(engine_id, 2, [md(0, end=3), md(1, start=3)])


ENGINE_SECRET, CLIENT_SECRET = "test-engine-secret", "test-client-secret"
SECRETS = {"engine_secret": ENGINE_SECRET, "client_secret": CLIENT_SECRET}


@pytest.fixture(scope="module")
def recorder_engine(tmp_path_factory, tiny_hf_dir):
    """A pp=2 engine (1 + 3 layers) with the handshake-recording connector and both secrets, for the
    module's two client-protocol tests (neither stops it; only the first adds a remote engine)."""
    kv = {"connector": "handshake-recorder", "module": MODULE, "engine_id": "prefill-a"}
    sections = tiny_sections(tiny_hf_dir, 2, (1, 3), kv_transfer=kv, server=SECRETS)
    with launched(tmp_path_factory.mktemp("recorder"), sections) as engine:
        yield engine
    assert engine.proc.returncode == 0, "".join(engine.output[-40:])


async def test_launched_stage_handshakes_and_the_client_protocol(recorder_engine):
    client = AsyncClient(recorder_engine.address, secret=ENGINE_SECRET, role="engine")
    try:
        stats = await client.stats()
        assert stats["handshake_keys"] == [[0, 0], [1, 0]]
        handshake = await client.kv_handshake()
        assert (handshake.engine_id, handshake.pp_size) == ("prefill-a", 2)
        assert [(s.pp_rank, s.start_layer, s.end_layer) for s in handshake.stages] == [(0, 0, 1), (1, 1, 4)]
        assert [s.agent_metadata for s in handshake.stages] == [b"agent of stage 0", b"agent of stage 1"]
        assert [len(s.regions) for s in handshake.stages] == [2, 6]
        assert all(s.num_blocks == stats["num_kv_blocks"] for s in handshake.stages)

        await client.add_remote_engine(remote("decode-b"))
        assert (await client.stats())["remote_engines"] == {"decode-b": [[0, 3], [3, 4]]}
        with pytest.raises(RuntimeError, match="refused remote engine 'decode-b': no thanks"):
            await client.add_remote_engine(remote("decode-b"))  # the connector keeps what it was told
        with pytest.raises(RuntimeError, match="refused remote engine 'refuse-c'"):
            await client.add_remote_engine(remote("refuse-c"))
        # The handshakes took nothing from the stages' outputs: steps complete as before.
        tokens = []
        async for delta in client.generate([5, 6, 7, 8], GREEDY):
            tokens += delta.token_ids
        assert len(tokens) == 4
    finally:
        client.close()


async def test_launched_only_the_engine_role_gets_handshakes_and_adds_engines(recorder_engine):
    """A client with the client secret is served, but never sees the handshake (its params key, its
    agents) nor adds an engine; a client without it, or claiming the engine role with it, is refused."""
    engine = recorder_engine
    client = AsyncClient(engine.address, secret=CLIENT_SECRET)
    strangers = [AsyncClient(engine.address), AsyncClient(engine.address, secret="guess"),
                 AsyncClient(engine.address, secret=CLIENT_SECRET, role="engine")]  # fmt: skip
    try:
        before = await client.stats()
        with pytest.raises(RuntimeError, match="engine refused the KV handshake: KVHandshakeRequest needs the engine role"):
            await client.kv_handshake(timeout_s=30)
        with pytest.raises(RuntimeError, match="refused remote engine 'decode-b': AddRemoteEngine needs the engine role"):
            await client.add_remote_engine(remote("decode-b"), timeout_s=30)
        stats = await client.stats()
        assert stats["remote_engines"] == before["remote_engines"]  # nothing was added
        assert "agent of stage" not in repr(stats)
        tokens = [t async for delta in client.generate([5, 6, 7, 8], GREEDY) for t in delta.token_ids]
        assert len(tokens) == 4
        for stranger in strangers:
            with pytest.raises(ClientRefusedError, match="refused this client's credentials"):
                await stranger.health(timeout_s=30)
            with pytest.raises(ClientRefusedError):
                async for _ in stranger.generate([5, 6], GREEDY):
                    pass
    finally:
        for c in (client, *strangers):
            c.close()
    # Logged before each refusal was sent (the log is line-buffered); the module's other test has none.
    events = [json.loads(line) for line in engine.log_file.read_text().splitlines()]
    refused = [e for e in events if e.get("event") == "engine_role_refused"]
    assert [(e["role"], e["message"]) for e in refused] == [("client", "KVHandshakeRequest"), ("client", "AddRemoteEngine")]


async def test_launched_without_a_connector_publishes_no_handshake(tmp_path, tiny_hf_dir):
    with launched(tmp_path, tiny_sections(tiny_hf_dir, 2, (2, 2), server={"engine_secret": ENGINE_SECRET})) as engine:
        client = AsyncClient(engine.address, secret=ENGINE_SECRET, role="engine")
        try:
            assert await client.kv_handshake() is None
            with pytest.raises(RuntimeError, match="no KV connector"):
                await client.add_remote_engine(remote("decode-b"))
        finally:
            client.close()


def test_launched_a_connector_that_is_not_pp_aware_fails_start_up(tmp_path, tiny_hf_dir):
    config = tmp_path / "plain.toml"
    kv = {"connector": "handshake-plain", "module": MODULE}
    config.write_text(to_toml(tiny_sections(tiny_hf_dir, 2, (2, 2), kv_transfer=kv)))
    command = [sys.executable, "-m", "asyncpp.launch", "--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)  # never hangs
    assert done.returncode == 2, done.stderr
    assert "error: kv_transfer.connector: KV connector PlainScheduler is not pipeline-parallel aware" in done.stderr
    assert "[(1, 0)]" in done.stderr and "asyncpp ready" not in done.stderr
