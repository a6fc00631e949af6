"""The `kv_transfer_params` of prefill/decode disaggregation: made and signed by the producer,
checked by the consumer before it reads a single byte.

A producer request is asked for with `{"do_remote_decode": true}` and
`max_tokens` 1. Once its one token is sampled (and it did not stop there),
the producer hands out `RemotePrefill`: its engine id and request id, the ids
of every block of the prompt it holds for the pull (the last one partly
filled), how many tokens they cover (the whole prompt), a hash of those
tokens, the token it sampled (the client already has it: the consumer
continues after it), when it sampled it (wall clock, for the handover time)
and an HMAC over all of it with a key that only engines see
(`EngineHandshake.params_key`). The consumer refuses params whose engine it
does not know, whose signature does not match (forged block ids, counts,
tokens), whose blocks do not cover exactly its prompt, or whose tokens are not
its prompt's: a bad request fails alone with a clear error and the producer's
blocks are only ever read as handed out.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

DO_REMOTE_DECODE = "do_remote_decode"
_FIELDS = (
    "remote_engine_id", "remote_request_id", "remote_block_ids", "num_tokens", "tokens_sha256",
    "first_token_id", "first_token_at",
)  # fmt: skip


def tokens_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prompt's KV waits to be pulled."""

    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]  # ceil(num_tokens / block_size) blocks
    num_tokens: int  # the prompt's length: the producer computed all of it
    tokens_sha256: str  # of the prompt's token ids
    first_token_id: int  # sampled by the producer, already streamed to the client
    first_token_at: float  # when (time.time() on the producer)

    def signed(self, key: bytes) -> dict[str, Any]:
        params = {name: getattr(self, name) for name in _FIELDS}
        return {**params, "sig": _sign(params, key)}

    @staticmethod
    def parse(params: Any) -> "RemotePrefill":
        """Types and shape only (`TypeError` / `ValueError`); `check` verifies the rest."""
        if not isinstance(params, dict):
            raise TypeError(f"kv_transfer_params must be a map, got {type(params).__name__}")
        unknown = sorted(set(params) - {*_FIELDS, "sig"})
        missing = [name for name in (*_FIELDS, "sig") if name not in params]
        if unknown or missing:
            raise ValueError(f"kv_transfer_params: unknown keys {unknown}, missing keys {missing}")
        for name in ("remote_engine_id", "remote_request_id", "tokens_sha256", "sig"):
            if not isinstance(params[name], str) or not params[name]:
                raise TypeError(f"kv_transfer_params.{name} must be a non-empty string")
        num_tokens, block_ids = params["num_tokens"], params["remote_block_ids"]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise TypeError(f"kv_transfer_params.num_tokens must be an int >= 0, got {num_tokens!r}")
        if not isinstance(block_ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise TypeError("kv_transfer_params.remote_block_ids must be a list of ints")
        first_token_id, first_token_at = params["first_token_id"], params["first_token_at"]
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, int) or first_token_id < 0:
            raise TypeError(f"kv_transfer_params.first_token_id must be an int >= 0, got {first_token_id!r}")
        if isinstance(first_token_at, bool) or not isinstance(first_token_at, (int, float)):
            raise TypeError(f"kv_transfer_params.first_token_at must be a number, got {first_token_at!r}")
        return RemotePrefill(*(params[name] for name in _FIELDS))

    def check(self, sig: str, key: bytes, block_size: int, prompt_token_ids: list[int], num_remote_blocks: int) -> None:
        """Raise `ValueError` unless the producer made these params for this prompt."""
        if not hmac.compare_digest(sig, _sign({name: getattr(self, name) for name in _FIELDS}, key)):
            raise ValueError(
                f"kv_transfer_params are not signed by engine {self.remote_engine_id!r} (forged or altered)"
            )
        if len(self.remote_block_ids) != -(-self.num_tokens // block_size):
            raise ValueError(
                f"kv_transfer_params: {self.num_tokens} tokens in {len(self.remote_block_ids)} blocks of {block_size}"
            )
        if self.num_tokens != len(prompt_token_ids):
            raise ValueError(
                f"kv_transfer_params cover {self.num_tokens} tokens of a {len(prompt_token_ids)}-token prompt: "
                "they must cover the whole prompt"
            )
        if any(not 0 <= b < num_remote_blocks for b in self.remote_block_ids):
            raise ValueError(f"kv_transfer_params: block ids outside engine {self.remote_engine_id!r}'s cache")
        if tokens_digest(prompt_token_ids) != self.tokens_sha256:
            raise ValueError("kv_transfer_params were made for another prompt (its tokens differ)")


def _sign(params: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, json.dumps(params, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()
