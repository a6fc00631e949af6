"""OpenAI's response shapes for one request: whole answers, stream chunks, usage, logprobs."""

from __future__ import annotations

import json
from typing import Any

from asyncpp.http.metrics import RequestTimes
from asyncpp.http.tool_calls import ToolCallStream, ToolRequest
from asyncpp.wire.client_msgs import RequestDelta


def token_string(raw: bytes) -> str:
    """A token's text; a token that is not UTF-8 on its own is `bytes:\\xNN...` (vLLM's spelling),
    so that distinct tokens never share a key in the top-logprobs maps."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Formatter:
    """OpenAI's response shapes for one request."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool, tokens: list[str], token_bytes: list[bytes],
                 tools: ToolRequest | None = None):  # fmt: skip
        self.request_id, self.created, self.model, self.chat = request_id, created, model, chat
        self.tokens, self.token_bytes = tokens, token_bytes
        self.tools = tools if chat else None
        self._tool_stream = ToolCallStream(tools) if self.tools is not None else None

    @staticmethod
    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) else ""

    def _logprobs(self, deltas: list[RequestDelta]) -> dict[str, Any] | None:
        pairs = [(t, lp) for d in deltas if d.logprobs is not None for t, lp in zip(d.token_ids, d.logprobs)]
        if not any(d.logprobs is not None for d in deltas):
            return None
        if self.chat:
            content = []
            for token_id, lp in pairs:
                top = [
                    {"token": self._token(i), "logprob": v, "bytes": list(self.token_bytes[i])}
                    for i, v in zip(lp.top_token_ids, lp.top_logprobs)
                ]
                content.append({"token": self._token(token_id), "logprob": lp.token_logprob,
                                "bytes": list(self.token_bytes[token_id]), "top_logprobs": top})  # fmt: skip
            return {"content": content}
        return {
            "tokens": [self._token(t) for t, _ in pairs],
            "token_logprobs": [lp.token_logprob for _, lp in pairs],
            "top_logprobs": [{self._token(i): v for i, v in zip(lp.top_token_ids, lp.top_logprobs)} for _, lp in pairs],
            "text_offset": [],
        }

    def chunk(self, delta: RequestDelta, is_first: bool = False) -> dict[str, Any]:
        finish = delta.finish_reason if delta.finished else None
        if self.chat:
            message = {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
            choice = {"index": 0, "delta": message, "logprobs": self._logprobs([delta]), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": self._logprobs([delta]), "finish_reason": finish}
        if delta.finished and delta.stop_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return {**self._base(chunk=True), "choices": [choice]}

    def chunks(self, delta: RequestDelta, is_first: bool = False) -> list[dict[str, Any]]:
        """The stream's chunks for one delta: one, or with tools as many as its `delta`s (tool calls
        come as their arguments are generated, or once the answer is whole)."""
        if self._tool_stream is None:
            return [self.chunk(delta, is_first)]
        stream = self._tool_stream
        messages = stream.deltas(delta.text, is_first, delta.finished)
        if delta.finished and not messages:
            messages = [{}]
        chunks = []
        for i, message in enumerate(messages):
            is_last = delta.finished and i == len(messages) - 1
            finish = _tool_finish(delta.finish_reason, stream.num_calls) if is_last else None
            choice = {"index": 0, "delta": message, "logprobs": self._logprobs([delta]) if i == 0 else None, "finish_reason": finish}
            if is_last and delta.stop_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            chunks.append({**self._base(chunk=True), "choices": [choice]})
        return chunks

    def usage(self, times: RequestTimes) -> dict[str, int]:
        return {
            "prompt_tokens": times.num_prompt_tokens,
            "completion_tokens": times.num_output_tokens,
            "total_tokens": times.num_prompt_tokens + times.num_output_tokens,
        }

    def usage_chunk(self, times: RequestTimes) -> dict[str, Any]:
        return {**self._base(chunk=True), "choices": [], "usage": self.usage(times)}

    def full(self, deltas: list[RequestDelta], times: RequestTimes) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        finish = last.finish_reason if last.finished else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                calls, content = self.tools.calls(text)
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                finish = _tool_finish(finish, len(calls))
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(deltas), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(deltas), "finish_reason": finish}
        if last.stop_reason is not None:
            choice["stop_reason"] = last.stop_reason
        return {**self._base(chunk=False), "choices": [choice], "usage": self.usage(times)}


def _tool_finish(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's: an answer that ended in tool calls finishes with "tool_calls"."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason
