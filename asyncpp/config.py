"""Deployment configuration: a frozen dataclass tree loaded from one TOML file.

`load_config(path)` reads TOML, rejects unknown keys and wrong types with an
error naming the dotted key (`cache.block_size`), and returns an immutable
`EngineConfig`. Values discovered at run time (the number of KV blocks) live
in separate objects and are never written back here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncpp.config_features import KVTransferConfig, SpeculativeConfig
from asyncpp.kernels.isa import ISA_LEVELS
from asyncpp.typed_toml import ConfigError, build_dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SOURCES = ("gguf", "hf", "random")
_LINEAR_KERNELS = ("auto", "onednn")
_CPU_ISAS = ("auto", *ISA_LEVELS)
_WEIGHT_FORMATS = ("auto", "float", "native")
_BACKENDS = ("local", "ray")
AUTO_SHIFT_LAYERS = 4  # parallel.shift_layers = -1: what evened out the default pp=2 SmolLM2 stages best
_PLACEMENTS = ("spread", "pack")
_TOKEN_HANDOFFS = ("auto", "host", "ring")


@dataclass(frozen=True)
class ModelConfig:
    source: str = "gguf"  # gguf | hf | random
    path: str = ""  # file (gguf), directory (hf) or tiny config name (random); "" = default SmolLM2 GGUF
    # "auto": bfloat16 on CUDA and on CPUs that compute it natively (AVX512-BF16), else float32;
    # resolved at start-up (asyncpp.engine.compute_plan), never written back here.
    dtype: str = "auto"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (every stage; parallel.devices sets one per stage)
    max_model_len: int = 2048  # the longest prompt plus answer, in tokens (at most the model's own)
    # bfloat16 CPU linears: "auto" = asyncpp's AVX512-BF16 kernel where the CPU has it and no
    # AMX, else oneDNN; "onednn" = always oneDNN (the same numbers as F.linear).
    linear_kernel: str = "auto"
    # The bfloat16 kernel's rows: from how many a linear multiplies with float32 FMA instead of
    # vdpbf16ps (the same bits, faster on CPUs whose FMA outruns vdpbf16ps): -1 = measured on this
    # CPU at start-up and cached per CPU (asyncpp.kernels.linear_choice), 0 = never, N = from N rows.
    fma_min_rows: int = -1
    # The CPU kernels' ISA level: "auto" = the best this CPU runs, or one of ISA_LEVELS to force a
    # lower one (torch's own kernels are capped too). A level the CPU lacks fails at start-up.
    cpu_isa: str = "auto"
    # "float": weights converted to `dtype` at load; "native": kept in the file's format (GGUF
    # quantized blocks, float16, ...) and multiplied by the kernels in float32, or in bfloat16 with
    # AVX512-BF16 (CPU only); "auto": native wherever that holds and the kernel builds.
    weight_format: str = "auto"
    # CUDA stages: capture a graph per stage for steps of these numbers of tokens, decodes,
    # prefill chunks or both (a step is padded to the next one; larger steps run eagerly: their
    # launches are a small part of their compute, which padding would grow, as in vLLM's 512 cap).
    # Sizes past scheduler.max_num_batched_tokens but the first are not captured. Ignored on CPU.
    cuda_graphs: bool = True  # capture CUDA graphs (off: every step runs eagerly)
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)  # the step sizes captured

    def __post_init__(self) -> None:
        if self.source not in _SOURCES:
            raise ConfigError(f"model.source must be one of {_SOURCES}, got {self.source!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"model.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.linear_kernel not in _LINEAR_KERNELS:
            raise ConfigError(f"model.linear_kernel must be one of {_LINEAR_KERNELS}, got {self.linear_kernel!r}")
        if self.fma_min_rows < -1:
            raise ConfigError(f"model.fma_min_rows must be -1 (measure), 0 (never) or a row count, got {self.fma_min_rows}")
        if self.cpu_isa not in _CPU_ISAS:
            raise ConfigError(f"model.cpu_isa must be one of {_CPU_ISAS}, got {self.cpu_isa!r}")
        if self.weight_format not in _WEIGHT_FORMATS:
            raise ConfigError(f"model.weight_format must be one of {_WEIGHT_FORMATS}, got {self.weight_format!r}")
        if not _is_device_name(self.device):
            raise ConfigError(f"model.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _at_least(1, "model.max_model_len", self.max_model_len)
        for n in self.cuda_graph_sizes:
            _at_least(1, "model.cuda_graph_sizes entries", n)
        if list(self.cuda_graph_sizes) != sorted(set(self.cuda_graph_sizes)):
            raise ConfigError(f"model.cuda_graph_sizes must be increasing and distinct, got {list(self.cuda_graph_sizes)}")

    @property
    def path_or_none(self) -> str | None:
        return self.path or None


@dataclass(frozen=True)
class ParallelConfig:
    pp_size: int = 1  # pipeline stages, one process each
    # Data parallelism: this many engines (replicas, each with pp_size stages) behind one router
    # that sends each request where its first token comes soonest (`asyncpp.dp`); 1 = one engine.
    dp_size: int = 1
    # With dp_size > 1: one more engine of this many stages, on every CPU, takes each prompt of at least
    # long_prompt_tokens, whose prefill then runs on all those cores (a replica's on its own); 0 = none.
    # One engine (dp_size 1) has nothing beside it: then it does not apply.
    long_prompt_pp_size: int = 0
    long_prompt_tokens: int = 512  # a prompt of at least this many tokens is long (estimated for text)
    layer_split: tuple[int, ...] = ()  # layers per stage; () = as even as possible
    num_threads: int = 1  # torch threads per stage process (CPU)
    # CPU: a lone cohort's steps run with every stage's threads (pp_size * num_threads) where
    # other processes leave those cores idle (the stages run one after the other).
    lend_idle_threads: bool = True
    # CPU: bind each stage's threads to CPUs (its own cores, then those its lent threads borrow:
    # `asyncpp/runtime/cpu_affinity.py`); an OpenMP binding the user set wins.
    pin_threads: bool = True
    # Cohorts in flight, disjoint sets of the live requests, each with one step in flight (two with
    # scheduler.async_scheduling); 0 = pp_size, or 1 where every stage is on the same GPU (their
    # steps take turns on it; `EngineConfig.steps_in_flight`). pp_size + 1 hides the engine's
    # turnaround without async scheduling, at the price of smaller cohorts.
    max_steps_in_flight: int = 0
    # Niceness the stages add to their own: the engine's short per-step bursts then take a core
    # from a stage at once instead of waiting for its time slice. 0 = the launcher's priority.
    stage_nice: int = 5
    # One device per stage ("cuda:0", "cuda:1", ...); () = every stage on model.device.
    devices: tuple[str, ...] = ()
    # CPU pipelines: each stage boundary may move this many layers per step, so that every
    # step's stage times come out even (the last stage's lm_head weighs on decode steps, the
    # earlier stages' layers on prompt chunks). Both neighbours hold the layers in between,
    # with one shared KV cache. 0 = the fixed split; also 0, with a warning at start-up, on
    # GPU stages and with a KV connector (`EngineConfig.shift_layers`). -1 = auto: AUTO_SHIFT_LAYERS
    # where it applies (CPU stages run locally, no KV connector), else 0 (said at start-up).
    shift_layers: int = 0
    # Where the stages run: "local" (child processes of the launcher) or "ray" (one Ray actor
    # per stage, placed by a placement group on a running Ray cluster: `asyncpp.runtime.ray_backend`).
    backend: str = "local"
    ray_address: str = "auto"  # ray.init(address=...): "auto", "ray://host:10001", "host:6379"
    placement: str = "spread"  # "spread": stages on different nodes where possible; "pack": few nodes
    # The step deadline: a stage that has had a step it could run (its input there, room for its
    # output) for this long and reported nothing is hung (a stopped process, a partitioned node, a
    # stuck ring), as if it died (`asyncpp/runtime/step_deadline.py`). A full prompt chunk of a big
    # model on a slow CPU must stay well under it, hence the generous default.
    step_timeout_s: float = 60.0
    # A stage that dies or hangs is restarted in place and its requests finish (`asyncpp.recovery`),
    # up to this many times within restart_window_s; past that (or 0) every request fails, exit 1.
    max_stage_restarts: int = 3
    restart_window_s: float = 60.0
    # Sampled tokens from the last stage to the first (async scheduling): "ring" device to device
    # (`asyncpp.transport.token_ring`), "host" in messages; "auto" = ring between local CUDA stages.
    token_handoff: str = "auto"

    def __post_init__(self) -> None:
        _at_least(1, "parallel.pp_size", self.pp_size)
        _at_least(1, "parallel.dp_size", self.dp_size)
        _at_least(1, "parallel.long_prompt_tokens", self.long_prompt_tokens)
        _at_least(0, "parallel.long_prompt_pp_size", self.long_prompt_pp_size)
        if self.token_handoff not in _TOKEN_HANDOFFS:
            raise ConfigError(f"parallel.token_handoff must be one of {_TOKEN_HANDOFFS}, got {self.token_handoff!r}")
        if self.backend not in _BACKENDS:
            raise ConfigError(f"parallel.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.placement not in _PLACEMENTS:
            raise ConfigError(f"parallel.placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        if not self.ray_address:
            raise ConfigError("parallel.ray_address must not be empty ('auto' finds the local cluster)")
        if self.backend == "ray" and self.shift_layers > 0:  # neighbours share a KV cache in shared memory
            raise ConfigError("parallel.shift_layers must be 0 (or -1, auto) with parallel.backend = 'ray'")
        if self.devices and len(self.devices) != self.pp_size:
            raise ConfigError(f"parallel.devices has {len(self.devices)} entries but parallel.pp_size is {self.pp_size}")
        for d in self.devices:
            if not _is_device_name(d):
                raise ConfigError(f"parallel.devices entries must be 'cpu' or 'cuda[:N]', got {d!r}")
        _at_least(1, "parallel.num_threads", self.num_threads)
        for key in ("step_timeout_s", "restart_window_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"parallel.{key} must be a positive number of seconds, got {value!r}")
        _at_least(0, "parallel.max_stage_restarts", self.max_stage_restarts)
        if not 0 <= self.max_steps_in_flight <= self.pp_size + 1:
            bounds = f"0 (= pp_size) or 1..pp_size + 1 = {self.pp_size + 1}"
            raise ConfigError(f"parallel.max_steps_in_flight must be {bounds}, got {self.max_steps_in_flight}")
        if not 0 <= self.stage_nice <= 19:
            raise ConfigError(f"parallel.stage_nice must be in 0..19, got {self.stage_nice}")
        if self.layer_split and len(self.layer_split) != self.pp_size:
            raise ConfigError(f"parallel.layer_split has {len(self.layer_split)} entries but parallel.pp_size is {self.pp_size}")
        for n in self.layer_split:
            _at_least(1, "parallel.layer_split entries", n)
        if self.shift_layers < -1:
            raise ConfigError(f"parallel.shift_layers must be >= 0 (or -1, auto), got {self.shift_layers}")

    @property
    def engine_stages(self) -> tuple[int, ...]:
        """The stages of each engine the launcher starts: `dp_size` of `pp_size`, then, with replicas, the
        long-prompt engine's `long_prompt_pp_size` (none at 0, and none beside one engine)."""
        long_prompts = (self.long_prompt_pp_size,) if self.dp_size > 1 and self.long_prompt_pp_size else ()
        return (self.pp_size,) * self.dp_size + long_prompts


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_mb: int = 256  # budget for K and V of this stage's layers
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix already computed
    num_kv_blocks_override: int = 0  # > 0: use exactly this many blocks (tests, debugging)

    def __post_init__(self) -> None:
        _at_least(1, "cache.block_size", self.block_size)
        _at_least(1, "cache.kv_cache_memory_mb", self.kv_cache_memory_mb)
        _at_least(0, "cache.num_kv_blocks_override", self.num_kv_blocks_override)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True  # a long prompt is computed over several steps, beside decodes
    # Pipeline runtime: schedule a cohort's next step while its current one runs, with
    # placeholders for the tokens it samples, which go from the last stage straight to the
    # first. The engine's turnaround then overlaps compute instead of idling the stages.
    async_scheduling: bool = True
    # A single stage leaves each step's sampled tokens on the device, fills the next step's
    # placeholders there, and reports a step once the next is enqueued (`asyncpp.worker.async_output`):
    # "auto" = on for one CUDA stage with async scheduling; "on" forces it (also on CPU, for tests).
    async_output: str = "auto"

    def __post_init__(self) -> None:
        if self.async_output not in ("auto", "on", "off"):
            raise ConfigError(f"scheduler.async_output must be 'auto', 'on' or 'off', got {self.async_output!r}")
        _at_least(1, "scheduler.max_num_seqs", self.max_num_seqs)
        _at_least(1, "scheduler.max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default
    port: int = 5557  # the engine's client port (AsyncClient, the HTTP server); 0 = any free one
    grace_period_s: float = 5.0  # on SIGTERM, open requests get this long to finish
    # The OpenAI-compatible HTTP server (asyncpp.http): 0 = none. Off loopback it needs an api_key.
    http_port: int = 0
    http_host: str = "127.0.0.1"  # the HTTP server's address
    api_key: str = ""  # clients send "Authorization: Bearer <api_key>"; "" = no key
    served_model_name: str = ""  # "" = named after the model file
    metrics_require_key: bool = False  # the key guards everything but /health, and /metrics too if set
    # HTTP requests admitted beyond scheduler.max_num_seqs at once; more get 503 + Retry-After.
    max_queued_requests: int = 1024
    # The largest client frame the engine reads; clients refuse to send a larger one.
    max_frame_bytes: int = 8 * 1024 * 1024
    # The client port (`asyncpp.wire.client_auth`): clients present client_secret ("" = any local
    # client; off loopback it is required); peer engines and the prefill/decode router present
    # engine_secret to exchange KV handshakes ("" = one made up per run, for this launch's own).
    client_secret: str = field(default="", repr=False)
    engine_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"server.http_port must be in 0..65535 (0 = no HTTP server), got {self.http_port}")
        _at_least(0, "server.max_queued_requests", self.max_queued_requests)
        _at_least(1, "server.max_frame_bytes", self.max_frame_bytes)
        if not self.client_secret and not is_loopback(self.host):
            raise ConfigError(
                f"server.host {self.host!r} is not loopback: set server.client_secret so that only clients "
                "that present it are served"
            )
        if self.http_port and not self.api_key and not is_loopback(self.http_host):
            raise ConfigError(
                f"server.http_host {self.http_host!r} is not loopback: set server.api_key (or --api-key) "
                "so that only clients with the key are served"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        kinds = {d.split(":")[0] for d in self.stage_devices}
        if len(kinds) > 1:
            raise ConfigError(f"parallel.devices mixes device kinds {sorted(kinds)}: every stage must be on CPU or on CUDA")
        if self.parallel.devices and kinds != {self.model.device.split(":")[0]}:
            raise ConfigError(f"parallel.devices {list(self.parallel.devices)} do not match model.device {self.model.device!r}")
        if (
            not self.scheduler.enable_chunked_prefill
            and self.scheduler.max_num_batched_tokens < self.model.max_model_len
        ):
            raise ConfigError(
                "scheduler.max_num_batched_tokens must be >= model.max_model_len "
                "when scheduler.enable_chunked_prefill is false"
            )
        k = self.speculative.num_speculative_tokens
        if self.speculative.is_enabled and k + 1 > self.scheduler.max_num_batched_tokens:
            raise ConfigError(
                f"speculative.num_speculative_tokens {k} does not fit the token budget: a step of one request "
                f"needs 1 + k = {k + 1} tokens, more than scheduler.max_num_batched_tokens "
                f"{self.scheduler.max_num_batched_tokens}"
            )
        if self.speculative.is_enabled and k + 1 >= self.model.max_model_len:
            raise ConfigError(
                f"speculative.num_speculative_tokens {k} must be below model.max_model_len - 1 "
                f"({self.model.max_model_len - 1})"
            )

        if self.parallel.token_handoff == "ring" and self.token_ring_off_reason:
            raise ConfigError(f"parallel.token_handoff = 'ring': {self.token_ring_off_reason}")
        if self.scheduler.async_output == "on" and not (self.parallel.pp_size == 1 and self.scheduler.async_scheduling):
            raise ConfigError(
                "scheduler.async_output = 'on' needs parallel.pp_size = 1 and scheduler.async_scheduling = true "
                f"(got pp_size {self.parallel.pp_size}, async_scheduling {self.scheduler.async_scheduling})"
            )

    @property
    def uses_async_output(self) -> bool:
        """`scheduler.async_output` resolved: "auto" is on for one CUDA stage with async scheduling."""
        if self.scheduler.async_output != "auto":
            return self.scheduler.async_output == "on"
        one_stage = self.parallel.pp_size == 1 and self.scheduler.async_scheduling
        return one_stage and self.on_cuda

    @property
    def on_cuda(self) -> bool:
        """The stages are on CUDA devices (all of them: device kinds never mix)."""
        return self.stage_devices[0].split(":")[0] == "cuda"

    @property
    def steps_in_flight(self) -> int:
        """Cohorts in flight: `parallel.max_steps_in_flight`, else one per stage, or one in all where
        the stages share one GPU (halving the batch there doubles the kernels per token for nothing:
        H200, pp = 2 at 64 requests, 0.63x pp = 1's tokens/s with two cohorts, 0.70x with one)."""
        if self.parallel.max_steps_in_flight:
            return self.parallel.max_steps_in_flight
        devices = {d if ":" in d else f"{d}:0" for d in self.stage_devices}
        shares_a_gpu = self.parallel.pp_size > 1 and len(devices) == 1 and self.on_cuda
        return 1 if shares_a_gpu else self.parallel.pp_size

    @property
    def uses_token_ring(self) -> bool:
        """`parallel.token_handoff` resolved ("ring" where it cannot apply is refused at load)."""
        if self.parallel.token_handoff != "auto":
            return self.parallel.token_handoff == "ring"
        return self.token_ring_off_reason is None and self.on_cuda

    @property
    def token_ring_off_reason(self) -> str | None:
        """Why sampled tokens cannot go through a token ring here (None: they can)."""
        if self.parallel.pp_size == 1 or not self.scheduler.async_scheduling:
            return "it needs parallel.pp_size > 1 and scheduler.async_scheduling = true"
        if self.parallel.backend != "local":
            return "it needs parallel.backend = 'local' (the ring is on the first stage's device)"
        return None

    @property
    def shift_layers_off_reason(self) -> str | None:
        """Why `parallel.shift_layers` does not apply to this deployment (None: it does, or is 0)."""
        if not self.parallel.shift_layers or self.parallel.pp_size == 1:
            return None
        if self.on_cuda:
            return "GPU stages: each stage's KV cache is on its own device"
        if self.kv_transfer.is_enabled:
            return "a KV connector: it places each layer's blocks on one stage"
        if self.parallel.backend == "ray":  # only auto gets here: a value set is refused
            return "the Ray backend: stages on other hosts share no KV cache"
        return None

    @property
    def shift_layers(self) -> int:
        """`parallel.shift_layers` where it applies (CPU pipelines, no KV connector), else 0."""
        if self.parallel.pp_size == 1 or self.shift_layers_off_reason:
            return 0
        return AUTO_SHIFT_LAYERS if self.parallel.shift_layers == -1 else self.parallel.shift_layers

    @property
    def stage_devices(self) -> tuple[str, ...]:
        """The device of every pipeline stage, in stage order."""
        return self.parallel.devices or (self.model.device,) * self.parallel.pp_size

    def replace(self, **sections: Any) -> "EngineConfig":
        """A copy with whole sections or single fields replaced: replace(model={"dtype": "float32"})."""
        updated = {}
        for name, value in sections.items():
            current = getattr(self, name)
            updated[name] = dataclasses.replace(current, **value) if isinstance(value, dict) else value
        return dataclasses.replace(self, **updated)


def with_http_overrides(config: EngineConfig, http_host: str | None = None, http_port: int | None = None,
                        api_key: str | None = None) -> EngineConfig:  # fmt: skip
    """`config` with the HTTP server settings given on a command line (None: keep the file's)."""
    server = {k: v for k, v in {"http_host": http_host, "http_port": http_port, "api_key": api_key}.items() if v is not None}
    return config.replace(server=server) if server else config


def load_config(path: str | Path) -> EngineConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> EngineConfig:
    return build_dataclass(EngineConfig, data, prefix="")


def _is_device_name(name: str) -> bool:
    kind, _, index = name.partition(":")
    return name in ("cpu", "cuda") or (kind == "cuda" and index.isdigit())


def _at_least(minimum: int, key: str, value: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
