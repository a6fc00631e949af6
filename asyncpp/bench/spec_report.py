"""Speculative decoding's figures over a run's measured window.

From the engine's stats before and after the window (vLLM's cumulative
`spec_decode_*` counters, each missing one read as 0 and a missing or shorter
per-position list padded with 0): the drafts verified (one per request per
step that had any), their tokens, the tokens accepted, and the accepted ones
per draft position. Acceptance rate = accepted / draft tokens; mean accepted
per draft = accepted / drafts (each such step also samples one token of its
own, so it emits that plus one); per position = accepted at it / drafts, the
chance a draft got that far (a draft shorter than the position counts as a
miss there, as in vLLM). A run gets the section when its config names a
method or its engine drafted in the window; figures over zero drafts are None.
"""

from __future__ import annotations

from typing import Any

# Window delta key -> engine stats counter.
COUNTERS = {
    "num_drafts": "spec_decode_num_drafts",
    "num_draft_tokens": "spec_decode_num_draft_tokens",
    "num_accepted_tokens": "spec_decode_num_accepted_tokens",
}
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
OFF = (None, "none")


def spec_section(before: dict[str, Any], after: dict[str, Any], method: str | None = None) -> dict[str, Any] | None:
    """Window deltas and rates; None when `method` is off (or unknown) and nothing was drafted."""
    delta = {key: (after.get(stat) or 0) - (before.get(stat) or 0) for key, stat in COUNTERS.items()}
    if method in OFF and not delta["num_draft_tokens"]:
        return None
    pos_before, pos_after = before.get(PER_POS) or [], after.get(PER_POS) or []
    num_positions = max(len(pos_before), len(pos_after))
    per_pos = [_at(pos_after, i) - _at(pos_before, i) for i in range(num_positions)]
    num_drafts, num_draft_tokens = delta["num_drafts"], delta["num_draft_tokens"]
    accepted = delta["num_accepted_tokens"]
    return {
        "method": method,
        **delta,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": accepted / num_draft_tokens if num_draft_tokens else None,
        "mean_draft_len": num_draft_tokens / num_drafts if num_drafts else None,
        "mean_accepted_tokens_per_draft": accepted / num_drafts if num_drafts else None,
        "acceptance_rate_per_pos": [n / num_drafts for n in per_pos] if num_drafts else None,
    }


def spec_lines(spec: dict[str, Any]) -> list[str]:
    """Rows for a run's block, in the serving metrics' 40 + 20 column layout."""
    per_pos = spec["acceptance_rate_per_pos"]
    rows = [
        ("Spec method:", spec["method"] or "?"),
        ("Drafts:", spec["num_drafts"]),
        ("Draft tokens:", spec["num_draft_tokens"]),
        ("Accepted tokens:", spec["num_accepted_tokens"]),
        ("Acceptance rate (%):", _fmt(spec["acceptance_rate"], 100)),
        ("Mean draft length (tok):", _fmt(spec["mean_draft_len"])),
        ("Mean accepted tokens per draft:", _fmt(spec["mean_accepted_tokens_per_draft"])),
        ("Accepted per position:", " / ".join(str(n) for n in spec["num_accepted_tokens_per_pos"]) or "-"),
        ("Acceptance rate per position:", " / ".join(_fmt(r) for r in per_pos) if per_pos else "-"),
    ]
    return [f"{name:<40}{value:>20}" for name, value in rows]


def spec_cell(spec: dict[str, Any] | None) -> str:
    """Summary table cell: acceptance rate % / mean accepted tokens per draft."""
    if not spec:
        return "-"
    return f"{_fmt(spec['acceptance_rate'], 100, 1)}% / {_fmt(spec['mean_accepted_tokens_per_draft'])}"


def _at(counts: list[int], i: int) -> int:
    return counts[i] if i < len(counts) else 0


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"
