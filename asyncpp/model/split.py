"""Layer split: which `[start_layer, end_layer)` each pipeline stage owns."""

from __future__ import annotations


def compute_layer_ranges(num_layers: int, pp_size: int, layer_split: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """Ranges per stage from an explicit split (layers per stage) or as even as possible.

    An even split gives the earlier stages the extra layers (the last stage
    also runs the final norm, lm_head and sampling).
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
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if i < extra else 0) for i in range(pp_size)]
    ranges, start = [], 0
    for n in counts:
        ranges.append((start, start + n))
        start += n
    return ranges
