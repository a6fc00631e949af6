"""The `offload` connector: registers its two halves (`scheduler`, `worker`) under that name."""

from __future__ import annotations

from asyncpp.kv_transfer.offload.scheduler import OffloadScheduler
from asyncpp.kv_transfer.offload.worker import OffloadWorker
from asyncpp.kv_transfer.registry import register_connector

register_connector("offload", OffloadScheduler, OffloadWorker)
