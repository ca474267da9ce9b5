"""Wall-clock seconds of an update's phases, added up into named slots."""
from __future__ import annotations

import collections
import time
from typing import Any, Dict


class Stopwatch:
    """Adds up seconds into named slots."""

    def __init__(self) -> None:
        self.times: Dict[str, float] = collections.defaultdict(float)

    def __call__(self, slot: str) -> '_Lap':
        return _Lap(self.times, slot)


class _Lap:
    def __init__(self, times: Dict[str, float], slot: str) -> None:
        self.times, self.slot = times, slot

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.times[self.slot] += time.perf_counter() - self.t0
