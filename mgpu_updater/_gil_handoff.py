"""How soon a thread that stops waiting gets the GIL back from a loader thread that loads.

A loader thread (:class:`mgpu_updater._loader.Prefetcher`) that loads ahead runs the
iterator, the dataset and the converter: Python, holding the GIL, while the replica
computes in the main thread. That compute lets go of the GIL whenever it waits: a BLAS
product, a wait for the GPU, a read. When such a wait ends, the main thread asks for the
GIL back, and CPython hands it over only once the thread that holds it has run for the
interpreter's switch interval (``sys.getswitchinterval()``, 5 ms unless set): the main
thread then waits up to 5 ms after every one of its waits while the loader loads: with a
compute that waits 20 times an update, a loader running ahead saved almost nothing.

So while a loader thread of this package that loads ahead is inside a load, the switch
interval is at most :data:`HANDOFF`; it is set back as soon as no such load runs in the
process. A thread that stops waiting then gets the GIL within about :data:`HANDOFF`. A
gated loader (loading ``'inline'``) loads only while its consumer waits for something
else, never beside its compute, so its loads leave the interval alone
(:func:`handoff_for`): there a thread that polls for its next message would only force
more hand-overs in the middle of a load it then waits for anyway.

On a 2-core Intel Xeon VM, one replica, a dataset of Python work (17-21 ms a batch) and a
compute of BLAS products (20 ms), the loader running ahead: a step took 1.81 times
max(L, C) with 5 ms, 1.26-1.31 times with 0.2 ms (``bench/overlap.py``, three runs); a
plain thread loading beside that compute at 0.01 ms reached 1.21 (the bench's "a thread's
best": every wait of the compute still ends with a wake-up). 0.1 and 0.05 ms would close
part of the gap (1.19, 1.18), but where both threads run Python a loader running ahead
then costs 7-13% more than at 0.2 ms, until ``prefetch='auto'``'s trial has chosen.
Where both threads only run Python nothing overlaps and every hand-over costs: there
loading ahead is slower than inline either way, and ``prefetch='auto'`` loads inline (its
trial times loading ahead as it runs, with this interval; the bench's host-bound rows).

A user's shorter interval is left as it is, and one the user sets while a load runs is
kept (set back only where it still is :data:`HANDOFF`). The interval is the process's: the
loaders of several updaters in one process share one count of the loads in progress. A
process forked meanwhile (a ``MultiprocessIterator``'s, started inside a load) has none
of them: its count starts at zero and its interval is set back.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import TracebackType
from typing import Any, Optional, Type

#: seconds: the longest switch interval while a loader thread loads ahead
HANDOFF = 2e-4

_lock = threading.Lock()
_loading = 0                       # loads in progress in this process
_restore: Optional[float] = None   # the interval to set back when none is, or None
_lowered = 0.0                     # HANDOFF as sys.getswitchinterval() reads it back


class Handoff:
    """``with HANDOFF_WHILE_LOADING:`` around one load in a loader thread."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _loading, _restore, _lowered
        with _lock:
            if _loading == 0:
                current = sys.getswitchinterval()
                if current > HANDOFF:
                    sys.setswitchinterval(HANDOFF)
                    _restore, _lowered = current, sys.getswitchinterval()
            _loading += 1

    def __exit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        global _loading, _restore
        with _lock:
            _loading -= 1
            if _loading == 0 and _restore is not None:
                if sys.getswitchinterval() == _lowered:   # else the user's since
                    sys.setswitchinterval(_restore)
                _restore = None


def _forked() -> None:
    """In a child of ``fork``: the loads in progress were the parent's threads', which the
    child does not have (nor the lock, if one of them held it)."""
    global _lock, _loading, _restore
    _lock = threading.Lock()
    if _loading and _restore is not None and sys.getswitchinterval() == _lowered:
        sys.setswitchinterval(_restore)
    _loading, _restore = 0, None


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_forked)

#: the one instance (it holds no state of its own)
HANDOFF_WHILE_LOADING = Handoff()
_NO_HANDOFF = contextlib.nullcontext()


def handoff_for(ahead: bool) -> Any:
    """What one load of a loader thread runs under: :data:`HANDOFF_WHILE_LOADING` where
    it loads ``ahead`` (beside its consumer's compute), nothing where it is gated."""
    return HANDOFF_WHILE_LOADING if ahead else _NO_HANDOFF
