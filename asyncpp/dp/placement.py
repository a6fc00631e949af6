"""Where a data-parallel router sends a request: the replica that would give it its first token soonest.

An engine's step runs its decoding requests first (one token each) and gives the rest of its token
budget (`max_num_batched_tokens`) to prompts, oldest first. A new prompt on a replica therefore
waits for the prompt tokens already queued there and then takes its own, at most `budget -
decoding` tokens a step, so it is first sampled after about

    (queued prompt tokens + its own) / (budget - decoding requests)

steps. `ReplicaLoads` keeps those counts per replica as the router sees them (a prompt counts as
queued from routing until its first delta comes back, a request as decoding from then until it
ends) and picks the live replica where that estimate is lowest; on equal estimates the one with
fewer unfinished requests, then the next in turn, so equal loads alternate. A replica with as many
decoding requests as its budget counts as never (it is full): the choice then falls back to the
fewest unfinished.

Counting only requests (least unfinished) sends a long prompt to a replica that is prefilling
another one rather than to one that is only decoding, where it would start at once; with short
prompts and a busy replica the two choices agree. Prompts come as token ids from the HTTP front
end; a text or chat prompt counts as one token per `CHARS_PER_TOKEN` characters.

With a long-prompt replica (`parallel.long_prompt_pp_size`: an engine of several stages over every
core the replicas use), `LongPrompts` narrows the choice first: a prompt of at least `min_tokens`
goes to it, whose stages prefill the prompt's chunks on all the cores at once (a replica's prefill
runs on its own cores only), and every other prompt to the replicas. When the side it belongs to
has no live replica, the prompt goes to the other side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4  # a text prompt's estimated tokens: its characters / this (English averages ~4)


def prompt_tokens(prompt: Any) -> int:
    """The prompt's tokens: exact for token ids, estimated for text or chat messages (at least 1). A
    prompt of any other shape counts as 1: the replica it goes to refuses it with its own error."""
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    if not isinstance(prompt, list):
        return 1
    if prompt and all(isinstance(m, dict) for m in prompt):
        return max(1, sum(len(str(m.get("content", ""))) for m in prompt) // CHARS_PER_TOKEN)
    return max(1, len(prompt))


@dataclass(frozen=True)
class LongPrompts:
    """Prompts of at least `min_tokens` go to replica `replica` (the long-prompt one), others elsewhere."""

    replica: int
    min_tokens: int

    def eligible(self, live: list[bool], tokens: int) -> list[bool]:
        """Which of the `live` replicas a prompt of `tokens` may go to (module docstring)."""
        is_long = tokens >= self.min_tokens
        side = [ok and (i == self.replica) == is_long for i, ok in enumerate(live)]
        return side if any(side) else live


@dataclass
class ReplicaLoads:
    """Per replica: prompt tokens queued and requests decoding, as routed; `choose` picks one."""

    num_replicas: int
    budget: int  # tokens a step (the replicas' `scheduler.max_num_batched_tokens`)
    queued_tokens: list[int] = field(init=False)
    num_queued: list[int] = field(init=False)
    num_decoding: list[int] = field(init=False)
    _next: int = field(default=0, init=False)  # where the search starts: ties go in turn

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.budget < 1:
            raise ValueError(f"replicas and budget must be positive, got {self.num_replicas} and {self.budget}")
        self.queued_tokens = [0] * self.num_replicas
        self.num_queued = [0] * self.num_replicas
        self.num_decoding = [0] * self.num_replicas

    def num_unfinished(self, replica: int) -> int:
        return self.num_queued[replica] + self.num_decoding[replica]

    def steps_to_first_token(self, replica: int, tokens: int) -> float:
        """About how many steps a prompt of `tokens` would wait on `replica` for its first token."""
        room = self.budget - self.num_decoding[replica]
        return math.inf if room <= 0 else (self.queued_tokens[replica] + tokens) / room

    def choose(self, live: list[bool], tokens: int) -> int | None:
        """The live replica where a prompt of `tokens` is first sampled soonest; None if none lives."""
        n = self.num_replicas
        order = [i for i in ((self._next + k) % n for k in range(n)) if live[i]]
        if not order:
            return None
        best = min(order, key=lambda i: (self.steps_to_first_token(i, tokens), self.num_unfinished(i)))
        self._next = (best + 1) % n
        return best

    def queued(self, replica: int, tokens: int) -> None:
        """A prompt routed to `replica`."""
        self.queued_tokens[replica] += tokens
        self.num_queued[replica] += 1

    def prefilled(self, replica: int, tokens: int) -> None:
        """Its first delta came back: it decodes from now on."""
        self.queued_tokens[replica] -= tokens
        self.num_queued[replica] -= 1
        self.num_decoding[replica] += 1

    def ended(self, replica: int, tokens: int, was_prefilled: bool) -> None:
        """The request ended (finished, failed or aborted), before or after its first delta."""
        if was_prefilled:
            self.num_decoding[replica] -= 1
        else:
            self.queued_tokens[replica] -= tokens
            self.num_queued[replica] -= 1
