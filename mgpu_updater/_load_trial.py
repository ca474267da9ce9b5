"""``prefetch='auto'``: which way of loading is faster for this replica, measured.

A replica loads its micro-batches one of two ways (:class:`mgpu_updater._loader.Prefetcher`):

- ``'inline'``: a batch is loaded when the window needs it, in the replica's own thread
  (a worker also loads while it waits for the master's next Step);
- ``'ahead'``: a background thread keeps up to two batches loaded, meanwhile.

Which is faster is the workload's. Loading ahead hides only what the window spends outside
the GIL: a dataset that sleeps or reads files, a ``MultiprocessIterator``'s processes, a GPU
computing while the host waits for it. Where the window is Python (a small model on the CPU,
a fast GPU that finishes each kernel before the host launches the next), a thread that
loads meanwhile takes the GIL from it and the update gets slower: on a 64-64-10 MLP, batch
16, one replica spent 0.3 ms more per update in its forward passes alone with a loading
thread (``bench/overhead.py``).

So each replica measures: its first :data:`WARMUP` windows load inline; then :data:`ROUNDS`
rounds of a block of :data:`BLOCK` windows each way, the order alternating by round, the
first :data:`SETTLE` windows of each block not counted (the switch, and the batches loaded
ahead before it). Each window counts the time from its start to the next window's start:
the whole cycle of an update, so that a thread that slows the step or the wait for the
others is counted too (and so is whatever runs between two updates, an extension, an
evaluation: the medians leave such outliers out). The median over the rounds of the ratio
'ahead' / 'inline' (of each block's median cycle) decides: loading ahead where it is faster
by more than :data:`MARGIN`, else inline (no thread competing). About 120 windows, half of
them the slower way; the choice is then kept, and each replica reports it
(``ParallelAccumulatingUpdater.loading_modes``).
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Tuple

WARMUP = 4        # windows loaded inline first, not counted
ROUNDS = 12       # rounds of one block each way
BLOCK = 5         # windows per block; the first SETTLE are not counted
SETTLE = 2        # (after loading ahead, the batches it loaded are used first)
MARGIN = 0.02     # loading ahead must be faster than this share to be kept

INLINE, AHEAD = 'inline', 'ahead'


class LoadTrial:
    """The schedule and the decision of one replica's trial: :meth:`window` at the start
    of every window gives the way to load in it, until it gives the decision for good."""

    def __init__(self, rounds: Optional[int] = None, block: Optional[int] = None,
                 warmup: Optional[int] = None, margin: Optional[float] = None,
                 settle: Optional[int] = None) -> None:
        rounds = ROUNDS if rounds is None else rounds
        block = BLOCK if block is None else block
        warmup = WARMUP if warmup is None else warmup
        settle = SETTLE if settle is None else settle
        # (way, round or None when not counted) per window
        self._plan: List[Tuple[str, Optional[int]]] = [(INLINE, None)] * warmup
        for r in range(rounds):
            for way in ((INLINE, AHEAD) if r % 2 == 0 else (AHEAD, INLINE)):
                self._plan += [(way, None)] * settle + [(way, r)] * (block - settle)
        self._margin = MARGIN if margin is None else margin
        self._next = 0
        self._started: Optional[float] = None
        self._cycles: Dict[Tuple[int, str], List[float]] = {}
        #: the way kept, once decided (None: still trying)
        self.decision: Optional[str] = None

    def window(self, now: float) -> str:
        """A window starts at ``now`` (seconds): the way to load in it."""
        if self._started is not None and self._next <= len(self._plan):
            way, counted = self._plan[self._next - 1]
            if counted is not None:
                self._cycles.setdefault((counted, way), []).append(now - self._started)
        self._started = now
        if self.decision is not None:
            return self.decision
        if self._next == len(self._plan):
            self._next += 1
            self.decision = self._decide()
            return self.decision
        way = self._plan[self._next][0]
        self._next += 1
        return way

    def ratios(self) -> List[float]:
        """Per round: the median cycle loading ahead / inline."""
        out = []
        rounds = sorted({r for r, _ in self._cycles})
        for r in rounds:
            ahead, inline = self._cycles.get((r, AHEAD)), self._cycles.get((r, INLINE))
            if ahead and inline:
                out.append(statistics.median(ahead) / statistics.median(inline))
        return out

    def _decide(self) -> str:
        ratios = self.ratios()
        if ratios and statistics.median(ratios) < 1.0 - self._margin:
            return AHEAD
        return INLINE
