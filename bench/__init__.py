"""Benchmarks (`vigil bench NAME`): each measures its floor in the same run and prints one JSON line last."""

from __future__ import annotations

from typing import Any


def result(bench: str, value: float, floor: float, unit: str, target: str, **details: Any) -> dict[str, Any]:
    """The one result shape from ARCHITECTURE.md: value, floor and their ratio, plus details."""
    ratio = value / floor if floor else float("inf")
    return {
        "bench": bench,
        "value": round(value, 6),
        "floor": round(floor, 6),
        "ratio": round(ratio, 4),
        "unit": unit,
        "target": target,
        **details,
    }
