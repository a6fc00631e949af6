"""Read an asyncpp JSON-lines log into typed records; never raises on a bad line.

Several processes append to the same file, so lines from other programs,
garbage, blank lines and a JSON object cut short by a killed process are
expected: each is counted in `ParsedLog.skipped` (or `num_blank`) and the
next line is read. Fields beyond the ones used are ignored; `num_reqs`,
`num_tokens` and `handoff_us` default to 0, the engine gauges and
`after_step_id` to None.

Used events and required fields:
  stage_done       pp_rank, step_id, start_us, end_us
  step_dispatched  step_id, t_us
  step_completed   step_id, t_us
  step_failed      step_id (engine side; a stage's own step_failed is ignored)
  stage_lost       t_us, pp_ranks, cause (a stage restart begins)
  stage_recovered  t_us (the latest restart ends)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from asyncpp.trace.records import ParsedLog, StageRestart, StageSlice, StepCompleted, StepDispatched


class _BadField(Exception):
    pass


_MISSING: Any = object()


def parse_log(path: str | Path) -> ParsedLog:
    """Parse a log file line by line (undecodable bytes are replaced, not fatal)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_lines(f)


def parse_lines(lines: Iterable[str]) -> ParsedLog:
    log = ParsedLog()
    for line in lines:
        _parse_line(line, log)
    return log


def _parse_line(line: str, log: ParsedLog) -> None:
    text = line.strip()
    if not text:
        log.num_blank += 1
        return
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested garbage
        log.skipped["not_json"] += 1
        return
    if not isinstance(obj, dict):
        log.skipped["not_object"] += 1
        return
    event = obj.get("event")
    handler = _HANDLERS.get(event) if isinstance(event, str) else None
    if handler is None:
        log.num_other += 1
        return
    try:
        handler(obj, log)
    except _BadField:
        log.skipped["bad_fields"] += 1


def _stage_done(obj: dict[str, Any], log: ParsedLog) -> None:
    start_us, end_us = _int(obj, "start_us"), _int(obj, "end_us")
    if end_us < start_us:
        raise _BadField("end_us before start_us")
    log.slices.append(
        StageSlice(
            pp_rank=_int(obj, "pp_rank"),
            step_id=_int(obj, "step_id"),
            start_us=start_us,
            end_us=end_us,
            num_tokens=_int(obj, "num_tokens", 0),
            num_reqs=_int(obj, "num_reqs", 0),
            handoff_us=_float(obj, "handoff_us", 0.0),
        )
    )


def _step_dispatched(obj: dict[str, Any], log: ParsedLog) -> None:
    log.dispatched.append(
        StepDispatched(
            step_id=_int(obj, "step_id"),
            t_us=_int(obj, "t_us"),
            num_reqs=_int(obj, "num_reqs", 0),
            num_tokens=_int(obj, "num_tokens", 0),
            after_step_id=_int(obj, "after_step_id", None),
        )
    )


def _step_completed(obj: dict[str, Any], log: ParsedLog) -> None:
    log.completed.append(
        StepCompleted(
            step_id=_int(obj, "step_id"),
            t_us=_int(obj, "t_us"),
            num_reqs=_int(obj, "num_reqs", 0),
            num_tokens=_int(obj, "num_tokens", 0),
            duration_ms=_float(obj, "duration_ms", None),
            num_running=_int(obj, "num_running", None),
            num_waiting=_int(obj, "num_waiting", None),
            kv_usage=_float(obj, "kv_usage", None),
        )
    )


def _step_failed(obj: dict[str, Any], log: ParsedLog) -> None:
    if obj.get("role") == "stage":
        return  # the engine logs its own step_failed for the same step
    log.failed_step_ids.add(_int(obj, "step_id"))


def _stage_lost(obj: dict[str, Any], log: ParsedLog) -> None:
    ranks = obj.get("pp_ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise _BadField("pp_ranks")
    log.restarts.append(StageRestart(_int(obj, "t_us"), tuple(ranks), str(obj.get("cause", ""))))


def _stage_recovered(obj: dict[str, Any], log: ParsedLog) -> None:
    t_us = _int(obj, "t_us")
    if not log.restarts or log.restarts[-1].recovered_us is not None:
        raise _BadField("stage_recovered without stage_lost")
    log.restarts[-1] = dataclasses.replace(log.restarts[-1], recovered_us=t_us)


_HANDLERS: dict[str, Callable[[dict[str, Any], ParsedLog], None]] = {
    "stage_done": _stage_done,
    "step_dispatched": _step_dispatched,
    "step_completed": _step_completed,
    "step_failed": _step_failed,
    "stage_lost": _stage_lost,
    "stage_recovered": _stage_recovered,
}


def _float(obj: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    if obj.get(key) is None:  # absent, or logged as null (structlog writes None as null)
        return _default(key, default)
    return float(_number(obj[key], key))


def _int(obj: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    if obj.get(key) is None:
        return _default(key, default)
    value = _number(obj[key], key)
    if isinstance(value, float):
        if not value.is_integer():
            raise _BadField(key)  # an id or a µs timestamp with a fraction is not ours
        value = int(value)
    return value


def _number(value: Any, key: str) -> int | float:
    # bool is an int subclass; a logged True is not a number we want. NaN/inf come from json's extensions.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadField(key)
    return value


def _default(key: str, default: Any) -> Any:
    if default is _MISSING:
        raise _BadField(key)
    return default
