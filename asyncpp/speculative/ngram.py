"""Prompt lookup decoding ("ngram", as in vLLM): draft what followed the last time the request's suffix appeared.

For n from max_n down to min_n, find an earlier occurrence of the request's
last n tokens in its own tokens (prompt + accepted outputs; the suffix itself
does not count) and propose the up-to-k tokens that followed it, fewer where
that continuation reaches the end of the tokens. The longest n wins; among
occurrences of that n, the most recent.

Cost: each request keeps an index from every n-gram (min_n <= n <= max_n) to
the end of its latest occurrence, updated in O(max_n - min_n + 1) per
appended token, so `propose` is at most max_n - min_n + 1 dict lookups, never
a scan of the history. Memory is O(num_tokens * (max_n - min_n + 1)) per request.
"""

from __future__ import annotations

from asyncpp.config import SpeculativeConfig
from asyncpp.speculative.proposer import Proposer, register_proposer


class _NgramIndex:
    """One request's tokens and, for every n-gram that is not the current suffix, where its latest occurrence ends.

    Invariant: `last_end` holds exactly the n-grams (min_n <= n <= max_n) that
    end before the last token, each mapped to its exclusive end (the position
    of the token that followed it, so always < len(token_ids)). The n-grams
    ending at the last token are the suffix being looked up; they enter the
    index only when the next token arrives. One dict serves every n: tuples of
    different lengths never compare equal.
    """

    __slots__ = ("last_end", "max_n", "min_n", "token_ids")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.token_ids: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        self.min_n = min_n
        self.max_n = max_n

    def append(self, token_ids: list[int]) -> None:
        tokens = self.token_ids
        last_end = self.last_end
        for token_id in token_ids:
            end = len(tokens)
            # The n-grams ending at the current last token stop being the suffix now.
            for n in range(self.min_n, min(self.max_n, end) + 1):
                last_end[tuple(tokens[end - n : end])] = end  # later occurrences overwrite: the most recent wins
            tokens.append(token_id)

    def lookup(self, max_num_tokens: int) -> list[int]:
        tokens = self.token_ids
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens), self.min_n - 1, -1):
            end = self.last_end.get(tuple(tokens[num_tokens - n :]))
            if end is not None:
                return tokens[end : end + max_num_tokens]
        return []


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens, with suffixes of min_n..max_n tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _NgramIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def start(self, request_id: str, token_ids: list[int]) -> None:
        index = _NgramIndex(self.min_n, self.max_n)
        index.append(token_ids)
        self._indexes[request_id] = index

    def extend(self, request_id: str, token_ids: list[int]) -> None:
        index = self._indexes.get(request_id)
        if index is not None:
            index.append(token_ids)

    def propose(self, request_id: str, max_num_tokens: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None or max_num_tokens <= 0:
            return []
        return index.lookup(max_num_tokens)

    def finish(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._indexes)


register_proposer("ngram", NgramProposer)
