"""The optional features' config sections: the KV connector (`[kv_transfer]`) and speculative decoding
(`[speculative]`). `asyncpp.config` builds them into `EngineConfig` and exports them too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncpp.typed_toml import ConfigError

_KV_STORES = ("shm", "dir")
_KV_ROLES = ("", "producer", "consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV connector (`asyncpp.kv_transfer`). The name is checked against the registry at start-up."""

    connector: str = "none"  # none | offload | multi | a name registered by `module`
    # offload: where every stage keeps its layers of saved blocks; "shm" (shared memory, gone
    # with the engine) or "dir" (files under store_path, kept across restarts).
    store: str = "shm"
    store_path: str = ""  # store "dir": the directory (a subdirectory per stage's layers)
    store_size_mb: int = 1024  # per stage; LRU eviction beyond it
    module: str = ""  # imported first, in the engine and every stage: registers out-of-tree connectors
    # Past these a transfer is aborted on every stage: a load's blocks are recomputed, a finished
    # request's sends (saves) are dropped, and its blocks are freed (`kv_transfer.base`).
    load_timeout_s: float = 30.0
    save_timeout_s: float = 30.0  # past this a finished request's sends (saves) are aborted
    # Prefill/decode disaggregation (`pd`): "producer" (computes prompts, others pull their KV) or
    # "consumer" (pulls prompts' KV, decodes); this engine's id among the engines it moves KV with
    # ("" = one made up per run); how long a producer keeps a finished prompt's blocks for pulls.
    kv_role: str = ""
    engine_id: str = ""  # this engine's id among those it moves KV with ("" = made up per run)
    pull_timeout_s: float = 30.0  # a producer keeps a finished prompt's blocks this long for pulls
    options: dict[str, Any] = field(default_factory=dict)  # the connector's own settings
    children: tuple["KVTransferConfig", ...] = ()  # multi: the connectors it composes, in load order

    def __post_init__(self) -> None:
        if not self.connector:
            raise ConfigError("kv_transfer.connector must be a connector name ('none' for none)")
        if self.store not in _KV_STORES:
            raise ConfigError(f"kv_transfer.store must be one of {_KV_STORES}, got {self.store!r}")
        if self.store_size_mb < 1:
            raise ConfigError(f"kv_transfer.store_size_mb must be >= 1, got {self.store_size_mb}")
        if self.kv_role not in _KV_ROLES:
            raise ConfigError(f"kv_transfer.kv_role must be one of {_KV_ROLES}, got {self.kv_role!r}")
        for name in ("load_timeout_s", "save_timeout_s", "pull_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"kv_transfer.{name} must be a positive number of seconds, got {value!r}")
        if self.store == "dir" and not self.store_path:
            raise ConfigError("kv_transfer.store_path must name a directory when kv_transfer.store is 'dir'")
        if self.connector == "multi" and not self.children:
            raise ConfigError("kv_transfer.children must list at least one connector when kv_transfer.connector is 'multi'")
        for child in self.children:
            if child.connector == "multi" or child.children:
                raise ConfigError("kv_transfer.children: a multi-connector cannot contain another one")

    @property
    def is_enabled(self) -> bool:
        return self.connector != "none"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer on the last stage drafts tokens, the next step verifies them.

    `method`: a registered proposer (`asyncpp.speculative`), "none" = off. `adaptive`: draft only
    where the expected accepted tokens pay for the wider step (measured), so it is never a loss.
    """

    method: str = "none"
    num_speculative_tokens: int = 4  # k: drafts per request per step, at most
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up in the request's tokens
    prompt_lookup_max: int = 4  # ngram: the longest
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not self.method:
            raise ConfigError("speculative.method must name a proposer ('none' for none)")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"speculative.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ConfigError(f"speculative.prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def is_enabled(self) -> bool:
        return self.method != "none"
