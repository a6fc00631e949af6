"""`TransferTopology`: remote stages stored per (engine_id, pp_rank), lookups by layer across splits
that do not line up, refused handshakes (gaps, overlaps, another geometry), re-registration."""

from __future__ import annotations

import pytest

from asyncpp.kv_transfer.handshake import EngineHandshake, KVHandshakeMetadata, KVRegion
from asyncpp.kv_transfer.pd.topology import EngineTransferInfo, TransferTopology

NUM_LAYERS = 30


def stage(pp_rank: int, start: int, end: int, block_size=16, dtype="float32", block_nbytes=4096) -> KVHandshakeMetadata:
    keys = [(layer, kind) for layer in range(start, end) for kind in "kv"]
    regions = [KVRegion(layer, kind, 1000 * layer + (kind == "v"), block_nbytes * 8) for layer, kind in keys]
    return KVHandshakeMetadata(
        pp_rank, 0, start, end, block_size, block_nbytes, dtype, num_blocks=8,
        agent_name=f"agent-{pp_rank}", agent_metadata=bytes([pp_rank]), regions=regions,
    )  # fmt: skip


def engine(engine_id: str, ranges: list[tuple[int, int]], **kw) -> EngineHandshake:
    return EngineHandshake(engine_id, len(ranges), [stage(i, s, e, **kw) for i, (s, e) in enumerate(ranges)])


def topology(**kw) -> TransferTopology:
    return TransferTopology("local", block_size=16, dtype="float32", num_layers=NUM_LAYERS, **kw)


def test_each_remote_stage_is_stored_under_its_own_pp_rank():
    topo = topology()
    infos = topo.register_remote_engine(engine("prefill", [(0, 17), (17, 30)]))
    assert [i.remote_pp_rank for i in infos] == [0, 1]
    assert topo.has_engine("prefill") and not topo.has_engine("other")
    assert topo.remote_pp_size("prefill") == 2
    first, second = topo.get_engine_info("prefill", 0), topo.get_engine_info("prefill", 1)
    assert (first.start_layer, first.end_layer, second.start_layer, second.end_layer) == (0, 17, 17, 30)
    assert second == EngineTransferInfo.of(engine("prefill", [(0, 17), (17, 30)]).stages[1], 2)
    assert (second.remote_pp_size, second.remote_block_size, second.remote_block_len) == (2, 16, 4096)
    assert second.dtype == "float32"
    assert (second.agent_name, second.agent_metadata, second.remote_num_blocks) == ("agent-1", b"\x01", 8)
    assert second.region(20, "v").addr == 20001 and len(second.regions) == 26
    with pytest.raises(KeyError, match="no 'k' cache for layer 3"):
        second.region(3, "k")
    with pytest.raises(KeyError, match="no stage 2"):
        topo.get_engine_info("prefill", 2)
    with pytest.raises(KeyError, match="unknown remote engine"):
        topo.remote_pp_size("other")
    assert topo.remote_layer_ranges("prefill") == [(0, 17), (17, 30)]


def test_splits_that_do_not_line_up():
    topo = topology()
    topo.register_remote_engine(engine("prefill", [(0, 17), (17, 30)]))
    local = [(0, 9), (9, 20), (20, 30)]
    assert topo.sources_for("prefill", *local[0]) == [(0, (0, 9))]
    assert topo.sources_for("prefill", *local[1]) == [(0, (9, 17)), (1, (17, 20))]
    assert topo.sources_for("prefill", *local[2]) == [(1, (20, 30))]
    assert topo.sources_for("prefill", 17, 17) == []
    assert topo.sources_for("prefill", 0, 30) == [(0, (0, 17)), (1, (17, 30))]
    # The producer's side: remote stage 0 [0, 17) is read by local stages 0 and 1, stage 1 [17, 30) by 1 and 2.
    assert TransferTopology.readers_of(local, 0, 17) == 2
    assert TransferTopology.readers_of(local, 17, 30) == 2
    assert TransferTopology.readers_of([(0, 30)], 17, 30) == 1
    assert TransferTopology.readers_of(local, 9, 20) == 1
    assert TransferTopology.readers_of(local, 8, 21) == 3


def test_engines_of_different_pp_sizes_side_by_side():
    topo = topology()
    topo.register_remote_engine(engine("a", [(0, 30)]))
    topo.register_remote_engine(engine("b", [(0, 5), (5, 12), (12, 25), (25, 30)]))
    assert topo.sources_for("a", 9, 20) == [(0, (9, 20))]
    assert topo.sources_for("b", 9, 20) == [(1, (9, 12)), (2, (12, 20))]
    described = topo.describe()
    assert described["local_engine_id"] == "local" and described["num_layers"] == NUM_LAYERS
    assert [s["layers"] for s in described["remote_engines"]["b"]] == [[0, 5], [5, 12], [12, 25], [25, 30]]
    assert described["remote_engines"]["a"] == [{"pp_rank": 0, "layers": [0, 30], "agent_name": "agent-0"}]


@pytest.mark.parametrize(
    "ranges,match",
    [
        ([(0, 10), (12, 30)], r"no stage serves layers \[10, 12\)"),
        ([(2, 30)], r"no stage serves layers \[0, 2\)"),
        ([(0, 17), (17, 29)], r"no stage serves layers \[29, 30\)"),
        ([(0, 17), (15, 30)], r"layers \[15, 17\) are served by two stages"),
        ([(0, 17), (17, 31)], "serve 31 layers, the model has 30"),
        ([(0, 0), (0, 30)], "serves no layers"),
    ],
)
def test_gaps_and_overlaps_are_refused(ranges, match):
    topo = topology()
    with pytest.raises(ValueError, match=match):
        topo.register_remote_engine(engine("prefill", ranges))
    assert not topo.has_engine("prefill")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"block_size": 32}, "block_size 32, this engine 16"),
        ({"dtype": "bfloat16"}, "KV dtype bfloat16, this engine float32"),
        ({"block_nbytes": 2048}, "2048 bytes per block and layer, this engine 4096"),
    ],
)
def test_another_geometry_is_refused(kw, match):
    topo = topology(block_len=4096)
    with pytest.raises(ValueError, match=match):
        topo.register_remote_engine(engine("prefill", [(0, 17), (17, 30)], **kw))
    assert not topo.has_engine("prefill")


def test_malformed_handshakes_are_refused():
    topo = topology()
    good = engine("prefill", [(0, 17), (17, 30)])
    with pytest.raises(ValueError, match="pp_size 3 but 2 stage handshakes"):
        topo.register_remote_engine(EngineHandshake("prefill", 3, good.stages))
    with pytest.raises(ValueError, match=r"stage 0's handshake is \(pp_rank, tp_rank\) \(1, 0\)"):
        topo.register_remote_engine(EngineHandshake("prefill", 2, good.stages[::-1]))
    mixed = EngineHandshake("prefill", 2, [good.stages[0], stage(1, 17, 30, block_nbytes=1024)])
    with pytest.raises(ValueError, match="disagree on bytes per block"):
        topo.register_remote_engine(mixed)
    with pytest.raises(ValueError, match="cannot be its own remote engine"):
        topo.register_remote_engine(engine("local", [(0, 30)]))
    assert topo.describe()["remote_engines"] == {}


def test_registering_again_replaces_the_engine():
    topo = topology()
    topo.register_remote_engine(engine("prefill", [(0, 17), (17, 30)]))
    topo.register_remote_engine(engine("prefill", [(0, 30)]))  # restarted with pp_size 1
    assert topo.remote_pp_size("prefill") == 1
    assert topo.sources_for("prefill", 9, 20) == [(0, (9, 20))]
    with pytest.raises(KeyError):
        topo.get_engine_info("prefill", 1)  # the old stage 1 is gone
    # A refused re-registration keeps what was registered.
    with pytest.raises(ValueError):
        topo.register_remote_engine(engine("prefill", [(0, 10)]))
    assert topo.remote_layer_ranges("prefill") == [(0, 30)]
    topo.remove_remote_engine("prefill")
    assert not topo.has_engine("prefill")
