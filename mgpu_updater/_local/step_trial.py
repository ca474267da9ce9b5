"""Which step the updates take under ``shard_optimizer='auto'``: a trial of both, then the faster.

The sharded step (:mod:`.sharded_step`) and the master's step give bitwise the same
parameters, so which one an update takes changes its time and nothing else; and which is
faster depends on the machine. In ``bench/paired_replicas.py`` at ``accumulate_steps=1``,
two CPU replicas of the example's CNN: on a 2-core Intel Xeon VM the sharded step took 0.970
(0.961-0.976) of the master step's time per update, on a 2-core AMD EPYC VM 1.006-1.012 of
it (its forward/backward slower there by about 1%, its step and sums faster). So, as
Horovod's autotuner does for its own knobs, the updater measures instead of guessing:

- the first :data:`WARMUP` updates that could be sharded alternate the two steps, untimed
  (each path's first use, its caches and allocations);
- then :data:`ROUNDS` rounds, each two blocks of :data:`BLOCK` updates, one block of each
  step, the order alternating from round to round (so that a drifting machine weighs on
  both alike, as in the paired benches); each update is timed from the group's begin to the
  end of its step, the first of each block left out (the switch), and a round gives the
  ratio of the two blocks' mean times (sharded / master);
- the median of the rounds' ratios decides: below 1, the sharded step from then on,
  otherwise the master's (the documented design, which a tie keeps).

The trial costs at most half its updates at the slower step (about 1-3% of 200 updates).
It restarts with the updater (a resumed run tries again). An update that could not be
sharded (:func:`.sharded_step.why_not`: loss scaling, a hook that is not elementwise) is
the master's step and does not count for the trial, whose sharded block then waits.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional

WARMUP = 10      # updates alternating the two steps before the timed rounds, untimed
ROUNDS = 20      # timed rounds: a block of each step
BLOCK = 5        # updates per block, the first not timed


class StepTrial:
    """The trial's state: :meth:`wants_shard` before an update, :meth:`record` after it,
    :attr:`decided` once the rounds are in (True: sharded; False: the master's step)."""

    def __init__(self, warmup: Optional[int] = None, rounds: Optional[int] = None,
                 block: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        warmup = WARMUP if warmup is None else warmup   # (read now: tests shorten them)
        rounds = ROUNDS if rounds is None else rounds
        block = BLOCK if block is None else block
        if warmup < 0 or rounds < 1 or block < 2:
            raise ValueError(f'StepTrial needs warmup >= 0, rounds >= 1, block >= 2 '
                             f'({warmup}, {rounds}, {block} given)')
        self.warmup, self.rounds, self.block = warmup, rounds, block
        self._clock = clock
        self._done = 0                   # updates counted so far (warm-up included)
        self._started: Optional[float] = None
        self._times: List[List[float]] = [[], []]   # this round's: [master, sharded]
        #: per finished round: the sharded block's mean time / the master block's
        self.ratios: List[float] = []
        #: None while on trial; then whether the updates are sharded
        self.decided: Optional[bool] = None

    def wants_shard(self) -> bool:
        """Whether the next update should be sharded (the trial's schedule, or its
        decision)."""
        if self.decided is not None:
            return self.decided
        n = self._done
        if n < self.warmup:
            return n % 2 == 1
        rnd, at = divmod(n - self.warmup, 2 * self.block)
        sharded_first = rnd % 2 == 0
        first_block = at < self.block
        return sharded_first == first_block

    def begin(self) -> None:
        """The update starts (the group's begin)."""
        self._started = self._clock() if self.decided is None else None

    def record(self, sharded: bool) -> None:
        """The update's step is over; ``sharded``: whether it was. Counts it where it took
        the step the schedule asked for."""
        started, self._started = self._started, None
        if started is None or self.decided is not None or sharded != self.wants_shard():
            return
        seconds = self._clock() - started
        n = self._done
        self._done += 1
        if n < self.warmup:
            return
        at = (n - self.warmup) % (2 * self.block)
        if at % self.block != 0:          # the first of each block is the switch's
            self._times[int(sharded)].append(seconds)
        if at == 2 * self.block - 1:      # the round is over
            master, shard = self._times
            self.ratios.append(statistics.fmean(shard) / statistics.fmean(master))
            self._times = [[], []]
            if len(self.ratios) == self.rounds:
                self.decided = statistics.median(self.ratios) < 1.0

    @property
    def state(self) -> str:
        """``'trial'``, ``'sharded'`` or ``'master'``."""
        if self.decided is None:
            return 'trial'
        return 'sharded' if self.decided else 'master'
