"""`PDScheduler` across a restart of its own stages (`forget_transfers`) or of a remote engine's
(a handshake of a new generation): params never outlive the stages that hold their blocks, and a
request whose pull may have happened computes its prompt instead of pulling again."""

from __future__ import annotations

import time

import pytest

from asyncpp.core.request import Request, RequestStatus
from asyncpp.kv_transfer.base import ConnectorContext, PlanInfo
from asyncpp.kv_transfer.metadata import BlockTransfer
from asyncpp.kv_transfer.pd.params import RemotePrefill, tokens_digest
from asyncpp.kv_transfer.pd.scheduler import PDScheduler
from asyncpp.sampling.params import SamplingParams
from tests.kv_transfer.pd.test_topology import stage

pytest.importorskip("nixl_cu12")
RANGES = ((0, 2), (2, 4))
PROMPT = list(range(1, 41))  # 3 blocks of 16, the last partly filled


def scheduler(role: str, engine_id: str) -> PDScheduler:
    ctx = ConnectorContext(
        name="pd", pp_size=2, layer_ranges=RANGES, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32",
        model_id="test", run_id="test", kv_role=role, engine_id=engine_id,
    )  # fmt: skip
    pd = PDScheduler(ctx)
    pd.set_xfer_handshake_metadata_pp_aware({(rank, 0): stage(rank, *RANGES[rank]) for rank in range(2)})
    return pd


def handed_out(producer: PDScheduler, request_id: str = "p1") -> dict:
    """The producer's params for PROMPT, as `request_finished` makes them."""
    request = Request(request_id, PROMPT, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    request.output_token_ids = [7]
    request.status = RequestStatus.FINISHED_LENGTH
    is_held, params = producer.request_finished(request, [3, 4, 5])
    assert is_held
    return params


def consumer_request(params: dict, request_id: str = "c1") -> Request:
    return Request(request_id, PROMPT, SamplingParams(max_tokens=8), kv_transfer_params=params, output_token_ids=[7])


def test_a_producer_restart_changes_its_generation_and_key_and_republishes_its_remotes():
    producer, consumer = scheduler("producer", "prefill"), scheduler("consumer", "decode")
    producer.add_remote_engine(consumer.engine_handshake())
    producer.build_connector_meta(PlanInfo(0, [], {}, {}))  # the remote engine went out with a plan
    before = producer.engine_handshake()
    params = handed_out(producer)
    assert before.generation == 0 and params["generation"] == 0
    producer._unsent_transfers.append(BlockTransfer("p9", [], [], remote_engine_id="decode", nonce="ab"))
    producer.forget_transfers()
    assert producer.engine_handshake() is None  # until the new stages publish theirs
    assert producer.has_unsent_metadata()
    meta = producer.build_connector_meta(PlanInfo(1, [], {}, {}))
    assert [h.engine_id for h in meta.remote_engines] == ["decode"] and meta.send_nonces == {}
    assert [t.request_id for t in meta.loads] == ["p9"]  # a release still goes
    producer.set_xfer_handshake_metadata_pp_aware({(rank, 0): stage(rank, *RANGES[rank]) for rank in range(2)})
    after = producer.engine_handshake()
    assert after.generation == 1 and after.params_key != before.params_key
    assert handed_out(producer, "p2")["generation"] == 1
    assert producer.stats()["pd_generation"] == 1
    producer.forget_transfers()
    assert producer.generation == 2


def test_a_consumer_refuses_params_of_another_generation_by_name():
    producer, consumer = scheduler("producer", "prefill"), scheduler("consumer", "decode")
    consumer.add_remote_engine(producer.engine_handshake())
    old = handed_out(producer)
    consumer.validate_kv_transfer_params(old, PROMPT)  # generation 0, as the consumer knows it
    producer.forget_transfers()
    producer.set_xfer_handshake_metadata_pp_aware({(rank, 0): stage(rank, *RANGES[rank]) for rank in range(2)})
    new = handed_out(producer, "p2")
    with pytest.raises(ValueError, match="generation 1 .* knows generation 0: .* its handshake is not here yet"):
        consumer.validate_kv_transfer_params(new, PROMPT)
    consumer.add_remote_engine(producer.engine_handshake())
    with pytest.raises(ValueError, match="generation 0 .* knows generation 1: .* the blocks are gone"):
        consumer.validate_kv_transfer_params(old, PROMPT)
    consumer.validate_kv_transfer_params(new, PROMPT)
    forged = {**RemotePrefill.parse(new).signed(producer.engine_handshake().params_key), "generation": 0}
    with pytest.raises(ValueError, match="generation 0"):
        consumer.validate_kv_transfer_params(forged, PROMPT)


def test_params_admitted_before_their_producer_restarted_are_computed_not_pulled():
    producer, consumer = scheduler("producer", "prefill"), scheduler("consumer", "decode")
    consumer.add_remote_engine(producer.engine_handshake())
    request, other = consumer_request(handed_out(producer)), consumer_request(handed_out(producer, "p2"), "c2")
    assert consumer.get_num_new_matched_tokens(request, 0) == (40, True)
    producer.forget_transfers()
    producer.set_xfer_handshake_metadata_pp_aware({(rank, 0): stage(rank, *RANGES[rank]) for rank in range(2)})
    consumer.add_remote_engine(producer.engine_handshake())
    assert consumer.get_num_new_matched_tokens(request, 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(request, 16) == (0, False)
    assert consumer.get_num_new_matched_tokens(other, 0) == (0, False)
    assert consumer.stats()["pd_num_computed_here"] == 2


@pytest.mark.parametrize("generation", ["1", True, -1, 1.5, None])
def test_a_generation_that_is_not_a_count_is_refused(generation):
    params = handed_out(scheduler("producer", "prefill"))
    with pytest.raises(TypeError, match="kv_transfer_params.generation must be an int >= 0"):
        RemotePrefill.parse({**params, "generation": generation})
    without = {k: v for k, v in params.items() if k != "generation"}
    with pytest.raises(ValueError, match=r"missing keys \['generation'\]"):
        RemotePrefill.parse(without)


def test_the_same_handshake_again_changes_nothing():
    producer, consumer = scheduler("producer", "prefill"), scheduler("consumer", "decode")
    consumer.add_remote_engine(producer.engine_handshake())
    consumer.build_connector_meta(PlanInfo(0, [], {}, {}))
    consumer.add_remote_engine(producer.engine_handshake())
    assert not consumer.has_unsent_metadata()  # its stages' agents, and the reads on them, stay


def test_a_consumer_restart_computes_bound_requests_and_releases_their_producer():
    producer, consumer = scheduler("producer", "prefill"), scheduler("consumer", "decode")
    consumer.add_remote_engine(producer.engine_handshake())
    params = handed_out(producer)
    bound, unbound = consumer_request(params), consumer_request(handed_out(producer, "p2"), "c2")
    assert consumer.get_num_new_matched_tokens(bound, 0) == (40, True)
    consumer.update_state_after_alloc(bound, [10, 11, 12], 40)
    meta = consumer.build_connector_meta(PlanInfo(0, [], {}, {}))
    assert [(t.request_id, t.block_ids) for t in meta.loads] == [("c1", [10, 11, 12])]
    consumer.update_state_after_alloc(unbound, [20, 21, 22], 40)  # bound in a plan that never went out
    consumer.forget_transfers()
    assert consumer.get_num_new_matched_tokens(bound, 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(unbound, 0) == (0, False)
    fresh = consumer_request(handed_out(producer, "p3"), "c3")
    assert consumer.get_num_new_matched_tokens(fresh, 0) == (40, True)  # not bound before: pulls
    meta = consumer.build_connector_meta(PlanInfo(1, [], {}, {}))
    assert [h.engine_id for h in meta.remote_engines] == ["prefill"]  # the new stages learn it again
    assert [(t.request_id, t.block_ids) for t in meta.loads] == [("c1", []), ("c2", [])]  # the unsent pull dropped
    release = meta.loads[0]
    assert (release.remote_engine_id, release.remote_request_id, release.nonce) == ("prefill", "p1", params["nonce"])
    assert consumer.stats()["pd_num_computed_here"] == 2
    assert consumer.engine_handshake() is None and consumer.generation == 1
    consumer.forget_transfers()  # a second restart: nothing bound since, and c1 and c2 still compute
    assert consumer.get_num_new_matched_tokens(bound, 0) == (0, False) and consumer.generation == 2
    assert consumer.stats()["pd_num_computed_here"] == 2  # counted once
    assert consumer.build_connector_meta(PlanInfo(2, [], {}, {})).loads == []
    assert tokens_digest(PROMPT) == params["tokens_sha256"] and time.time() < params["expires_at"]
