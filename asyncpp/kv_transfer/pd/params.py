"""The `kv_transfer_params` of prefill/decode disaggregation: made and signed by the producer,
checked by the consumer before it reads a single byte.

A producer request is asked for with `{"do_remote_decode": true}` and
`max_tokens` 1. Once its one token is sampled (and it did not stop there),
the producer hands out `RemotePrefill`: its engine id and request id, the ids
of every block of the prompt it holds for the pull (the last one partly
filled), how many tokens they cover (the whole prompt), a hash of those
tokens, the token it sampled (the client already has it: the consumer
continues after it), when it sampled it (wall clock, for the handover time),
the consumer engine they are handed to, when they expire, a nonce, the
generation of the producer's stages that hold the blocks, and an
HMAC over all of it with a key that only engines see
(`EngineHandshake.params_key`). The consumer refuses params whose engine it
does not know, whose signature does not match (forged block ids, counts,
tokens), whose blocks do not cover exactly its prompt, whose tokens are not
its prompt's, that were handed to another engine, that expired, or whose
nonce it accepted before: a bad request fails alone with a clear error and
the producer's blocks are only ever read as handed out, once.

A producer whose stages were restarted (`asyncpp.runtime.recovery`) lost
every block it held: its generation goes up and its params key changes, so
that no engine reads the new stages' memory under params handed out before.
The consumer refuses params of another generation than the producer
handshake it holds (the router gives it the new one first), and computes a
request itself whose params' generation has passed by the time it would
pull (its prompt and first token are all it needs).

Params are used once. The consumer named is the request's `decode_engine_id`
if it names one, else the one remote engine the producer knows if it knows
exactly one, else "" (any engine that knows the producer; name the decode
engine to bind them). They expire when the producer stops holding their
blocks (`first_token_at + pull_timeout_s`; the engines' clocks must agree
to well within that). The consumer remembers every nonce it accepted until
it expires, so a replay (the producer may have freed and reused the blocks
since: NIXL reads are one-sided, the producer cannot refuse them) or a
second use while the first reads is refused before a byte is read. Each pull
tells the producer the nonce it read under (`worker.notification`), and the
producer releases a handout's blocks only once the readers of that nonce are
done: readers of other params of the same request id never count.

Early handover (what the router does): the decode engine is given the request
when the prefill engine is, with `AwaitedPrefill` params (the producer's
engine id and request id, unsigned), and the producer with
`{"do_remote_decode": true, "decode_engine_id": ...}`. The consumer admits
the request at once and allocates its prompt's blocks; each producer stage,
right after each forward that computed a chunk of the prompt in its layers,
tells the consumer's stages that read them where the blocks are
(`ReadyNotice`), and they read them while the rest is computed and while
the first token travels. The signed `RemotePrefill`
follows as the request's first token (`RemotePrefillDone`), checked like the
params of a late request: nothing is computed or streamed before it passed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

DO_REMOTE_DECODE = "do_remote_decode"
DECODE_ENGINE_ID = "decode_engine_id"  # producer: whose stages to tell once the prompt's KV is computed
DO_REMOTE_PREFILL = "do_remote_prefill"
_FIELDS = (
    "remote_engine_id", "remote_request_id", "remote_block_ids", "num_tokens", "tokens_sha256",
    "first_token_id", "first_token_at", "consumer_engine_id", "expires_at", "nonce", "generation",
)  # fmt: skip

_NONCE = re.compile(r"[0-9a-f]{1,64}")


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
    consumer_engine_id: str  # the decode engine they were handed to ("": any engine that knows the producer)
    expires_at: float  # time.time() past which the producer no longer holds the blocks
    nonce: str  # random, one per handout: the producer counts the readers of these params by it
    generation: int = 0  # of the producer's stages that hold the blocks (`EngineHandshake.generation`)

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
        for name in ("remote_engine_id", "remote_request_id", "tokens_sha256", "nonce", "sig"):
            if not isinstance(params[name], str) or not params[name]:
                raise TypeError(f"kv_transfer_params.{name} must be a non-empty string")
        if not isinstance(params["consumer_engine_id"], str):
            raise TypeError("kv_transfer_params.consumer_engine_id must be a string")
        if not _NONCE.fullmatch(params["nonce"]):
            raise ValueError("kv_transfer_params.nonce must be hex digits")
        num_tokens, block_ids = params["num_tokens"], params["remote_block_ids"]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise TypeError(f"kv_transfer_params.num_tokens must be an int >= 0, got {num_tokens!r}")
        if not isinstance(block_ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise TypeError("kv_transfer_params.remote_block_ids must be a list of ints")
        first_token_id = params["first_token_id"]
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, int) or first_token_id < 0:
            raise TypeError(f"kv_transfer_params.first_token_id must be an int >= 0, got {first_token_id!r}")
        generation = params["generation"]
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise TypeError(f"kv_transfer_params.generation must be an int >= 0, got {generation!r}")
        for name in ("first_token_at", "expires_at"):
            if isinstance(params[name], bool) or not isinstance(params[name], (int, float)):
                raise TypeError(f"kv_transfer_params.{name} must be a number, got {params[name]!r}")
        return RemotePrefill(*(params[name] for name in _FIELDS))

    def check(
        self, sig: str, key: bytes, block_size: int, prompt_token_ids: list[int], num_remote_blocks: int,
        engine_id: str, now: float,
    ) -> None:  # fmt: skip
        """Raise `ValueError` unless the producer made these params for this prompt, for engine
        `engine_id` (the consumer), and they have not expired at `now` (time.time()). Single use is
        the consumer's to check (`nonce`)."""
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
        if self.consumer_engine_id not in ("", engine_id):
            raise ValueError(
                f"kv_transfer_params were handed to engine {self.consumer_engine_id!r}, not to this one ({engine_id!r})"
            )
        if now > self.expires_at:
            raise ValueError(
                f"kv_transfer_params expired {now - self.expires_at:.1f} s ago: engine {self.remote_engine_id!r} "
                "no longer holds their blocks"
            )


@dataclass(frozen=True)
class AwaitedPrefill:
    """Consumer params of a request admitted before its prompt's KV exists: the producer request
    that computes it (`{"do_remote_prefill": true, "remote_engine_id": ..., "remote_request_id": ...}`)."""

    remote_engine_id: str
    remote_request_id: str

    def params(self) -> dict[str, Any]:
        return {DO_REMOTE_PREFILL: True, "remote_engine_id": self.remote_engine_id, "remote_request_id": self.remote_request_id}

    @staticmethod
    def is_awaited(params: Any) -> bool:
        return isinstance(params, dict) and DO_REMOTE_PREFILL in params

    @staticmethod
    def parse(params: Any) -> "AwaitedPrefill":
        if not isinstance(params, dict):
            raise TypeError(f"kv_transfer_params must be a map, got {type(params).__name__}")
        expected = {DO_REMOTE_PREFILL, "remote_engine_id", "remote_request_id"}
        if set(params) != expected or params[DO_REMOTE_PREFILL] is not True:
            raise ValueError(f"kv_transfer_params of an awaited prefill take exactly {sorted(expected)} ({DO_REMOTE_PREFILL} true)")
        for name in ("remote_engine_id", "remote_request_id"):
            if not isinstance(params[name], str) or not params[name]:
                raise TypeError(f"kv_transfer_params.{name} must be a non-empty string")
        return AwaitedPrefill(params["remote_engine_id"], params["remote_request_id"])

    def check_done(self, done: RemotePrefill) -> None:
        """The producer's params for the request this one awaits (`ValueError` otherwise)."""
        if (done.remote_engine_id, done.remote_request_id) != (self.remote_engine_id, self.remote_request_id):
            raise ValueError(
                f"kv_transfer_params are engine {done.remote_engine_id!r}'s request {done.remote_request_id!r}; "
                f"this request awaits engine {self.remote_engine_id!r}'s request {self.remote_request_id!r}"
            )


@dataclass(frozen=True)
class ReadyNotice:
    """A producer stage's word to a consumer stage: the KV of its layers for the prompt's first
    `num_ready_tokens` tokens is in these blocks (one notice per prompt chunk). A void notice
    (`num_ready_tokens` -1) says the producer preempted the request: what was read is void, the
    chunks come again. `nonce` is the one the request's signed params will carry: the reader's
    notification names it, so that the producer counts the readers of this handout only."""

    engine_id: str  # the producer's (no "|" in it)
    request_id: str  # the producer's request
    nonce: str  # of the handout (hex)
    pp_rank: int  # the producer stage's
    num_tokens: int  # the prompt's
    num_ready_tokens: int  # computed so far (== num_tokens: the whole prompt; -1: void)
    block_ids: list[int]  # of the computed tokens, the last one maybe partly filled

    @property
    def is_void(self) -> bool:
        return self.num_ready_tokens < 0

    @property
    def is_complete(self) -> bool:
        return self.num_ready_tokens == self.num_tokens

    def encode(self) -> bytes:
        blocks = ",".join(map(str, self.block_ids))
        head = f"ready|{self.engine_id}|{self.request_id}|{self.nonce}"
        return f"{head}|{self.pp_rank}|{self.num_tokens}|{self.num_ready_tokens}|{blocks}".encode()

    @staticmethod
    def decode(msg: bytes) -> "ReadyNotice | None":
        """None if `msg` is not a ready notice (the request id may hold "|")."""
        try:
            head, engine_id, rest = msg.decode().split("|", 2)
            if head != "ready":
                return None
            request_id, nonce, pp_rank, num_tokens, num_ready, block_ids = rest.rsplit("|", 5)
            blocks = [int(b) for b in block_ids.split(",") if b]
            return ReadyNotice(engine_id, request_id, nonce, int(pp_rank), int(num_tokens), int(num_ready), blocks)
        except ValueError:
            return None


def _sign(params: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, json.dumps(params, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()
