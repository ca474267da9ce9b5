"""Whether a worker's iterator the script holds stands where its replica stopped.

Each worker process reads its own copy of its iterator; the object the script holds (from
``shard_iterators``) moves only when an updater puts the worker's position back into it:
at ``finalize()``, or by loading a snapshot. Until then it stands where the updater found
it. A second updater built on it would have its replica read those samples again,
silently, where under ``StandardUpdater`` one iterator object always stands where reading
stopped. So the iterators an updater runs are marked while it runs, and marked lost where
it stopped without putting the positions back (an update failed; the updater was dropped
without ``finalize()``); an updater that starts on a marked one warns, naming it and why.
Loading a snapshot into the updater, or the positions put back, clears the mark.
"""
from __future__ import annotations

import weakref
from typing import Any, List

from ._warning import warn

#: iterator -> why its position is not its replica's (a running updater's, or lost)
_marks: 'weakref.WeakKeyDictionary[Any, str]' = weakref.WeakKeyDictionary()


def running(iterators: List[Any]) -> None:
    """An updater's workers read copies of ``iterators`` from now on."""
    _mark(iterators, 'another ParallelAccumulatingUpdater that was not finalized reads it')


def lost(iterators: List[Any], why: str) -> None:
    """The positions of ``iterators``' replicas are gone (``why``)."""
    _mark(iterators, why)


def put_back(iterators: List[Any]) -> None:
    """``iterators`` stand where their replicas stopped (positions put back, a snapshot
    loaded)."""
    for it in iterators:
        try:
            _marks.pop(it, None)
        except TypeError:   # not weakly referable: never marked
            pass


def warn_if_marked(iterators: List[Any]) -> None:
    """Warn about each of ``iterators`` (worker ``i``'s is ``iterators[i - 1]``) whose
    position may not be its replica's."""
    for rank, it in enumerate(iterators, start=1):
        try:
            why = _marks.get(it)
        except TypeError:
            continue
        if why is not None:
            warn(
                f"iterator {rank} (worker {rank}'s) may not stand where its replica stopped "
                f'reading: {why}, and its worker read a copy of it. This updater\'s replica '
                f'{rank} then reads those samples again. Finalize the other updater first '
                '(finalize() puts the positions back), load a snapshot into this one, or '
                'give it new iterators', RuntimeWarning, stacklevel=4)


def at_pass_start(iterator: Any) -> bool:
    """Whether ``iterator`` has read nothing of its pass (its ``epoch_detail`` is 0: new,
    or reset); False where it cannot say."""
    try:
        return iterator.epoch_detail == 0
    except Exception:  # noqa: BLE001 - none, or none to compute (an empty dataset)
        return False


def follow_new_pass(main: Any, iterators: List[Any]) -> None:
    """Reset each of ``iterators`` (``repeat=False``) that has read of its pass where
    ``main`` starts one (nothing read of it yet): the script reset the main iterator, as
    the next pass of its loop, and built a new updater (the one that ran the pass
    finalized). A running updater starts the new pass on every replica at such a reset
    after the end of the data (its ``_new_pass_if_reset``); a new one did not, and its
    workers, at the end of their shards, left the pass to the master's alone. One the
    script reset too is left as it is (a second reset would shuffle it anew)."""
    if getattr(main, 'repeat', True) is not False or not at_pass_start(main):
        return
    for it in iterators:
        if getattr(it, 'repeat', True) is False and not at_pass_start(it):
            it.reset()


def _mark(iterators: List[Any], why: str) -> None:
    for it in iterators:
        try:
            _marks[it] = why
        except TypeError:   # not weakly referable: not watched
            pass
