"""Timeline tooling for asyncpp's JSON-lines logs.

`parse_log` -> `ParsedLog` (typed records, skipped-line counts);
`pipeline_stats` -> per-stage busy / bubble fractions;
`stage_waits` / `phase_balance` -> what the bubbles waited on, stage balance by phase;
`build_trace` -> a Chrome Trace Event Format object;
`render_summary_png` (in `asyncpp.trace.plot`, needs matplotlib) -> a summary figure.
CLI: `python -m asyncpp.trace LOGFILE -o trace.json [--png summary.png]`.
"""

from asyncpp.trace.chrome import build_trace
from asyncpp.trace.parse import parse_lines, parse_log
from asyncpp.trace.records import ParsedLog, StageSlice, StepCompleted, StepDispatched
from asyncpp.trace.stats import PipelineStats, StageStats, format_summary, pipeline_stats
from asyncpp.trace.waits import PhaseBalance, StageWaits, phase_balance, stage_waits

__all__ = [
    "ParsedLog",
    "PhaseBalance",
    "PipelineStats",
    "StageSlice",
    "StageStats",
    "StageWaits",
    "StepCompleted",
    "StepDispatched",
    "build_trace",
    "format_summary",
    "parse_lines",
    "parse_log",
    "phase_balance",
    "pipeline_stats",
    "stage_waits",
]
