"""The `pd` connector (prefill/decode disaggregation): registers its two halves under that name."""

from __future__ import annotations

from asyncpp.kv_transfer.pd.scheduler import PDScheduler
from asyncpp.kv_transfer.pd.worker import PDWorker
from asyncpp.kv_transfer.registry import register_connector

register_connector("pd", PDScheduler, PDWorker)
