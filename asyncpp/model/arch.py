"""`ModelArch`: the architecture hyper-parameters of a Llama-family decoder.

Every loader (GGUF metadata, HF `config.json`, named random configs) produces
one of these; the model is built from it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads(self) -> tuple[int, int, int]:
        """(num_heads, num_kv_heads, head_dim): the attention's shape."""
        return self.num_heads, self.num_kv_heads, self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linears (q, k, v, o, gate, up, down): its multiply-adds per token."""
        return (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )
