"""Connectors by name: a small registry, and the one place that turns config into connector halves.

Built-in connectors are registered lazily by module (importing the offload
store needs nothing heavy, but `none` should cost nothing at all). An
out-of-tree connector (a test's, a plugin's) registers itself with
`register_connector` when `kv_transfer.module` is imported; the engine and
every stage import it before looking the name up, so it works across
processes. An unknown name fails at start-up naming `kv_transfer.connector`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from asyncpp.config import ConfigError, KVTransferConfig
from asyncpp.kv_transfer.base import ConnectorContext, KVConnectorScheduler, KVConnectorWorker

_CONNECTORS: dict[str, tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]] = {}
_BUILTIN_MODULES = {
    "offload": "asyncpp.kv_transfer.offload.connector",
    "multi": "asyncpp.kv_transfer.multi",
    "pd": "asyncpp.kv_transfer.pd.connector",
}


def register_connector(name: str, scheduler_cls: type[KVConnectorScheduler], worker_cls: type[KVConnectorWorker]) -> None:
    if name == "none":
        raise ValueError("'none' is reserved: it means no connector")
    existing = _CONNECTORS.get(name)
    if existing is not None and existing != (scheduler_cls, worker_cls):
        raise ValueError(f"KV connector {name!r} registered twice")
    _CONNECTORS[name] = (scheduler_cls, worker_cls)


def connector_classes(name: str, key: str = "kv_transfer.connector") -> tuple[type[KVConnectorScheduler], type[KVConnectorWorker]]:
    if name not in _CONNECTORS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _CONNECTORS:
        known = sorted({"none", *_BUILTIN_MODULES, *_CONNECTORS})
        raise ConfigError(f"{key}: unknown KV connector {name!r} (known: {', '.join(known)})")
    return _CONNECTORS[name]


def import_connector_module(module: str) -> None:
    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"kv_transfer.module: cannot import {module!r}: {e}") from e


def connector_context(
    config: KVTransferConfig,
    *,
    layer_ranges: Sequence[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    model_id: str,
    run_id: str,
) -> ConnectorContext | None:
    """The plain values both halves are built from; None for `connector = "none"`.

    Checks every name now (importing `module` first), so a typo fails before any stage starts.
    """
    import_connector_module(config.module)
    if not config.is_enabled:
        return None

    def build(cfg: KVTransferConfig, index: int, key: str) -> ConnectorContext:
        connector_classes(cfg.connector, key)
        return ConnectorContext(
            name=cfg.connector,
            pp_size=len(layer_ranges),
            layer_ranges=tuple(tuple(r) for r in layer_ranges),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            model_id=model_id,
            run_id=run_id,
            store=cfg.store,
            store_path=str(Path(cfg.store_path).expanduser()) if cfg.store_path else "",
            store_size_mb=cfg.store_size_mb,
            connector_index=index,
            load_timeout_s=float(config.load_timeout_s),  # the top level's: one deadline per transfer
            save_timeout_s=float(config.save_timeout_s),
            kv_role=config.kv_role,
            engine_id=config.engine_id or f"engine-{run_id}",
            pull_timeout_s=float(config.pull_timeout_s),
            extra=dict(cfg.options),
            children=tuple(
                build(child, i, f"kv_transfer.children[{i}].connector") for i, child in enumerate(cfg.children)
            ),
        )

    return build(config, 0, "kv_transfer.connector")


def create_scheduler_connector(ctx: ConnectorContext | None, module: str = "") -> KVConnectorScheduler | None:
    if ctx is None:
        return None
    import_connector_module(module)
    return connector_classes(ctx.name)[0](ctx)


def create_worker_connector(ctx: ConnectorContext | None, pp_rank: int, module: str = "") -> KVConnectorWorker | None:
    if ctx is None:
        return None
    import_connector_module(module)
    return connector_classes(ctx.name)[1](ctx, pp_rank)
