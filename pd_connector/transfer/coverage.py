"""Which token spans of a transfer landed in D, per layer: P sends ``Done`` only when none has a hole.

Why: D asks for tokens ``[start_token, num_tokens)`` of every layer; P's pushes follow its own steps (chunks,
its own prefix-cache hit, replays to a D rank that came late), and a span never written would leave D decoding
from whatever its blocks held before. The sender records each landed write's span here and asks for the first
hole before it says ``Done``. Pure functions over sorted, merged span lists (a few per layer).
"""

from __future__ import annotations

Spans = list[tuple[int, int]]


def add_span(spans: Spans, first: int, last: int) -> None:
    """Merge ``[first, last)`` into sorted, disjoint ``spans`` (few per layer: chunks are contiguous)."""
    merged: Spans = []
    for a, b in spans:
        if b < first or a > last:
            merged.append((a, b))
        else:
            first, last = min(a, first), max(b, last)
    merged.append((first, last))
    spans[:] = sorted(merged)


def first_hole(covered: dict[int, Spans], layers: int, start: int, end: int) -> str | None:
    """Why tokens ``[start, end)`` are not all in D on every layer (the first gap found), or None."""
    for layer in range(layers):
        at = start
        for a, b in covered.get(layer, ()):
            if a > at:
                break
            at = max(at, b)
        if at < end:
            gap_end = next((a for a, _ in covered.get(layer, ()) if a > at), end)
            return f"layer {layer} is missing tokens [{at}, {min(gap_end, end)}) of the [{start}, {end}) decode wants"
    return None
