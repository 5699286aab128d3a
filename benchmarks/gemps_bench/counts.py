"""Counts as people write them: "100K,1M,2.5M,1.3G" (model sizes, client counts on command lines)."""

from __future__ import annotations

_UNITS = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}


def parse_counts(text: str) -> list[int]:
    """ "100K,1M" -> [100000, 1000000] (also plain numbers and 2.5M); ValueError when not."""
    try:
        values = [_count(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"not a list of counts: {text!r} (e.g. 100K,1M,10M)") from None
    if not values or min(values) < 1:
        raise ValueError(f"counts must be >= 1: {text!r}")
    return values


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = _UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)
