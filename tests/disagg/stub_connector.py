"""`pd_stub`: a stand-in for the `pd` connector in launched router tests, registered on import
(`kv_transfer.module = "tests.disagg.stub_connector"`). It moves no KV (the decode engine
computes every prompt) but speaks the protocol the router relies on:

* producer: takes exactly `{"do_remote_decode": true}`, publishes a handshake, and hands out
  `{"stub_engine_id", "stub_num_prompt_tokens", "stub_first_token_id"}` with the request's last
  delta when it ends at its length (the consumer goes on after that token);
* consumer: refuses params before a producer's handshake was added, from another engine, or
  for another prompt length: an end-to-end run proves the router exchanged the handshakes at
  start-up and passed the params on verbatim.
"""

from __future__ import annotations

from typing import Any

from asyncpp.kv_transfer.handshake import EngineHandshake
from asyncpp.kv_transfer.registry import register_connector
from tests.kv_transfer.connectors import RecordingScheduler, RecordingWorker

DO_REMOTE_DECODE = {"do_remote_decode": True}


class StubPDScheduler(RecordingScheduler):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.engine_id = ctx.engine_id or f"stub-{ctx.run_id}"
        self.remote_engine_ids: list[str] = []

    def validate_kv_transfer_params(self, params: dict[str, Any], prompt_token_ids: list[int]) -> None:
        if self.ctx.kv_role == "producer":
            if params != DO_REMOTE_DECODE:
                raise ValueError(f"a producer takes only {DO_REMOTE_DECODE}, got {params!r}")
            return
        if params.get("stub_engine_id") not in self.remote_engine_ids:
            raise ValueError(f"unknown producer {params.get('stub_engine_id')!r} (known: {self.remote_engine_ids})")
        if params.get("stub_num_prompt_tokens") != len(prompt_token_ids):
            raise ValueError(f"params for {params.get('stub_num_prompt_tokens')} prompt tokens, got {len(prompt_token_ids)}")

    def remote_output_token_ids(self, params: dict[str, Any]) -> list[int]:
        return [params["stub_first_token_id"]] if self.ctx.kv_role == "consumer" else []

    def engine_handshake(self) -> EngineHandshake | None:
        return EngineHandshake(self.engine_id, 0, []) if self.ctx.kv_role == "producer" else None

    def add_remote_engine(self, handshake: EngineHandshake) -> None:
        self.remote_engine_ids.append(handshake.engine_id)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        if request.kv_transfer_params == DO_REMOTE_DECODE and request.status.finish_reason == "length":
            return False, {
                "stub_engine_id": self.engine_id,
                "stub_num_prompt_tokens": len(request.prompt_token_ids),
                "stub_first_token_id": request.output_token_ids[0],
            }
        return False, None


register_connector("pd_stub", StubPDScheduler, RecordingWorker)
