"""Layer split: which `[start_layer, end_layer)` each pipeline stage owns."""

from __future__ import annotations

from asyncpp.model.arch import ModelArch

# The last stage also runs the final norm, lm_head and sampling. Measured on SmolLM2 (bf16 native
# weights: Q4_1 layers, a Q8_0 head, whose blocks cost more to expand), that costs about three
# quarters of the head's parameter count expressed in decoder layers: 18/12 instead of 17/13 brought
# the last / first stage time of decode-only steps from 1.26 to 1.17 and 4-6% more tokens/s at
# concurrency 16 and 64 (`python -m asyncpp.trace`, `scripts/cpu_vs_peers.sh` loads).
HEAD_COST_FACTOR = 0.75


def compute_layer_ranges(
    num_layers: int, pp_size: int, layer_split: tuple[int, ...] = (), last_stage_extra_layers: float = 0.0
) -> list[tuple[int, int]]:
    """Ranges per stage from an explicit split (layers per stage), or balanced.

    The balanced split gives each stage about the same work, counting
    `last_stage_extra_layers` of extra work on the last stage; ties give the
    earlier stages the extra layers.
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} is larger than the number of layers {num_layers}")
    if layer_split:
        if len(layer_split) != pp_size:
            raise ValueError(f"layer_split {list(layer_split)} has {len(layer_split)} entries, pp_size is {pp_size}")
        if any(n < 1 for n in layer_split) or sum(layer_split) != num_layers:
            raise ValueError(
                f"layer_split {list(layer_split)} must be positive and sum to the model's {num_layers} layers"
            )
        counts = list(layer_split)
    else:
        counts = _balanced_counts(num_layers, pp_size, last_stage_extra_layers)
    ranges, start = [], 0
    for n in counts:
        ranges.append((start, start + n))
        start += n
    return ranges


def head_cost_in_layers(arch: ModelArch) -> float:
    """The last stage's extra work (lm_head) in decoder-layer units, for balancing."""
    return HEAD_COST_FACTOR * arch.vocab_size * arch.hidden_size / arch.layer_params


def _balanced_counts(num_layers: int, pp_size: int, last_extra: float) -> list[int]:
    if pp_size == 1:
        return [num_layers]
    if last_extra <= 0:
        base, extra = divmod(num_layers, pp_size)
        return [base + (1 if i < extra else 0) for i in range(pp_size)]
    # Give the last stage fewer layers so that its layers + extra match the others, keeping >= 1 each.
    per_stage = (num_layers + last_extra) / pp_size
    last = max(1, min(num_layers - (pp_size - 1), round(per_stage - last_extra)))
    base, extra = divmod(num_layers - last, pp_size - 1)
    return [base + (1 if i < extra else 0) for i in range(pp_size - 1)] + [last]


def shift_windows(ranges: list[tuple[int, int]], shift_layers: int) -> list[tuple[int, int]]:
    """Per boundary between stages i and i + 1: the (lowest, highest) layer where stage i + 1 may
    start a step, at most `shift_layers` from the static boundary, every stage keeping at least
    one layer of its own whatever its neighbours do. Layers in [lowest, highest) are held by both
    stages (weights loaded twice, KV cache shared)."""
    if shift_layers < 0:
        raise ValueError(f"shift_layers must be >= 0, got {shift_layers}")
    windows: list[tuple[int, int]] = []
    for i in range(len(ranges) - 1):
        boundary = ranges[i][1]
        floor = windows[-1][1] + 1 if windows else ranges[i][0] + 1  # stage i keeps a layer
        lo = max(boundary - shift_layers, floor)
        hi = min(boundary + shift_layers, ranges[i + 1][1] - 1)
        windows.append((min(lo, boundary), max(hi, boundary)))
    return windows


def held_ranges(ranges: list[tuple[int, int]], windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The layers each stage loads: its own range widened by the windows of its two boundaries."""
    held = []
    for rank, (start, end) in enumerate(ranges):
        lo = windows[rank - 1][0] if rank > 0 else start
        hi = windows[rank][1] if rank < len(windows) else end
        held.append((lo, hi))
    return held
