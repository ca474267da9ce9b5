"""Where a worker's replica resumes from: its iterator and random state between updates.

Under ``max_worker_restarts`` a worker that dies is replaced (:mod:`.recovery`), and the
update it died in is redone by every rank. The new worker must start that update exactly
where the lost one started it, and the workers that survived must go back there: then the
redone update is the lost one, bit for bit. A :class:`ResumePoint` is that place:

- the iterator's state as of the last batch used (:func:`mgpu_updater._checkpoint.
  capture_state`, what a snapshot saves, the shuffling order's generator included; a
  loader that runs ahead gives the state before its oldest batch not handed out,
  :meth:`mgpu_updater._loader.Loader.state`);
- the process's random state: numpy's global generator (what Chainer's CPU functions draw
  from, dropout among them) and Python's ``random``. CuPy's generator has no state that
  can be read back, so a model that draws random numbers on a GPU redoes the update with
  other numbers (docs/reliability.md).

Each worker keeps two (:class:`Keeper`): where its latest window started (a survivor goes
back there, :meth:`Keeper.rewind`) and where it ended, which is where its next update starts.
It sends the latter to the master with every window's result, as a :class:`Change` against
the last one it sent: the iterator's entries that changed (the position every update, the
shuffled order only when an epoch starts) and a random state only when it moved. The master
(:class:`Records`) applies the changes of an update once the update is complete, so that it
always holds where each worker's next update starts: what a replacement is given.

Random numbers drawn while loading (a dataset that augments with ``numpy.random``) come
from the same generator; a loader that runs ahead draws them at moments that depend on
timing, in an uninterrupted run too, so those are not reproduced.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, NamedTuple, Optional

import numpy

from .._checkpoint import restore_state


class ResumePoint(NamedTuple):
    """Where a replica's next update starts."""
    iterator: Dict[str, numpy.ndarray]   # capture_state's flat dict
    numpy_random: Any = None    # numpy.random.get_state(); None: as the worker's seed left it
    python_random: Any = None   # random.getstate(); None: likewise


class Change(NamedTuple):
    """A worker's resume point, as it differs from the last one it sent (``full``: the
    whole of it). ``None`` random states did not change."""
    full: bool
    iterator: Dict[str, numpy.ndarray]
    numpy_random: Any = None
    python_random: Any = None


def capture(loader: Any) -> ResumePoint:
    """This process's resume point, its replica reading through ``loader``."""
    return ResumePoint(loader.state(), numpy.random.get_state(), random.getstate())


def restore(point: ResumePoint, iterator: Any) -> None:
    """Set this process's random state and ``iterator`` to ``point``, in that order: an
    iterator whose shuffling draws from numpy's global generator (Chainer's default
    ``ShuffleOrderSampler``) then keeps its own saved state of it."""
    if point.numpy_random is not None:
        numpy.random.set_state(point.numpy_random)
    if point.python_random is not None:
        random.setstate(point.python_random)
    restore_state(iterator, point.iterator)


def difference(sent: Optional[ResumePoint], point: ResumePoint) -> Change:
    """``point`` as a change from ``sent`` (None: nothing sent, the whole of it)."""
    if sent is None or sent.iterator.keys() != point.iterator.keys():
        return Change(True, dict(point.iterator), point.numpy_random, point.python_random)
    old = sent.iterator
    changed = {key: value for key, value in point.iterator.items()
               if not _same_array(old[key], value)}
    return Change(False, changed,
                  None if _same_numpy_random(sent.numpy_random, point.numpy_random)
                  else point.numpy_random,
                  None if sent.python_random == point.python_random else point.python_random)


def apply(point: ResumePoint, change: Change) -> ResumePoint:
    """``point`` moved by ``change``."""
    if change.full:
        return ResumePoint(change.iterator, change.numpy_random, change.python_random)
    return ResumePoint(
        {**point.iterator, **change.iterator},
        point.numpy_random if change.numpy_random is None else change.numpy_random,
        point.python_random if change.python_random is None else change.python_random)


def _same_array(a: Any, b: Any) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and numpy.array_equal(a, b))


def _same_numpy_random(a: Any, b: Any) -> bool:
    """Two ``numpy.random.get_state()`` tuples: (name, keys, pos, has_gauss, gauss)."""
    return (a is not None and a[2] == b[2] and a[3] == b[3] and a[4] == b[4]
            and a[0] == b[0] and numpy.array_equal(a[1], b[1]))


class Keeper:
    """A worker's two resume points: where its latest window started (:attr:`before`)
    and where it is now (:attr:`here`, the end of that window, where its next starts)."""

    def __init__(self, loader: Any) -> None:
        self.here = capture(loader)
        self.before = self.here
        self._sent: Optional[ResumePoint] = None   # what the master holds, as far as known
        self._in_window = False   # a window started and has not ended (or was given up)

    def window_starts(self) -> None:
        """A Step came: the master completed the update before it (or redoes this one)."""
        self.before = self.here
        self._in_window = True

    def window_ended(self, loader: Any) -> Change:
        """The window is over: where the next starts, as the change to send the master."""
        self._in_window = False
        self.here = point = capture(loader)
        change = difference(self._sent, point)
        self._sent = point
        return change

    def rewind(self, replica: Any, make_loader: Callable[[], Any]) -> None:
        """The update was abandoned: back to where the latest window started, with a new
        loader (the old one read ahead of it). The master did not apply the change sent
        for that window: the next change is sent whole."""
        self._sent = None
        if self.here is self.before and not self._in_window:   # no window ran since
            return
        self._in_window = False   # one given up half-way read batches too
        replica.loader.close()
        restore(self.before, replica.loader.iterator)
        replica.loader = make_loader()
        self.here = self.before


class Records:
    """The master's resume point of every worker, by rank, as of the next update's start
    (``initial``: as of the workers' start), and the most samples one of its forward
    passes may hold, as of its latest window that held any (what
    ``micro_batch_size='auto'`` found; None: whole batches, or no window yet)."""

    def __init__(self, initial: Dict[int, ResumePoint]) -> None:
        self.points = dict(initial)
        self.chunk_sizes: Dict[int, Optional[int]] = {rank: None for rank in initial}
        self._changes: Dict[int, Any] = {}

    def unwrap(self, rank: int, shipment: Any) -> Any:
        """The result a worker delivered in its :class:`~.protocol.Shipment`; its change
        is kept until :meth:`commit`."""
        self._changes[rank] = shipment
        return shipment.result

    def commit(self) -> None:
        """The update is complete: its workers' next updates start where they said."""
        for rank, shipment in self._changes.items():
            self.points[rank] = apply(self.points[rank], shipment.change)
            if shipment.result.count:
                self.chunk_sizes[rank] = shipment.result.chunk_limit
        self._changes.clear()

    def discard(self) -> None:
        """The update is abandoned: the changes it brought do not hold."""
        self._changes.clear()
