"""`StepPlan.num_threads` travels with the plan; a frame without it means the stage's own threads."""

from __future__ import annotations

import msgpack
import pytest

from asyncpp.core.plan import ScheduledRequest, StepPlan
from asyncpp.wire.codec import WireError, decode, encode

PLAN = StepPlan(step_id=7, scheduled=[ScheduledRequest("a", [-1], 3, [3], True)], after_step_id=6, num_threads=4)


def test_round_trip():
    assert decode(encode(PLAN)) == PLAN
    assert decode(encode(StepPlan(step_id=8, scheduled=[]))).num_threads == 0


def _frame(**changes) -> bytes:
    tag, fields = msgpack.unpackb(encode(PLAN), raw=False)
    fields.update(changes)
    return msgpack.packb([tag, {k: v for k, v in fields.items() if v is not None}], use_bin_type=True)


def test_missing_field_is_zero():
    assert decode(_frame(num_threads=None)).num_threads == 0


@pytest.mark.parametrize("value,kind", [("4", "str"), (True, "bool"), (2.0, "float")])
def test_wrong_type_is_rejected(value, kind):
    with pytest.raises(WireError, match=f"StepPlan.num_threads must be .*, got {kind}"):
        decode(_frame(num_threads=value))
