"""A tiny progress reporter that never spams logs.

    with Progress(total=64, desc="pp=2 requests", unit="req") as bar:
        bar.update()
    for name in track(names, total=len(names), desc="loading", unit="tensors"):
        ...

Contract:
- On a TTY it draws one line, redrawn in place with `\\r` (at most every
  `min_redraw_s`, and always at the end): count/total, percent, rate, ETA.
  `leave=False` erases the line when done (for start-up noise).
- Anywhere else (a pipe, a log file) it prints at most one line at 0%, one
  when each 25% milestone is first crossed and one at the end: never more
  than 6 lines, whatever the number of updates. With an unknown total only
  the start and the end lines are printed.
- `quiet=True` prints nothing; `quiet=None` (the default) is quiet when the
  environment sets `ASYNCPP_PROGRESS` to 0 / off / false / no.
- Rate = count / elapsed; ETA = (total - count) / rate. Both are None until
  something was counted.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TextIO, TypeVar

T = TypeVar("T")

NUM_MILESTONES = 4  # non-TTY lines at 0%, 25%, 50%, 75%, 100%
_QUIET_VALUES = ("0", "off", "false", "no")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def quiet_from_env() -> bool:
    return os.environ.get("ASYNCPP_PROGRESS", "").strip().lower() in _QUIET_VALUES


class Progress:
    def __init__(
        self,
        total: int | None,
        desc: str = "",
        unit: str = "it",
        *,
        stream: TextIO | None = None,
        quiet: bool | None = None,
        leave: bool = True,
        min_redraw_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        self.is_quiet = quiet_from_env() if quiet is None else quiet
        self.is_tty = _isatty(self.stream)
        self.leave = leave
        self.min_redraw_s = min_redraw_s
        self.clock = clock
        self.started_at = clock()
        self.num_lines = 0  # lines written (non-TTY) or redraws (TTY)
        self._last_draw = -float("inf")
        self._milestone = -1  # highest quartile already printed (non-TTY)
        self._closed = False
        self._emit(final=False)

    # ---- counting ---------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        self.count += n
        self._emit(final=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._emit(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- figures ----------------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started_at

    @property
    def rate(self) -> float | None:
        """Items per second so far; None before the first item or the first clock tick."""
        elapsed = self.elapsed_s
        return self.count / elapsed if self.count and elapsed > 0 else None

    @property
    def eta_s(self) -> float | None:
        rate = self.rate
        if rate is None or self.total is None:
            return None
        return max(0, self.total - self.count) / rate

    def line(self) -> str:
        parts = [self.desc] if self.desc else []
        if self.total is not None:
            pct = 100.0 * self.count / self.total if self.total else 100.0
            parts.append(f"{self.count}/{self.total} {self.unit} ({pct:3.0f}%)")
        else:
            parts.append(f"{self.count} {self.unit}")
        rate = self.rate
        parts.append(f"{rate:.1f} {self.unit}/s" if rate is not None else f"- {self.unit}/s")
        if self._closed:
            is_done = self.total is None or self.count >= self.total
            parts.append(f"{'done' if is_done else 'stopped'} in {_fmt_s(self.elapsed_s)}")
        elif self.total is not None:
            eta = self.eta_s
            parts.append(f"ETA {_fmt_s(eta)}" if eta is not None else "ETA -")
        return " ".join(parts)

    # ---- output -----------------------------------------------------------------------------
    def _emit(self, final: bool) -> None:
        if self.is_quiet:
            return
        if self.is_tty:
            self._draw_tty(final)
        else:
            self._print_milestone(final)

    def _draw_tty(self, final: bool) -> None:
        now = self.clock()
        if not final and now - self._last_draw < self.min_redraw_s:
            return
        self._last_draw = now
        self.num_lines += 1
        if final and not self.leave:
            self.stream.write("\r\x1b[K")
        else:
            self.stream.write("\r" + self.line() + "\x1b[K" + ("\n" if final else ""))
        self.stream.flush()

    def _print_milestone(self, final: bool) -> None:
        if final:
            if self._milestone >= NUM_MILESTONES:
                return
            self._milestone = NUM_MILESTONES
        else:
            reached = self._quartile()
            # 100% is left to close(), which knows the total time.
            if reached >= NUM_MILESTONES or reached <= self._milestone:
                return
            self._milestone = reached
        self.num_lines += 1
        self.stream.write(self.line() + "\n")
        self.stream.flush()

    def _quartile(self) -> int:
        if self.total is None:
            return 0
        if self.total <= 0:
            return NUM_MILESTONES
        return min(NUM_MILESTONES, self.count * NUM_MILESTONES // self.total)


def track(
    items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it", **kwargs
) -> Iterator[T]:
    """Yield `items` unchanged, counting them on a `Progress`; closed when the loop ends or breaks."""
    if total is None and isinstance(items, Sequence):
        total = len(items)
    bar = Progress(total, desc, unit, **kwargs)
    try:
        for item in items:
            yield item
            bar.update()
    finally:
        bar.close()


def track_weights(names: Sequence[str], source: str) -> Iterator[str]:
    """`track` over HF tensor names, labelled with the layer range they cover (a stage's slice)."""
    return track(names, desc=f"{source} {weights_span(names)}:", unit="tensors", leave=False)


def weights_span(names: Sequence[str]) -> str:
    """'layers 0-14 + embed' for HF Llama names; layer indices are global."""
    layers = sorted({int(m.group(1)) for m in map(_LAYER_RE.search, names) if m})
    parts = [f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"] if layers else []
    if any("embed_tokens" in n for n in names):
        parts.append("embed")
    if any(n in ("model.norm.weight", "lm_head.weight") for n in names):
        parts.append("head")
    return " + ".join(parts) or "weights"


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
