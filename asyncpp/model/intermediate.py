"""`IntermediateTensors`: what one pipeline stage hands to the next.

A fixed key set (`INTERMEDIATE_KEYS`) agreed at start-up; each tensor is
`[num_tokens, hidden_size]`. The receiving stage owns persistent buffers with
these keys, so a mismatch is a bug that must fail loudly, never silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INTERMEDIATE_KEYS: tuple[str, ...] = ("hidden_states", "residual")


@dataclass
class IntermediateTensors:
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def keys(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    @property
    def num_tokens(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def narrow(self, num_tokens: int) -> "IntermediateTensors":
        """A view of the first `num_tokens` rows of every tensor."""
        return IntermediateTensors({k: v[:num_tokens] for k, v in self.tensors.items()})

    @staticmethod
    def empty_like(other: "IntermediateTensors") -> "IntermediateTensors":
        return IntermediateTensors({k: torch.empty_like(v) for k, v in other.tensors.items()})

    @staticmethod
    def allocate(
        num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> "IntermediateTensors":
        return IntermediateTensors(
            {k: torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device) for k in INTERMEDIATE_KEYS}
        )
