"""Render the pipeline summary PNG: per-stage busy timeline and busy/bubble bars.

Left: one row per stage, a bar per `stage_done` slice over the run's span
(ms from the first slice), coloured by step_id so one step can be followed
down the stages; gaps are bubbles. Right: per stage, busy % and bubble %
stacked to 100 %. Stage restarts are shaded on the timeline. The title gives the mean bubble fraction. Uses the Agg
backend (no display needed); matplotlib is imported only when a PNG is asked for.
"""

from __future__ import annotations

from pathlib import Path

from asyncpp.trace.records import ParsedLog
from asyncpp.trace.stats import PipelineStats

_BUSY_COLOR = "#4c72b0"
_BUBBLE_COLOR = "#dd8452"
_RESTART_COLOR = "#c44e52"


def render_summary_png(log: ParsedLog, stats: PipelineStats | None, path: str | Path) -> None:
    """Write the figure to `path`; with no stage slices, a figure that says so."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    if stats is None:
        fig, ax = plt.subplots(figsize=(8, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no stage_done lines in this log (stages log them at debug level)", ha="center", va="center")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return

    ranks = [s.pp_rank for s in stats.stages]
    fig, (ax_time, ax_bar) = plt.subplots(
        1, 2, figsize=(12, 1.2 + 0.8 * len(ranks)), sharey=True, gridspec_kw={"width_ratios": [5, 1]}
    )
    cmap = plt.get_cmap("tab10")
    for row, rank in enumerate(ranks):
        mine = log.stage_slices(rank)
        ranges = [((s.start_us - stats.span_start_us) / 1e3, s.duration_us / 1e3) for s in mine]
        ax_time.broken_barh(ranges, (row - 0.4, 0.8), facecolors=[cmap(s.step_id % 10) for s in mine], linewidth=0)
    for r in log.restarts:  # stage restarts: shaded from the loss to serving again
        end_us = r.recovered_us if r.recovered_us is not None else stats.span_start_us + stats.span_us
        lost_ms, end_ms = (r.lost_us - stats.span_start_us) / 1e3, (end_us - stats.span_start_us) / 1e3
        ax_time.axvspan(lost_ms, end_ms, color=_RESTART_COLOR, alpha=0.3, linewidth=0)
        ax_time.text(lost_ms, -0.45, f"restart: stage {list(r.pp_ranks)} {r.cause}", fontsize=7, va="bottom")
    ax_time.set_xlim(0, max(stats.span_us / 1e3, 1e-3))
    ax_time.set_xlabel("time since first slice (ms)")
    ax_time.set_yticks(range(len(ranks)), [f"stage {r}" for r in ranks])
    ax_time.invert_yaxis()  # stage 0 on top, like the trace viewer
    ax_time.set_title("busy slices (colour = step_id mod 10; gaps are bubbles)", fontsize=9)

    busy = [100 * s.busy_fraction for s in stats.stages]
    bubble = [100 * s.bubble_fraction for s in stats.stages]
    rows = range(len(ranks))
    ax_bar.barh(rows, busy, color=_BUSY_COLOR, label="busy")
    ax_bar.barh(rows, bubble, left=busy, color=_BUBBLE_COLOR, label="bubble")
    for row, (b, bub) in enumerate(zip(busy, bubble)):
        ax_bar.text(2, row, f"{b:.0f}% / {bub:.0f}%", va="center", fontsize=8, color="white")
    ax_bar.set_xlim(0, 100)
    ax_bar.set_xlabel("% of span")
    ax_bar.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)

    num_steps = len({s.step_id for s in log.slices})
    fig.suptitle(
        f"pipeline bubble {stats.mean_bubble_fraction:.1%} (mean over {len(ranks)} stages) — "
        f"{num_steps} steps, span {stats.span_us / 1e3:.1f} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
