"""What a benchmarked engine computed with: CPU, ISA level used / best, dtype, weight format, weights.

Read from the engine's stats (its resolved `ComputePlan` and every stage's
resident weight bytes), so the report says what ran, not what the config
asked for ("auto"). An engine whose stats have no plan gives no section.
"""

from __future__ import annotations

from typing import Any

PLAN_KEYS = ("cpu_model", "isa", "best_isa", "dtype", "weight_format", "reason")


def compute_section(stats: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's fields and the resident weight MB (1e6 bytes) of each stage; None without a plan."""
    if "isa" not in stats:
        return None
    weight_bytes = list(stats.get("weight_bytes_per_stage", []))
    return {
        **{key: stats.get(key) for key in PLAN_KEYS},
        "weight_bytes_per_stage": weight_bytes,
        "weight_mb_per_stage": [round(n / 1e6, 2) for n in weight_bytes],
    }


def compute_lines(section: dict[str, Any]) -> list[str]:
    """A run block's lines: CPU, ISA, dtype and weights, then why this dtype."""

    def row(name: str, value: Any) -> str:
        return f"{name:<40}{value:>20}"

    return [
        row("CPU:", section["cpu_model"]),
        row("ISA used / best:", f"{section['isa']} / {section['best_isa']}"),
        row("dtype / weight format:", f"{section['dtype']} / {section['weight_format']}"),
        row("Resident weights per stage (MB):", weight_mb(section)),
        f"  {section['reason']}",
    ]


def compute_cell(section: dict[str, Any] | None) -> str:
    """Summary table cell: isa / dtype / weight format."""
    return "-" if not section else f"{section['isa']} / {section['dtype']} / {section['weight_format']}"


def weight_mb(section: dict[str, Any] | None) -> str:
    """Resident weight MB per stage, `64.1 / 70.3`."""
    return "-" if not section else " / ".join(f"{mb:.1f}" for mb in section["weight_mb_per_stage"])
