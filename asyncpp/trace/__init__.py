"""Timeline tooling for asyncpp's JSON-lines logs.

`parse_log` -> `ParsedLog` (typed records, skipped-line counts);
`pipeline_stats` -> per-stage busy / bubble fractions;
`build_trace` -> a Chrome Trace Event Format object;
`render_summary_png` (in `asyncpp.trace.plot`, needs matplotlib) -> a summary figure.
CLI: `python -m asyncpp.trace LOGFILE -o trace.json [--png summary.png]`.
"""

from asyncpp.trace.chrome import build_trace
from asyncpp.trace.parse import parse_lines, parse_log
from asyncpp.trace.records import ParsedLog, StageSlice, StepCompleted, StepDispatched
from asyncpp.trace.stats import PipelineStats, StageStats, format_summary, pipeline_stats

__all__ = [
    "ParsedLog",
    "PipelineStats",
    "StageSlice",
    "StageStats",
    "StepCompleted",
    "StepDispatched",
    "build_trace",
    "format_summary",
    "parse_lines",
    "parse_log",
    "pipeline_stats",
]
