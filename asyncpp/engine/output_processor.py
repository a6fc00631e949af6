"""Turn token updates into streamed `RequestOutput` deltas: detokenize, find stop strings.

Token-level stops (EOS, stop token ids, max_tokens) are decided by the
scheduler; stop strings are found here, across token boundaries, and the
caller finishes those requests in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpp.core.request import Request
from asyncpp.engine.outputs import RequestOutput
from asyncpp.tokenizer.detokenizer import IncrementalDetokenizer
from asyncpp.worker.outputs import Logprobs


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}
        tokenizer.token_bytes_by_id()  # built now (~30 ms for a 49k vocabulary), not for the first request

    def add_request(self, request: Request) -> None:
        """Track a request; output tokens it starts with (a remote engine streamed them) are fed to its
        detokenizer but never emitted, so its deltas go on exactly where that engine stopped.
        `ValueError` (nothing tracked) if those tokens already complete one of its stop strings."""
        params = request.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        _prime(detok, request.output_token_ids)
        self._tracked[request.request_id] = _Tracked(request, detok)

    def add_remote_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens a remote engine streamed for a tracked request that awaited them: fed to its
        detokenizer, never emitted. `ValueError` if they end at a stop string (the request must
        then fail: it has streamed nothing of its own)."""
        _prime(self._tracked[request_id].detokenizer, token_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def process(
        self,
        request_id: str,
        new_token_ids: list[int],
        finish_reason: str | None,
        stop_reason: int | str | None,
        logprobs: list[Logprobs] | None = None,
    ) -> RequestOutput | None:
        """Delta for one request's new tokens; sets `stop_reason` to the stop string if one was hit.
        Several tokens (speculative decoding) end at the one that completes a stop string: the
        delta has no token, text or logprob past it."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        delta = None
        if new_token_ids:
            delta, num_taken = tracked.detokenizer.add_tokens_until_stop(new_token_ids)
            if num_taken < len(new_token_ids):
                new_token_ids = new_token_ids[:num_taken]
                logprobs = logprobs[:num_taken] if logprobs is not None else None
        text = delta.text if delta is not None else ""
        if delta is not None and delta.stop_string is not None:
            finish_reason, stop_reason = "stop", delta.stop_string
        elif finish_reason is not None and tracked.request.finished_kv_transfer_params is None:
            # Not handed to a remote engine to go on with (which holds back the same text).
            text += tracked.detokenizer.flush()
        if finish_reason is not None:
            del self._tracked[request_id]
        req = tracked.request
        return RequestOutput(
            request_id=request_id,
            text=text,
            token_ids=list(new_token_ids),
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            kv_transfer_params=req.finished_kv_transfer_params if finish_reason is not None else None,
        )

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        return RequestOutput(
            request_id=request_id,
            text="",
            token_ids=[],
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=tracked.request.num_prompt_tokens,
            error=error,
        )


def _prime(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> None:
    if token_ids and detokenizer.add_tokens(token_ids).stop_string is not None:
        raise ValueError("the remote engine's tokens already end at one of this request's stop strings")
