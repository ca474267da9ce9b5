"""Where the ranks meet without messages: a small shared-memory board.

Where :func:`announces_packs`, every rank posts its sample count and loss once its
gradient is packed, and the master, which waits for every post, sums and steps before it
reads the workers' results: the master knows within one look that the last gradient is in,
where a Done took 0.1-0.3 ms from the worker's send to the master's read (a post is seen
within microseconds by a rank that spins and within about 60 us by one that sleeps between
looks).

Where a rank posts, its window's result (what a Done message would carry: the reported
values, times, epochs) goes into its *mailbox* on the board right after the post
(:meth:`Board.post_result`), and the master reads it there (:meth:`Board.result`) instead
of receiving a Done through the pipe: receiving one took the master 0.2-0.25 ms of every
update (the pipe's wait and read, and unpickling, with caches cold after the window), on
the critical path, after its step. A result too large for the mailbox (:data:`MAILBOX`)
still goes as a Done through the pipe; the mailbox then says so.

The board is one segment: a row of :data:`_WORDS` 64-bit words per rank (its round number,
its count, its loss as float64, the round of the result in its mailbox and that result's
length), one header word (how long a waiter spins, :func:`spin_for`), then one mailbox of
:data:`MAILBOX` bytes per rank. A rank writes its count and loss first and its round last,
and its mailbox and the result's length before the result's round; a reader that sees a
round reads the values after it. That order holds where stores reach
other cores in the order they were made and loads are not reordered with older loads
(x86-64, "total store order"); there, a pipe message is not needed to publish them, nor
the gradient each rank packed before posting. Elsewhere (ARM's weaker order) the packs are
not announced and Done says it (:data:`STORE_ORDER`).

A round's values stay on the board until their rank posts values again, and the local
protocol makes every rank read them before that: a worker posts new values only in the next
update, after the master's next Step, which the master sends after it has read them. Every
rank posts as many rounds in an update as every other: one where packs are announced, none
otherwise.

A waiter spins first, yielding the CPU between looks (``os.sched_yield``, under a
microsecond, which also lets go of the GIL), for :data:`SPIN_LONG` where every rank of the
host can have a core of its own and :data:`SPIN` where they cannot (:func:`spin_for`:
there a spinning rank would take the CPU from one that computes). Then it sleeps between
looks: ``time.sleep(0)`` (60-100 us, the kernel's timer slack) until :data:`PATIENT`, and
after that :data:`BACKOFF` of the time it has waited so far, at most
:data:`LONGEST_SLEEP`, so that a long wait (a slower peer's longer window) costs little
CPU (``time.sleep(0)`` alone kept a waiter at about 20% of a core) and at most 5% more
time. Sleeping where the ranks had cores to spare cost the master 0.1-0.15 ms per update
on average (the post seen one sleep late; median wait at ``accumulate_steps=1`` about 0.5
ms).

Waiting is bounded by the ranks' health, not by time, like the pipes' waits: ``check``
runs every :data:`CHECK_EVERY` seconds (the master's raises for a worker that died or
reported an error; a worker's leaves when the master stops it).
"""
from __future__ import annotations

import os
import platform
import secrets
import time
from typing import Callable, List, Optional, Sequence, Tuple

from .._replica import mean_loss
from ..comm.shm import _open

#: Whether this machine's memory order lets a post publish what was written before it.
STORE_ORDER = platform.machine().lower() in ('x86_64', 'amd64', 'i386', 'i686', 'x86')

_WORDS = 8                 # per rank: round, count, loss (float64), result's round and length
_ROUND, _COUNT, _LOSS, _RESULT, _LENGTH = 0, 1, 2, 3, 4
_SPIN_WORD = 0             # the header word (after the rows): the spin, in nanoseconds
MAILBOX = 1 << 14          # bytes of each rank's mailbox (a result is about 400 bytes)
SPIN = 50e-6               # seconds a waiter spins before it sleeps, where cores are short
SPIN_LONG = 2e-3           # ... and where every rank of the host has a core of its own
PATIENT = 1e-3             # seconds after which a waiter sleeps longer between looks:
BACKOFF = 0.05             # this share of the time it has waited so far,
LONGEST_SLEEP = 1e-3       # at most this long
CHECK_EVERY = 0.005        # seconds between a waiter's health checks


class Board:
    """The board of ``size`` ranks, seen by ``rank``: :meth:`create` in the master,
    :meth:`attach` (with :attr:`name`) in each worker."""

    def __init__(self, segment: object, size: int, rank: int, owner: bool) -> None:
        self._segment = segment
        self.size, self.rank, self._owner = size, rank, owner
        buf = segment.buf   # type: ignore[attr-defined]
        self._bytes = buf
        self._ints = buf.cast('q')
        self._floats = buf.cast('d')
        self._header = size * _WORDS                # the header word's index
        self._mail = (self._header + 1) * 8        # the first mailbox's first byte
        self._round = 0    # this rank's posts so far
        self._round_words = tuple(r * _WORDS + _ROUND for r in range(size))
        #: seconds a waiter spins before it sleeps (:func:`spin_for`, set by the master)
        self.spin = self._ints[self._header + _SPIN_WORD] * 1e-9

    @classmethod
    def create(cls, size: int, spin: float = SPIN) -> 'Board':
        """The master's board for ``size`` ranks, whose waiters spin ``spin`` seconds
        (:func:`spin_for`); the workers attach with :attr:`name` and read it there."""
        nbytes = (size * _WORDS + 1) * 8 + size * MAILBOX
        segment = _open('mgpu_' + secrets.token_hex(16), nbytes, create=True)
        segment.buf[:] = bytes(len(segment.buf))
        segment.buf.cast('q')[size * _WORDS + _SPIN_WORD] = int(spin * 1e9)
        return cls(segment, size, 0, owner=True)

    @classmethod
    def attach(cls, name: str, size: int, rank: int) -> 'Board':
        return cls(_open(name), size, rank, owner=False)

    @property
    def name(self) -> str:
        return self._segment.name   # type: ignore[attr-defined]

    def meet(self, count: int, loss: float,
             check: Callable[[], None]) -> List[Tuple[int, float]]:
        """Post this rank's ``count`` and ``loss``, wait until every rank posted this
        round, and return every rank's (count, loss), in rank order. ``check`` runs every
        :data:`CHECK_EVERY` seconds while waiting (it raises to stop the wait)."""
        self.post(count, loss)
        self.wait(check)
        return self.posted()

    def posted(self) -> List[Tuple[int, float]]:
        """Every rank's (count, loss) as last posted with values, in rank order."""
        return [(self._ints[r * _WORDS + _COUNT], self._floats[r * _WORDS + _LOSS])
                for r in range(self.size)]

    def behind(self) -> List[int]:
        """The ranks that have not posted this rank's latest round yet."""
        ints, target = self._ints, self._round
        return [r for r in range(self.size) if ints[r * _WORDS + _ROUND] < target]

    def post(self, count: Optional[int] = None, loss: Optional[float] = None) -> None:
        """Start this rank's next round, with its ``count`` and ``loss`` or (None) with
        the values it posted last, which the others may still be reading."""
        self._round += 1
        at = self.rank * _WORDS
        if count is not None:
            self._ints[at + _COUNT] = int(count)
            self._floats[at + _LOSS] = float(loss)   # type: ignore[arg-type]
        self._ints[at + _ROUND] = self._round    # last: the post is complete

    def wait(self, check: Callable[[], None]) -> None:
        """Wait until every rank has posted this rank's latest round (see :meth:`meet`)."""
        self._wait_for(self._round_words, check)

    def post_result(self, data: Optional[bytes], ahead: bool = False) -> bool:
        """After this rank's post: put ``data`` (its pickled window result) in its mailbox
        as the result of that round, and say so; or, where ``data`` is None or longer than
        :data:`MAILBOX`, say that the result goes through the pipe. True: in the mailbox.
        ``ahead``: before the post instead, as the result of the round it will post next
        (under ``max_worker_restarts``: a rank seen posting has its result in, so that no
        death after a post leaves the master without it)."""
        at = self.rank * _WORDS
        fits = data is not None and len(data) <= MAILBOX
        if fits:
            first = self._mail + self.rank * MAILBOX
            self._bytes[first:first + len(data)] = data   # type: ignore[arg-type]
        self._ints[at + _LENGTH] = len(data) if fits else -1   # type: ignore[arg-type]
        self._ints[at + _RESULT] = self._round + ahead   # last: the result is complete
        return fits

    def result(self, rank: int, check: Callable[[], None]) -> Optional[bytes]:
        """Wait until ``rank`` has put its result of this rank's latest round (see
        :meth:`post_result`; ``check`` as in :meth:`meet`); its bytes, or None where it
        goes through the pipe."""
        at = rank * _WORDS
        self._wait_for((at + _RESULT,), check)
        length = self._ints[at + _LENGTH]
        if length < 0:
            return None
        first = self._mail + rank * MAILBOX
        return bytes(self._bytes[first:first + length])

    def _wait_for(self, words: Sequence[int], check: Callable[[], None]) -> None:
        """Wait until every one of ``words`` holds this rank's latest round."""
        ints, target, spin = self._ints, self._round, self.spin
        for i in words:   # (every update, several times: a loop, not a generator)
            if ints[i] < target:
                break
        else:
            return
        start = time.perf_counter()
        next_check = start + CHECK_EVERY
        while True:
            if all(ints[i] >= target for i in words):
                return
            now = time.perf_counter()
            if now >= next_check:
                check()
                next_check = now + CHECK_EVERY
            waited = now - start
            if waited <= spin:
                os.sched_yield()   # the CPU and the GIL, for whoever else wants them
            elif waited > PATIENT:     # a long wait: sleep longer, so as to use little CPU
                time.sleep(min(BACKOFF * waited, LONGEST_SLEEP))
            else:
                time.sleep(0)   # lets this process's other threads (the loader) run

    def start_over(self) -> None:
        """Count rounds from zero again: every rank calls it between updates once one rank
        was replaced (:mod:`.recovery`; the replacement attaches at round zero); the master
        (the owner), once every other rank has, also clears every rank's row."""
        self._round = 0
        if self._owner:
            ints = self._ints
            for i in range(self.size * _WORDS):
                ints[i] = 0

    def close(self) -> None:
        """Release the mapping; the master also removes the segment."""
        for view in (self._ints, self._floats):   # (_bytes is the segment's own)
            view.release()
        try:
            self._segment.close()   # type: ignore[attr-defined]
        except BufferError:
            pass
        if self._owner:
            try:
                self._segment.unlink()   # type: ignore[attr-defined]
            except FileNotFoundError:
                pass


def announces_packs(board: Optional['Board']) -> bool:
    """Whether each rank says at ``board`` that its gradient is packed (one post with its
    count and loss, after its pack and its reductions), so that the master sums as soon as the last rank posted, while the workers' Done
    messages are still on their way: where there is a board and the memory order lets a
    post publish the pack (:data:`STORE_ORDER`). Otherwise Done says it, as before. The
    master and its workers run on one machine, so they answer alike."""
    return board is not None and STORE_ORDER


def spin_for(ranks_on_host: int, cores: int) -> float:
    """How long a waiter spins before it sleeps: :data:`SPIN_LONG` where each of the
    host's ``ranks_on_host`` processes can have one of its ``cores`` to itself (a spinning
    rank then takes no CPU that another needs), else :data:`SPIN`."""
    return SPIN_LONG if ranks_on_host <= cores else SPIN


def posted_total(posted: List[Tuple[int, float]]) -> Tuple[int, float]:
    """The update's sample count and mean loss from every rank's post, in rank order
    (what every rank computes alike, as :func:`mgpu_updater._replica.mean_loss`)."""
    count = 0
    for samples, _ in posted:
        count += samples
    return count, mean_loss(posted)
