"""Every wire message round-trips through msgpack; decode rejects anything else with a `WireError`."""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import pytest

from asyncpp.core.plan import NewRequestData, ScheduledRequest, StepPlan
from asyncpp.kv_transfer.metadata import BlockTransfer, KVConnectorMetadata, KVTransferStats
from asyncpp.sampling.params import SamplingParams
from asyncpp.transport.base import ActivationNotice, RingSpec
from asyncpp.wire.client_msgs import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RequestDelta,
    RequestDeltas,
    StatsReply,
    StatsRequest,
)
from asyncpp.wire.codec import WireError, decode, encode
from asyncpp.wire.stage_msgs import SampledTokens, Shutdown, StageOutput, StageReady, StageStart
from asyncpp.worker.shared_kv import SharedKVSpec
from asyncpp.worker.outputs import KVConnectorOutput, Logprobs, ModelRunnerOutput

PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.7,
    top_k=20,
    top_p=0.9,
    min_p=0.05,
    seed=1234,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    stop=("\n\n", "END"),
    stop_token_ids=(2, 17),
    ignore_eos=True,
    logprobs=3,
    include_stop_str_in_output=True,
)

RING = RingSpec("shm", "asyncpp-abc-ring1", ["hidden_states", "residual"], 3, 512, 64, "bfloat16")

PLAN = StepPlan(
    step_id=41,
    scheduled=[
        ScheduledRequest("a", [5, 6, 7], 0, [3, 9], True),
        ScheduledRequest("b", [11], 16, [1], False),
    ],
    new_requests=[
        NewRequestData("a", [5, 6, 7], [], PARAMS),
        NewRequestData("c", [8], [99, 100], SamplingParams()),
    ],
    finished_req_ids=["z", "y"],
)

MESSAGES = [
    PLAN,
    StepPlan(step_id=0, scheduled=[]),
    StageReady(1, 4242, 2, 4, 1024, RING, 0.25, 56_623_104),
    StageReady(0, 4241, 0, 2, 1000, None, 1.5, 0),
    StageStart(1000, RING),
    StageStart(1000, None),
    StageOutput(
        step_id=41,
        pp_rank=1,
        output=ModelRunnerOutput(
            req_ids=["a", "b"],
            sampled_token_ids=[[17], [3, 4]],
            logprobs=[[Logprobs(-0.25, [17, 3], [-0.25, -2.5])], None],
            kv_connector_output=KVConnectorOutput(frozenset({"a"}), frozenset({"b", "c"})),
        ),
        busy_s=0.012,
        handoff_us=35.5,
    ),
    StageOutput(7, 0, ModelRunnerOutput.with_kv_conn_output_only(None)),
    StageOutput(8, 0, error="stage 0: RuntimeError: boom"),
    Shutdown(),
    Shutdown("engine stopping"),
    SampledTokens(41, ["a", "b"], [17, 4]),
    StepPlan(step_id=42, scheduled=[ScheduledRequest("a", [-1], 3, [3], True)], after_step_id=41),
    SampledTokens(42),
    ActivationNotice(41, 2, 35, ["hidden_states", "residual"]),
    GenerateRequest("r1", "Hello there", {"max_tokens": 4, "stop": ["x"], "temperature": 0.0}),
    GenerateRequest("r2", [1, 5, 319]),
    GenerateRequest("r3", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    GenerateRequest("r4", "x", PARAMS.to_dict()),
    AbortRequest("r1"),
    HealthRequest(),
    HealthRequest(9),
    HealthReply(9, True),
    StatsRequest(3),
    StatsReply(3, {"num_running": 2, "kv_usage": 0.5, "stage_pids": [10, 11], "handoff_us_p50": [None]}),
    RequestDelta("r1", "Hi", [17, 18]),
    RequestDelta(
        "r1", "!", [19], True, "stop", "END", [Logprobs(-0.1, [19], [-0.1])], num_prompt_tokens=5, num_cached_tokens=4
    ),
    RequestDelta("r2", "", [], True, "stop", 2),
    RequestDeltas.of(
        [
            RequestDelta("r1", " there", [21], num_prompt_tokens=5),
            RequestDelta("r2", "!", [19], True, "stop", "END", [Logprobs(-0.1, [19, 4], [-0.1, -3.0])], 7, 3),
            RequestDelta("r3", "", [], True, "stop", 2),
        ]
    ),
    RequestDeltas.of([]),
    ErrorReply(None, "malformed frame", "bad_frame"),
    ErrorReply("r9", "temperature must be >= 0", "invalid_request", "sampling_params"),
    # KV connector metadata travels in the plan; every stage's report in its output.
    StepPlan(
        step_id=43,
        scheduled=[ScheduledRequest("a", [5], 3, [3, 9], True)],
        preempted_req_ids=["q"],
        kv_connector_metadata=KVConnectorMetadata(
            loads=[BlockTransfer("c", [4, 8], [b"\x01" * 32, b"\x02" * 32], [0, 5])],
            saves=[BlockTransfer("a", [3], [b"\x03" * 32], [7], connector_index=1)],
            send_holders={"z": [0, 1]},
        ),
    ),
    StepPlan(step_id=44, scheduled=[], kv_connector_metadata=KVConnectorMetadata()),
    StageOutput(
        9,
        2,
        ModelRunnerOutput.with_kv_conn_output_only(
            KVConnectorOutput(frozenset({"a"}), frozenset(), frozenset({3, 9}), KVTransferStats(1, 2, 100, 200, 0.5, 0.25))
        ),
    ),
    StepPlan(step_id=7, scheduled=[ScheduledRequest("a", [5], 3, [0], True)], layer_bounds=(20,)),
    StageStart(1000, RING, [SharedKVSpec("asyncpp-abc-kv0", 14, 8, 16 * 1000, 3, 64, "bfloat16")]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_is_equal(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert encode(back) == frame


def test_round_trip_keeps_container_types():
    back = decode(encode(PLAN))
    params = back.new_requests[0].sampling_params
    assert isinstance(params.stop, tuple) and isinstance(params.stop_token_ids, tuple)
    assert isinstance(back.scheduled[0].token_ids, list)
    out = decode(encode(MESSAGES[6])).output
    assert isinstance(out.kv_connector_output.finished_recving, frozenset)
    assert isinstance(out.logprobs[0][0], Logprobs)
    chat = decode(encode(GenerateRequest("r3", [{"role": "user", "content": "Hi"}]))).prompt
    assert chat == [{"role": "user", "content": "Hi"}]
    ids = decode(encode(GenerateRequest("r2", [1, 2]))).prompt
    assert ids == [1, 2] and all(type(t) is int for t in ids)


def test_request_deltas_are_columns_of_deltas():
    deltas = [
        RequestDelta("r1", "Hi", [17, 18], num_prompt_tokens=3),
        RequestDelta("r2", "!", [19], True, "stop", "END", [Logprobs(-0.1, [19], [-0.1])], 5, 4),
    ]
    batch = RequestDeltas.of(deltas)
    assert batch.request_ids == ["r1", "r2"] and batch.token_ids == [[17, 18], [19]]
    assert batch.deltas() == deltas
    assert decode(encode(batch)).deltas() == deltas
    with pytest.raises(ValueError, match="finished has 1 entries for 2 request ids"):
        dataclasses.replace(batch, finished=[True])


def test_sets_are_sent_sorted():
    # A set iterates in an order that depends on hashing (PYTHONHASHSEED) and insertion history:
    # sorted, equal messages always make equal frames.
    kv = KVConnectorOutput(frozenset({"zz", "b", "c", "a0"}), frozenset(f"r{i}" for i in range(20, 0, -1)))
    sent = fields_of(StageOutput(1, 1, ModelRunnerOutput(kv_connector_output=kv)))["output"]["kv_connector_output"]
    assert sent["finished_sending"] == ["a0", "b", "c", "zz"]
    assert sent["finished_recving"] == sorted(f"r{i}" for i in range(1, 21))


def test_int_where_float_is_declared_decodes_as_float():
    frame = msgpack.packb(["stage_output", {"step_id": 1, "pp_rank": 0, "busy_s": 2}])
    out = decode(frame)
    assert out.busy_s == 2.0 and type(out.busy_s) is float


def test_encode_refuses_unregistered_objects():
    with pytest.raises(TypeError, match="not a registered wire message"):
        encode({"step_id": 1})


def raw(tag, fields) -> bytes:
    return msgpack.packb([tag, fields], use_bin_type=True)


def fields_of(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)[1]


BAD_FRAMES = [
    (b"\xc1", "malformed frame"),  # 0xc1 is never used in msgpack
    (b"not msgpack at all \xff\xfe", "malformed frame"),
    (encode(AbortRequest("r1"))[:-3], "malformed frame"),  # truncated
    (encode(PLAN)[:-1], "malformed frame"),
    (b"", "malformed frame"),
    (encode(AbortRequest("r1")) + b"\x00", "malformed frame"),  # trailing bytes
    (msgpack.packb({"abort": {"request_id": "r"}}), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(["abort"]), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(["abort", {"request_id": "r"}, 1]), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(["abort", ["r"]]), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb([7, {"request_id": "r"}]), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb("abort"), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(None), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(["launch_missiles", {}]), "unknown message type 'launch_missiles'"),
    (msgpack.packb([b"abort", {"request_id": "r"}], use_bin_type=True), r"\[type_tag, \{fields\}\]"),
    (msgpack.packb(["abort", {1: "r"}]), "malformed frame"),  # non-string map keys are refused
]


@pytest.mark.parametrize("frame,words", BAD_FRAMES)
def test_bad_frames_are_rejected(frame, words):
    with pytest.raises(WireError, match=words):
        decode(frame)


def _with(msg, path: list, value):
    """The plain fields of `msg` with the item at `path` replaced (or added) by `value`."""
    plain = fields_of(msg)
    target = plain
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return raw(msg.WIRE_TAG, plain)


WRONG_TYPES = [
    (_with(AbortRequest("r"), ["request_id"], 5), "AbortRequest.request_id must be str, got int"),
    (_with(HealthRequest(), ["nonce"], "1"), "HealthRequest.nonce must be int, got str"),
    (_with(HealthRequest(), ["nonce"], True), "HealthRequest.nonce must be an integer, got bool"),
    (_with(HealthRequest(), ["nonce"], 1.5), "HealthRequest.nonce must be int, got float"),
    (_with(HealthReply(1, True), ["is_healthy"], 1), "HealthReply.is_healthy must be bool, got int"),
    (_with(StageOutput(1, 0), ["busy_s"], "fast"), "StageOutput.busy_s must be a number, got str"),
    (_with(MESSAGES[2], ["weight_nbytes"], 1.5), "StageReady.weight_nbytes must be int, got float"),
    (_with(StageOutput(1, 0), ["busy_s"], False), "StageOutput.busy_s must be a number, got bool"),
    (_with(PLAN, ["scheduled"], {"a": 1}), "StepPlan.scheduled must be a list, got dict"),
    (_with(PLAN, ["scheduled", 0], [1, 2]), r"StepPlan.scheduled\[0\] must be a map, got list"),
    (_with(PLAN, ["scheduled", 1, "token_ids", 0], "x"), r"StepPlan.scheduled\[1\].token_ids\[0\] must be int, got str"),
    (_with(PLAN, ["scheduled", 0, "do_sample"], None), r"StepPlan.scheduled\[0\].do_sample must be bool, got NoneType"),
    (
        _with(PLAN, ["new_requests", 0, "sampling_params", "temperature"], "hot"),
        r"StepPlan.new_requests\[0\].sampling_params.temperature must be a number, got str",
    ),
    (
        _with(PLAN, ["new_requests", 0, "sampling_params", "stop", 1], 3),
        r"StepPlan.new_requests\[0\].sampling_params.stop\[1\] must be str, got int",
    ),
    (
        _with(PLAN, ["new_requests", 0, "sampling_params", "seed"], "s"),
        r"StepPlan.new_requests\[0\].sampling_params.seed must be int, got str",
    ),
    (_with(MESSAGES[2], ["recv_ring", "keys"], "hidden_states"), "StageReady.recv_ring.keys must be a list, got str"),
    (
        _with(MESSAGES[6], ["output", "logprobs", 0, 0, "top_logprobs", 1], "x"),
        r"StageOutput.output.logprobs\[0\]\[0\].top_logprobs\[1\] must be a number, got str",
    ),
    (
        _with(MESSAGES[6], ["output", "kv_connector_output", "finished_sending"], [1]),
        r"StageOutput.output.kv_connector_output.finished_sending\[0\] must be str, got int",
    ),
    (_with(GenerateRequest("r", "x"), ["sampling_params"], [1]), "GenerateRequest.sampling_params must be a map"),
    (_with(GenerateRequest("r", "x"), ["prompt"], 42), "GenerateRequest.prompt: no type of"),
    (_with(GenerateRequest("r", "x"), ["prompt"], [1, "a"]), "GenerateRequest.prompt: no type of"),
    (_with(GenerateRequest("r", "x"), ["prompt"], [{"role": 1}]), "GenerateRequest.prompt: no type of"),
    (_with(StatsReply(1, {}), ["stats"], [1]), "StatsReply.stats must be a map, got list"),
    (_with(ErrorReply(None, "m"), ["field"], 3), "ErrorReply.field must be str, got int"),
    (_with(RequestDelta("r", "", []), ["stop_reason"], 1.5), "RequestDelta.stop_reason: no type of"),
    (
        _with(RequestDeltas.of([RequestDelta("r", "", [1]), RequestDelta("s", "", [2, 3])]), ["token_ids", 1, 1], "7"),
        r"RequestDeltas.token_ids\[1\]\[1\] must be int, got str",
    ),
    (_with(RequestDeltas.of([]), ["request_ids"], {"r": 1}), "RequestDeltas.request_ids must be a list, got dict"),
    (
        _with(RequestDeltas.of([RequestDelta("r", "", [1])]), ["stop_reasons", 0], 1.5),
        r"RequestDeltas.stop_reasons\[0\]: no type of",
    ),
    (
        _with(RequestDeltas.of([RequestDelta("r", "", [1])]), ["texts"], ["a", "b"]),
        "RequestDeltas: texts has 2 entries for 1 request ids",
    ),
    (_with(ActivationNotice(1, 0, 3, ["a"]), ["num_tokens"], b"3"), "ActivationNotice.num_tokens must be int, got bytes"),
]


@pytest.mark.parametrize("frame,words", WRONG_TYPES)
def test_wrong_field_types_name_the_field(frame, words):
    with pytest.raises(WireError, match=words):
        decode(frame)


def test_unknown_fields_are_rejected():
    with pytest.raises(WireError, match="AbortRequest: unknown field 'reason'"):
        decode(_with(AbortRequest("r"), ["reason"], "x"))
    with pytest.raises(WireError, match=r"StepPlan.scheduled\[0\]: unknown field 'extra'"):
        decode(_with(PLAN, ["scheduled", 0, "extra"], 1))
    with pytest.raises(WireError, match=r"StepPlan.new_requests\[0\].sampling_params: unknown field 'beam_width'"):
        decode(_with(PLAN, ["new_requests", 0, "sampling_params", "beam_width"], 4))


def test_binary_field_names_are_rejected_as_wire_errors():
    # A peer may send field names as msgpack bin; mixing them with str names must still be a WireError.
    for fields in ({b"request_id": "r"}, {"request_id": "r", b"request_id": "r"}, {b"a": 1, "b": 2}):
        with pytest.raises(WireError, match="AbortRequest: unknown field"):
            decode(msgpack.packb(["abort", fields], use_bin_type=True))


def test_missing_required_fields_are_rejected():
    with pytest.raises(WireError, match="AbortRequest: .*missing .*'request_id'"):
        decode(raw("abort", {}))
    with pytest.raises(WireError, match="StepPlan: .*missing .*'step_id'"):
        decode(raw("step_plan", {"scheduled": []}))
    plain = fields_of(PLAN)
    del plain["scheduled"][0]["block_ids"]
    with pytest.raises(WireError, match=r"StepPlan.scheduled\[0\]: .*missing .*'block_ids'"):
        decode(raw("step_plan", plain))
    # Fields with defaults may be left out.
    assert decode(raw("health", {})) == HealthRequest(0)
    assert decode(raw("step_plan", {"step_id": 3, "scheduled": []})) == StepPlan(3, [])


def test_frames_over_the_limit_are_rejected_before_decoding():
    frame = encode(GenerateRequest("r", "x" * 2000))
    assert decode(frame, max_bytes=len(frame)) == GenerateRequest("r", "x" * 2000)
    with pytest.raises(WireError, match=f"frame of {len(frame)} bytes is over the {len(frame) - 1}-byte limit"):
        decode(frame, max_bytes=len(frame) - 1)
    # The limit is checked on the size alone, so even garbage is refused for its size.
    with pytest.raises(WireError, match="over the 1024-byte limit"):
        decode(b"\xc1" * 4096, max_bytes=1024)


class _Boom:
    """Unpickling this would record that pickle ran (an arbitrary-code-execution vector)."""

    ran = []

    def __reduce__(self):
        return (_Boom.ran.append, ("unpickled",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_nothing_is_unpickled(protocol):
    payload = pickle.dumps(_Boom(), protocol=protocol)
    with pytest.raises(WireError):
        decode(payload)
    # A pickle smuggled inside a well-formed frame is just bytes where a str or list belongs.
    with pytest.raises(WireError, match="GenerateRequest.prompt"):
        decode(raw("generate", {"request_id": "r", "prompt": payload}))
    with pytest.raises(WireError, match="AbortRequest.request_id must be str, got bytes"):
        decode(raw("abort", {"request_id": payload}))
    # And where any value is allowed, it stays inert bytes.
    reply = decode(raw("stats_reply", {"nonce": 1, "stats": {"blob": payload}}))
    assert reply.stats["blob"] == payload
    assert _Boom.ran == []


def test_pickled_message_objects_are_rejected():
    with pytest.raises(WireError):
        decode(pickle.dumps(AbortRequest("r")))
    with pytest.raises(WireError):
        decode(pickle.dumps(["abort", {"request_id": "r"}]))
