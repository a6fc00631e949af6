"""structlog set-up shared by every process.

Console rendering for people, JSON lines for tools (`asyncpp.trace` reads
them). Bind `role`, `pp_rank`, `step_id`, `request_id` with
`get_logger(role=...)` / `.bind(...)` so a step can be followed across
processes by its `step_id`.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from typing import Any

import structlog

_configured = False


def configure_logging(fmt: str = "console", level: str = "info", file: str | None = None) -> None:
    """Configure structlog (and stdlib logging) for this process; idempotent per call."""
    global _configured
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    stream: Any = open(file, "a", buffering=1) if file else _CurrentStderr()  # noqa: SIM115 - lives with the process
    is_json = fmt == "json" or file is not None
    renderer: Any = structlog.processors.JSONRenderer() if is_json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    # JSON lines carry integer wall-clock microseconds so `asyncpp.trace` can line processes up,
    # and the host name: stages may run on other hosts (`parallel.backend = "ray"`).
    timestamps = [_add_wall_us, _add_host] if is_json else []
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            *timestamps,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


class _CurrentStderr:
    """Whatever `sys.stderr` is when an event is written, not when logging was configured.

    Something may replace `sys.stderr` later (a test runner's capture, then closed); a
    background thread's warning must not then fail on a closed stream.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def _add_wall_us(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("t_us", time.time_ns() // 1000)
    return event


_HOST = socket.gethostname()


def _add_host(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("host", _HOST)
    return event


def get_logger(**bound: Any) -> Any:
    if not _configured:
        configure_logging(level="warning")
    return structlog.get_logger().bind(**bound)


def is_debug_enabled(log: Any) -> bool:
    """Whether `log.debug` events are kept; hot loops check once instead of computing fields for nothing."""
    is_enabled_for = getattr(log, "is_enabled_for", None)
    return True if is_enabled_for is None else bool(is_enabled_for(logging.DEBUG))
